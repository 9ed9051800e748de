"""The hang report's words: what a rank's published entry says of where it is, and the reports
a timed-out or failed wait raises (hang.py collects the entries: [Note: the hang report]).
"""

from __future__ import annotations

import re
from typing import Any

from fsdp2.debug import switches

__all__ = ["OP_NAMES", "describe", "failed", "rank_line", "timed_out"]

OP_NAMES = {
    "all_gather": "all-gather",
    "reduce_scatter": "reduce-scatter",
    "all_reduce": "all-reduce",
    "all_to_all": "all-to-all",
    "redistribute": "DTensor redistribution",
}


def describe(event: dict[str, Any]) -> str:
    """``all-gather #6 for `blocks.1` (4,160 elements, float32)``"""
    op = OP_NAMES.get(event["op"], event["op"])
    label = event["label"] or "<root>"
    size = f"{event['numel']:,} elements, " if event["numel"] >= 0 else ""
    return f"{op} #{event['seq']} for `{label}` ({size}{event['dtype']})"


def _whereabouts(entry: dict[str, Any], now: float) -> str:
    waiting, exited = entry["waiting"], entry.get("exited")
    last = entry["recent"][-1] if entry["recent"] else None
    if exited is not None:  # first: a rank that raised from a wait still names it as waiting
        where = f"its process EXITED {now - exited['time']:.1f} s ago ({exited['how']})"
        where += f", after issuing {describe(last)}" if last else ""
    elif waiting:  # the longest wait first, then any other thread's
        where = "blocked in " + ", and in ".join(
            f"{describe(w)} for {now - w['since']:.1f} s" for w in waiting
        )
    elif last is None:
        where = "has issued no fsdp2 collective"
    else:
        where = (
            "not in an fsdp2 collective (busy elsewhere, finished or raised); last seen "
            f"{now - last['time']:.1f} s ago issuing {describe(last)}"
        )
    return f"{where} [published {now - entry['time']:.1f} s ago]"


def rank_line(
    rank: int,
    entry: dict[str, Any] | None,
    target: dict[str, Any],
    now: float,
    fresh: bool,
    answer_wait: float,
) -> str:
    """Where ``rank`` is (its published ``entry``; ``fresh``: it answered this report's ask
    within ``answer_wait`` seconds), relative to the collective ``target``."""
    if entry is None:
        return (
            f"rank {rank}: published nothing and did not answer within {answer_wait:.1f} s "
            "(never issued an fsdp2 collective, or died)"
        )
    issued = entry["counts"].get(target["group"], 0)
    where = _whereabouts(entry, now)
    if not fresh:  # [Note: fresh entries]: what it knew then, never a verdict on now
        so_far = f"#0-#{issued - 1}" if issued else "none"
        return (
            f"rank {rank}: NO ANSWER within {answer_wait:.1f} s, so its entry may be behind "
            f"(its publisher thread did not run in time: a loaded machine, or a call holding the GIL); when "
            f"published, it had issued {so_far} on this group; {where}"
        )
    if issued <= target["seq"]:
        so_far = f"only #0-#{issued - 1}" if issued else "none"
        return f"rank {rank}: MISSING, issued {so_far} on this group; {where}"
    same = [
        e for e in entry["recent"] if e["group"] == target["group"] and e["seq"] == target["seq"]
    ]
    if same and describe(same[0]) != describe(target):
        if any(describe(w) == describe(same[0]) for w in entry["waiting"]):
            return f"rank {rank}: DIFFERENT collective: {where}"
        return f"rank {rank}: DIFFERENT collective, issued {describe(same[0])}; {where}"
    return f"rank {rank}: issued it; {where}"


def timed_out(
    rank: int, what: str, ranks: list[int], where: str, waited: float | None, limit: float
) -> str:
    """The hang report of ``rank``, whose wait for ``what`` passed the deadline ``limit``;
    ``waited``: how long the wait lasted, where the backend may have ended it before fsdp2's
    deadline (a process group's own ``timeout=`` that is shorter). ``where``: every rank's
    line."""
    how_long = f"{limit:g} s (FSDP2_COLLECTIVE_TIMEOUT)"
    if waited is not None and waited < 0.95 * limit:  # not ours: the clocks differ slightly
        how_long = (
            f"{waited:.1f} s (the process group's own timeout ended the wait, before "
            f"FSDP2_COLLECTIVE_TIMEOUT's {limit:g} s)"
        )
    return (
        f"fsdp2: rank {rank} waited {how_long} for "
        f"{what} on the process group of ranks {ranks}, and it has not finished.\n{where}"
        "A rank MISSING from it skipped that module (control flow that depends on the rank or "
        "the data: MoE routing, a layer skipped for some inputs or shapes), raised, or never "
        "started the step. A rank on a DIFFERENT collective got out of step earlier: "
        "collectives pair up by order, not by module, so earlier ones may have exchanged wrong "
        "data. The process group is unusable now (a collective is half done): "
        f"abort the job on every rank. {_checks_hint()}"
    )


def failed(rank: int, what: str, ranks: list[int], where: str, error: Exception) -> str:
    """The report of ``rank``, whose wait for ``what`` ended in the backend's ``error``."""
    # gloo prefixes its source location: "[.../pair.cc:553] Connection closed by peer ..."
    said = re.sub(r"^\[[^\]]*:\d+\] ", "", str(error).strip()).split("\n")[0]
    return (
        f"fsdp2: rank {rank} was waiting for {what} on the process group of ranks "
        f"{ranks} when the backend raised {type(error).__name__}: {said}\n{where}"
        f"{_failure_cause(said)} The process group is unusable now: abort the job on every rank."
    )


def _failure_cause(said: str) -> str:
    if "timed out" in said.lower():  # the backend's own timeout, on a wait fsdp2 could not bound
        return (
            "Likely cause: the backend's own timeout passed (its works take no finite timeout, "
            "so FSDP2_COLLECTIVE_TIMEOUT could not end the wait sooner): a rank MISSING from "
            "this collective skipped that module, raised, or never started the step."
        )
    return (
        "Likely cause: a peer rank is gone. A rank whose process EXITED ended its training loop "
        "before the others (e.g. its data loader ran out of batches first); one that published "
        "nothing more may have crashed (see its own log). Fix: give every rank the same number "
        "of batches (DistributedSampler(..., drop_last=True), or stop every rank's loop when "
        "one runs out)."
    )


def _checks_hint() -> str:
    if switches.checks_enabled:
        return "(Collective checks are on: the ranks agreed on every collective before this one.)"
    return (
        "FSDP2_CHECK_COLLECTIVES=1 stops at the first collective where the ranks disagree, "
        "with both sides named."
    )
