"""The seam every collective of fsdp2 passes through: all-gather, reduce-scatter, all-reduce and
all-to-all (the last for matrix optimizers, :mod:`fsdp2.optim`), and DTensor's redistributions.

Every collective goes through :func:`all_gather`, :func:`all_gather_in_place` (several outputs
gathered in place as one, for ``iter_full_weights``), :func:`reduce_scatter`, :func:`all_reduce`,
:func:`all_to_all` or :func:`redistribute`, the seam where the hang report notes it, the opt-in
checks compare it across ranks, and :func:`record_collectives` observes it (tests count them,
benchmarks sum bytes). Only this file and the pluggable collectives in ``comm.py`` (which the
seam calls in place of its default) issue ``torch.distributed`` collectives; DTensor issues the
ones :func:`redistribute` runs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal, TypeVar, cast

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement

from fsdp2.debug import checks, hang, switches
from fsdp2.debug.waiting import is_gloo
from fsdp2.engine.handover import alias, drop, hand, settle_later
from fsdp2.engine.releases import RULES

__all__ = [
    "CollectiveKind", "CollectiveRecord", "Pending", "agree_ints", "agree_objects", "all_gather",
    "all_gather_in_place", "all_reduce", "all_to_all", "defer_check", "forget_deferred_checks",
    "record", "record_collectives", "redistribute", "reduce_scatter", "run_deferred_checks",
    "taking_state",
]  # fmt: skip

# "agree": the small exchanges that make every rank raise alike (agreement.py), at init only.
# "check": the fingerprint exchanges of the collective checks (checks.py), opt-in.
# "redistribute": DTensor's change of a tensor's placements (:func:`redistribute`).
CollectiveKind = Literal[
    "all_gather", "reduce_scatter", "all_reduce", "all_to_all", "agree", "check", "redistribute"
]


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective issued by this rank, as :func:`record_collectives` lists it.

    Attributes:
        kind: ``"all_gather"``, ``"reduce_scatter"``, ``"all_reduce"``, ``"all_to_all"``;
            ``"redistribute"`` for DTensor's change of a tensor's placements, one record per
            mesh dim whose placement changes (with the whole local input and output);
            ``"agree"`` for the small exchanges that make every rank raise alike (at
            ``fully_shard`` and at the first forward), ``"check"`` for the collective checks'
            fingerprints.
        label: which modules' group issued it (their FQNs, comma-joined; ``""`` for the root).
        input_nbytes: bytes of this rank's input.
        output_nbytes: bytes of this rank's output.
        world_size: the size of the process group it ran on.
        group: that process group's name (``ProcessGroup.group_name``).
    """

    kind: CollectiveKind
    label: str  # comma-joined FQNs of the modules of the group ("" for the root module)
    input_nbytes: int
    output_nbytes: int
    world_size: int
    group: str = ""  # the process group's name (``ProcessGroup.group_name``)


_recorders: list[list[CollectiveRecord]] = []

# Checks of collectives an accelerator has not finished (a coalesced gather's headers,
# coalesce.py): run before the next collective is issued, so that ranks that diverged raise
# before they could issue mismatched ones, and at the end of a forward and of a backward. Run at
# the gather's own wait they would stall the host until the device's whole queue drained.
# They are the training's: a thread taking state (``taking_state``) never runs them.
_deferred: list[Callable[[], None]] = []
_takers: set[int] = set()  # the idents of the threads inside ``taking_state``


def defer_check(check: Callable[[], None]) -> None:
    _deferred.append(check)


@contextmanager
def taking_state() -> Iterator[None]:
    """Taking state beside the training (consistent_state): run none of its deferred checks."""
    _takers.add(me := threading.get_ident())
    try:
        yield
    finally:
        _takers.discard(me)


def run_deferred_checks() -> None:
    """Run the deferred checks (each may block until its collective finished); the first to
    fail raises, and the rest are dropped: every rank raises at the same one."""
    if _deferred and threading.get_ident() not in _takers:
        pending = list(_deferred)
        _deferred.clear()
        for check in pending:
            check()


def forget_deferred_checks() -> None:
    """A failed iteration is forgotten: so are the checks of its collectives."""
    _deferred.clear()


