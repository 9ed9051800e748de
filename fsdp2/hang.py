"""The hang report: where every rank is when one of fsdp2's collectives does not finish.

[Note: the hang report]
Every collective fsdp2 issues is noted as an :class:`Event` (op, module label, size, the
per-process-group sequence number) in a short ring: a few attribute writes, no I/O. A daemon
thread publishes this rank's latest events, and the collective it is blocked in if any, to the
job's c10d store (the default process group's store, which every job already has) at most every
``FSDP2_COLLECTIVE_TIMEOUT / 4`` seconds (30 at most), only when something changed: the default
path writes nothing per collective and issues no extra collective.

Waiting on one of fsdp2's collectives (``Pending.wait``) is bounded by ``FSDP2_COLLECTIVE_TIMEOUT``
seconds (default 300). When it expires, the rank publishes its own state, waits one publishing
interval (its peers blocked at the same moment publish theirs), reads every peer's entry without
blocking (``store.check`` first, so a dead rank costs nothing) and raises
:class:`CollectiveTimeoutError`: per rank, whether it issued the collective, what it issued
instead, and what it was last seen doing.

CUDA: NCCL's ``work.wait()`` only makes the current stream wait; the host never blocks there,
so no deadline applies and the report is not raised (NCCL's own watchdog ends the job at the
process group's timeout). The entries are still published, and :func:`describe_ranks` reads them.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "CollectiveTimeoutError",
    "Event",
    "describe_ranks",
    "note",
    "timeout_s",
    "wait",
]

DEFAULT_TIMEOUT_S = 300.0
_RING = 8  # events kept per rank
_PUBLISHED = 4  # of which the newest are published
_KEY = "fsdp2/hang/rank{}"
_OP_NAMES = {
    "all_gather": "all-gather",
    "reduce_scatter": "reduce-scatter",
    "all_reduce": "all-reduce",
    "all_to_all": "all-to-all",
}


class CollectiveTimeoutError(RuntimeError):
    """One of fsdp2's collectives did not finish within ``FSDP2_COLLECTIVE_TIMEOUT`` seconds."""


class Event:
    """One collective this rank issued."""

    __slots__ = ("dtype", "group", "label", "numel", "op", "seq", "time")

    def __init__(
        self, op: str, label: str, tensor: torch.Tensor, group: dist.ProcessGroup, seq: int
    ) -> None:
        self.op = op
        self.label = label  # comma-joined FQNs of the group's modules ("" for the root)
        # An all-to-all's splits may differ between ranks: its size is no fact to compare.
        self.numel = tensor.numel() if op != "all_to_all" else -1
        self.dtype = tensor.dtype
        self.group = group
        self.seq = seq  # this rank's collectives on ``group`` before this one
        self.time = time.time()

    def as_dict(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "label": self.label,
            "numel": self.numel,
            "dtype": str(self.dtype).removeprefix("torch."),
            "group": _name(self.group),
            "seq": self.seq,
            "time": self.time,
        }


_ring: deque[Event] = deque(maxlen=_RING)
# Collectives issued per process group, by name: keyed by the group itself, this would keep
# every destroyed group alive.
_counts: dict[str, int] = {}
_waiting: tuple[Event, float] | None = None  # the collective this rank is blocked in, since when
_thread: threading.Thread | None = None


def _name(group: dist.ProcessGroup) -> str:
    try:
        return group.group_name
    except Exception:  # a destroyed group
        return "?"


def timeout_s() -> float:
    return float(os.environ.get("FSDP2_COLLECTIVE_TIMEOUT", DEFAULT_TIMEOUT_S))


def note(op: str, label: str, tensor: torch.Tensor, group: dist.ProcessGroup) -> Event:
    """Record a collective about to be issued on ``group``."""
    name = _name(group)
    seq = _counts.get(name, 0)
    _counts[name] = seq + 1
    event = Event(op, label, tensor, group, seq)
    _ring.append(event)
    if _thread is None:
        _start_publisher()
    return event


def wait(work: dist.Work, event: Event, device: torch.device, phase: str = "") -> None:
    """``work.wait()``, bounded by the deadline where the host blocks (not on CUDA)."""
    if device.type != "cpu":  # an accelerator: wait() only orders streams, never blocks
        work.wait()
        return
    global _waiting
    _waiting = (event, time.time())
    try:
        if not _wait_with_timeout(work):
            _publish()
            time.sleep(_interval())  # the peers' publishers catch up with their latest state
            raise CollectiveTimeoutError(_report(event, phase))
    finally:
        _waiting = None


def _wait_with_timeout(work: dist.Work) -> bool:
    try:
        work.wait(timeout=timedelta(seconds=timeout_s()))
    except RuntimeError as e:
        if "timed out" in str(e).lower():
            return False
        raise
    return True


# ---------------------------------------------------------------------------------------------
# Publishing
# ---------------------------------------------------------------------------------------------


def _start_publisher() -> None:
    global _thread
    _thread = threading.Thread(target=_publish_loop, name="fsdp2-hang-report", daemon=True)
    _thread.start()


