"""The only place fsdp2 talks to ``torch.distributed``: one all-gather and one reduce-scatter.

Every collective goes through :func:`all_gather` or :func:`reduce_scatter`, which is also the
seam where :func:`record_collectives` observes them (tests count them, benchmarks sum bytes).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

__all__ = [
    "AllGather",
    "CollectiveRecord",
    "Comm",
    "LowPrecisionReduceScatter",
    "Pending",
    "ReduceScatter",
    "all_gather",
    "all_reduce",
    "record_collectives",
    "reduce_scatter",
]

CollectiveKind = Literal["all_gather", "reduce_scatter", "all_reduce", "all_to_all"]


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective issued by this rank."""

    kind: CollectiveKind
    label: str  # comma-joined FQNs of the modules of the group ("" for the root module)
    input_nbytes: int
    output_nbytes: int
    world_size: int


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
    kind: CollectiveKind, label: str, inp: torch.Tensor, out: torch.Tensor, size: int
) -> None:
    record = CollectiveRecord(
        kind, label, inp.numel() * inp.element_size(), out.numel() * out.element_size(), size
    )
    for records in _recorders:
        records.append(record)


class Pending:
    """An issued collective; ``wait()`` returns once its output may be read."""

    __slots__ = ("_work",)

    def __init__(self, work: dist.Work | None) -> None:
        self._work = work

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None

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
            _record("all_to_all", "low-precision reduce-scatter", sent, received, world)
        dist.all_to_all_single(received, sent, group=group)
        torch.sum(received.view(world, -1), dim=0, dtype=output_tensor.dtype, out=output_tensor)
        if op == dist.ReduceOp.AVG:
            output_tensor.div_(world)
        return None


def all_gather(
    out: torch.Tensor,
    inp: torch.Tensor,
    group: dist.ProcessGroup,
    label: str,
    comm: AllGather | None = None,
) -> Pending:
    """Gather every rank's ``inp`` (1-D, same size everywhere) into ``out``, rank-major."""
    if _recorders:
        _record("all_gather", label, inp, out, group.size())
    if comm is not None:
        return Pending(comm(out, inp, group, async_op=True))
    return Pending(_all_gather_single(out, inp, group=group, async_op=True))


def reduce_scatter(
    out: torch.Tensor,
    inp: torch.Tensor,
    group: dist.ProcessGroup,
    label: str,
    op: dist.ReduceOp.RedOpType,
    comm: ReduceScatter | None = None,
) -> Pending:
    """Reduce ``inp`` (rank-major chunks) over ranks; this rank's chunk lands in ``out``."""
    if _recorders:
        _record("reduce_scatter", label, inp, out, group.size())
    if comm is not None:
        return Pending(comm(out, inp, group, op, async_op=True))
    return Pending(_reduce_scatter_single(out, inp, op=op, group=group, async_op=True))


def all_reduce(
    tensor: torch.Tensor, group: dist.ProcessGroup, label: str, op: dist.ReduceOp.RedOpType
) -> Pending:
    """Reduce ``tensor`` in place over ``group`` (HSDP's replicas, replicate-only training)."""
    if _recorders:
        _record("all_reduce", label, tensor, tensor, group.size())
    return Pending(dist.all_reduce(tensor, op=op, group=group, async_op=True))