# What the seam calls in place of its default all-gather / reduce-scatter (``comm.py``'s classes):
# ``(output, input, group, async_op=...)``, and ``op`` before ``async_op`` for a reduce-scatter.
GatherFn = Callable[..., "dist.Work | None"]
ScatterFn = Callable[..., "dist.Work | None"]

# The tensor-in, tensor-out collectives, under the installed torch's names (releases.py).
if RULES.single_collectives:
    _all_gather_single = dist.all_gather_single
    _reduce_scatter_single = dist.reduce_scatter_single
else:
    _all_gather_single = dist.all_gather_into_tensor
    _reduce_scatter_single = dist.reduce_scatter_tensor


@contextmanager
def record_collectives() -> Iterator[list[CollectiveRecord]]:
    """Record every collective fsdp2 issues while the context is active, on this rank.

    Yields a list that fills with one :class:`CollectiveRecord` per collective, in issue order,
    appended just before the collective is issued (nested contexts each get every record).

    Example::

        with record_collectives() as records:
            loss = model(x).sum()
            loss.backward()
        num_gathers = sum(r.kind == "all_gather" for r in records)
    """
    records: list[CollectiveRecord] = []
    _recorders.append(records)
    try:
        yield records
    finally:
        _recorders.remove(records)


def record(
    kind: CollectiveKind, label: str, inp: torch.Tensor, out: torch.Tensor, group: dist.ProcessGroup
) -> None:
    """Hand a collective about to be issued to every active :func:`record_collectives` (for
    collectives issued inside a pluggable one, ``comm.py``)."""
    if _recorders:
        _record(kind, label, inp, out, group)


def _record(
    kind: CollectiveKind, label: str, inp: torch.Tensor, out: torch.Tensor, group: dist.ProcessGroup
) -> None:
    entry = CollectiveRecord(kind, label, inp.nbytes, out.nbytes, group.size(), group.group_name)
    for records in _recorders:
        records.append(entry)


class Pending:
    """An issued collective; ``wait()`` returns once its output may be read (or raises the hang
    report after ``FSDP2_COLLECTIVE_TIMEOUT`` seconds: see [Note: the hang report]).
    ``then``: a copy ``(dst, src)`` to make once the collective finished (see
    :func:`reduce_scatter` on gloo). ``handed``: the tensors the backend got (handover.py), let
    go of once waited on; with ``empty``, emptied first."""

    __slots__ = ("_device", "_empty", "_event", "_handed", "_then", "_work")

    def __init__(
        self,
        work: dist.Work | None,
        event: hang.Event | None = None,
        device: torch.device | None = None,
        then: tuple[torch.Tensor, torch.Tensor] | None = None,
        handed: list[torch.Tensor] | None = None,
        empty: bool = False,
    ) -> None:
        self._work = work
        self._event = event
        self._device = device
        self._then = then
        self._handed = handed
        self._empty = empty

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
            if self._handed is not None:
                _let_go(self._handed, self._empty)
                self._handed = None

    def done(self) -> bool:
        """Whether ``wait()`` would return at once (never blocks)."""
        return self._work is None or self._work.is_completed()


def all_gather(
    out: torch.Tensor,
    inp: torch.Tensor,
    group: dist.ProcessGroup,
    label: str,
    comm: GatherFn | None = None,
) -> Pending:
    """Gather every rank's ``inp`` (1-D, same size everywhere) into ``out``, rank-major; with
    ``comm`` (a :class:`~fsdp2.engine.comm.AllGather`), through it."""
    event = _note("all_gather", label, inp, out, group)
    if comm is not None:
        return Pending(comm(out, inp, group, async_op=True), event, inp.device)
    work, handed = _gather(out, inp, group, async_op=True)
    return Pending(work, event, inp.device, handed=handed)


def _gather(
    out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup, async_op: bool
) -> tuple[dist.Work | None, list[torch.Tensor]]:
    """Issue the all-gather of ``inp`` into ``out`` (rank-major) on handed tensors: its work,
    and them. gloo's tensor form holds views of ``out`` of its own making: its list form
    ([Note: a backend thread's last reference]) is handed ``out``'s rows."""
    if is_gloo(group, inp.device):
        handed = [*(hand(row) for row in out.chunk(group.size())), hand(inp)]
        return dist.all_gather(handed[:-1], handed[-1], group=group, async_op=async_op), handed
    handed = [hand(out), hand(inp)]
    return _all_gather_single(handed[0], handed[1], group=group, async_op=async_op), handed


