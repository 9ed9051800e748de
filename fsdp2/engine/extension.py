"""The all-gather extension protocol: a tensor subclass decides what its shard sends.

A sharded local tensor whose class defines ``fsdp_pre_all_gather(mesh, outer_size, outer_stride,
module, mp_policy) -> (inputs, metadata)`` and ``fsdp_post_all_gather(outputs, metadata,
param_dtype, *, out=None)`` is gathered as the ``inputs`` it returns (e.g. int8 data and scales
instead of fp32), and its unsharded parameter is whatever the post hook builds from the gathered
``outputs`` (each input concatenated over ranks along dim 0). The first post hook returns
``(tensor, inner_tensors)``; later ones refill that tensor in place (``out=``) after fsdp2
re-allocates the inner tensors it freed at reshard.

The older one-argument form, ``fsdp_pre_all_gather(mesh)`` (torchao's float8 training weights and
its NF4 tensors define it), is still honoured: the hook's signature decides which form is called.

A group holding such parameters gathers bytes: its plain parameters' shard and every extension
input, packed back to back, in one all-gather; unpacking cuts the bytes apart again.
"""

from __future__ import annotations

import inspect
import math
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast, overload

import torch
import torch.nn as nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from fsdp2.engine.param import FSDPParam
    from fsdp2.engine.param_group import FSDPParamGroup
    from fsdp2.engine.policies import MixedPrecisionPolicy

    class _Extension(Protocol):
        """What ``has_extension`` checks a shard for: the two hooks of the module docstring."""

        def fsdp_pre_all_gather(
            self,
            mesh: DeviceMesh,
            outer_size: torch.Size,
            outer_stride: tuple[int, ...],
            module: nn.Module,
            mp_policy: MixedPrecisionPolicy,
        ) -> tuple[Sequence[torch.Tensor], Any]: ...

        @overload
        def fsdp_post_all_gather(
            self,
            all_gather_outputs: tuple[torch.Tensor, ...],
            metadata: Any,
            param_dtype: torch.dtype,
        ) -> tuple[torch.Tensor, Sequence[torch.Tensor]]: ...

        @overload
        def fsdp_post_all_gather(
            self,
            all_gather_outputs: tuple[torch.Tensor, ...],
            metadata: Any,
            param_dtype: torch.dtype,
            *,
            out: torch.Tensor,
        ) -> None: ...


__all__ = ["has_extension", "pack", "unpack"]

# Per extension parameter: its metadata and the (dtype, shape) of each input it sent.
Packing = list[tuple[Any, list[tuple[torch.dtype, torch.Size]]]]


