"""``summon_full_params``: the full parameters of fsdp2 modules, for a while, outside training.

[Note: summoned parameters]
Inside the context every summoned parameter is registered on its modules as a plain full tensor
in the parameter's own dtype (not mixed precision's ``param_dtype``), gathered through DTensor's
``full_tensor()``, so any placement fsdp2 uses is handled without knowing its buffer layout. On
exit, with ``writeback``, each rank copies its own slice of the (possibly edited) full tensor
into its shard, locally; then the sharded parameters are registered again.

Running the model inside the context (evaluation, generation) uses the summoned tensors as they
are: the summoned modules' fsdp2 hooks step aside, so no collective runs and nothing is
resharded under the caller. Gradients computed there land on the summoned tensors and are
dropped on exit; training belongs outside the context.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any, NamedTuple, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from fsdp2.engine.param import FSDPParam, parameter
from fsdp2.engine.param_group import FSDPParamGroup
from fsdp2.engine.state import STATES, FSDPState, TrainingState, state_of

__all__ = ["summon_full_params"]


class _Summoned(NamedTuple):
    """A parameter registered in full on its modules while the context is active."""

    fsdp_param: FSDPParam
    full: nn.Parameter


# Groups summoned right now: summoning one twice would register tensors that the outer context
# then fails to write back.
_summoned: weakref.WeakSet[FSDPParamGroup] = weakref.WeakSet()


@contextmanager
def summon_full_params(
    module: nn.Module,
    *,
    writeback: bool = True,
    rank0_only: bool = False,
    offload_to_cpu: bool = False,
    recurse: bool = True,
) -> Iterator[None]:
    """Register the full parameters of ``module``'s fsdp2 modules while the context is active.

    Call it on every rank, outside forward and backward (see [Note: summoned parameters]).

    Args:
        module: a module holding fsdp2 modules (or one itself).
        writeback: copy changes made to the full parameters back into the shards on exit
            (every rank writes its own slice, so make the same change on every rank).
        rank0_only: only rank 0 keeps the full parameters; the other ranks keep their shards
            (needs ``writeback=False``).
        offload_to_cpu: hold the full parameters on CPU, one parameter at a time on the
            device.
        recurse: also summon the fsdp2 modules below ``module``; ``False`` summons only
            ``module``'s own ``fully_shard`` group.
    """
    if rank0_only and writeback:
        raise ValueError(
            "summon_full_params(rank0_only=True) needs writeback=False: only rank 0 holds the "
            "full parameters, so the other ranks would have nothing to write back"
        )
    states = _states_in(module, recurse)
    names = {id(m): n for n, m in module.named_modules()}
    labels = {id(s): _label(s, names) for s in states}
    _check_idle(states, labels)
    groups = [group for s in states for group in s.groups]
    keep = not rank0_only or dist.get_rank() == 0
    with ExitStack() as stack:
        for state in states:
            stack.enter_context(_hooks_step_aside(state, labels[id(state)], keep))
        for group in groups:
            stack.enter_context(_summon_group(group, writeback, keep, offload_to_cpu))
        yield


def _states_in(module: nn.Module, recurse: bool) -> list[FSDPState]:
    if not recurse:
        state = state_of(module)
        if state is None:
            raise ValueError(
                f"summon_full_params(recurse=False) needs an fsdp2 module, got a "
                f"{type(module).__name__} that fully_shard was not applied to; apply it, or "
                "pass recurse=True to summon the fsdp2 modules below it"
            )
        return [state]
    states = STATES.under(module)
    if not states:
        raise ValueError(
            f"summon_full_params found no fsdp2 module in this {type(module).__name__}; "
            "apply fully_shard to it (or to its submodules) first"
        )
    return states


def _label(state: FSDPState, names: dict[int, str]) -> str:
    """The state's modules as named from the summoned module (its class name for itself)."""
    return ", ".join(names.get(id(m)) or type(m).__name__ for m in state.modules)


