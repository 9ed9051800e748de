"""Which group to gather ahead of its own hook, guessed from the order of the last forward.

[Note: prefetch order]
While forward runs, each group appends itself to the context's recording the first time it runs
in that iteration; when the root's forward ends the recording becomes ``forward_order``. In
backward a group prefetches the group before it (the root prefetches the last one, whose
gradients arrive first), so that gather overlaps its backward compute. A wrong guess costs
memory, never correctness: anything gathered and unused is freed at the end of backward.
On accelerators forward guesses too: each group, once gathered, starts the gather of the group
that followed it in the last forward, before its own kernels are queued. An asynchronous NCCL
collective waits for everything already queued on the compute stream when it is issued, so a
gather issued at the next module's own pre-forward could only start once this module's compute
is done: every forward gather would be exposed (torch hides it with side streams; we need none,
see docs/accelerators.md). On CPU meshes neither direction guesses: compute and gloo share the
same cores, so a prefetched gather overlaps nothing (forward: 784 vs 958 ms per step, GPT at 2
ranks; backward: 49.1 vs 48.9 ms) while its buffer raised peak memory by 2 MiB of 19 (the same
model). ``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch`` replace the
guess everywhere; ``GroupSettings.guess_prefetch`` overrides the choice by device.
With coalescing on, a guessed prefetch is a coalesced gather like any other: the group guessed
takes along the small groups after it (backward: before it). Gathered alone it would leave the
next group's own hook nothing to coalesce, and from there on every group would be prefetched
alone, one collective each (measured on one H100, 96 tiny blocks on an 8-rank fake group: 179
all-gathers per step instead of 14).
"""

from __future__ import annotations

from fsdp2.engine.changes import take_up_changes
from fsdp2.engine.coalesce import Context, gather_coalesced
from fsdp2.engine.param_group import FSDPParamGroup

__all__ = ["prefetch_after", "prefetch_before"]


def _start(target: FSDPParamGroup, ctx: Context, coalesce: bool, backward: bool) -> None:
    if not (coalesce and gather_coalesced(target, ctx, backward)):
        target.unshard()  # a no-op if it is gathered or under way


def prefetch_after(group: FSDPParamGroup, ctx: Context, coalesce: bool) -> None:
    """At ``group``'s pre-forward, on accelerators: start gathering the group that ran after it
    in the last forward (``ctx.forward_order``), unless that one ran already in this iteration.
    ``coalesce``: with the small groups after it, as its own pre-forward would."""
    if not group.guesses_prefetch():
        return
    order, index = ctx.forward_order, group.order_index
    if index + 1 < len(order) and order[index] is group:
        following = order[index + 1]
        if following.seen_in != ctx.iteration:  # not run yet in this forward
            take_up_changes(following)  # what its own pre-forward would do first
            _start(following, ctx, coalesce, backward=False)


def prefetch_before(
    group: FSDPParamGroup,
    ctx: Context,
    coalesce: bool,
    is_root: bool,
    root_groups: list[FSDPParamGroup],
) -> None:
    """At ``group``'s pre-backward, on accelerators: start gathering the group whose backward
    comes next, the one before it in the last forward (``ctx.forward_order``); ``coalesce``:
    with the small groups before that one."""
    if not group.guesses_prefetch():
        return
    order, iteration = ctx.forward_order, ctx.iteration
    if group.seen_in == iteration and order and order[group.order_index] is group:
        # The root prefetches the last group, whose gradients come first; any other group the
        # one before it, but never the root's: the root's pre-backward ran first and gathered
        # it, so by now it is either still gathered or done with backward.
        previous = group  # nothing to prefetch
        if is_root:
            previous = order[-1]
        elif group.order_index > 0 and order[group.order_index - 1] not in root_groups:
            previous = order[group.order_index - 1]
        if previous is not group and previous.settings.unshard_in_backward:
            _start(previous, ctx, coalesce, backward=True)
