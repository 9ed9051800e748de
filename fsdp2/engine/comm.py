"""Pluggable collectives: what ``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter``
accept, and the ones fsdp2 ships.

A :class:`Comm` says where its buffers come from (``allocate``) and how it runs (``__call__``,
with the signature of the ``torch.distributed`` call it replaces). The seam (``collectives.py``)
still notes, checks and records the group's collective; it calls the ``Comm`` in place of its
default. Subclass :class:`AllGather` or :class:`ReduceScatter` for your own; fsdp2's are
:class:`LowPrecisionReduceScatter` (bf16 on the wire, sums at full precision), the process
group's allocator (:class:`GroupAllocAllGather`, :class:`GroupAllocReduceScatter`) and
symmetric memory (:class:`SymmMemAllGather`, :class:`SymmMemReduceScatter`).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Literal

import torch
import torch.distributed as dist

from fsdp2.engine import collectives

__all__ = [
    "AllGather",
    "Comm",
    "GroupAllocAllGather",
    "GroupAllocReduceScatter",
    "LowPrecisionReduceScatter",
    "ReduceScatter",
    "SymmMemAllGather",
    "SymmMemReduceScatter",
]


class Comm(ABC):
    """A user-supplied collective: where its buffers come from, and how it runs."""

    @abstractmethod
    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """Return an uninitialised buffer for this collective's input or output.

        Args:
            size: the buffer's shape.
            dtype: its dtype.
            device: its device.
        """


class AllGather(Comm):
    """Replaces the group's all-gather (``FSDPModule.set_custom_all_gather``): ``output`` gets
    every rank's ``input``, rank-major. Subclass it and implement ``allocate`` and ``__call__``,
    whose arguments are ``torch.distributed.all_gather_into_tensor``'s: ``output_tensor`` (from
    ``allocate``), ``input_tensor`` (this rank's flat shard), ``group`` and ``async_op``; return
    the work (or ``None`` once done)."""

    @abstractmethod
    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None: ...


class ReduceScatter(Comm):
    """Replaces the group's reduce-scatter (``FSDPModule.set_custom_reduce_scatter``):
    ``output`` gets this rank's reduced chunk. Subclass it and implement ``allocate`` (called
    for both buffers) and ``__call__``, whose arguments are
    ``torch.distributed.reduce_scatter_tensor``'s: ``output_tensor``, ``input_tensor`` (every
    rank's chunk, rank-major), ``group``, ``op`` (``ReduceOp.AVG`` or ``SUM``) and ``async_op``;
    return the work (or ``None`` once done)."""

    @abstractmethod
    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp.RedOpType,
        async_op: bool = False,
    ) -> dist.Work | None: ...


class LowPrecisionReduceScatter(ReduceScatter):
    """Send gradients in ``comm_dtype`` (e.g. bf16: half the bytes of fp32) but add them up in
    the reduce dtype: an all-to-all hands each rank every rank's low-precision copy of its
    chunk, and the sum happens locally at full precision, so rounding happens once per value
    sent instead of at every step of a ring reduction. Install with
    ``module.set_custom_reduce_scatter(LowPrecisionReduceScatter(torch.bfloat16))``.

    Args:
        comm_dtype: the dtype gradients are sent in (default ``torch.bfloat16``).
    """

    def __init__(self, comm_dtype: torch.dtype = torch.bfloat16) -> None:
        self.comm_dtype = comm_dtype

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp.RedOpType,
        async_op: bool = False,
    ) -> dist.Work | None:
        world = group.size()
        sent = input_tensor.to(self.comm_dtype)
        received = torch.empty_like(sent)
        collectives.record("all_to_all", "low-precision reduce-scatter", sent, received, group)
        dist.all_to_all_single(received, sent, group=group)
        torch.sum(received.view(world, -1), dim=0, dtype=output_tensor.dtype, out=output_tensor)
        if op == dist.ReduceOp.AVG:
            output_tensor.div_(world)
        return None


class GroupAllocAllGather(AllGather):
    """The default all-gather with its output buffer from the process group's own allocator
    (``FSDPModule.set_allocate_memory_from_process_group_for_comm``): e.g. memory NCCL has
    registered for zero-copy transfers. Plain memory where the backend has none (gloo).

    Args:
        group: the process group whose allocator makes the buffers.
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return _group_allocate(self.group, size, dtype, device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        work: dist.Work | None = collectives._all_gather_single(
            output_tensor, input_tensor, group=group, async_op=async_op
        )
        return work


class GroupAllocReduceScatter(ReduceScatter):
    """The default reduce-scatter with both buffers from the process group's own allocator
    (see :class:`GroupAllocAllGather`)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return _group_allocate(self.group, size, dtype, device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp.RedOpType,
        async_op: bool = False,
    ) -> dist.Work | None:
        work: dist.Work | None = collectives._reduce_scatter_single(
            output_tensor, input_tensor, op=op, group=group, async_op=async_op
        )
        return work


def _group_allocate(
    group: dist.ProcessGroup,
    size: Sequence[int | torch.SymInt],
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    backend = group._get_backend(device)
    if backend.supports_tensor_alloc(device):
        numel = math.prod(int(s) for s in size)
        return backend.allocate_tensor(numel, dtype=dtype, device=device).view(size)
    return torch.empty(size, dtype=dtype, device=device)


class SymmMemAllGather(GroupAllocAllGather):
    """The default all-gather into a symmetric-memory buffer (CUDA + NCCL only), which lets NCCL
    use its copy-engine or symmetric-kernel all-gather (``FSDPModule.set_symm_mem_for_comm``)."""

    def __init__(self, group: dist.ProcessGroup, backend: Literal["NCCL"] = "NCCL") -> None:
        super().__init__(group)
        _init_symm_mem(group, backend)

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return _symm_mem_empty(size, dtype, device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        from torch.distributed import _symmetric_memory as symm_mem

        symm_mem.rendezvous(output_tensor, group=group.group_name)  # cached per buffer
        return super().__call__(output_tensor, input_tensor, group, async_op)


class SymmMemReduceScatter(GroupAllocReduceScatter):
    """The default reduce-scatter on symmetric-memory buffers (CUDA + NCCL only). NCCL's
    symmetric reduce-scatter only sums: installed only with ``set_force_sum_reduction_for_comms``."""

    def __init__(self, group: dist.ProcessGroup, backend: Literal["NCCL"] = "NCCL") -> None:
        super().__init__(group)
        _init_symm_mem(group, backend)

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return _symm_mem_empty(size, dtype, device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp.RedOpType,
        async_op: bool = False,
    ) -> dist.Work | None:
        from torch.distributed import _symmetric_memory as symm_mem

        symm_mem.rendezvous(input_tensor, group=group.group_name)
        symm_mem.rendezvous(output_tensor, group=group.group_name)
        return super().__call__(output_tensor, input_tensor, group, op, async_op)


def _init_symm_mem(group: dist.ProcessGroup, backend: Literal["NCCL"]) -> None:
    from torch.distributed import _symmetric_memory as symm_mem

    symm_mem.set_backend(backend)
    # The first rendezvous needs the NCCL communicator, which NCCL creates lazily: a barrier
    # creates it now, once, instead of inside the first gather.
    dist.barrier(group=group)


def _symm_mem_empty(
    size: Sequence[int | torch.SymInt], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    from torch.distributed import _symmetric_memory as symm_mem

    # Buffers come from (and return to) symmetric memory's pool: no new registration per step.
    with torch.cuda.use_mem_pool(symm_mem.get_mem_pool(device)):
        return torch.empty(size, dtype=dtype, device=device)
