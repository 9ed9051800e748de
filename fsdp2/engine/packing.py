"""How a group gathers its all-gather extension parameters (extension.py's protocol).

A group holding such parameters gathers bytes: its plain parameters' shard and every extension
input, packed back to back, in one all-gather; unpacking cuts the bytes apart again and hands
each parameter's gathered inputs to its post hook.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn as nn

from fsdp2.engine.extension import contiguous_strides, mesh_only
from fsdp2.engine.mesh import MeshInfo
from fsdp2.engine.param import FSDPParam
from fsdp2.engine.policies import MixedPrecisionPolicy

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from fsdp2.engine.extension import Extension

__all__ = ["Packing", "forget", "free", "pack", "shard_mesh", "unpack"]

# Per extension parameter: its metadata and the (dtype, shape) of each input it sent.
Packing = list[tuple[Any, list[tuple[torch.dtype, torch.Size]]]]


def pack(
    ext_params: list[FSDPParam],
    plain: torch.Tensor,
    info: MeshInfo,
    device: torch.device,
    mp_policy: MixedPrecisionPolicy,
) -> tuple[torch.Tensor, Packing]:
    """One rank's send buffer (``uint8``): ``plain`` then every extension input, as bytes."""
    parts = [plain]
    packing: Packing = []
    for fsdp_param in ext_params:
        local = _subclass_view(fsdp_param)
        mesh = shard_mesh(fsdp_param, info)
        if mesh_only(local):
            inputs, metadata = local.fsdp_pre_all_gather(mesh)  # type: ignore[call-arg]
        else:
            inputs, metadata = local.fsdp_pre_all_gather(
                mesh,
                fsdp_param.global_shape,
                fsdp_param.stride,
                fsdp_param.module,
                mp_policy,
            )
        inputs = [_pad_rows(fsdp_param, t.to(device)) for t in inputs]
        packing.append((metadata, [(t.dtype, t.shape) for t in inputs]))
        parts.extend(inputs)
    send = torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in parts])
    return send, packing


def unpack(
    ext_params: list[FSDPParam],
    gathered: torch.Tensor,
    packing: Packing,
    plain_bytes: int,
    shard_size: int,
    device: torch.device,
) -> torch.Tensor:
    """Rebuild every extension parameter from ``gathered`` (rank-major bytes, each rank's
    ``plain_bytes`` of plain parameters first); return the plain parameters' part as a
    ``(shard_size, bytes)`` view for the usual copy-out."""
    rows = gathered.view(shard_size, -1)
    start = plain_bytes
    for fsdp_param, (metadata, specs) in zip(ext_params, packing, strict=True):
        outputs = _outputs(fsdp_param, specs, shard_size, device)
        for out, (dtype, shape) in zip(outputs, specs, strict=True):
            nbytes = math.prod(shape) * dtype.itemsize
            # Autograd may have saved these (as the parameter's inner tensors) in forward.
            with torch.autograd._unsafe_preserve_version_counter(out):  # type: ignore[attr-defined]
                out.view(-1).view(torch.uint8).view(shard_size, nbytes).copy_(
                    rows[:, start : start + nbytes]
                )
            start += nbytes
        _rebuild_unsharded(fsdp_param, outputs, metadata, fsdp_param.param_dtype)
        if fsdp_param.ext.release_outputs:  # the parameter holds none of them: free them now
            for out in outputs:
                out.untyped_storage().resize_(0)
    return rows[:, :plain_bytes]


def shard_mesh(fsdp_param: FSDPParam, info: MeshInfo) -> DeviceMesh:
    """The 1-D mesh of the dim that shards the parameter (HSDP's shard dim, not its 2-D mesh),
    the mesh the pre hook gets: hooks ask it for the shard group (NF4's
    ``mesh.get_group().size()``). Several flattened shard dims keep the whole mesh."""
    if fsdp_param.ext.mesh is None:
        mesh, names = info.mesh, info.mesh.mesh_dim_names
        if mesh.ndim > 1 and names and info.shard_axis is not None and len(info.shard_axes) < 2:
            mesh = mesh[names[info.shard_axis]]
        fsdp_param.ext.mesh = mesh
    return fsdp_param.ext.mesh


