"""Changes users make to a sharded module between iterations, taken up when a forward starts.

``fully_shard`` records each parameter's object and ``requires_grad``; users change both later:
progressive unfreezing and LoRA setups call ``requires_grad_`` on ``model.parameters()`` (the
sharded DTensors), and init code assigns new parameters (``module.weight = nn.Parameter(...)``,
``load_state_dict(assign=True)``). Each group looks at its modules again at the start of every
forward (and at an explicit ``unshard()``), so a change made between iterations counts from the
next forward. A change in the middle of an iteration cannot be followed: a replaced parameter
raises when fsdp2 next swaps what its module holds (see ``FSDPParam.check_slots``); a weight
frozen after its forward gets no gradient, as in plain PyTorch (see ``accumulate_grad``).

Every check below depends on facts that are the same on every rank (types, shapes, placements,
which object sits where) when every rank runs the same code, so every rank raises alike.
"""

from __future__ import annotations

from typing import NamedTuple, cast

import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp2.engine.param import FSDPParam
from fsdp2.engine.param_group import FSDPParamGroup, ShardedState

__all__ = ["take_up_changes"]


class _Replacement(NamedTuple):
    """A parameter assigned in place of a sharded one, about to be adopted."""

    fsdp_param: FSDPParam
    new: nn.Parameter


def take_up_changes(group: FSDPParamGroup) -> None:
    """Adopt parameters assigned on the group's modules, then follow ``requires_grad``."""
    if _unchanged(group):
        return
    _adopt_replaced(group)
    _follow_requires_grad(group)


def _unchanged(group: FSDPParamGroup) -> bool:
    """Whether every slot holds the parameter fsdp2 registered there, with the ``requires_grad``
    it last saw: then the two passes below would find nothing. Asked at every forward, one loop
    instead of their two."""
    gathered = group.state is ShardedState.UNSHARDED
    for fsdp_param in group.fsdp_params:
        registered = fsdp_param.unsharded_param if gathered else fsdp_param.sharded_param
        if registered.requires_grad is not fsdp_param.requires_grad:
            return False
        for params, name in fsdp_param.slots:
            if params.get(name) is not registered:
                return False
    return True


def _follow_requires_grad(group: FSDPParamGroup) -> None:
    gathered = group.state is ShardedState.UNSHARDED
    changed = [p for p in group.fsdp_params if p.follow_requires_grad(gathered)]
    if not changed:
        return
    if group.reducer.deferred_replica_sum is not None:
        raise RuntimeError(
            f"requires_grad of {', '.join(p.fqn for p in changed)} changed while fsdp2 held "
            "gradients reduced over the shard ranks but not yet all-reduced over replicas "
            "(set_requires_all_reduce(False)); change it after a backward that all-reduces"
        )
    for fsdp_param in changed:
        if not fsdp_param.requires_grad:  # frozen: never hand it a gradient summed before
            group.reducer.drop_grad(fsdp_param)
    group.layout.follow_requires_grad()


def _adopt_replaced(group: FSDPParamGroup) -> None:
    """Make parameters assigned on the modules since fsdp2 last registered its own the group's
    sharded parameters, re-packed into its buffers now, with the rest (the objects stay: an
    optimizer built after the assignment holds them). ``load_state_dict(assign=True)`` does
    its own adoption (state_dict.py), waiting for the whole group."""
    unsharded = group.state is ShardedState.UNSHARDED
    found: list[_Replacement] = []
    for fsdp_param in group.fsdp_params:
        if unsharded:
            fsdp_param.check_slots(fsdp_param.unsharded_param)  # gathered: cannot adopt now
            continue
        new = _replacement(fsdp_param)
        if new is not None:
            found.append(_Replacement(fsdp_param, new))
    if not found:
        return
    mine = {id(p.sharded_param) for p in group.fsdp_params}
    taken = mine - {id(p.sharded_param) for p, _ in found}  # still in use after this
    for fsdp_param, new in found:
        stolen = id(new) in taken or (
            id(new) not in mine and getattr(new, "_fsdp2_owner", None) is not None
        )
        if stolen or sum(n is new for _, n in found) > 1:
            raise ValueError(
                f"{fsdp_param.fqn} was assigned a parameter that fsdp2 already manages under "
                "another name: weights tied after fully_shard cannot be followed. Tie them "
                "before fully_shard, and shard the modules sharing one in one call, e.g. "
                "fully_shard([embedding, lm_head])"
            )
        if fsdp_param in group.reducer.unreduced:
            raise RuntimeError(
                f"{fsdp_param.fqn} was replaced while gradients of backwards without gradient "
                "sync (set_requires_gradient_sync(False)) were pending for it; replace it "
                "after a backward that reduces them"
            )
    for fsdp_param, new in found:
        fsdp_param.adopt(new)
    group.repack(force=True)


def _replacement(fsdp_param: FSDPParam) -> nn.Parameter | None:
    """The parameter now in ``fsdp_param``'s slots if it replaced the sharded one (``None`` if
    not), checked to be laid out as the one it replaces."""
    current = fsdp_param.sharded_param
    slots = fsdp_param.slots
    if len(slots) == 1 and slots[0][0].get(slots[0][1]) is current:
        return None  # the common case, checked at every forward: not replaced
    held = [params.get(name) for params, name in slots]
    if all(p is current for p in held):
        return None
    old = cast(DTensor, current)
    new = held[0]
    if any(p is not new for p in held):
        raise ValueError(
            f"{fsdp_param.fqn} is one parameter shared by {len(held)} modules (tied weights), "
            "and only some of them were assigned a new one. Assign the same parameter to all "
            "of them (tie or untie weights before fully_shard)"
        )
    if new is None:
        module = type(fsdp_param.slot_modules[0][0]).__name__
        raise ValueError(
            f"{fsdp_param.fqn} was removed from its module ({module}) after fully_shard (as "
            "torch.nn.utils.parametrize and weight_norm do); fsdp2 cannot follow a parameter "
            "that moved. Apply them before fully_shard"
        )
    layout = _layout(old, old)
    if not isinstance(new, DTensor) or _layout(new, old) != layout:
        found = _layout(new, old) if isinstance(new, DTensor) else f"a plain {type(new).__name__}"
        raise ValueError(
            f"{fsdp_param.fqn} was replaced after fully_shard by {found}; fsdp2 can adopt a "
            f"parameter laid out like the one it replaces: {layout}. Build it as "
            "nn.Parameter(distribute_tensor(full, old.device_mesh, old.placements)), or copy "
            "into the old one in place (with torch.no_grad(): old.copy_(new))"
        )
    return new


def _layout(param: DTensor, old: DTensor) -> str:
    """What must match; the device too, unless the old shard was never materialised."""
    device = param._local_tensor.device
    on = "" if old._local_tensor.device.type == "meta" else f" on {device}"
    return f"a DTensor of shape {tuple(param.shape)} over {param.device_mesh} as {param.placements}{on}"