def _check_idle(states: list[FSDPState], labels: dict[int, str]) -> None:
    for state in states:
        if state.training_state is not TrainingState.IDLE:
            raise RuntimeError(
                f"summon_full_params cannot run inside forward or backward: fsdp2 module "
                f"{labels[id(state)]} is in {state.training_state.name}. Call it before forward "
                "or after backward has finished"
            )
        if any(group in _summoned for group in state.groups):
            raise RuntimeError(
                f"summon_full_params is already active on fsdp2 module {labels[id(state)]}; "
                "it cannot be nested over the same module"
            )


@contextmanager
def _hooks_step_aside(state: FSDPState, label: str, keep: bool) -> Iterator[None]:
    """Shadow ``state``'s forward hooks (an instance attribute hides the method) so a forward
    inside the context computes on the summoned tensors."""

    def pre_forward(
        args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if not keep:
            raise RuntimeError(
                f"fsdp2 module {label} ran forward inside "
                f"summon_full_params(rank0_only=True) on rank {dist.get_rank()}, which holds "
                "only its shards; run forward on rank 0 only, or pass rank0_only=False"
            )
        return args, kwargs

    def post_forward(output: Any, module: object = None) -> Any:
        return output

    traced = state.traced  # the traced forward would gather (and re-register shards) itself
    state.set_traced(False)
    state.__dict__["pre_forward"] = pre_forward
    state.__dict__["post_forward"] = post_forward
    try:
        yield
    finally:
        del state.__dict__["pre_forward"], state.__dict__["post_forward"]
        state.set_traced(traced)


@contextmanager
def _summon_group(
    group: FSDPParamGroup, writeback: bool, keep: bool, offload_to_cpu: bool
) -> Iterator[None]:
    group.reshard()
    fulls: list[_Summoned] = []
    _summoned.add(group)
    try:
        for fsdp_param in group.fsdp_params:
            full = _gather(fsdp_param, group.device, offload_to_cpu)
            if keep:
                full_param = parameter(full, fsdp_param.sharded_param.requires_grad)
                fsdp_param.register(full_param)
                fulls.append(_Summoned(fsdp_param, full_param))
        yield
        if writeback:  # not after an exception: the shards keep their values then
            _write_back(fulls)
    finally:
        _summoned.discard(group)
        for fsdp_param, _ in fulls:
            fsdp_param.register(fsdp_param.sharded_param)


def _gather(fsdp_param: FSDPParam, device: torch.device, offload_to_cpu: bool) -> torch.Tensor:
    sharded = cast(DTensor, fsdp_param.sharded_param.detach())
    shard_ptr = sharded.to_local().untyped_storage().data_ptr()
    if sharded.device != device:  # CPU-offloaded shards gather on the mesh's device
        sharded = cast(DTensor, sharded.to(device))
    full: torch.Tensor = sharded.full_tensor()
    full = full.cpu() if offload_to_cpu else full
    if full.untyped_storage().data_ptr() == shard_ptr:
        full = full.clone()  # one rank: the "gathered" tensor is the shard itself
    return full


@torch.no_grad()
def _write_back(fulls: list[_Summoned]) -> None:
    for fsdp_param, full_param in fulls:  # check all first: write all or nothing
        owner, name = fsdp_param.slot_modules[0]
        if owner._parameters.get(name) is not full_param:
            raise RuntimeError(
                f"{fsdp_param.fqn} was replaced inside summon_full_params, so its new value "
                "cannot be written back; change the summoned tensor in place instead (e.g. "
                "`with torch.no_grad(): param.copy_(value)`)"
            )
    for fsdp_param, full_param in fulls:
        sharded = cast(DTensor, fsdp_param.sharded_param)
        local = sharded.to_local()
        # src_data_rank=None: each rank slices its own full copy, with no communication.
        mine = distribute_tensor(
            full_param.detach().to(local.device),
            sharded.device_mesh,
            sharded.placements,
            src_data_rank=None,
        )
        local.copy_(mine.to_local())