def _pad_rows(fsdp_param: FSDPParam, tensor: torch.Tensor) -> torch.Tensor:
    """An input that follows the shard's rows, padded with zero rows to the chunk every rank
    sends, where dim 0 does not split evenly (a hook may also pad it itself, from outer_size)."""
    rows, chunk = fsdp_param.chunk.local_shape[:1], fsdp_param.chunk.rows
    if not rows or tensor.dim() == 0 or tensor.shape[0] != rows[0] or rows[0] == chunk:
        return tensor
    padded = tensor.new_zeros(chunk, *tensor.shape[1:])
    padded[: rows[0]] = tensor
    return padded


def _outputs(
    fsdp_param: FSDPParam,
    specs: list[tuple[torch.dtype, torch.Size]],
    shard_size: int,
    device: torch.device,
) -> tuple[torch.Tensor, ...]:
    """The post hook's inputs, every rank's inputs concatenated along dim 0: allocated at the
    first gather and regrown (after ``free``) at later ones, so a hook that keeps them as its
    inner tensors sees every gather's values."""
    shapes = [(dtype, (shard_size * s[0], *s[1:]) if s else (shard_size,)) for dtype, s in specs]
    kept = fsdp_param.ext.outputs
    if kept is None or [(t.dtype, tuple(t.shape)) for t in kept] != shapes:
        kept = [torch.empty(shape, dtype=dtype, device=device) for dtype, shape in shapes]
        fsdp_param.ext.outputs = kept
        fsdp_param.ext.inner = None  # new outputs: the post hook builds the parameter again
    for tensor in kept:
        regrow(tensor.untyped_storage(), tensor.numel() * tensor.element_size())
    return tuple(kept)


def _rebuild_unsharded(
    fsdp_param: FSDPParam, outputs: tuple[torch.Tensor, ...], metadata: Any, dtype: torch.dtype
) -> None:
    local = _subclass_view(fsdp_param)
    if fsdp_param.ext.inner is None:
        tensor, inner = local.fsdp_post_all_gather(outputs, metadata, dtype)
        fsdp_param.ext.inner = [(t, t.untyped_storage().nbytes()) for t in inner]
        if tensor.shape != fsdp_param.shape:  # padded rows (uneven dim 0): cut them off
            tensor = torch.as_strided(
                tensor, fsdp_param.shape, contiguous_strides(fsdp_param.shape), 0
            )
        fsdp_param.adopt_unsharded(nn.Parameter(tensor, requires_grad=fsdp_param.requires_grad))
        return
    for tensor, nbytes in fsdp_param.ext.inner:
        regrow(tensor.untyped_storage(), nbytes)
    # Refilling the very tensor autograd saved in forward (see [Note: freeing unsharded storage]).
    with torch.autograd._unsafe_preserve_version_counter(fsdp_param.unsharded_param):  # type: ignore[attr-defined]
        local.fsdp_post_all_gather(outputs, metadata, dtype, out=fsdp_param.unsharded_param)


def _subclass_view(fsdp_param: FSDPParam) -> Extension:
    """The shard as the user's subclass (DTensor operations may hand back a plain tensor)."""
    local = fsdp_param.sharded_param._local_tensor  # type: ignore[attr-defined]
    subclass = fsdp_param.subclass
    if subclass is None:
        raise AssertionError(
            f"{fsdp_param.fqn}: expected an all-gather extension subclass, found a plain tensor"
        )
    return cast("Extension", local if isinstance(local, subclass) else local.as_subclass(subclass))


def regrow(storage: torch.UntypedStorage, nbytes: int) -> None:
    """Give a freed storage its ``nbytes`` back. A CPU storage reallocates at every
    ``resize_``: one kept at full size (``set_keep_unsharded_storage``) is left alone, so its
    data pointer stays."""
    if storage.nbytes() != nbytes:
        storage.resize_(nbytes)


def free(fsdp_param: FSDPParam) -> None:
    for tensor, _ in fsdp_param.ext.inner or ():
        tensor.untyped_storage().resize_(0)
    for tensor in fsdp_param.ext.outputs or ():
        tensor.untyped_storage().resize_(0)


def forget(fsdp_param: FSDPParam) -> None:
    """New buffers (a re-pack): the next gather hands the post hook new outputs."""
    fsdp_param.ext.outputs = None
    fsdp_param.ext.inner = None