def _publish_loop() -> None:
    published: tuple[object, object] | None = None
    last = 0.0
    while True:
        # Short naps, so that a timeout lowered at run time (tests) takes effect at once.
        interval = _interval()
        time.sleep(min(interval, 0.5))
        state = (_ring[-1] if _ring else None, _waiting)
        if state != published and time.monotonic() - last >= interval:
            _publish()
            published, last = state, time.monotonic()


def _interval() -> float:
    """Seconds between two publications: a report sees entries at most this old."""
    return min(timeout_s() / 4, 30.0)


def _entry() -> dict[str, Any]:
    waiting = _waiting
    return {
        "time": time.time(),
        "counts": dict(_counts),
        "recent": [e.as_dict() for e in list(_ring)[-_PUBLISHED:]],
        "waiting": None if waiting is None else {**waiting[0].as_dict(), "since": waiting[1]},
    }


def _publish() -> None:
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(_KEY.format(dist.get_rank()), json.dumps(_entry()))
    except Exception:  # no default group (any more), or its store is gone: nothing to tell
        pass


def _read(ranks: list[int]) -> dict[int, dict[str, Any]]:
    """Every listed rank's published entry; never blocks on a rank that published nothing."""
    entries: dict[int, dict[str, Any]] = {}
    try:
        store = dist.distributed_c10d._get_default_store()
        for rank in ranks:
            key = _KEY.format(rank)
            if store.check([key]):
                entries[rank] = json.loads(store.get(key))
    except Exception:  # a dead store: report what was read
        pass
    return entries


# ---------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------


def describe(event: dict[str, Any]) -> str:
    """``all-gather #6 for `blocks.1` (4,160 elements, float32)``"""
    op = _OP_NAMES.get(event["op"], event["op"])
    label = event["label"] or "<root>"
    size = f"{event['numel']:,} elements, " if event["numel"] >= 0 else ""
    return f"{op} #{event['seq']} for `{label}` ({size}{event['dtype']})"


def _whereabouts(entry: dict[str, Any], now: float) -> str:
    waiting = entry["waiting"]
    if waiting is not None:
        where = f"blocked in {describe(waiting)} for {now - waiting['since']:.1f} s"
    elif not entry["recent"]:
        where = "has issued no fsdp2 collective"
    else:
        last = entry["recent"][-1]
        where = (
            "not in an fsdp2 collective (busy elsewhere, finished or raised); last seen "
            f"{now - last['time']:.1f} s ago issuing {describe(last)}"
        )
    return f"{where} [published {now - entry['time']:.1f} s ago]"


def _rank_line(rank: int, entry: dict[str, Any] | None, target: dict[str, Any], now: float) -> str:
    if entry is None:
        return f"rank {rank}: published nothing (never issued an fsdp2 collective, or died)"
    if rank == dist.get_rank():
        return f"rank {rank} (this rank): blocked in it"
    issued = entry["counts"].get(target["group"], 0)
    where = _whereabouts(entry, now)
    if issued <= target["seq"]:
        so_far = f"only #0-#{issued - 1}" if issued else "none"
        return f"rank {rank}: MISSING, issued {so_far} on this group; {where}"
    same = [
        e for e in entry["recent"] if e["group"] == target["group"] and e["seq"] == target["seq"]
    ]
    if same and describe(same[0]) != describe(target):
        waiting = entry["waiting"]
        if waiting is not None and describe(waiting) == describe(same[0]):
            return f"rank {rank}: DIFFERENT collective: {where}"
        return f"rank {rank}: DIFFERENT collective, issued {describe(same[0])}; {where}"
    return f"rank {rank}: issued it; {where}"


def describe_ranks(event: Event, ranks: list[int]) -> list[str]:
    """One line per rank of ``ranks``: where it is, relative to ``event``."""
    entries = _read(ranks)
    entries[dist.get_rank()] = _entry()  # this rank's own state, fresher than the store's
    now, target = time.time(), event.as_dict()
    return [_rank_line(rank, entries.get(rank), target, now) for rank in ranks]


def _report(event: Event, phase: str) -> str:
    ranks = dist.get_process_group_ranks(event.group)
    target = describe(event.as_dict())
    lines = "\n".join(f"  {line}" for line in describe_ranks(event, ranks))
    what = f"the {phase} the {target}" if phase else f"the {target}"
    return (
        f"fsdp2: rank {dist.get_rank()} waited {timeout_s():g} s (FSDP2_COLLECTIVE_TIMEOUT) for "
        f"{what} on the process group of ranks {ranks}, and it has not finished.\n"
        f"Where each rank is (from the c10d store):\n{lines}\n"
        "A rank MISSING from it skipped that module (control flow that depends on the rank or "
        "the data: MoE routing, a layer skipped for some inputs or shapes), raised, or never "
        "started the step. A rank on a DIFFERENT collective got out of step earlier: "
        "collectives pair up by order, not by module, so earlier ones may have exchanged wrong "
        "data. The process group is unusable now (a collective is half done): "
        f"abort the job on every rank. {_checks_hint()}"
    )


def _checks_hint() -> str:
    from fsdp2 import checks

    if checks.enabled():
        return "(Collective checks are on: the ranks agreed on every collective before this one.)"
    return (
        "FSDP2_CHECK_COLLECTIVES=1 stops at the first collective where the ranks disagree, "
        "with both sides named."
    )