def all_gather_in_place(
    outs: Sequence[torch.Tensor], group: dist.ProcessGroup, label: str
) -> Pending:
    """Gather into each of ``outs`` (1-D, rank-major; this rank's chunk already written in
    place) as one collective: one coalesced launch (noted, checked and recorded as one
    all-gather of the total size), waited on as one.

    gloo gathers through temporaries: its coalesced form flattens the inputs and the outputs
    (1.5 times the outputs' bytes at W=2, measured), even one in-place gather copies through
    one of its output's size, and a finished work keeps it a while. Its broadcast writes in
    place. So on gloo each rank's chunk of each output is broadcast from that rank, all issued
    at once and waited on here: the same bytes, no temporary (full_weights.py's memory bound
    rests on it), W launches per output where gloo's coalesced form would take one.

    A backend's work may hold its tensors a while after it finished (gloo's workers drop them
    a moment after ``wait()`` returns), which would keep the caller's buffer alive into its
    next one: the backend gets aliases of its own (not views: a view holds its base), emptied
    once waited on, then watched until the backend lets go (handover.py)."""
    world, rank = group.size(), group.rank()
    device, dtype, total = outs[0].device, outs[0].dtype, sum(out.numel() for out in outs)
    # The hang report, the checks and the records see one collective of the total size.
    inp = torch.empty(total // world, dtype=dtype, device="meta")
    event = _note("all_gather", label, inp, inp.new_empty(total), group, device)
    if is_gloo(group, device):
        roots = dist.get_process_group_ranks(group)
        rows = [alias(row) for out in outs for row in out.view(world, -1).unbind(0)]
        works = [
            dist.broadcast(row, roots[index % world], group=group, async_op=True)
            for index, row in enumerate(rows)
        ]
        for work in works:
            if work is not None:
                hang.wait(work, event, device)
        del works
        _let_go(rows, empty=True)
        return Pending(None)
    pairs = [(alias(out), alias(out.view(world, -1)[rank])) for out in outs]
    with dist._coalescing_manager(group=group, async_ops=True) as manager:  # type: ignore[attr-defined]
        for view, mine in pairs:
            _all_gather_single(view, mine, group=group)
    if len(manager.works) != 1:  # the coalesced launch: one work for all of them
        raise AssertionError(f"{label}: expected one coalesced work, got {len(manager.works)}")
    handed = [tensor for pair in pairs for tensor in pair]
    work = manager.works[0]
    del manager, pairs  # the backend's aliases are held by the returned Pending alone
    return Pending(work, event, device, handed=handed, empty=True)


def _let_go(handed: list[torch.Tensor], empty: bool = False) -> None:
    """The seam is done with the tensors a waited collective was handed (emptied first with
    ``empty``): watch them until the backend drops them too (handover.py). Clears ``handed``."""
    if empty:
        for tensor in handed:
            drop(tensor)
    settle_later(handed)
    handed.clear()


def reduce_scatter(
    out: torch.Tensor,
    inp: torch.Tensor,
    group: dist.ProcessGroup,
    label: str,
    op: dist.ReduceOp.RedOpType,
    comm: ScatterFn | None = None,
) -> Pending:
    """Reduce ``inp`` (rank-major chunks) over ranks; this rank's chunk lands in ``out``; with
    ``comm`` (a :class:`~fsdp2.engine.comm.ReduceScatter`), through it."""
    event = _note("reduce_scatter", label, inp, out, group)
    if comm is not None:
        return Pending(comm(out, inp, group, op, async_op=True), event, inp.device)
    if is_gloo(group, inp.device):
        # gloo's reduce-scatter is an all-reduce of a clone of ``inp`` and a copy of this rank's
        # chunk when waited on; its work ignores wait()'s timeout and never reports is_completed().
        # ``inp`` is our own scratch buffer: all-reduce it in place (the same algorithm on the
        # same bytes, so bitwise the same result) with a work that honours both, and no clone.
        # (c10d sees an all-reduce: observers below the seam tell it by the "reduce_scatter"
        # record just before it.)
        handed = [hand(inp)]
        work = dist.all_reduce(handed[0], op=op, group=group, async_op=True)
        chunk = inp.view(group.size(), -1)[group.rank()]
        return Pending(work, event, inp.device, then=(out, chunk), handed=handed)
    handed = [hand(out), hand(inp)]
    work = _reduce_scatter_single(handed[0], handed[1], op=op, group=group, async_op=True)
    return Pending(work, event, inp.device, handed=handed)


def all_reduce(
    tensor: torch.Tensor, group: dist.ProcessGroup, label: str, op: dist.ReduceOp.RedOpType
) -> Pending:
    """Reduce ``tensor`` in place over ``group`` (HSDP's replicas, replicate-only training)."""
    event = _note("all_reduce", label, tensor, tensor, group)
    handed = [hand(tensor)]
    work = dist.all_reduce(handed[0], op=op, group=group, async_op=True)
    return Pending(work, event, tensor.device, handed=handed)


_R = TypeVar("_R")


def redistribute(
    value: DTensor, target: Sequence[Placement], label: str, run: Callable[[], _R]
) -> _R:
    """``run()``, a DTensor call that lays ``value`` out as ``target`` on its mesh (a
    ``redistribute``; a ``full_tensor``: all ``Replicate``), seen by the seam. DTensor plans and
    issues its collectives (several dims, uneven and strided shards: a planner of ours would be
    a second one to keep in step). The seam notes a "redistribute" per mesh dim that changes
    from other than ``Replicate``, on its group, sized as the global tensor (the same on every
    rank), checks it (opt-in), and records it once ``run`` returned. Meanwhile the rank is
    "blocked in" the first one, without fsdp2's deadline: the hang report is logged when it
    passes, the backend's timeout ends the wait. No change: ``run()`` alone."""
    mesh = value.device_mesh  # from Replicate every placement is a local cut
    groups = [
        mesh.get_group(dim)
        for dim, (have, want) in enumerate(zip(value.placements, target, strict=True))
        if have != want and not have.is_replicate()
    ]
    if not groups:
        return run()
    local = value._local_tensor
    whole = torch.empty(value.shape, dtype=value.dtype, device="meta")
    events = [
        _note("redistribute", label, whole, whole, group, local.device, record=False)
        for group in groups
    ]
    with hang.blocked_in(events[0], local.device):
        out = run()
    if _recorders:
        got = out._local_tensor if isinstance(out, DTensor) else out
        if isinstance(got, torch.Tensor):
            for group in groups:
                _record("redistribute", label, local, got, group)
    return out


def _note(
    kind: CollectiveKind,
    label: str,
    inp: torch.Tensor,
    out: torch.Tensor,
    group: dist.ProcessGroup,
    device: torch.device | None = None,
    record: bool = True,
) -> hang.Event:
    """Before issuing: the deferred checks, the event ring (always), the cross-rank check
    (opt-in, on ``device``: ``inp``'s unless given), the records (unless ``record`` is off)."""
    if _deferred:
        run_deferred_checks()
    event = hang.note(kind, label, inp, group)
    if switches.checks_enabled:
        if _recorders:
            size = checks.FINGERPRINT_BYTES
            check = CollectiveRecord("check", label, size, size * group.size(), group.size())
            for records in _recorders:
                records.append(check)
        checks.verify(event, device or inp.device, _gather_handed)
    if _recorders and record:
        _record(kind, label, inp, out, group)
    return event


def _gather_handed(
    out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup, async_op: bool
) -> dist.Work | None:
    """The checks' fingerprint gather (checks.py waits on it, and keeps none of its tensors)."""
    work, handed = _gather(out, inp, group, async_op)
    _let_go(handed)
    return work


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
    handed = [hand(out), hand(inp)]
    work = dist.all_to_all_single(
        handed[0], handed[1], list(out_splits), list(in_splits), group=group, async_op=True
    )
    return Pending(work, event, inp.device, handed=handed)


def agree_ints(
    values: list[int], group: dist.ProcessGroup, device: torch.device
) -> list[list[int]]:
    """Every rank's ``values`` (the same count on each), in group rank order: one small
    blocking all-gather, for the checks that make every rank raise alike (agreement.py)."""
    inp = torch.tensor(values, dtype=torch.int64, device=device)
    out = inp.new_empty(group.size() * inp.numel())
    if _recorders:
        _record("agree", "", inp, out, group)
    _, handed = _gather(out, inp, group, async_op=False)
    _let_go(handed)  # often a script's last collective (iter_full_weights' closing exchange)
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
