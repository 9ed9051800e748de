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

The bucket grows while its groups' shards fit in the fixed send size, and stops at the first
group that cannot join: another process group, device or gather dtype, a custom all-gather, CPU
offload, ``reshard_after_forward=k``, all-gather extensions, one rank, a group already gathered
or under way, or one that did not run in the last forward (the rule the reduce-scatters, the
full-weights stream and the planner cut by too: [Note: one bucketing] in buckets.py). Nothing
coalesces while any state has explicit prefetch targets (``set_modules_to_*_prefetch``): the
user chose the order. The budget is ``DEFAULT_COALESCE_BYTES`` unless ``FSDP2_COALESCE_BYTES``
or :func:`set_coalesce_bytes` (``fsdp2.set_coalesce_bytes``) says otherwise; 0 turns it off.

Ranks that run different modules (a user's rank-dependent control flow, which the hang report
exists to name) form different buckets: no rule made from one rank's own facts can prevent it,
since what ran is exactly what differs. So every coalesced gather has ONE size, whatever its
groups: each rank sends the budget's share (``budget // world``, to 16 bytes; less if all the
root's small groups fit in less), a header (a bit per group of the root, the same list on every
rank) then the shards, aligned, then zeros. A mismatch then exchanges equal sizes (gloo would abort the process on unequal ones, with no
report; NCCL would corrupt or hang), and every rank's header is compared: every rank raises
:class:`CollectiveMismatchError`, naming each rank's groups. On CPU the first group to wait
compares them, before any data is used. On an accelerator that would stall the host until the
device's queue drained, at every coalesced gather (one H100, 96 blocks on an 8-rank fake group,
compute-bound: 18 ms of a 154 ms step): there the headers are copied to the host without
blocking, and compared before the next collective is issued (no rank issues one past a
mismatch) or at the end of the forward or backward: the step raises before its gradients are
reduced. A group small enough goes this way even alone (a bucket of one; in the first
iteration, with no order recorded yet, every one): on a rank that got out of step, its gather
may meet a bucket of several, even the other phase's (a rank that skipped a block in forward
starts its backward one collective early). A group too large to join, or one that cannot, keeps
its own gather: against a coalesced one it is a size mismatch, as between two plain gathers of
different groups and sizes, which gloo aborts on. The cost: each coalesced gather moves the
fixed size (gloo, 2 ranks, loaded CPU: 248 us for a 256 KiB output against 175 us for 4 KiB; one gather
saved is ~170 us), which the budget's choice must weigh. The collective's label names its groups
(``"a+b+c"``, a long run elided to its first two and last): the hang report and the collective
checks see one collective, named.

A group gathered ahead and never used costs memory, not correctness: the root's post-forward
and the end of backward free it, as they free an unused prefetch. The shared output is freed
when the last of its groups has copied out (or was resharded without copying out).

The same budget and switch coalesce the reduce-scatters of backward: [Note: coalesced
reduce-scatters] in coalesce_reduce.py.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from functools import partial

import torch

from fsdp2.debug.checks import CollectiveMismatchError
from fsdp2.engine.buckets import Run, fill, fixed_size
from fsdp2.engine.changes import take_up_changes
from fsdp2.engine.collectives import all_gather, defer_check
from fsdp2.engine.param_group import (
    FSDPParamGroup,
    InFlightGather,
    ShardedState,
    outside_transforms,
)

__all__ = [
    "ALIGN",
    "DEFAULT_COALESCE_BYTES",
    "Gathers",
    "SharedOutput",
    "ag_joinable",
    "bucket_label",
    "check_on_host",
    "coalesce_bytes",
    "fixed_send_bytes",
    "header_bytes",
    "set_coalesce_bytes",
]

ALIGN = 16  # each part of a send buffer starts here-aligned: a view of any dtype
_LABEL_GROUPS = 6  # a coalesced gather's label names this many groups, then elides
_BITS = 32  # header bits per int64 word


# The budget unless FSDP2_COALESCE_BYTES or set_coalesce_bytes says otherwise: the one place it
# is set (benchmarks/ sweeps it).
DEFAULT_COALESCE_BYTES = 256 * 1024


