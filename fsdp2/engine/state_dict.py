"""State dicts of fsdp2 modules: sharded DTensors out; DTensors of any layout or full tensors in.

Saving reshards first, so ``state_dict()`` holds each parameter as its sharded ``DTensor``, with
the parameter's global shape and placements (fsdp2's padding never shows). Loading takes, per
parameter, a DTensor in the same layout (copied locally), a DTensor in another layout or on
another mesh (redistributed), or a plain full tensor (this rank's slice is taken, with no
communication), whether the module is sharded or unsharded at the time.

[Note: state from any thread]
A thread other than the training one (torchft's quorum thread, a checkpointing or monitoring
thread) may take the state while a forward or backward runs: the modules then hold gathered
tensors, which the training thread is using. Such a taker must not reshard, nor swap what the
modules hold. So ``state_dict()`` on another thread than the one that started the last forward
(``IterContext.thread``) leaves the groups alone and puts each parameter's sharded DTensor in
the state dict in place of whatever its module holds at the moment (``after_save``), and a
fully-sharded module's ``named_parameters()`` yields the sharded parameters there too (what
``get_state_dict`` maps the optimizer's state by). The values are the shards themselves, as on
the training thread: those of the last completed optimizer step until the next step begins
(nothing but an optimizer step, or a load, writes them). A taker that keeps them across a
step copies them first, inside ``consistent_state`` ([Note: consistent state] in steps.py)
where a copy may overlap a step (torchft's commit waits for its transfer: no overlap).

``FSDPModule.load_state_dict`` checks the whole state dict against the module before
``nn.Module`` copies anything (:func:`check_state_dict`): ``nn.Module`` copies each parameter as
it goes and reports bad keys and shapes only at the end, which would leave a model half loaded.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from fsdp2.engine.collectives import redistribute
from fsdp2.engine.param import FSDPParam
from fsdp2.engine.param_group import FSDPParamGroup
from fsdp2.engine.state import FSDPState

__all__ = ["check_state_dict", "register_state_dict_hooks", "taken_elsewhere"]


def taken_elsewhere(state: FSDPState) -> bool:
    """Whether the state of ``state``'s modules is being taken from another thread than the one
    training them ([Note: state from any thread])."""
    ctx = state.ctx
    return ctx is not None and ctx.off_thread()


def register_state_dict_hooks(module: nn.Module, state: FSDPState, group: FSDPParamGroup) -> None:
    """Reshard ``group`` before ``module``'s state is read or written (on another thread than the
    training one: read the shards instead), turn the values offered to ``load_state_dict`` into
    this rank's shards, and re-pack the group if loading with ``assign=True`` replaced its
    parameters."""
    # Key of each parameter relative to ``module`` (a tied one has several), worked out when
    # loading: a tied weight may leave the group for a later call's (api.py).
    names = {id(m): n for n, m in module.named_modules()}

    def keys() -> list[tuple[str, FSDPParam]]:
        return [
            (f"{names[id(owner)]}.{name}".lstrip("."), fsdp_param)
            for fsdp_param in group.fsdp_params
            for owner, name in fsdp_param.slot_modules
            if id(owner) in names
        ]

    def before_save(_module: nn.Module, _prefix: str, _keep_vars: bool) -> None:
        if not taken_elsewhere(state):
            group.reshard()

    def after_save(_module: nn.Module, saved: dict[str, Any], prefix: str, *_args: Any) -> None:
        if not taken_elsewhere(state):
            return  # resharded before: the state dict already holds the shards
        for key, fsdp_param in keys():
            held = saved.get(prefix + key)
            if held is not None:
                sharded = fsdp_param.sharded_param  # keep_vars=True: the parameter itself
                saved[prefix + key] = (
                    sharded if isinstance(held, nn.Parameter) else sharded.detach()
                )

    def before_load(
        _module: nn.Module, state_dict: dict[str, Any], prefix: str, *_args: Any
    ) -> None:
        group.reshard()
        for key, fsdp_param in keys():
            value = state_dict.get(prefix + key)
            if isinstance(value, torch.Tensor):
                state_dict[prefix + key] = _as_shard(value, fsdp_param)

    def after_load(_module: nn.Module, _incompatible: Any) -> None:
        _adopt_assigned(group)

    module.register_state_dict_pre_hook(before_save)  # type: ignore[no-untyped-call]
    module.register_state_dict_post_hook(after_save)  # type: ignore[no-untyped-call]
    module.register_load_state_dict_pre_hook(before_load)  # type: ignore[no-untyped-call]
    module.register_load_state_dict_post_hook(after_load)  # type: ignore[no-untyped-call]


def _as_shard(value: torch.Tensor, fsdp_param: FSDPParam) -> torch.Tensor:
    """``value`` as a DTensor laid out like the sharded parameter. A wrongly shaped value is left
    as it is, for ``load_state_dict`` to report."""
    target = _dtensor(fsdp_param.sharded_param)
    if target.dim() == 0 and tuple(value.shape) == (1,):
        value = value.reshape(())  # an old checkpoint's scalar (see _shapes_match)
    if tuple(value.shape) != tuple(target.shape):
        return value
    mesh, placements = target.device_mesh, target.placements
    if isinstance(value, DTensor):
        got, label = value, fsdp_param.fqn
        if got.device_mesh == mesh:  # the same mesh: no collective where the layout is too
            return redistribute(got, placements, label, lambda: got.redistribute(mesh, placements))
        # Another mesh: go through the full tensor.
        value = redistribute(got, [Replicate()] * got.device_mesh.ndim, label, got.full_tensor)
    if value.device.type == "meta":
        return value  # nothing to slice; copying from meta is nn.Module's to refuse
    # A model still on meta keeps the value's device: load_state_dict(assign=True) materialises.
    device = target.to_local().device
    device = value.device if device.type == "meta" else device
    # src_data_rank=None: every rank slices its own copy of the full tensor, no communication.
    value = value.detach().to(device, target.dtype)
    return distribute_tensor(value, mesh, placements, src_data_rank=None)


def _adopt_assigned(group: FSDPParamGroup) -> None:
    """``load_state_dict(assign=True)`` (as ``set_model_state_dict`` does for a model still on
    the meta device) registers new parameter objects: make them the group's sharded parameters,
    tie every slot of a shared parameter to one object again, and pack them into the group's
    buffers. ``repack`` is a no-op when nothing was replaced."""
    for fsdp_param in group.fsdp_params:
        # Any slot may hold the new object: a tied alias can be loaded after the first name.
        current = next(
            (
                p
                for owner, name in fsdp_param.slot_modules
                if (p := owner._parameters.get(name)) is not None
                and p is not fsdp_param.sharded_param
            ),
            None,
        )
        if current is None:
            continue
        placements = _dtensor(fsdp_param.sharded_param).placements
        if not isinstance(current, DTensor) or current.placements != placements:
            raise AssertionError(
                f"fsdp2: after load_state_dict, {fsdp_param.fqn} is a {type(current).__name__} "
                f"with placements {getattr(current, 'placements', None)}; expected a DTensor "
                f"with placements {placements}"
            )
        owner, name = fsdp_param.slot_modules[0]
        if (
            owner._parameters.get(name) is fsdp_param.sharded_param
            and fsdp_param.in_buffer()
            and fsdp_param.sharded_param.device.type != "meta"
        ):
            # A tied alias loaded after the name already adopted and packed: keep the packed
            # object, take the values, and tie the alias back to it.
            with torch.no_grad():
                _dtensor(fsdp_param.sharded_param)._local_tensor.copy_(current._local_tensor)
            fsdp_param.register(fsdp_param.sharded_param)
            continue
        fsdp_param.adopt(current)
        fsdp_param.register(current)
    group.repack()


def _dtensor(param: nn.Parameter) -> DTensor:
    """A sharded parameter, typed as what it is: an ``nn.Parameter`` wrapping a DTensor."""
    return cast(DTensor, param)


def check_state_dict(module: nn.Module, state_dict: Mapping[str, Any], strict: bool) -> None:
    """Raise if ``state_dict`` cannot be loaded into ``module``, naming every bad key, before
    anything is copied. ``strict=False`` allows missing and unexpected keys, never a wrong shape."""
    expected = module.state_dict(keep_vars=True)
    missing = [key for key in expected if key not in state_dict] if strict else []
    unexpected = [key for key in state_dict if key not in expected] if strict else []
    mismatched = []
    for key, value in state_dict.items():
        want = expected.get(key)
        if not isinstance(want, torch.Tensor):
            continue  # unexpected, or a module's extra state: not ours to check
        if not isinstance(value, torch.Tensor):
            mismatched.append(f"{key} is a {type(value).__name__}, not a tensor")
        elif not _shapes_match(value.shape, want.shape):
            mismatched.append(
                f"{key} has shape {tuple(value.shape)}, the model's is {tuple(want.shape)}"
            )
    if not (missing or unexpected or mismatched):
        return
    lines = [
        f"load_state_dict for {type(module).__name__} found problems; nothing was loaded, "
        "the model is unchanged:"
    ]
    if missing:
        lines.append(f"  missing keys ({len(missing)}): {', '.join(missing)}")
    if unexpected:
        lines.append(f"  unexpected keys ({len(unexpected)}): {', '.join(unexpected)}")
    if mismatched:
        lines.append(f"  bad values ({len(mismatched)}): {'; '.join(mismatched)}")
    if missing or unexpected:
        lines.append("Pass strict=False to load a subset of the keys; shapes must match anyway.")
    raise RuntimeError("\n".join(lines))


def _shapes_match(got: torch.Size, want: torch.Size) -> bool:
    # nn.Module also loads a one-element 1-D tensor into a 0-d parameter (old checkpoints).
    return got == want or (len(want) == 0 and tuple(got) == (1,))
