"""The fsdp2 states of a module tree: where ``fully_shard`` keeps a module's state, and how
everything else finds it.

Each ``fully_shard`` call makes one ``FSDPState`` and attaches it to every module of the call, in
the module's ``__dict__`` under ``STATE_ATTR``, and reads it from there: a module's own entry,
never one found through a ``__getattr__`` that forwards to a wrapped model (as peft's wrappers
do), and no exception for the modules that have none. "Is this module sharded?", "which states
are below this module?" and attaching a state are asked here and nowhere else.

The registry is generic in the state's type: ``state.py`` walks it at lazy init, so it must sit
below ``state.py`` and cannot import it; ``state.py`` binds it to ``FSDPState`` (``STATES``).
"""

from __future__ import annotations

from typing import Generic, TypeVar

import torch.nn as nn

__all__ = ["STATE_ATTR", "StateRegistry"]

STATE_ATTR = "_fsdp2_state"

_State = TypeVar("_State")


class StateRegistry(Generic[_State]):
    """The states attached to modules under ``STATE_ATTR``, typed as ``_State``."""

    def of(self, module: nn.Module) -> _State | None:
        """The state of the ``fully_shard`` call ``module`` was part of (``None``: not sharded)."""
        return module.__dict__.get(STATE_ATTR)

    def attach(self, module: nn.Module, state: _State) -> None:
        module.__dict__[STATE_ATTR] = state

    def under(self, *roots: nn.Module) -> list[_State]:
        """Every state attached to ``roots`` or a module below them, each once, in pre-order
        (the order a forward first reaches them: the outermost first)."""
        found: list[_State] = []
        seen: set[int] = set()
        for root in roots:
            for module in root.modules():
                state = module.__dict__.get(STATE_ATTR)
                if state is not None and id(state) not in seen:
                    seen.add(id(state))
                    found.append(state)
        return found
