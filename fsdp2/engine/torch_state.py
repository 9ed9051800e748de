"""``fully_shard.state(module)``: fsdp2's state seen through the private names that
``torch.distributed.pipelining`` reads.

torch's pipeline stage (``stage.py``, ``perform_reduce_grad``) is FSDP2's one caller of
``fully_shard.state``: after the last microbatch's backward it calls ``post_backward()`` on every
``_fsdp_param_group`` of every state in ``state._state_ctx.all_states``, then
``state._root_post_backward_final_callback()``, to reduce the gradients that the microbatches
accumulated without sync. Those names are torch's internals; ``TorchStateView`` maps exactly them
onto fsdp2's runtime, and nothing else (any other name raises, naming the supported ones).

torch's ``fully_shard.state(module)`` looks the state up in the module's ``__dict__`` under
``contract.STATE_KEY``, keyed by its undecorated function. fsdp2 stores its view there, so the
stage finds it whether it calls fsdp2's ``fully_shard`` (``patch_torch_fsdp()``) or torch's
(``from fsdp2 import fully_shard``, torch left as it is). Only the state lookup is shared: the
registry torch keeps of applied APIs (``REGISTRY_KEY``) stays empty, so no other torch code takes
an fsdp2 module for one of torch's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed._composable.contract import STATE_KEY
from torch.distributed.fsdp._fully_shard._fully_shard import fully_shard as _torch_fully_shard

from fsdp2.engine.iteration import IterContext
from fsdp2.engine.param_group import FSDPParamGroup
from fsdp2.engine.state import FSDPState

__all__ = ["TorchStateView", "register_torch_state", "torch_state"]

# The key torch's ``fully_shard.state`` reads: the function ``@contract`` decorated.
_TORCH_KEY = _torch_fully_shard.__wrapped__  # type: ignore[attr-defined]
_SUPPORTED = "_state_ctx.all_states, _fsdp_param_groups[i].post_backward(), " + (
    "_root_post_backward_final_callback()"
)


def register_torch_state(module: nn.Module, state: FSDPState) -> None:
    """Make ``fully_shard.state(module)`` (torch's and fsdp2's) return ``state``'s view."""
    states = module.__dict__.setdefault(STATE_KEY, {})
    states.setdefault(_TORCH_KEY, TorchStateView(state))  # never replace torch's own state


def torch_state(module: nn.Module) -> TorchStateView | None:
    """``fully_shard.state(module)``: the view registered for ``module``, or ``None``."""
    found = module.__dict__.get(STATE_KEY, {}).get(_TORCH_KEY)
    return found if isinstance(found, TorchStateView) else None


class _Unsupported:
    """Raises for every torch-internal name fsdp2 does not provide."""

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"{type(self).__name__} has no attribute {name!r}: fsdp2's fully_shard.state(module) "
            f"provides only the torch-internal names torch.distributed.pipelining uses "
            f"({_SUPPORTED}); use FSDPModule's public methods for anything else"
        )


class TorchStateView(_Unsupported):
    """One fsdp2 state (one ``fully_shard`` call), as ``fully_shard.state`` returns it."""

    def __init__(self, state: FSDPState) -> None:
        self._fsdp_state = state

    @property
    def _fsdp_param_groups(self) -> list[_GroupView]:
        return [_GroupView(group, self._fsdp_state) for group in self._fsdp_state.groups]

    @property
    def _state_ctx(self) -> _ContextView:
        return _ContextView(self._fsdp_state)

    def _root_post_backward_final_callback(self) -> None:
        """Finish the backward: reduce what no ``post_backward()`` reduced, wait for the
        reductions (unless ``set_is_last_backward(False)``), hand the reduced shards to the
        parameters' ``.grad`` and reshard, as the end of an ordinary backward does. Outside
        autograd grad mode is on, which the end of backward reads as a ``create_graph``
        backward that keeps parameters gathered: run it as autograd would, without grad."""
        with torch.no_grad():
            _root(self._fsdp_state).end_of_backward()


class _ContextView(_Unsupported):
    def __init__(self, state: FSDPState) -> None:
        self._fsdp_state = state

    @property
    def all_states(self) -> list[TorchStateView]:
        return [TorchStateView(s) for s in _root(self._fsdp_state).members]


class _GroupView(_Unsupported):
    def __init__(self, group: FSDPParamGroup, state: FSDPState) -> None:
        self._group = group
        self._fsdp_state = state

    def post_backward(self) -> None:
        """Reduce the gradients the group accumulated (over the microbatches whose backward ran
        without sync), resharding first if it reshards after backward; the same as the end of
        a backward does for a group (``IterContext.end_of_backward``). Without gradient sync,
        fold this backward's gradients into the unreduced sum instead. A second call finds
        nothing left to reduce (``IterContext.finish_group``)."""
        _context(self._fsdp_state).finish_group(self._group, self._group.settings.max_in_flight)


def _context(state: FSDPState) -> IterContext:
    if state.ctx is None:
        state._lazy_init()  # never ran forward: nothing to reduce, but the calls must work
    return state.require_ctx()


def _root(state: FSDPState) -> FSDPState:
    _context(state)
    return state.root