def has_extension(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` defines the extension's hooks; raises if one is missing, or if the pre
    hook takes neither form (at ``fully_shard``, from its class: alike on every rank)."""
    pre = hasattr(tensor, "fsdp_pre_all_gather")
    if pre != hasattr(tensor, "fsdp_post_all_gather"):
        raise TypeError(
            f"{type(tensor).__name__} defines only one of fsdp_pre_all_gather and "
            "fsdp_post_all_gather; the all-gather extension needs both"
        )
    if pre:
        _mesh_only(cast("_Extension", tensor))
    return pre


# Per hook function: whether it is the one-argument form. Weak keys: a class may be redefined.
_MESH_ONLY: weakref.WeakKeyDictionary[Callable[..., Any], bool] = weakref.WeakKeyDictionary()


def _mesh_only(local: _Extension) -> bool:
    """Whether ``local``'s pre hook is the older ``fsdp_pre_all_gather(mesh)``; decided by its
    number of parameters (``self`` not counted), once per hook function."""
    hook = local.fsdp_pre_all_gather
    func = getattr(hook, "__func__", hook)
    known = _MESH_ONLY.get(func)
    if known is not None:
        return known
    signature = inspect.signature(hook)
    if len(signature.parameters) not in (1, 5):
        names = ", ".join(signature.parameters)
        raise TypeError(
            f"{type(local).__name__}.fsdp_pre_all_gather({names}) takes "
            f"{len(signature.parameters)} arguments after self; the all-gather extension calls "
            "it as fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy), or "
            "in its older form fsdp_pre_all_gather(mesh). Define one of the two"
        )
    mesh_only = len(signature.parameters) == 1
    try:
        _MESH_ONLY[func] = mesh_only
    except TypeError:  # not weakly referenceable (a builtin): decided again at the next gather
        pass
    return mesh_only


def pack(group: FSDPParamGroup, plain: torch.Tensor) -> tuple[torch.Tensor, Packing]:
    """One rank's send buffer (``uint8``): ``plain`` then every extension input, as bytes."""
    parts = [plain]
    packing: Packing = []
    for fsdp_param in group.ext_params:
        local = _subclass_view(fsdp_param)
        mesh = shard_mesh(fsdp_param)
        if _mesh_only(local):
            inputs, metadata = local.fsdp_pre_all_gather(mesh)  # type: ignore[call-arg]
        else:
            inputs, metadata = local.fsdp_pre_all_gather(
                mesh,
                fsdp_param.global_shape,
                fsdp_param.stride,
                fsdp_param.module,
                group.mp_policy,
            )
        inputs = [_pad_rows(fsdp_param, t.to(group.device)) for t in inputs]
        packing.append((metadata, [(t.dtype, t.shape) for t in inputs]))
        parts.extend(inputs)
    send = torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in parts])
    return send, packing


def unpack(group: FSDPParamGroup, gathered: torch.Tensor, packing: Packing) -> torch.Tensor:
    """Rebuild every extension parameter from ``gathered`` (rank-major bytes); return the
    plain parameters' part as a ``(world, bytes)`` view for the usual copy-out."""
    world = group.shard_size
    rows = gathered.view(world, -1)
    if group.unsharded_flat is None:
        raise AssertionError(
            f"unpacking the gather of '{group.label}': expected its unsharded buffer, found None"
        )
    plain_bytes = group.plain_numel * group.unsharded_flat.element_size()
    start = plain_bytes
    for fsdp_param, (metadata, specs) in zip(group.ext_params, packing, strict=True):
        outputs = _outputs(fsdp_param, specs, world)
        for out, (dtype, shape) in zip(outputs, specs, strict=True):
            nbytes = math.prod(shape) * dtype.itemsize
            # Autograd may have saved these (as the parameter's inner tensors) in forward.
            with torch.autograd._unsafe_preserve_version_counter(out):  # type: ignore[attr-defined]
                out.view(-1).view(torch.uint8).view(world, nbytes).copy_(
                    rows[:, start : start + nbytes]
                )
            start += nbytes
        _rebuild_unsharded(fsdp_param, outputs, metadata, fsdp_param.param_dtype)
    return rows[:, :plain_bytes]


def shard_mesh(fsdp_param: FSDPParam) -> DeviceMesh:
    """The 1-D mesh of the dim that shards the parameter (HSDP's shard dim, not its 2-D mesh),
    the mesh the pre hook gets: hooks ask it for the shard group (NF4's
    ``mesh.get_group().size()``). Several flattened shard dims keep the whole mesh."""
    if fsdp_param.ext_mesh is None:
        info = fsdp_param.group.info
        mesh, names = info.mesh, info.mesh.mesh_dim_names
        if mesh.ndim > 1 and names and info.shard_axis is not None and len(info.shard_axes) < 2:
            mesh = mesh[names[info.shard_axis]]
        fsdp_param.ext_mesh = mesh
    return fsdp_param.ext_mesh


def _pad_rows(fsdp_param: FSDPParam, tensor: torch.Tensor) -> torch.Tensor:
    """An input that follows the shard's rows, padded with zero rows to the chunk every rank
    sends, where dim 0 does not split evenly (a hook may also pad it itself, from outer_size)."""
    rows, chunk = fsdp_param.local_shape[:1], fsdp_param.chunk_rows
    if not rows or tensor.dim() == 0 or tensor.shape[0] != rows[0] or rows[0] == chunk:
        return tensor
    padded = tensor.new_zeros(chunk, *tensor.shape[1:])
    padded[: rows[0]] = tensor
    return padded


def _outputs(
    fsdp_param: FSDPParam, specs: list[tuple[torch.dtype, torch.Size]], world: int
) -> tuple[torch.Tensor, ...]:
    """The post hook's inputs, every rank's inputs concatenated along dim 0: allocated at the
    first gather and regrown (after ``free``) at later ones, so a hook that keeps them as its
    inner tensors sees every gather's values."""
    shapes = [(dtype, (world * s[0], *s[1:]) if s else (world,)) for dtype, s in specs]
    kept = fsdp_param.ext_outputs
    if kept is None or [(t.dtype, tuple(t.shape)) for t in kept] != shapes:
        kept = [
            torch.empty(shape, dtype=dtype, device=fsdp_param.group.device)
            for dtype, shape in shapes
        ]
        fsdp_param.ext_outputs = kept
        fsdp_param.ext_inner = None  # new outputs: the post hook builds the parameter again
    for tensor in kept:
        tensor.untyped_storage().resize_(tensor.numel() * tensor.element_size())
    return tuple(kept)


def _rebuild_unsharded(
    fsdp_param: FSDPParam, outputs: tuple[torch.Tensor, ...], metadata: Any, dtype: torch.dtype
) -> None:
    local = _subclass_view(fsdp_param)
    if fsdp_param.ext_inner is None:
        tensor, inner = local.fsdp_post_all_gather(outputs, metadata, dtype)
        fsdp_param.ext_inner = [(t, t.untyped_storage().nbytes()) for t in inner]
        if tensor.shape != fsdp_param.shape:  # padded rows (uneven dim 0): cut them off
            tensor = torch.as_strided(
                tensor, fsdp_param.shape, contiguous_strides(fsdp_param.shape), 0
            )
        fsdp_param.adopt_unsharded(nn.Parameter(tensor, requires_grad=fsdp_param.requires_grad))
        return
    for tensor, nbytes in fsdp_param.ext_inner:
        tensor.untyped_storage().resize_(nbytes)
    # Refilling the very tensor autograd saved in forward (see [Note: freeing unsharded storage]).
    with torch.autograd._unsafe_preserve_version_counter(fsdp_param.unsharded_param):  # type: ignore[attr-defined]
        local.fsdp_post_all_gather(outputs, metadata, dtype, out=fsdp_param.unsharded_param)


def contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (what ``torch.empty(shape).stride()`` gives)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _subclass_view(fsdp_param: FSDPParam) -> _Extension:
    """The shard as the user's subclass (DTensor operations may hand back a plain tensor)."""
    local = fsdp_param.sharded_param._local_tensor  # type: ignore[attr-defined]
    subclass = fsdp_param.subclass
    if subclass is None:
        raise AssertionError(
            f"{fsdp_param.fqn}: expected an all-gather extension subclass, found a plain tensor"
        )
    return cast("_Extension", local if isinstance(local, subclass) else local.as_subclass(subclass))


def free(fsdp_param: FSDPParam) -> None:
    for tensor, _ in fsdp_param.ext_inner or ():
        tensor.untyped_storage().resize_(0)
    for tensor in fsdp_param.ext_outputs or ():
        tensor.untyped_storage().resize_(0)