def _from_env() -> int:
    raw = os.environ.get("FSDP2_COALESCE_BYTES", str(DEFAULT_COALESCE_BYTES))
    try:
        return max(0, int(raw))
    except ValueError:
        raise ValueError(
            f"FSDP2_COALESCE_BYTES: expected a number of bytes (0 turns coalescing off), found "
            f"{raw!r}"
        ) from None


_budget = _from_env()


def set_coalesce_bytes(budget: int) -> None:
    """Coalesce runs of small ``fully_shard`` groups' collectives: their all-gathers in one
    all-gather each, of at most ``budget`` bytes of unsharded parameters, and their
    reduce-scatters in one reduce-scatter each, of at most ``budget`` bytes of input (on by
    default: ``DEFAULT_COALESCE_BYTES``, 256 KiB; ``FSDP2_COALESCE_BYTES`` in the environment sets
    it at import). Training is bitwise the same either way at two ranks; fewer collectives for
    models of many small blocks. Every rank must set the same value, before the forward (and
    backward) it applies to.

    Args:
        budget: bytes one coalesced collective may carry; 0 turns coalescing off (one
            all-gather and one reduce-scatter per group, as torch's ``fully_shard`` issues).
    """
    global _budget
    _budget = max(0, int(budget))


def coalesce_bytes() -> int:
    """The current budget in bytes (0: coalescing is off)."""
    return _budget


def ag_joinable(group: FSDPParamGroup) -> bool:
    """Whether ``group``'s all-gather may ever be coalesced: facts of its settings and layout,
    the same on every rank and fixed between forwards (the planner asks this too)."""
    layout = group.layout
    return (
        group.shard_size > 1
        and not layout.alias
        and not layout.ext_params
        and layout.offload is None
        and group.settings.custom_all_gather is None
        and group.mode.coalesces  # not reshard-to-k's block, nor hfsdp's two levels
    )


