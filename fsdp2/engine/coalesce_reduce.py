"""Coalescing in backward: one reduce-scatter for a run of small groups, instead of one each.

[Note: coalesced reduce-scatters]
Groups become ready to reduce in backward order, one post-backward at a time. A small group's
rank-major input is built as usual (its unsharded gradients copied in and freed), but its
collective waits in the iteration's held bucket. The next group to reduce joins the bucket when
it is joinable, reduces over the same process group with the same dtype, device and op (SUM or
AVG), and the bucket's input (shard ranks x numel x reduce dtype) stays within the budget of
[Note: coalesced gathers]; otherwise the bucket is issued first, and the new group starts the
next one (or, if not joinable, is issued alone). The bucket is issued too at the end of backward
(and pipelining's final callback), before anything waits for a reduction. Joinable: more than
one shard rank, no replicas (HSDP), no custom reduce-scatter, no all-reduce hook, gradient sync
on, no CPU offload, and some trainable parameter (a group without one reduces nothing anywhere
and leaves the bucket as it is). Unlike gathers, this needs no recorded order (the first
backward coalesces too) and explicit prefetch targets do not turn it off: they order gathers,
not reductions.

Issuing: the members' inputs, concatenated along their columns, ``(ranks, n_1 + ... + n_k)``,
are one reduce-scatter, labelled as a coalesced gather is (``bucket_label``). Row r of the
concatenation is the members' rows r side by side, so this rank's chunk of the output is each
member's own chunk, side by side: each member's ``PendingReduce`` gets its slice and finishes
as alone (division, flags, the cut into shards). Per element the collective adds the same
values as the member's own would. With two ranks that is one addition, and IEEE addition is
commutative: bitwise equal to coalescing off. With more ranks the backend's algorithm (gloo's
ring, NCCL's) splits the buffer by position, and an element's summation order can change with
its offset: equal within the rounding of a sum of that many terms, not bitwise.

Buckets must be the same on every rank. A group with no gradient at all on this rank normally
reduces nothing (``None``): whether it has one is a fact of this rank's batch ([Note: gradients
on some ranks only]), so a joinable group that fits the budget reduces zeros there instead, with
its flags saying no gradient: the other ranks' sums are unchanged, parameters that no rank had a
gradient for stay ``None``, and every rank forms the same buckets from facts that are the same
everywhere (sizes, settings, the order of post-backwards). A backward for inputs only then
reduces zeros too, when coalescing is on: it costs a collective, never a value.

Ranks out of step (one skipped a block: rank-dependent control flow) form different buckets, as
for gathers ([Note: coalesced gathers]), and so every coalesced reduce-scatter has ONE size and a
header: each rank's row (its chunk) is the budget's share (``budget // world``, whole elements of
the reduce dtype; less if every joinable group of the root fits in less: ``fixed_row_bytes``), a
header of one element per group of the root, 1 where the group is in the bucket, then the
members' columns, then zeros. Reduced, an element of the header is the number of ranks whose
bucket holds that group (its mean, for AVG): every rank then sees the same disagreement and
raises :class:`CollectiveMismatchError` naming the groups, instead of a size mismatch (which gloo
aborts the process on). A bucket of one goes this way too: against a rank out of step it may
meet a bucket of several. The header is checked when the bucket is finished, before any
gradient is handed out (on accelerators, without stalling the host: ``check_on_host``).

Memory: the held inputs never exceed the budget. Issuing copies them into the concatenation
(one more budget's worth, for a moment) and frees them at once; the concatenation is freed when
the first member finishes, as a single group's input is.
"""

from __future__ import annotations

from collections import deque
from functools import partial

import torch

from fsdp2.debug.checks import CollectiveMismatchError
from fsdp2.engine.buckets import Run, fixed_size, hold
from fsdp2.engine.coalesce import bucket_label, check_on_host, coalesce_bytes
from fsdp2.engine.collectives import reduce_scatter
from fsdp2.engine.grads import Reduced, hand_over
from fsdp2.engine.param_group import FSDPParamGroup
from fsdp2.engine.reduce import GradientReducer, PendingReduce, ReduceInput, reduce_op

__all__ = [
    "UNBOUNDED",
    "PendingBucket",
    "Reductions",
    "fixed_row_bytes",
    "row_nbytes",
    "rs_joinable",
]

UNBOUNDED = 1_000_000  # max_in_flight where everything is issued before anything waits


class PendingBucket:
    """A coalesced reduce-scatter in flight: its members' ``PendingReduce`` share one collective
    and count as one in flight. ``check``: compares the reduced header, at ``finish``."""

    __slots__ = ("check", "members")

    def __init__(self, members: list[PendingReduce], check: partial[None]) -> None:
        self.members = members
        self.check = check

    def finished_locally(self) -> bool:
        return all(m.finished_locally() for m in self.members)

    def finish(self) -> list[Reduced]:
        self.members[0].pending.wait()
        self.check()  # before any member's gradients are handed out
        return [shard for member in self.members for shard in member.finish()]


