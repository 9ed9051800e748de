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

Memory: the held inputs never exceed the budget. Issuing copies them into the concatenation
(one more budget's worth, for a moment) and frees them at once; the concatenation is freed when
the first member finishes, as a single group's input is.
"""

from __future__ import annotations

from typing import Protocol

import torch

from fsdp2.engine.coalesce import bucket_label, coalesce_bytes
from fsdp2.engine.collectives import reduce_scatter
from fsdp2.engine.grads import Reduced
from fsdp2.engine.reduce import GradientReducer, PendingReduce, ReduceInput, reduce_op

__all__ = ["HeldReduces", "PendingBucket", "input_nbytes", "rs_joinable"]


class PendingBucket:
    """A coalesced reduce-scatter in flight: its members' ``PendingReduce`` share one collective
    and count as one in flight."""

    __slots__ = ("members",)

    def __init__(self, members: list[PendingReduce]) -> None:
        self.members = members

    def finished_locally(self) -> bool:
        return all(m.finished_locally() for m in self.members)

    def finish(self) -> list[Reduced]:
        return [shard for member in self.members for shard in member.finish()]


class _Queue(Protocol):
    """Where issued reductions go (``IterContext.add_reduce``)."""

    def add_reduce(self, reduce: PendingReduce | PendingBucket | None, max_in_flight: int) -> None:
        """Put ``reduce`` in flight."""


def rs_joinable(reducer: GradientReducer) -> bool:
    """Whether ``reducer``'s reduce-scatter may be coalesced: only facts the same on every rank."""
    settings, layout = reducer.settings, reducer.layout
    return (
        reducer.shard_size > 1
        and reducer.info.replicate_group is None
        and settings.custom_reduce_scatter is None
        and settings.all_reduce_hook is None
        and settings.requires_gradient_sync
        and layout.offload is None
        and bool(layout.trainable)
    )


def input_nbytes(reducer: GradientReducer) -> int:
    """The bytes of a joinable group's rank-major input, known before it is built: every
    trainable parameter's chunk, and one flag each unless unused ones get zeros anyway."""
    layout = reducer.layout
    numel = sum(p.chunk_numel for p in layout.trainable)
    if not reducer.settings.reduce_scatter_unused:
        numel += len(layout.trainable)
    return reducer.shard_size * numel * layout.reduce_dtype.itemsize


class HeldReduces:
    """One iteration's held bucket: built reduce-scatter inputs whose collective waits."""

    def __init__(self) -> None:
        self.members: list[tuple[GradientReducer, ReduceInput]] = []
        self.nbytes = 0

    def reduce(self, reducer: GradientReducer, queue: _Queue, max_in_flight: int) -> None:
        """Reduce ``reducer``'s gradients: held in the bucket, or issued (after the bucket)."""
        budget = coalesce_bytes()
        if not reducer.layout.trainable:  # nothing to reduce, on any rank: the bucket stays
            queue.add_reduce(reducer.reduce_grads(), max_in_flight)
            return
        nbytes = input_nbytes(reducer) if budget and rs_joinable(reducer) else budget + 1
        if self.members and not (self.nbytes + nbytes <= budget and self._compatible(reducer)):
            self.flush(queue, max_in_flight)
        if nbytes > budget:  # not joinable, or too large to hold: alone, as without coalescing
            queue.add_reduce(reducer.reduce_grads(), max_in_flight)
            return
        built = reducer.build_input(always=True)
        if not isinstance(built, ReduceInput) or built.inp.nbytes != nbytes:
            raise AssertionError(
                f"coalesced reduce-scatter '{reducer.label}': expected an input of {nbytes} "
                f"bytes, found {built.inp.nbytes if isinstance(built, ReduceInput) else built}"
            )
        self.members.append((reducer, built))
        self.nbytes += nbytes

    def _compatible(self, reducer: GradientReducer) -> bool:
        first = self.members[0][0]
        return (
            reducer.reduce_group() is first.reduce_group()
            and reducer.layout.reduce_dtype == first.layout.reduce_dtype
            and reducer.layout.device == first.layout.device
            and reducer.sums() == first.sums()
        )

    def flush(self, queue: _Queue, max_in_flight: int) -> None:
        """Issue the held bucket, if any, as one reduce-scatter."""
        members, self.members, self.nbytes = self.members, [], 0
        if len(members) == 1:
            reducer, built = members[0]
            queue.add_reduce(reducer.issue(built), max_in_flight)
        elif members:
            queue.add_reduce(_issue(members), max_in_flight)

    def drop(self) -> None:
        """Forget the held inputs (a reset: the failed iteration's gradients are dropped)."""
        self.members, self.nbytes = [], 0


def _issue(members: list[tuple[GradientReducer, ReduceInput]]) -> PendingBucket:
    """One reduce-scatter of the members' inputs side by side; each gets its column slice.
    Through the seam itself, not a member's ``GradientReducer.reduce_scatter``: it is no one
    group's collective."""
    inp = torch.cat([built.inp for _, built in members], dim=1)
    for _, built in members:
        built.inp.untyped_storage().resize_(0)  # copied: free before the collective
    out = inp.new_empty(inp.shape[1])
    first, built = members[0]
    label = bucket_label([reducer.label for reducer, _ in members])
    pending = reduce_scatter(
        out, inp.view(-1), first.reduce_group(), label, reduce_op(built.use_sum)
    )
    issued = []
    offset = 0
    for reducer, built in members:
        numel = built.inp.shape[1]
        part = out[offset : offset + numel]
        offset += numel
        issued.append(
            PendingReduce(
                reducer, pending, part, built.params, inp, built.use_sum, True, built.used
            )
        )
    return PendingBucket(issued)