def _joinable(group: FSDPParamGroup) -> bool:
    """Whether ``group`` may be gathered in a coalesced collective now."""
    return (
        group.state is ShardedState.SHARDED
        and not group.unshard_pending
        and not group.layout.stale
        and ag_joinable(group)
        and group.layout.sharded_flat.device.type != "meta"
        and not group.still_gathered()  # memory_mode="zero2": nothing to gather
    )


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def header_bytes(num_groups: int) -> int:
    """One word for the number of groups, then a bit per group: which ones this gather serves
    (32 to an int64 word: a 64th bit would not fit a signed word)."""
    return _aligned(8 * (1 + -(-num_groups // _BITS)))


def fixed_send_bytes(sends: list[int], budget: int, world: int) -> int:
    """The rule of ``Gathers.per_rank_bytes``, on sizes alone (the planner replays it): each of the
    root's groups sends ``sends[i]`` aligned bytes; the budget's share per rank, or the header and
    every send that fits the share, if less."""
    return fixed_size(sends, header_bytes(len(sends)), (budget // world) // ALIGN * ALIGN)


def _send_bytes(group: FSDPParamGroup) -> int:
    """This rank's part of ``group``'s gather, aligned so that the next one starts aligned."""
    return _aligned(group.layout.send_bytes)


def _key(group: FSDPParamGroup) -> tuple[object, ...]:
    """What the groups of one coalesced gather share (the planner's ``gather_key``)."""
    layout = group.layout
    return (id(group.info.shard_group), layout.param_dtype, layout.device)


class SharedOutput:
    """The output of a coalesced gather (coalesce.py), freed once every group it served is done
    with it: copied out, or resharded without."""

    def __init__(
        self, out: torch.Tensor, users: int, check: Callable[[], None], send: torch.Tensor
    ) -> None:
        self.out = out
        self.users = users
        self._check: Callable[[], None] | None = check  # raises if the ranks' buckets differ
        # This rank's send buffer: freed as soon as the gather is done, not whenever the
        # backend drops its own reference (gloo: on its worker thread, maybe after the next
        # gather started), so that it never adds to the budget's worth gathered ahead.
        self._send: torch.Tensor | None = send

    def check(self) -> None:
        """Once the gather finished, before any group copies out: did every rank send the
        same groups? (Run once, by the first group to wait.)"""
        self._free_send()
        check, self._check = self._check, None
        if check is not None:
            check()

    def _free_send(self) -> None:
        send, self._send = self._send, None
        if send is not None:
            send.untyped_storage().resize_(0)

    def release(self) -> None:
        """One group done with the output (after the gather finished)."""
        self._free_send()
        self.users -= 1
        if self.users == 0:  # as for an owned buffer: not left to the collective's reference
            self.out.untyped_storage().resize_(0)


class Gathers:
    """One root's coalesced gathers: its groups (every rank's same list, whose positions are
    the header's bits) and the fixed send size worked out from them."""

    def __init__(self, groups: list[FSDPParamGroup]) -> None:
        self.groups = groups
        self.positions = {id(g): i for i, g in enumerate(groups)}
        self._per_rank: tuple[tuple[int, int], int] | None = None  # ((budget, world), bytes)

    def per_rank_bytes(self, budget: int, world: int) -> int:
        """The one size of every rank's send buffer in a coalesced gather over ``world``
        ranks: the budget's share, or less where every group of the root that could join fits
        in less (a small model's gathers carry no padding it cannot use). Made only of facts
        every rank shares."""
        key = (budget, world)
        if self._per_rank is None or self._per_rank[0] != key:
            sends = [_send_bytes(g) for g in self.groups]
            self._per_rank = (key, fixed_send_bytes(sends, budget, world))
        return self._per_rank[1]

    def gather(
        self, group: FSDPParamGroup, order: list[FSDPParamGroup], iteration: int, backward: bool
    ) -> bool:
        """Start ``group``'s gather together with the small groups that come after it in
        ``order``, the last forward's (``backward``: those before it, in reverse). Returns
        False, gathering nothing, when ``group`` cannot be coalesced: the caller then gathers it
        alone. A bucket of one is still a coalesced gather: its fixed size is what lets a
        mismatch be named ([Note: coalesced gathers])."""
        budget = _budget
        if not budget or not _joinable(group):
            return False
        per_rank = self.per_rank_bytes(budget, group.shard_size)
        bucket: Run[FSDPParamGroup] = Run(per_rank - header_bytes(len(self.groups)))
        rest = _after(group, order, iteration, backward)
        if not fill(bucket, group, _send_bytes(group), _key(group), rest):
            return False
        _issue(bucket.members, self.groups, self.positions, per_rank)
        return True


def _after(
    group: FSDPParamGroup, order: list[FSDPParamGroup], iteration: int, backward: bool
) -> Iterator[tuple[FSDPParamGroup, int, object] | None]:
    """The groups that may follow ``group`` into its bucket, in ``order`` (the last forward's;
    ``backward``: walking back), lazily; ``None`` at the first that cannot join."""
    index, step = group.order_index, -1 if backward else 1
    # Not in the last forward's order (the first iteration, or it did not run): alone.
    i = index + step if index < len(order) and order[index] is group else -1
    while 0 <= i < len(order):
        other = order[i]
        if not backward and other.seen_in != iteration:
            take_up_changes(other)  # what its own pre-forward would do first
        # Forward: only groups still to run in this forward; backward: those that ran in it.
        ran = other.seen_in == iteration
        if (
            ran != backward
            or not _joinable(other)
            or (backward and not other.settings.unshard_in_backward)
        ):
            yield None
            return
        yield other, _send_bytes(other), _key(other)
        i += step


def bucket_label(labels: list[str]) -> str:
    """A coalesced gather's label: its groups' labels joined with "+", the middle of a long run
    elided (the first and last name it: the groups are consecutive in the recorded order)."""
    names = [label or "<root>" for label in labels] if len(labels) > 1 else labels
    if len(names) <= _LABEL_GROUPS:
        return "+".join(names)
    return f"{names[0]}+{names[1]}+...+{names[-1]} ({len(names)} groups)"


@outside_transforms
def _issue(
    bucket: list[FSDPParamGroup],
    groups: list[FSDPParamGroup],
    positions: dict[int, int],
    per_rank: int,
) -> None:
    """One all-gather of a fixed-size send buffer per rank: a header naming the bucket's groups,
    then their shards; each group gets its column slice, checked against every rank's header."""
    first = bucket[0]
    world, device = first.shard_size, first.device
    header = header_bytes(len(groups))
    # Typed as the groups' gathers would be (what the hang report and the checks show), filled
    # as bytes.
    dtype = first.layout.param_dtype
    typed = torch.zeros(per_rank // dtype.itemsize, dtype=dtype, device=device)
    send = typed.view(torch.uint8)
    values = [len(groups)] + [0] * (header // 8 - 1)
    for member in bucket:
        i = positions[id(member)]
        values[1 + i // _BITS] |= 1 << (i % _BITS)
    words = torch.tensor(values, dtype=torch.int64)
    send[:header].copy_(words.view(torch.uint8))
    sources, offset = [], header
    for member in bucket:
        layout = member.layout
        if layout.unsharded_flat is None:
            layout.make_unsharded_views()  # the first gather: allocated at full size
        source, _ = layout.gather_source()
        nbytes = source.numel() * source.element_size()
        if offset + nbytes > per_rank:
            raise AssertionError(f"coalesced gather '{first.label}': the shards exceed the budget")
        send[offset : offset + nbytes].copy_(source.reshape(-1).view(torch.uint8))
        sources.append((source, offset))
        offset += _aligned(nbytes)
    out = typed.new_empty(world * typed.numel())
    group = first.info.shard_group
    if group is None:
        raise AssertionError(
            f"coalesced gather '{first.label}': expected a process group, found None"
        )
    pending = all_gather(out, typed, group, bucket_label([m.label for m in bucket]))
    rows = out.view(torch.uint8).view(world, per_rank)
    check = partial(_check_headers, rows[:, :header], words, groups)
    shared = SharedOutput(out, len(bucket), check, typed)
    for member, (source, start) in zip(bucket, sources, strict=True):
        nbytes = source.numel() * source.element_size()
        part = rows[:, start : start + nbytes].view(source.dtype)
        member.start_shared_gather(InFlightGather(pending, part, None, False, shared))


def _defers(device: torch.device) -> bool:
    """Whether a header check on ``device`` waits for the next collective (tests patch it)."""
    return device.type != "cpu"


def _check_headers(headers: torch.Tensor, own: torch.Tensor, groups: list[FSDPParamGroup]) -> None:
    """Once the gather is waited for: compare every rank's header with this rank's."""
    check_on_host(headers, partial(_compare_headers, own=own, groups=groups))


def check_on_host(header: torch.Tensor, compare: Callable[[torch.Tensor], None]) -> None:
    """Run ``compare`` on a coalesced collective's ``header`` (waited for): now on CPU, else
    once the device has copied it to the host, before the next collective is issued or at the
    end of the forward or backward, so that the host never stalls on the device's queue
    ([Note: coalesced gathers]). The one rule for when a coalesced collective is checked."""
    device = header.device
    if not _defers(device):
        compare(header)
        return
    on_device = device.type != "cpu"
    host = torch.empty(header.shape, dtype=header.dtype, pin_memory=on_device)
    host.copy_(header, non_blocking=on_device)
    copied = torch.Event(device) if on_device else None
    if copied is not None:
        copied.record()

    def check() -> None:
        if copied is not None:
            copied.synchronize()
        compare(host)

    defer_check(check)


def _compare_headers(
    headers: torch.Tensor, *, own: torch.Tensor, groups: list[FSDPParamGroup]
) -> None:
    """Raise, on every rank, if the ranks gathered different groups in one coalesced gather."""
    rows = headers.cpu().contiguous().view(torch.int64)
    if bool((rows == own).all()):
        return
    lines = []
    for rank, row in enumerate(rows.tolist()):
        members = [
            groups[i].label or "<root>"
            for i in range(len(groups))
            if row[0] == len(groups) and (row[1 + i // _BITS] >> (i % _BITS)) & 1
        ]
        said = "+".join(members) if members else f"an unreadable header {row}"
        lines.append(f"  rank {rank}: `{said}`")
    raise CollectiveMismatchError(
        "fsdp2: the ranks gathered different groups in one coalesced all-gather:\n"
        + "\n".join(lines)
        + "\nThe ranks ran different fully_shard modules in this iteration (control flow that "
        "depends on the rank or the data: MoE routing, a layer skipped for some inputs). Every "
        "rank must run every sharded module in each forward, in the same order (give an unused "
        "expert a zero-weighted call). The step raised before its gradients were reduced: "
        "discard this iteration. To see each "
        "collective on its own, turn coalescing off (FSDP2_COALESCE_BYTES=0)."
    )
