"""The only place fsdp2 talks to ``torch.distributed``: all-gather, reduce-scatter, all-reduce and
all-to-all (the last for matrix optimizers, :mod:`fsdp2.optim`).

Every collective goes through :func:`all_gather`, :func:`reduce_scatter`, :func:`all_reduce` or
:func:`all_to_all`, the seam where :func:`record_collectives` observes them (tests count them,
benchmarks sum bytes).
"""

from __future__ import annotations

import math
import weakref
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal, cast

import torch
import torch.distributed as dist

from fsdp2.debug import checks, hang

__all__ = [
    "AllGather",
    "CollectiveRecord",
    "Comm",
    "GroupAllocAllGather",
    "GroupAllocReduceScatter",
    "LowPrecisionReduceScatter",
    "Pending",
    "ReduceScatter",
    "SymmMemAllGather",
    "SymmMemReduceScatter",
    "agree_ints",
    "agree_objects",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "record_collectives",
    "reduce_scatter",
]

# "agree": the small exchanges that make every rank raise alike (agreement.py), at init only.
# "check": the fingerprint exchanges of the collective checks (checks.py), opt-in.
CollectiveKind = Literal[
    "all_gather", "reduce_scatter", "all_reduce", "all_to_all", "agree", "check"
]


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective issued by this rank."""

    kind: CollectiveKind
    label: str  # comma-joined FQNs of the modules of the group ("" for the root module)
    input_nbytes: int
    output_nbytes: int
    world_size: int
    group: str = ""  # the process group's name (``ProcessGroup.group_name``)


_recorders: list[list[CollectiveRecord]] = []

# torch 2.13 renamed the tensor-in, tensor-out collectives; older releases only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@contextmanager
def record_collectives() -> Iterator[list[CollectiveRecord]]:
    """Collect a :class:`CollectiveRecord` for every collective fsdp2 issues while active."""
    records: list[CollectiveRecord] = []
    _recorders.append(records)
    try:
        yield records
    finally:
        _recorders.remove(records)


def _record(
    kind: CollectiveKind, label: str, inp: torch.Tensor, out: torch.Tensor, group: dist.ProcessGroup
) -> None:
    record = CollectiveRecord(
        kind,
        label,
        inp.numel() * inp.element_size(),
        out.numel() * out.element_size(),
        group.size(),
        group.group_name,
    )
    for records in _recorders:
        records.append(record)


class Pending:
    """An issued collective; ``wait()`` returns once its output may be read (or raises the hang
    report after ``FSDP2_COLLECTIVE_TIMEOUT`` seconds: see [Note: the hang report]).
    ``then``: a copy ``(dst, src)`` to make once the collective finished (see
    :func:`reduce_scatter` on gloo)."""

    __slots__ = ("_device", "_event", "_then", "_work")

    def __init__(
        self,
        work: dist.Work | None,
        event: hang.Event | None = None,
        device: torch.device | None = None,
        then: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        self._work = work
        self._event = event
        self._device = device
        self._then = then

    def wait(self) -> None:
        if self._work is not None:
            if self._event is None or self._device is None:
                self._work.wait()
            else:
                hang.wait(self._work, self._event, self._device)
            self._work = None
            if self._then is not None:
                dst, src = self._then
                dst.copy_(src)
                self._then = None

    def done(self) -> bool:
        """Whether ``wait()`` would return at once (never blocks)."""
        return self._work is None or self._work.is_completed()


class Comm(ABC):
    """A user-supplied collective: where its buffers come from, and how it runs."""

    @abstractmethod
    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """Return an uninitialised buffer of ``size`` for this collective to write into."""


class AllGather(Comm):
    """Replaces the group's all-gather: ``output`` gets every rank's ``input``, rank-major."""

    @abstractmethod
    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None: ...


class ReduceScatter(Comm):
    """Replaces the group's reduce-scatter: ``output`` gets this rank's reduced chunk."""

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
    ``module.set_custom_reduce_scatter(LowPrecisionReduceScatter(torch.bfloat16))``."""

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
        if _recorders:
            _record("all_to_all", "low-precision reduce-scatter", sent, received, group)
        dist.all_to_all_single(received, sent, group=group)
        torch.sum(received.view(world, -1), dim=0, dtype=output_tensor.dtype, out=output_tensor)
        if op == dist.ReduceOp.AVG:
            output_tensor.div_(world)
        return None


