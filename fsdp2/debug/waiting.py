"""Waiting on a collective with a deadline, where the process group's backend allows one.

gloo's works accept ``wait(timeout=...)``; others may not: torch's multi-threaded process group
(what torch's own FSDP tests and many users' unit tests run on) and any backend whose works wrap
a future raise "wait() with finite timeout not implemented", and an out-of-tree backend may raise
anything. Each process group's first wait learns which (:func:`wait`); the answer is kept per
group, so later waits cost one dictionary look-up. See docs/debugging.md for how the hang
report degrades without a deadline.
"""

from __future__ import annotations

import logging
import os
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["is_gloo", "is_timed", "timed_wait", "timeout_s", "wait"]

logger = logging.getLogger("fsdp2")

DEFAULT_TIMEOUT_S = 300.0


def timeout_s() -> float:
    return float(os.environ.get("FSDP2_COLLECTIVE_TIMEOUT", DEFAULT_TIMEOUT_S))


# Per process group: whether its works accept ``wait(timeout=...)``, learnt at its first wait.
_timed: weakref.WeakKeyDictionary[dist.ProcessGroup, bool] = weakref.WeakKeyDictionary()


def is_timed(group: dist.ProcessGroup) -> bool:
    """Whether waits on ``group`` have a deadline (True until its first wait said otherwise)."""
    return _timed.get(group, True)


def wait(work: dist.Work, group: dist.ProcessGroup) -> bool:
    """Whether ``work`` finished (False: the deadline passed first)."""
    timed = _timed.get(group)
    if timed:
        return timed_wait(work)
    if timed is None:
        return _first_wait(work, group)
    work.wait()  # no deadline: see _first_wait
    return True


def timed_wait(work: dist.Work) -> bool:
    try:
        work.wait(timeout=timedelta(seconds=timeout_s()))
    except RuntimeError as e:
        if "timed out" in str(e).lower():
            return False
        raise
    return True


def _first_wait(work: dist.Work, group: dist.ProcessGroup) -> bool:
    """The group's first wait, which learns whether its backend's works take a finite timeout.
    gloo's do. Others may not: torch's multi-threaded process group's (and any work wrapping a
    future) raise "wait() with finite timeout not implemented", an out-of-tree backend may raise
    anything. So a work that raises on a timed wait is waited on once more without one: if that
    returns, the backend rejects timeouts and the group's waits go untimed from now on (no
    deadline: the hang report degrades, see docs/debugging.md); a collective that really failed
    raises again."""
    if is_gloo(group):
        _timed[group] = True
        return timed_wait(work)
    try:
        finished = timed_wait(work)
    except Exception as refused:
        _timed[group] = False
        try:
            work.wait()
        except BaseException:
            del _timed[group]  # it failed: nothing learnt
            raise
        logger.info(
            "fsdp2: the works of process group %s (backend %s) reject a finite wait(timeout) "
            "(%s); fsdp2 waits on them without FSDP2_COLLECTIVE_TIMEOUT's deadline and logs the "
            "hang report when it passes",
            group.group_name,  # alive: its work was just waited on
            _backend_name(group),
            refused,
        )
        return True
    _timed[group] = True
    return finished


_GLOO = getattr(dist, "ProcessGroupGloo", None)  # absent from builds without gloo
# Per process group (weakly: a destroyed group goes), per device type: whether gloo runs it.
_gloo_groups: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[str, bool]] = (
    weakref.WeakKeyDictionary()
)
_CPU = torch.device("cpu")


def is_gloo(group: dist.ProcessGroup, device: torch.device = _CPU) -> bool:
    """Whether ``group`` runs collectives on ``device`` with gloo (cached: asked per collective
    by the seam, whose reduce-scatter runs differently there)."""
    known = _gloo_groups.get(group)
    if known is None:
        known = _gloo_groups[group] = {}
    answer = known.get(device.type)
    if answer is None:
        try:
            backend = group._get_backend(device)
        except Exception:  # no backend for that device (a fake or custom group)
            backend = None
        answer = known[device.type] = _GLOO is not None and isinstance(backend, _GLOO)
    return answer


def _backend_name(group: dist.ProcessGroup) -> str:
    try:
        return str(group.name())
    except Exception:
        return "?"
