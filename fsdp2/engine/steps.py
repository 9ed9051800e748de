"""Optimizer steps: how many have completed, and holding the next one while another thread
copies the state (:func:`consistent_state`).

Counting. A group kept gathered between steps (``memory_mode="zero2"``, hfsdp) is current while
nothing wrote the shards since its gather. Writes through the parameter (``load_state_dict``,
``with torch.no_grad(): p.copy_(...)``) or through its local tensor (a checkpoint loaded in
place) bump autograd's version counters, which the group compares. An optimizer's in-place
update does not always reach the local tensor's counter (a ``DTensor`` runs the local op below
autograd), so every step of an optimizer of sharded parameters counts here too (one of plain
tensors only is not counted: :func:`_writes_shards`). Every rank steps the same such
optimizers, so every rank sees the same count and gathers at the same forward.

[Note: consistent state]
A thread other than the training one may copy the state (the sharded parameters and the
optimizer's state) at any moment ([Note: state from any thread] in state_dict.py); only an
optimizer step writes it. A copy is consistent when it holds the values after one completed
step, the same step on every rank. ``consistent_state`` makes it so without a lock held for
the training step:
- entering it takes a *hold* at the step this rank is at (one in flight counts as done: it
  ends, it is not waited for at the door), so no later step begins here;
- with a process group, the takers of all ranks agree on the largest of their holds (one
  all-reduce on the takers' group, never the training one, through the seam: a peer's taker
  that never comes gets the hang report): a rank behind steps up to it,
  which its peers' training can always let it do, since ranks train in lockstep and a step
  its peers completed needs nothing more from them (distributed Muon's collectives included);
- the copy starts when no step is in flight and the agreed one has completed.
The training thread waits only if it reaches its next optimizer step while a copy is still
being made, and only until that copy ends; a checkpoint's writing happens after. Nested
steps (an optimizer container stepping its optimizers, torchtitan's) count once, when the
outermost ends. Every wait has a deadline (``FSDP2_COLLECTIVE_TIMEOUT``) and then raises,
naming what it waited for: never a silent hang.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from fsdp2.debug.waiting import timeout_s
from fsdp2.engine.collectives import all_reduce, taking_state

__all__ = ["TAKER_LABEL", "consistent_state", "optimizer_steps", "watch_optimizer_steps"]

TAKER_LABEL = "consistent_state"  # the label of the takers' agreement in record_collectives()

_cond = threading.Condition()
_steps = 0  # completed (outermost) optimizer steps
# Per thread stepping: the optimizers whose step is in flight there, outermost first, and when
# the outermost began.
_stepping: dict[int, tuple[list[int], float]] = {}
# Per taker: [the step it copies at, its thread]; no step may begin on another thread once
# the count has reached a hold.
_holds: list[list[int]] = []
_handles: Any = None
# Per optimizer: its number of param groups, and whether they hold a sharded parameter.
_shards: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[int, bool]] = (
    weakref.WeakKeyDictionary()
)
_Hook = Callable[[torch.optim.Optimizer, Any, Any], None]


def _wait(ready: Callable[[], bool], what: Callable[[], str], timeout: float) -> None:
    """Wait on ``_cond`` (held) until ``ready()``; past ``timeout`` seconds raise, saying what
    was waited for."""
    if not _cond.wait_for(ready, timeout):
        raise RuntimeError(
            f"fsdp2: waited {timeout:.0f} s for {what()}. Set FSDP2_COLLECTIVE_TIMEOUT to wait "
            "longer; if that step raised or its thread stopped, no consistent copy can be made."
        )


def _held_here() -> bool:
    """Whether a taker on another thread holds the step that would begin now."""
    me = threading.get_ident()
    return any(step <= _steps and thread != me for step, thread in _holds)


def _end(me: int, optimizer: torch.optim.Optimizer) -> None:
    """``optimizer``'s step on thread ``me`` ended, and any above it; count the outermost."""
    global _steps
    stack = _stepping.get(me, ([], 0.0))[0]
    if id(optimizer) in stack:
        del stack[stack.index(id(optimizer)) :]
        if not stack:
            del _stepping[me]
            _steps += 1
            _cond.notify_all()


