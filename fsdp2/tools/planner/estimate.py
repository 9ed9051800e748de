"""Closed-form accounting over the groups: the collectives of one training step, and the
transient memory fsdp2's gathers and reductions add on top of what a rank holds.

[Note: the planner's transient model]
It follows fsdp2's runtime (state.py, param_group.py, reduce.py), per rank, for one step with
every trainable parameter getting a gradient:
- Forward runs the groups in pre-order (the root first). A group being gathered holds its
  all-gather output and its unsharded buffer at once (the copy-out), then only the latter, until
  its post-forward frees it if it reshards after forward (the root, by default, does not).
- Backward runs them in reverse. A group that resharded is gathered again (the same two
  buffers); on an accelerator mesh one more group's gather output is in flight (the backward
  prefetch; CPU meshes do not prefetch). Its gradients appear unsharded in param_dtype; when
  they are all in, the group reshards, copies them into the reduce-scatter input (both alive
  for the copy) and the previous group's reduce-scatter, still in flight, is finished only
  after that: two reduce-scatter inputs coexist for a moment. A group with nothing to reduce
  finds the one before finished, unless it all-reduces (HSDP): that one is never finished early,
  so it stays in flight through frozen groups until the next reduce-scatter is issued.
- A kept group (the root) may get gradients first (the head's) and is reduced last, at the end
  of backward: its unsharded gradients count as alive through all of backward.
- Reduced shards accumulate through backward (counted with the held gradients), and the groups
  kept unsharded after forward stay so until the end of backward.
- A group backward never reaches (frozen, with nothing trainable before it: a frozen first
  block) is not gathered in backward on a CPU mesh; on an accelerator the group after it
  prefetches it anyway (unless that is the root's), and the gather is freed unused at the end
  of backward (fsdp2/engine/state.py, [Note: prefetch order]).
What it does not see: the optimizer step's temporaries (foreach AdamW allocates a few
parameter-shard-sized buffers), caching-allocator fragmentation, extension (float8) packing.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial

import torch

from fsdp2.engine.buckets import Run, fill, hold
from fsdp2.engine.coalesce import ALIGN, bucket_label, fixed_send_bytes, header_bytes
from fsdp2.engine.coalesce_reduce import fixed_row_bytes
from fsdp2.engine.iteration import backward_prefetch
from fsdp2.tools.planner.groups import GroupFacts

__all__ = ["Collective", "Schedule", "Transient", "collectives", "transient"]


@dataclass(frozen=True)
class Collective:
    """One collective this rank issues in a step, sized as ``record_collectives()`` sees it."""

    kind: str
    label: str
    input_nbytes: int
    output_nbytes: int
    world_size: int


def _gkey(g: GroupFacts) -> tuple[object, ...]:
    """What the groups of one coalesced gather share (the engine's ``coalesce._key``)."""
    return (g.gather_key, g.param_dtype)


def collectives(groups: list[GroupFacts], prefetch: bool, budget: int = 0) -> list[Collective]:
    """The collectives of one forward + backward, in issue order, of a steady-state step (any
    step after the first: the first has no recorded order to coalesce by). With ``prefetch``,
    a group's backward gather is issued by the group after it, as that one's backward begins
    (before its reduce-scatter); the root's pre-backward issues the last group's. With a
    coalescing ``budget``, runs of small groups share one collective ([Note: the planner's
    coalesced step])."""
    return Schedule(groups, prefetch, budget).out


class Schedule:
    """fsdp2's step replayed over the groups: which group's hook issues which collective.

    [Note: the planner's coalesced step]
    With a budget (``fsdp2.engine.coalesce.coalesce_bytes()``, read when planning) the planner
    applies the engine's coalescing rules to a steady-state step: a group gathered by its own
    hook (not already gathered or prefetched) takes along the groups after it in forward order
    (in backward: before it) while each is joinable, compatible (same process group and gather
    dtype), still sharded and the gather outputs stay within the budget; backward takes only
    groups that resharded after forward and gather in backward. A guessed prefetch (on
    accelerators) forms its bucket the same way from the group it prefetches. In backward a
    reduce-scatter that may join is held; the next joins it while compatible (process group,
    reduce dtype, op) and the rows fit the fixed row size less its header
    (``coalesce_reduce.fixed_row_bytes``), else the held bucket is issued first, at that size;
    the rest is issued at the end of backward. A group alone over it is issued alone. The
    engine gathers at one fixed size per root (a header, then the aligned shards:
    ``coalesce.fixed_send_bytes``): the members' aligned sends fill that size, and a group that
    fits goes that way even alone. Memory: a bucket's shared output lives from its gather until
    its last member copies out (a member backward never reaches: the end of backward), beside
    its send buffer and, on gloo, a temporary the output's size while it runs; held
    reduce-scatter inputs (with their outputs) live until their bucket is issued, when they are
    copied into one input (counted at the reduction that issues it; the one at the end of
    backward is taken to peak lower).
    """

    def __init__(
        self, groups: list[GroupFacts], prefetch: bool, budget: int, gloo: bool = False
    ) -> None:
        self.groups, self.prefetch, self.budget, self.gloo = groups, prefetch, budget, gloo
        self.out: list[Collective] = []
        n = len(groups)
        self.gathered = [False] * n  # gathered or under way
        self.forward_shared = [0] * n  # bytes of the gather output alive at its copy-out
        self.backward_shared = [0] * n
        # A coalesced gather's bytes besides its output while it runs (until its first member's
        # wait): the concatenated send buffer, and on gloo a temporary the output's size
        # (measured: gloo's all_gather_into_tensor of a 2 MiB output peaks 2 MiB above it).
        self.forward_extra = [0] * n
        self.backward_extra = [0] * n
        self.shared_after = [0] * n  # a backward bucket's output still alive after its compute
        self.stuck_after = [0] * n  # bytes alive from its backward to the end of backward
        # Reduce-scatter inputs and outputs built and not finished as its own is built
        self.reduce_before = [0] * n
        self.reduce_concat = [0] * n  # a held bucket issued at its reduction: the concatenation
        self._last_reduce = 0  # those alive after the last one: held, or issued alone
        self.held: Run[int] = Run()  # the held reduce-scatter bucket
        self._rs_fixed = 0  # its fixed row bytes
        # The all-reduces (HSDP) of the reduce-scatter in flight, issued when it is finished
        self._finishing: list[Collective] = []
        self._forward()
        self._backward()

    def _forward(self) -> None:
        groups = self.groups
        for i, g in enumerate(groups):
            if g.shard_world > 1 and not self.gathered[i]:
                self._gather(i, backward=False)
            nxt = i + 1
            if self.prefetch and nxt < len(groups) and not self.gathered[nxt]:
                if groups[nxt].shard_world > 1:
                    self._gather(nxt, backward=False)
        for i, g in enumerate(groups):  # after forward: resharded, or kept gathered
            self.gathered[i] = not g.reshard_after_forward and g.shard_world > 1

    def _backward(self) -> None:
        groups = self.groups
        gathered = gathered_in_backward(groups, self.prefetch)
        # The root's pre-backward runs first (its outputs' gradients arrive before any block's):
        # a root that resharded after forward is gathered then, and alone, as the engine's
        # bucket walks back from it in forward order and nothing precedes the root.
        if groups and groups[0].is_root:
            if gathered[0] and self._regathers(0):
                self._gather(0, backward=True)
            self._prefetch(0)
        for i in reversed(range(len(groups))):
            g = groups[i]
            if gathered[i] and self._regathers(i) and not self.gathered[i]:
                self._gather(i, backward=True)
            if g.backward_reached and not g.is_root:
                self._prefetch(i)
            if g.num_trainable and g.shard_world > 1:
                self._reduce(i)
            elif not self.held.members and not self._finishing:
                # The one before it was finished as it ran; not one that all-reduces (HSDP),
                # which stays in flight until the next reduce-scatter is issued.
                self._last_reduce = 0
            if g.num_trainable and g.replicate_world and g.shard_world == 1:
                self.out.extend(_all_reduces([g]))  # no reduce-scatter: issued at once
        self._issue_held()
        self.out.extend(self._finishing)  # the end of backward waits for every reduction

    def _prefetch(self, i: int) -> None:
        """Group ``i``'s pre-backward prefetch (the engine's ``backward_prefetch``)."""
        if not self.prefetch:  # CPU meshes guess no prefetch
            return
        groups = self.groups
        at = backward_prefetch(len(groups), i, groups[i].is_root, lambda k: groups[k].is_root)
        if at >= 0 and self._regathers(at) and not self.gathered[at]:
            self._gather(at, backward=True)

    def _regathers(self, i: int) -> bool:
        g = self.groups[i]
        return g.shard_world > 1 and g.reshard_after_forward and g.unshard_in_backward

    def _gather(self, i: int, backward: bool) -> None:
        """Group ``i``'s gather, with the groups that join it (forward: after it; backward:
        before it)."""
        groups, limit = self.groups, self._capacity(self.groups[i])
        g = groups[i]
        run: Run[int] = Run(limit)
        rest = self._may_follow(i, backward)
        joins = bool(limit) and g.gather_joinable and fill(run, i, self._size(g), _gkey(g), rest)
        bucket = run.members if joins else [i]
        for k in bucket:
            self.gathered[k] = True
        members = [groups[k] for k in bucket]
        if not joins:
            planned = g.backward_gathers if backward else g.forward_gathers
            self.out.extend(Collective(p.kind, g.label, *p[1:]) for p in planned)
            total = g.unsharded_bytes
        else:  # one collective of fixed-size send buffers, even for a bucket of one
            send = self._per_rank(g)
            total = send * g.shard_world
            label = bucket_label([m.label for m in members])
            self.out.append(Collective("all_gather", label, send, total, g.shard_world))
            extra = self.backward_extra if backward else self.forward_extra
            extra[i] = send + (total if self.gloo else 0)
        if backward:
            # The shared output lives until its last member copies out; a member backward never
            # reaches never does: it lives on to the end of backward.
            stuck = len(bucket) > 1 and any(not groups[k].backward_reached for k in bucket)
            for k in bucket:
                self.backward_shared[k] = total if k == i or not stuck else 0
                self.shared_after[k] = total if k != bucket[-1] and not stuck else 0
            self.stuck_after[i] += total if stuck else 0
        else:
            for k in bucket:
                self.forward_shared[k] = total

    def _may_follow(self, i: int, backward: bool) -> Iterator[tuple[int, int, object] | None]:
        """The groups that may join ``i``'s gather (forward: those after it; backward: before),
        in order; ``None`` at the first that cannot (the engine's ``coalesce._after``)."""
        step = -1 if backward else 1
        j = i + step
        while 0 <= j < len(self.groups):
            other = self.groups[j]
            if self.gathered[j] or not other.gather_joinable:
                yield None
                return
            if backward and not self._regathers(j):
                yield None
                return
            yield j, self._size(other), _gkey(other)
            j += step

    def _per_rank(self, g: GroupFacts) -> int:
        """The engine's fixed send size of a coalesced gather over ``g``'s ranks: the budget's
        share, or what the root's groups that fit in it need (``coalesce.fixed_send_bytes``)."""
        return fixed_send_bytes([self._size(m) for m in self.groups], self.budget, g.shard_world)

    def _capacity(self, g: GroupFacts) -> int:
        """Bytes of members' sends one coalesced gather may carry (0: coalescing off)."""
        if not self.budget:
            return 0
        return self._per_rank(g) - header_bytes(len(self.groups))

    def _size(self, g: GroupFacts) -> int:
        """What a member counts against the capacity: its aligned send."""
        return -(-g.gather_in_bytes // ALIGN) * ALIGN

    def _reduce(self, i: int) -> None:
        g = self.groups[i]
        held = self.held.members
        self.reduce_before[i] = sum(self._rs_bytes(k) for k in held) or self._last_reduce
        joinable = bool(self.budget) and g.reduce_joinable and g.num_trainable > 0
        size = g.reduce_out_bytes if joinable else None
        key = (g.reduce_key, g.reduce_dtype, g.reduce_op)

        def flush() -> None:
            # issuing copies the inputs into one of the fixed size, for a moment
            self.reduce_concat[i] = self._rs_fixed * self.groups[held[0]].shard_world
            self._issue_held()

        if hold(self.held, size, key, flush, partial(self._size_bucket, g)) and size is not None:
            self.held.add(i, size, key)
            self._last_reduce = sum(self._rs_bytes(k) for k in self.held.members)
        else:
            self.out.extend(_reduces(g))
            self._in_flight([g])
            if len(g.reduce_worlds) > 1:  # hfsdp: its input reordered by shard rank first
                self.reduce_concat[i] += g.reduce_in_bytes
            self._last_reduce = self._rs_bytes(i)

    def _rs_bytes(self, i: int) -> int:
        """What stays alive of a group's reduce-scatter while it is in flight: its last
        level's input and output (in levels: the one before has finished)."""
        last = _reduces(self.groups[i])[-1]
        return last.input_nbytes + last.output_nbytes

    def _size_bucket(self, g: GroupFacts) -> int:
        """The engine's fixed row size (``coalesce_reduce.fixed_row_bytes``) of a reduce-scatter
        bucket ``g`` starts; returned, what its members' rows may fill of it (less the header)."""
        itemsize: int = getattr(torch, g.reduce_dtype).itemsize
        rows = [m.reduce_out_bytes for m in self.groups if m.reduce_joinable and m.num_trainable]
        n = len(self.groups)
        self._rs_fixed = fixed_row_bytes(rows, n, itemsize, self.budget, g.shard_world)
        return self._rs_fixed - n * itemsize

    def _issue_held(self) -> None:
        """One reduce-scatter of the fixed size, for a bucket of one too."""
        members = [self.groups[k] for k in self.held.take()]
        if not members:
            return
        world = members[0].shard_world
        self.out.append(
            Collective(
                "reduce_scatter",
                bucket_label([m.label for m in members]),
                world * self._rs_fixed,
                self._rs_fixed,
                world,
            )
        )
        self._in_flight(members)

    def _in_flight(self, members: list[GroupFacts]) -> None:
        """A reduce-scatter just issued for ``members``: the one in flight before it is finished
        now (one at a time), which issues its all-reduces over the replicas (HSDP); the new
        one's wait for its own finish (a rank may not finish those early: their peers would
        pair them with other collectives)."""
        self.out.extend(self._finishing)
        self._finishing = _all_reduces(members)


def gathered_in_backward(groups: list[GroupFacts], prefetch: bool) -> list[bool]:
    """Per group (pre-order): whether backward gathers it (if it resharded after forward):
    reached by backward, or prefetched by a group that is (the engine's ``backward_prefetch``).
    (Coalescing may gather a group backward never reaches as well: ``Schedule``.)"""
    out = [g.backward_reached for g in groups]
    for i, g in enumerate(groups):
        if prefetch and (g.is_root or g.backward_reached):  # the root's pre-backward always runs
            at = backward_prefetch(len(groups), i, g.is_root, lambda k: groups[k].is_root)
            if at >= 0:
                out[at] = True
    return out


def _all_reduces(groups: list[GroupFacts]) -> list[Collective]:
    """HSDP's all-reduce of each group's reduced shard over the replicas (even over one)."""
    return [
        Collective("all_reduce", g.label, g.reduce_out_bytes, g.reduce_out_bytes, g.replicate_world)
        for g in groups
        if g.num_trainable and g.replicate_world
    ]


def _reduces(g: GroupFacts) -> list[Collective]:
    """A group's reduce-scatter, level by level (the mode's ``reduce_worlds``): each level's
    output is its input over its size, the last one the reduced shard."""
    out, nbytes = [], g.reduce_in_bytes
    for j, world in enumerate(g.reduce_worlds):
        to = g.reduce_out_bytes if j == len(g.reduce_worlds) - 1 else nbytes // world
        out.append(Collective("reduce_scatter", g.label, nbytes, to, world))
        nbytes = to
    return out


@dataclass(frozen=True)
class Transient:
    """The most bytes fsdp2's own buffers add above the held ones, and where that happens."""

    forward_bytes: int
    forward_at: str
    backward_bytes: int
    backward_at: str
    backward_start_bytes: int  # as backward begins (the last group regathered): when
    # activations are at their peak


def _early(g: GroupFacts) -> bool:
    return g.is_root and not g.reshard_after_forward


def _transient_unsharded(g: GroupFacts) -> int:
    """A group's unsharded buffer as a transient: none if it stays gathered between steps
    (``Plan.kept_gathered_bytes`` holds it)."""
    return 0 if g.stay_gathered else g.unsharded_bytes


def transient(
    groups: list[GroupFacts], prefetch: bool, budget: int = 0, gloo: bool = False
) -> Transient:
    """The peaks of [Note: the planner's transient model], in a steady-state step with the
    coalescing ``budget`` ([Note: the planner's coalesced step]); ``gloo``: the backend's
    temporaries of a coalesced gather count."""
    step = Schedule(groups, prefetch, budget, gloo)
    kept = 0  # groups that stay unsharded after their forward
    fwd, fwd_at = 0, ""
    for i, g in enumerate(groups):
        # Gathering: the collective's output (its bucket's) beside the unsharded buffer (held
        # already if the group stays gathered between steps).
        out = max(step.forward_shared[i], g.unsharded_bytes)
        own = _transient_unsharded(g) + g.copy_extra_bytes
        now = kept + out + max(own, step.forward_extra[i])
        if now > fwd:
            fwd, fwd_at = now, g.label or "<root>"
        if not g.reshard_after_forward:
            kept += _transient_unsharded(g)
    bwd, bwd_at, start = 0, "", 0
    order = list(reversed(groups))
    # The root, kept gathered, may get gradients early (the head's) and is reduced last: count
    # its unsharded gradients as alive through all of backward. Any other group's arrive in its
    # own backward (kept gathered or not: reshard_after_forward=False, zero2).
    early = sum(g.unsharded_grad_bytes for g in groups if _early(g))
    gathered = list(reversed(gathered_in_backward(groups, prefetch)))
    stuck = 0  # coalesced outputs a member backward never reaches keeps to its end
    for i, g in enumerate(order):
        at = len(groups) - 1 - i  # its index in ``groups`` and ``step``
        if not gathered[i]:
            stuck += step.stuck_after[at]
            continue  # backward never runs it and nothing prefetches it
        own = 0 if _early(g) else g.unsharded_grad_bytes
        again = g.unsharded_bytes if g.reshard_after_forward else 0
        nxt = order[i + 1] if i + 1 < len(order) else None
        # The prefetched gather output of the group before it in forward order.
        ahead = nxt.unsharded_bytes if prefetch and nxt and nxt.reshard_after_forward else 0
        held = step.reduce_before[at]
        base = kept + early + ahead + held + stuck
        # Its output (or its bucket's) beside, while it runs, what the collective adds, then
        # beside its unsharded buffer as it copies out
        copy = g.copy_extra_bytes if again else 0  # hfsdp's transposed copy-out
        gathering = base + step.backward_shared[at] + max(again + copy, step.backward_extra[at])
        shared = step.shared_after[at]  # its bucket's output, for members still to copy out
        stuck += step.stuck_after[at]
        computed = kept + early + ahead + held + stuck + shared + again + own
        # Resharded first (a kept group leaves ``kept`` now), then copied into the input.
        if not g.reshard_after_forward:
            kept -= _transient_unsharded(g)
        reducing = kept + early + ahead + held + stuck + shared + own
        reducing += g.reduce_in_bytes + g.reduce_out_bytes + step.reduce_concat[at]
        if _early(g):
            early -= g.unsharded_grad_bytes
        if i == 0:
            start = max(gathering, computed)
        now = max(gathering, computed, reducing)
        if now > bwd:
            bwd, bwd_at = now, g.label or "<root>"
    return Transient(fwd, fwd_at, bwd, bwd_at, start)
