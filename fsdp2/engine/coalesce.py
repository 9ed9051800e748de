"""Coalescing: one all-gather for a run of small groups, instead of one each.

[Note: coalesced gathers]
On a latency-bound link (gloo: ~0.5 ms per collective) a model of many tiny blocks spends its
step waiting on round trips, not bytes. When a group must be gathered (its pre-forward, or its
pre-backward) and the groups that follow it in the recorded order ([Note: prefetch order]:
forward order in forward, reversed in backward) are small and compatible, their flat shards are
concatenated and gathered in ONE collective; each group's ``_gather`` then holds its own column
slice of the shared rank-major output and copies it out at its own ``wait_for_unshard``, exactly
as after a prefetch. The data each group receives is the very bytes its own gather would have
brought, so parameters, gradients and every later number are bitwise those of coalescing off.

The bucket grows while the gather output (the unsharded bytes of its groups) stays within the
budget (``FSDP2_COALESCE_BYTES``, or :func:`set_coalesce_bytes`; 0, the default, turns it off),
and stops at the first group that cannot join: another process group, device or gather dtype,
a custom all-gather, CPU offload, ``reshard_after_forward=k``, all-gather extensions, one rank,
a group already gathered or under way, or one that did not run in the last forward. Nothing
coalesces while any state has explicit prefetch targets (``set_modules_to_*_prefetch``): the
user chose the order. Every fact used is the same on every rank when the model and the program
are, so every rank forms the same buckets. The collective's label names its groups
(``"a+b+c"``): the hang report and the collective checks see one collective, named.

A group gathered ahead and never used costs memory, not correctness: the root's post-forward
and the end of backward free it, as they free an unused prefetch. The shared output is freed
when the last of its groups has copied out (or was resharded without copying out).

The same budget and switch coalesce the reduce-scatters of backward: [Note: coalesced
reduce-scatters] in coalesce_reduce.py.
"""

from __future__ import annotations

import os
from typing import Protocol

import torch

from fsdp2.engine.changes import take_up_changes
from fsdp2.engine.collectives import all_gather
from fsdp2.engine.param_group import (
    FSDPParamGroup,
    InFlightGather,
    ShardedState,
    SharedOutput,
    _plain_tensors,
)

__all__ = ["coalesce_bytes", "gather_with_following", "set_coalesce_bytes"]


def _from_env() -> int:
    raw = os.environ.get("FSDP2_COALESCE_BYTES", "0")
    try:
        return max(0, int(raw))
    except ValueError:
        raise ValueError(
            f"FSDP2_COALESCE_BYTES: expected a number of bytes (0 turns coalescing off), found "
            f"{raw!r}"
        ) from None


_budget = _from_env()


def set_coalesce_bytes(budget: int) -> None:
    """Coalesce small groups' all-gathers up to ``budget`` bytes of unsharded parameters per
    collective, and their reduce-scatters up to ``budget`` bytes of input (0: off). Every rank
    must set the same value, before the forward (and backward) it applies to."""
    global _budget
    _budget = max(0, int(budget))


def coalesce_bytes() -> int:
    """The current budget in bytes (0: coalescing is off)."""
    return _budget


class _Context(Protocol):
    """What a bucket is formed from (an ``IterContext``): the order and the iteration."""

    forward_order: list[FSDPParamGroup]
    iteration: int


def _joinable(group: FSDPParamGroup) -> bool:
    """Whether ``group`` may be gathered in a coalesced collective now."""
    layout = group.layout
    return (
        group.state is ShardedState.SHARDED
        and not group.unshard_pending
        and group.shard_size > 1
        and not layout.alias
        and not layout.stale
        and not layout.ext_params
        and layout.offload is None
        and group.settings.custom_all_gather is None
        and group.settings.k_group is None
        and layout.sharded_flat.device.type != "meta"
    )


def _nbytes(group: FSDPParamGroup) -> int:
    layout = group.layout
    return group.shard_size * layout.plain_numel * layout.param_dtype.itemsize


def _compatible(first: FSDPParamGroup, other: FSDPParamGroup) -> bool:
    return (
        other.info.shard_group is first.info.shard_group
        and other.layout.param_dtype == first.layout.param_dtype
        and other.layout.device == first.layout.device
    )


def gather_with_following(group: FSDPParamGroup, ctx: _Context, backward: bool) -> bool:
    """Start ``group``'s gather together with the small groups that come after it in ``order``
    (``backward``: those before it, in reverse). Returns False, gathering nothing, when there is
    no bucket of two or more to form: the caller then gathers ``group`` alone."""
    budget, order, iteration = _budget, ctx.forward_order, ctx.iteration
    if not budget or not _joinable(group) or _nbytes(group) > budget:
        return False
    index = group.order_index
    if not (index < len(order) and order[index] is group):
        return False
    step = -1 if backward else 1
    bucket, total = [group], _nbytes(group)
    i = index + step
    while 0 <= i < len(order):
        other = order[i]
        if not backward and other.seen_in != iteration:
            take_up_changes(other)  # what its own pre-forward would do first
        # Forward: only groups still to run in this forward; backward: those that ran in it.
        ran = other.seen_in == iteration
        if ran != backward or not _joinable(other) or not _compatible(group, other):
            break
        if backward and not other.settings.unshard_in_backward:
            break
        size = _nbytes(other)
        if total + size > budget:
            break
        bucket.append(other)
        total += size
        i += step
    if len(bucket) < 2:
        return False
    _issue(bucket)
    return True


@_plain_tensors
def _issue(bucket: list[FSDPParamGroup]) -> None:
    """One all-gather of the bucket's shards, concatenated; each group gets its column slice."""
    first = bucket[0]
    sources = []
    for member in bucket:
        layout = member.layout
        if layout.unsharded_flat is None:
            layout.make_unsharded_views()  # the first gather: allocated at full size
        source, _ = layout.gather_source()
        sources.append(source)
    send = torch.cat(sources)
    world = first.shard_size
    out = send.new_empty(world * send.numel())
    group = first.info.shard_group
    if group is None:
        raise AssertionError(
            f"coalesced gather '{first.label}': expected a process group, found None"
        )
    label = "+".join(member.label for member in bucket)
    pending = all_gather(out, send, group, label)
    rows = out.view(world, send.numel())
    shared = SharedOutput(out, len(bucket))
    offset = 0
    for member, source in zip(bucket, sources, strict=True):
        part = rows[:, offset : offset + source.numel()]
        offset += source.numel()
        member.start_shared_gather(InFlightGather(pending, part, None, False, shared))
