"""When the sharded parameters may have changed: the optimizer-step count that groups kept
gathered between steps (``fully_shard(..., memory_mode="zero2")``) compare against.

A kept gathered copy is current while nothing wrote the shards since its gather. Writes through
the parameter (``load_state_dict``, ``with torch.no_grad(): p.copy_(...)``) or through its
local tensor (a checkpoint loaded in place) bump autograd's version counters, which the group
compares. An optimizer's in-place update does not always reach the local tensor's counter (a
``DTensor`` runs the local op below autograd), so every optimizer step counts here too: the
global post-step hook is installed the first time a group keeps its copy. Every rank steps the
same optimizers, so every rank sees the same count and gathers at the same forward."""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

__all__ = ["optimizer_steps", "watch_optimizer_steps"]

_steps = 0
_handle: Any = None


def _count(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    global _steps
    _steps += 1


def watch_optimizer_steps() -> None:
    """Count every optimizer step from now on (idempotent)."""
    global _handle
    if _handle is None:
        _handle = register_optimizer_step_post_hook(_count)


def optimizer_steps() -> int:
    """Optimizer steps taken since the first group kept its gathered copy."""
    return _steps