def rs_joinable(reducer: GradientReducer) -> bool:
    """Whether ``reducer``'s reduce-scatter may be coalesced: only facts the same on every rank."""
    settings, layout = reducer.settings, reducer.layout
    return (
        reducer.shard_size > 1
        and reducer.info.replicate_group is None
        and reducer.levels is None  # hfsdp: two levels, each its own collective
        and settings.custom_reduce_scatter is None
        and settings.all_reduce_hook is None
        and settings.requires_gradient_sync
        and layout.offload is None
        and bool(layout.trainable)
    )


def row_nbytes(reducer: GradientReducer) -> int:
    """The bytes of one rank's row of a joinable group's input, known before it is built."""
    return reducer.row_numel() * reducer.layout.reduce_dtype.itemsize


def fixed_row_bytes(
    rows: list[int], num_groups: int, itemsize: int, budget: int, world: int
) -> int:
    """The one size of every rank's row in a coalesced reduce-scatter over ``world`` ranks, in
    a reduce dtype of ``itemsize`` bytes: the budget's share, or the header and every row of
    ``rows`` (the root's joinable groups, one rank's chunk each) that fits the share, if less.
    Made of facts every rank shares; the planner replays it."""
    return fixed_size(rows, num_groups * itemsize, budget // world // itemsize * itemsize)


def _key(reducer: GradientReducer) -> tuple[object, ...]:
    """What the members of one coalesced reduce-scatter share (the planner's ``reduce_key``)."""
    layout = reducer.layout
    return (id(reducer.reduce_group()), layout.reduce_dtype, layout.device, reducer.sums())


class Reductions:
    """The reductions of one root's backward, in the order they are decided: the held bucket
    (built inputs whose collective waits, [Note: coalesced reduce-scatters]), the collectives in
    flight, and the reduced shards, handed to the parameters only when backward ends (so that a
    backward that raises leaves no partial gradients behind: ``drop``)."""

    def __init__(self, groups: list[FSDPParamGroup]) -> None:
        self.groups = groups  # the root's: a bucket's header has one element per group
        self.in_flight: deque[PendingReduce | PendingBucket] = deque()
        self.reduced: list[Reduced] = []
        # The held bucket: its members' rows fill its capacity, the fixed row (fixed_row_bytes)
        # less the header.
        self.held: Run[tuple[GradientReducer, ReduceInput]] = Run()
        self.fixed = 0
        # (budget, itemsize, world) -> (fixed, capacity), for this backward: the rows it is
        # made of are fixed once a forward took up its changes; computing them walks every group.
        self._sizes: dict[tuple[int, int, int], tuple[int, int]] = {}

    def reduce(self, reducer: GradientReducer, max_in_flight: int) -> None:
        """Reduce ``reducer``'s gradients: held in the bucket, or issued (after the bucket)."""
        budget = coalesce_bytes()
        if not reducer.layout.trainable:  # nothing to reduce, on any rank: the bucket stays
            self._add(reducer.reduce_grads(), max_in_flight)
            return
        joinable = bool(budget) and rs_joinable(reducer)
        if not joinable and not self.held.members:  # coalescing off, most often: hold's rule
            self._add(reducer.reduce_grads(), max_in_flight)
            return
        row = row_nbytes(reducer) if joinable else None
        key = _key(reducer) if joinable else None
        flush, start = partial(self.flush, max_in_flight), partial(self._size, reducer, budget)
        if not hold(self.held, row, key, flush, start) or row is None:
            self._add(reducer.reduce_grads(), max_in_flight)  # alone, as without coalescing
            return
        built = reducer.build_input(always=True)
        if not isinstance(built, ReduceInput) or built.inp.nbytes != row * reducer.shard_size:
            raise AssertionError(
                f"coalesced reduce-scatter '{reducer.label}': expected an input of "
                f"{row * reducer.shard_size} bytes, found "
                f"{built.inp.nbytes if isinstance(built, ReduceInput) else built}"
            )
        self.held.add((reducer, built), row, key)

    def _size(self, reducer: GradientReducer, budget: int) -> int:
        """The fixed row size of a bucket that ``reducer`` starts; its capacity, returned."""
        itemsize, world = reducer.layout.reduce_dtype.itemsize, reducer.shard_size
        key = (budget, itemsize, world)
        sized = self._sizes.get(key)
        if sized is None:
            groups = self.groups
            rows = [row_nbytes(g.reducer) for g in groups if rs_joinable(g.reducer)]
            fixed = fixed_row_bytes(rows, len(groups), itemsize, budget, world)
            sized = self._sizes[key] = (fixed, fixed - len(groups) * itemsize)
        self.fixed, capacity = sized
        return capacity

    def flush(self, max_in_flight: int) -> None:
        """Issue the held bucket, if any, as one reduce-scatter of the fixed size (a bucket of
        one too: see [Note: coalesced reduce-scatters])."""
        if self.held.members:
            self._add(_issue(self.held.take(), self.groups, self.fixed), max_in_flight)

    def _add(self, reduce: PendingReduce | PendingBucket | None, max_in_flight: int) -> None:
        """Put ``reduce`` in flight, first finishing older ones beyond ``max_in_flight - 1``."""
        if reduce is None:
            return
        while len(self.in_flight) >= max_in_flight:
            self.reduced.extend(self.in_flight.popleft().finish())
        self.in_flight.append(reduce)

    def reap(self) -> None:
        """Finish the reduce-scatters that have completed, oldest first, without blocking: each
        holds an input as large as its group's gradients until then. Not those whose finish
        issues a collective (HSDP): completion times differ between ranks."""
        while self.in_flight and self.in_flight[0].finished_locally():
            self.reduced.extend(self.in_flight.popleft().finish())

    def wait_all(self) -> None:
        """Issue the held bucket and wait for every reduction."""
        self.flush(max_in_flight=UNBOUNDED)
        while self.in_flight:
            self.reduced.extend(self.in_flight.popleft().finish())

    def hand_over(self) -> None:
        """The end of backward: the reduced shards to the parameters' ``.grad``; the next
        backward sizes its buckets afresh."""
        reduced, self.reduced = self.reduced, []
        hand_over(reduced)
        self._sizes = {}

    def drop(self) -> None:
        """A reset: forget the held inputs, finish what is in flight, drop every reduced shard."""
        self.held.take()
        while self.in_flight:
            self.in_flight.popleft().finish()
        self.reduced = []
        self._sizes = {}


def _issue(
    members: list[tuple[GradientReducer, ReduceInput]], groups: list[FSDPParamGroup], fixed: int
) -> PendingBucket:
    """One reduce-scatter of ``fixed`` bytes per rank's row: the header, the members' inputs
    side by side (each gets its column slice of the output), zeros. Through the seam itself,
    not a member's ``GradientReducer.reduce_scatter``: it is no one group's collective."""
    first, built = members[0]
    world, dtype = built.inp.shape[0], built.inp.dtype
    header = len(groups)
    inp = built.inp.new_zeros((world, fixed // dtype.itemsize))
    own = torch.zeros(header, dtype=dtype)
    mine = {id(reducer) for reducer, _ in members}
    own[[i for i, g in enumerate(groups) if id(g.reducer) in mine]] = 1
    inp[:, :header] = own.to(inp.device)
    offset = header
    for _, each in members:
        numel = each.inp.shape[1]
        inp[:, offset : offset + numel].copy_(each.inp)
        each.inp.untyped_storage().resize_(0)  # copied: free before the collective
        offset += numel
    out = inp.new_empty(inp.shape[1])
    labels = [reducer.label for reducer, _ in members]
    use_sum = built.use_sum
    pending = reduce_scatter(
        out, inp.view(-1), first.reduce_group(), bucket_label(labels), reduce_op(use_sum)
    )
    issued = []
    offset = header
    for reducer, each in members:
        numel = each.inp.shape[1]
        part = out[offset : offset + numel]
        offset += numel
        issued.append(
            PendingReduce(reducer, pending, part, each.params, inp, use_sum, True, each.used)
        )
    compare = partial(_compare, own=own, groups=groups, world=world, summed=use_sum)
    return PendingBucket(issued, partial(check_on_host, out[:header], compare))


def _compare(
    got: torch.Tensor, *, own: torch.Tensor, groups: list[FSDPParamGroup], world: int, summed: bool
) -> None:
    """Raise, on every rank, if the ranks reduced different groups in one coalesced
    reduce-scatter: each header element counts the ranks whose bucket holds that group."""
    counts = got.float().cpu() * (1 if summed else world)
    expected = own.float() * world
    if bool(((counts - expected).abs() < 0.5).all()):
        return
    mine = [groups[i].label or "<root>" for i in range(len(groups)) if own[i]]
    some = [
        f"{groups[i].label or '<root>'} ({round(float(counts[i]))} of {world} ranks)"
        for i in range(len(groups))
        if 0.5 < float(counts[i]) < world - 0.5
    ]
    raise CollectiveMismatchError(
        "fsdp2: the ranks reduced different groups in one coalesced reduce-scatter: this "
        f"rank's bucket holds `{bucket_label(mine)}`; in some ranks' buckets only: "
        f"{', '.join(some) or 'none readable'}.\nThe ranks ran different fully_shard modules "
        "in this iteration's backward (control flow that depends on the rank or the data: "
        "MoE routing, a layer skipped for some inputs). Every rank must run every sharded "
        "module in each step, in the same order (give an unused expert a zero-weighted call). "
        "The step raised before its gradients were handed out: discard this iteration. To see "
        "each collective on its own, turn coalescing off (FSDP2_COALESCE_BYTES=0)."
    )