class GroupAllocAllGather(AllGather):
    """The default all-gather with its output buffer from the process group's own allocator
    (``FSDPModule.set_allocate_memory_from_process_group_for_comm``): e.g. memory NCCL has
    registered for zero-copy transfers. Plain memory where the backend has none (gloo)."""

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
        work: dist.Work | None = _all_gather_single(
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
        work: dist.Work | None = _reduce_scatter_single(
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


def all_gather(
    out: torch.Tensor,
    inp: torch.Tensor,
    group: dist.ProcessGroup,
    label: str,
    comm: AllGather | None = None,
) -> Pending:
    """Gather every rank's ``inp`` (1-D, same size everywhere) into ``out``, rank-major."""
    event = _note("all_gather", label, inp, out, group)
    if comm is not None:
        return Pending(comm(out, inp, group, async_op=True), event, inp.device)
    return Pending(_all_gather_single(out, inp, group=group, async_op=True), event, inp.device)


def reduce_scatter(
    out: torch.Tensor,
    inp: torch.Tensor,
    group: dist.ProcessGroup,
    label: str,
    op: dist.ReduceOp.RedOpType,
    comm: ReduceScatter | None = None,
) -> Pending:
    """Reduce ``inp`` (rank-major chunks) over ranks; this rank's chunk lands in ``out``."""
    event = _note("reduce_scatter", label, inp, out, group)
    if comm is not None:
        return Pending(comm(out, inp, group, op, async_op=True), event, inp.device)
    if _is_gloo(group, inp.device):
        # gloo's reduce-scatter is an all-reduce of a clone of ``inp`` and a copy of this rank's
        # chunk when waited on; its work ignores wait()'s timeout and never reports is_completed().
        # ``inp`` is our own scratch buffer: all-reduce it in place (the same algorithm on the
        # same bytes, so bitwise the same result) with a work that honours both, and no clone.
        global all_reduce_for_reduce_scatter
        all_reduce_for_reduce_scatter = True  # c10d sees an all-reduce: lets tests tell
        try:
            work = dist.all_reduce(inp, op=op, group=group, async_op=True)
        finally:
            all_reduce_for_reduce_scatter = False
        chunk = inp.view(group.size(), -1)[group.rank()]
        return Pending(work, event, inp.device, then=(out, chunk))
    work = _reduce_scatter_single(out, inp, op=op, group=group, async_op=True)
    return Pending(work, event, inp.device)


all_reduce_for_reduce_scatter = False  # True while issuing such an all-reduce
_GLOO = getattr(dist, "ProcessGroupGloo", None)  # absent from builds without gloo
# Per process group (weakly: a destroyed group goes), per device type: whether gloo runs it.
_gloo_groups: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[str, bool]] = (
    weakref.WeakKeyDictionary()
)


def _is_gloo(group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether ``group`` runs collectives on ``device`` with gloo (cached: asked per collective)."""
    known = _gloo_groups.get(group)
    if known is None:
        known = _gloo_groups[group] = {}
    answer = known.get(device.type)
    if answer is None:
        try:
            backend = group._get_backend(device)
        except Exception:  # no backend for that device (a fake or custom group)
            backend = None
        answer = known[device.type] = _GLOO is not None and isinstance(backend, _GLOO)
    return answer


def all_reduce(
    tensor: torch.Tensor, group: dist.ProcessGroup, label: str, op: dist.ReduceOp.RedOpType
) -> Pending:
    """Reduce ``tensor`` in place over ``group`` (HSDP's replicas, replicate-only training)."""
    event = _note("all_reduce", label, tensor, tensor, group)
    work = dist.all_reduce(tensor, op=op, group=group, async_op=True)
    return Pending(work, event, tensor.device)


def _note(
    kind: CollectiveKind,
    label: str,
    inp: torch.Tensor,
    out: torch.Tensor,
    group: dist.ProcessGroup,
) -> hang.Event:
    """Before issuing: the event ring (always), the cross-rank check (opt-in), the records."""
    event = hang.note(kind, label, inp, group)
    if checks._enabled:
        if _recorders:
            size = checks.FINGERPRINT_BYTES
            check = CollectiveRecord("check", label, size, size * group.size(), group.size())
            for records in _recorders:
                records.append(check)
        checks.verify(event, inp.device, _all_gather_single)
    if _recorders:
        _record(kind, label, inp, out, group)
    return event


def all_to_all(
    out: torch.Tensor,
    inp: torch.Tensor,
    out_splits: Sequence[int],
    in_splits: Sequence[int],
    group: dist.ProcessGroup,
    label: str,
) -> Pending:
    """Send ``inp``'s i-th split (``in_splits[i]`` elements of the 1-D ``inp``) to rank i of
    ``group``; rank j's split for this rank lands in ``out``'s j-th split (``out_splits[j]``).
    Splits may be uneven (and zero): matrix optimizers move whole matrices' shards this way."""
    event = _note("all_to_all", label, inp, out, group)
    work = dist.all_to_all_single(
        out, inp, list(out_splits), list(in_splits), group=group, async_op=True
    )
    return Pending(work, event, inp.device)


def agree_ints(
    values: list[int], group: dist.ProcessGroup, device: torch.device
) -> list[list[int]]:
    """Every rank's ``values`` (the same count on each), in group rank order: one small
    blocking all-gather, for the checks that make every rank raise alike (agreement.py)."""
    inp = torch.tensor(values, dtype=torch.int64, device=device)
    out = inp.new_empty(group.size() * inp.numel())
    if _recorders:
        _record("agree", "", inp, out, group)
    _all_gather_single(out, inp, group=group)
    return cast("list[list[int]]", out.view(group.size(), -1).tolist())


def agree_objects(obj: object, group: dist.ProcessGroup) -> list[object]:
    """Every rank's ``obj`` (picklable), in group rank order; only once ``agree_ints`` found a
    difference, to word the error."""
    out: list[object] = [None] * group.size()
    if _recorders:
        empty = torch.empty(0)
        _record("agree", "", empty, empty, group)
    dist.all_gather_object(out, obj, group=group)
    return out