def _writes_shards(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` steps a sharded parameter (a DTensor); only such steps count. One
    of plain tensors (a probe, one rank's own head) may step on some ranks only: counting it
    would part the ranks' counts, hence their copies' steps and zero2's regathers."""
    groups = optimizer.param_groups
    known = _shards.get(optimizer)
    if known is None or known[0] != len(groups):  # add_param_group may change the answer
        known = (len(groups), any(isinstance(p, DTensor) for g in groups for p in g["params"]))
        _shards[optimizer] = known
    return known[1]


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if not _writes_shards(optimizer):
        return
    me = threading.get_ident()
    with _cond:
        # Already stepping here: its last step raised (it may have written: it counts).
        _end(me, optimizer)
        if me not in _stepping:
            _wait(
                lambda: not _held_here(),
                lambda: f"a copy of the state (fsdp2.consistent_state) holding step {_steps + 1}",
                timeout_s(),
            )
            _stepping[me] = ([], time.monotonic())
        _stepping[me][0].append(id(optimizer))


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if not _writes_shards(optimizer):
        return
    with _cond:
        _end(threading.get_ident(), optimizer)


def watch_optimizer_steps() -> None:
    """Count every optimizer step from now on, and hold it for copies (idempotent; every
    group's construction calls it, so a step in flight when a copy is first asked is known)."""
    global _handles
    with _cond:  # groups may be built on several threads at once (a threaded process group)
        if _handles is not None:
            return
        # A compiled ``optimizer.step`` would trace them (a lock, thread ids: dynamo warns and
        # splits the step there; the counts stay right). Kept out of its way where dynamo is
        # loaded already (a model compiled before fully_shard, torchtitan's order): importing
        # it here would cost every run ~2 s.
        eager: Callable[[_Hook], _Hook] = lambda hook: hook  # noqa: E731
        if "torch._dynamo" in sys.modules:
            eager = cast(Callable[[_Hook], _Hook], torch.compiler.disable)
        _handles = (
            register_optimizer_step_pre_hook(eager(_before_step)),
            register_optimizer_step_post_hook(eager(_after_step)),
        )


def optimizer_steps() -> int:
    """Optimizer steps completed since the first group was made."""
    return _steps


def _in_flight_elsewhere() -> bool:
    me = threading.get_ident()
    return any(thread != me for thread in _stepping)


def _describe_stepping() -> str:
    now = time.monotonic()
    ages = [f"{now - began:.0f} s" for _, began in _stepping.values()]
    return f"step {_steps + 1} to end (in flight for {', '.join(ages) or '0 s'})"


@contextlib.contextmanager
def consistent_state(process_group: dist.ProcessGroup | None = None) -> Iterator[int]:
    """Within this context, the model's and the optimizer's state are those after one completed
    optimizer step, and no step writes them until it exits ([Note: consistent state]). Yields
    the number of that step (steps counted since the first ``fully_shard``).

    Args:
        process_group: the group of the threads taking the copy on every rank, to agree on one
            step (a group of their own, e.g. ``dist.new_group(backend="gloo")``: never the
            training one, whose collectives they would interleave with). ``None``: this rank
            alone.
    """
    watch_optimizer_steps()
    me = threading.get_ident()
    timeout = timeout_s()
    with _cond:
        hold = [_steps + (1 if _in_flight_elsewhere() else 0), me]
        _holds.append(hold)
    try:
        with taking_state():  # this thread's collectives run none of the training's checks
            if process_group is not None:
                # Through the seam: a peer's taker that never comes gets the hang report at the
                # deadline, not a wait as long as the backend's own timeout.
                agreed = torch.tensor([hold[0]], dtype=torch.int64)
                all_reduce(agreed, process_group, TAKER_LABEL, dist.ReduceOp.MAX).wait()
                with _cond:
                    hold[0] = int(agreed.item())
                    _cond.notify_all()  # a rank behind may take the steps up to it
            with _cond:
                _wait(
                    lambda: _steps >= hold[0] and not _in_flight_elsewhere(),
                    lambda: (
                        _describe_stepping()
                        if _in_flight_elsewhere()
                        else f"step {hold[0]}, which other ranks completed (this rank: {_steps})"
                    ),
                    timeout,
                )
            if torch.accelerator.is_available():  # the step's kernels ran before the copy's
                torch.accelerator.synchronize()
            yield hold[0]
            if torch.accelerator.is_available():  # the copy's kernels ran before the next step's
                torch.accelerator.synchronize()
    finally:
        with _cond:
            _holds.remove(hold)
            _cond.notify_all()
