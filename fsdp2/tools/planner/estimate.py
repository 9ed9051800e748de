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
  after that: two reduce-scatter inputs coexist for a moment.
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

from dataclasses import dataclass

from fsdp2.tools.planner.groups import GroupFacts

__all__ = ["Collective", "Transient", "collectives", "transient"]


@dataclass(frozen=True)
class Collective:
    """One collective this rank issues in a step, sized as ``record_collectives()`` sees it."""

    kind: str
    label: str
    input_nbytes: int
    output_nbytes: int
    world_size: int


def collectives(groups: list[GroupFacts], prefetch: bool) -> list[Collective]:
    """The collectives of one forward + backward, in issue order. With ``prefetch``, a group's
    backward gather is issued by the group after it, as that one's backward begins (before its
    reduce-scatter); the root's pre-backward issues the last group's."""
    out = [_gather(g, backward=False) for g in groups if g.shard_world > 1]
    gathered = gathered_in_backward(groups, prefetch)
    needs = [
        g.shard_world > 1 and g.reshard_after_forward and gathered[i] for i, g in enumerate(groups)
    ]
    issued: set[int] = set()
    for i in reversed(range(len(groups))):
        g = groups[i]
        if needs[i] and i not in issued:
            out.append(_gather(g, backward=True))
        before = i - 1
        if prefetch and g.backward_reached and not g.is_root and before >= 0 and needs[before]:
            if not groups[before].is_root:
                out.append(_gather(groups[before], backward=True))
                issued.add(before)
        if g.num_trainable and g.shard_world > 1:
            out.append(
                Collective(
                    "reduce_scatter", g.label, g.reduce_in_bytes, g.reduce_out_bytes, g.shard_world
                )
            )
        if g.num_trainable and g.replicate_world:  # HSDP all-reduces even over one replica
            nbytes = g.reduce_out_bytes
            out.append(Collective("all_reduce", g.label, nbytes, nbytes, g.replicate_world))
    return out


def gathered_in_backward(groups: list[GroupFacts], prefetch: bool) -> list[bool]:
    """Per group (pre-order): whether backward gathers it (if it resharded after forward):
    reached by backward, or prefetched by the next group in forward order, which (as in
    ``FSDPState._prefetch_before``) the root's own groups never do; the root prefetches the
    last group."""
    out = []
    for i, g in enumerate(groups):
        nxt = groups[i + 1] if i + 1 < len(groups) else None
        by_next = nxt is not None and nxt.backward_reached and not nxt.is_root and not g.is_root
        by_root = nxt is None and not g.is_root
        out.append(g.backward_reached or (prefetch and (by_next or by_root)))
    return out


def _gather(g: GroupFacts, backward: bool) -> Collective:
    if backward and g.partial_k:  # k ranks, each sending W/k chunks
        per_rank = g.gather_in_bytes * (g.shard_world // g.partial_k)
        return Collective("all_gather", g.label, per_rank, per_rank * g.partial_k, g.partial_k)
    out = g.gather_in_bytes * g.shard_world
    return Collective("all_gather", g.label, g.gather_in_bytes, out, g.shard_world)


@dataclass(frozen=True)
class Transient:
    """The most bytes fsdp2's own buffers add above the held ones, and where that happens."""

    forward_bytes: int
    forward_at: str
    backward_bytes: int
    backward_at: str
    backward_start_bytes: int  # as backward begins (the last group regathered): when
    # activations are at their peak


def transient(groups: list[GroupFacts], prefetch: bool) -> Transient:
    """The peaks of [Note: the planner's transient model]."""
    kept = 0  # groups that stay unsharded after their forward
    fwd, fwd_at = 0, ""
    for g in groups:
        # Gathering: the collective's output beside the unsharded buffer (alias: nothing).
        now = kept + 2 * g.unsharded_bytes
        if now > fwd:
            fwd, fwd_at = now, g.label or "<root>"
        if not g.reshard_after_forward:
            kept += g.unsharded_bytes
    bwd, bwd_at, start = 0, "", 0
    order = list(reversed(groups))
    in_flight = 0  # the previous group's reduce-scatter input and output, not finished yet
    # A kept group (the root) may get gradients early (the head's) and is reduced last: count
    # its unsharded gradients as alive through all of backward.
    early = sum(g.unsharded_grad_bytes for g in groups if not g.reshard_after_forward)
    gathered = list(reversed(gathered_in_backward(groups, prefetch)))
    for i, g in enumerate(order):
        if not gathered[i]:
            continue  # backward never runs it and nothing prefetches it
        own = g.unsharded_grad_bytes if g.reshard_after_forward else 0
        again = g.unsharded_bytes if g.reshard_after_forward else 0
        nxt = order[i + 1] if i + 1 < len(order) else None
        # The prefetched gather output of the group before it in forward order.
        ahead = nxt.unsharded_bytes if prefetch and nxt and nxt.reshard_after_forward else 0
        base = kept + early + ahead + in_flight
        gathering = base + 2 * again
        computed = base + again + own
        # Resharded first (a kept group leaves ``kept`` now), then copied into the input.
        if not g.reshard_after_forward:
            kept -= g.unsharded_bytes
        reducing = kept + early + ahead + in_flight + own + g.reduce_in_bytes + g.reduce_out_bytes
        if not g.reshard_after_forward:
            early -= g.unsharded_grad_bytes
        if i == 0:
            start = max(gathering, computed)
        now = max(gathering, computed, reducing)
        if now > bwd:
            bwd, bwd_at = now, g.label or "<root>"
        in_flight = g.reduce_in_bytes + g.reduce_out_bytes
    return Transient(fwd, fwd_at, bwd, bwd_at, start)
