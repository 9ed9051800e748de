"""State-dict hooks: saving always sees the sharded DTensors; loading accepts full tensors too."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp2.param_group import FSDPParamGroup

__all__ = ["register_state_dict_hooks"]


def register_state_dict_hooks(module: nn.Module, group: FSDPParamGroup) -> None:
    """Reshard ``group`` before ``module``'s state is read or written, and turn full tensors
    offered to ``load_state_dict`` into this rank's shard."""
    # Key of each parameter relative to ``module`` (a tied one has several).
    names = {id(m): n for n, m in module.named_modules()}
    keys = [
        (f"{names[id(params_owner)]}.{name}".lstrip("."), fsdp_param)
        for fsdp_param in group.fsdp_params
        for params_owner, name in fsdp_param.slot_modules
        if id(params_owner) in names
    ]

    def before_save(_module: nn.Module, _prefix: str, _keep_vars: bool) -> None:
        group.reshard()

    def before_load(state_dict: dict[str, Any], prefix: str, *_args: Any) -> None:
        group.reshard()
        for key, fsdp_param in keys:
            value = state_dict.get(prefix + key)
            if isinstance(value, torch.Tensor):
                state_dict[prefix + key] = _as_shard(value, fsdp_param)

    module.register_state_dict_pre_hook(before_save)
    module._register_load_state_dict_pre_hook(before_load)


def _as_shard(value: torch.Tensor, fsdp_param: Any) -> torch.Tensor:
    """``value`` as a DTensor placed like the sharded parameter; a wrongly shaped value is left
    as it is, so ``load_state_dict`` reports the size mismatch itself."""
    target = fsdp_param.sharded_param
    if tuple(value.shape) != tuple(target.shape):
        return value
    if isinstance(value, DTensor):
        if (
            value._spec.placements == target._spec.placements
            and value.device_mesh == target.device_mesh
        ):
            return value
        value = value.full_tensor()  # another layout or mesh: go through the full tensor
    local = fsdp_param.shard_of(value).to(target._local_tensor.device, target.dtype)
    return DTensor(local, target._spec, requires_grad=False)
