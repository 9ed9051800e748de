"""``clip_grad_norm_`` for gradients on any mix of meshes, in one all-reduce.

[Note: one all-reduce for every mesh]
The total norm of order p is ``(sum over gradients of sum |g_i|^p) ** (1/p)``. Each rank holds a
piece of each gradient: a DTensor's local tensor is its shard on the mesh axes it is split over
(``Shard``, ``_StridedShard``, uneven or empty) and a full copy along the axes it is
``Replicate`` on. If every rank adds ``|x|^p`` over the elements it *owns*, one sum over the ranks
gives the total. A rank owns its local tensor when it is at coordinate 0 of every ``Replicate``
axis of the gradient's mesh, and when its mesh holds the *anchor*, the lowest rank of the
reduction domain (below): a mesh smaller than the domain has copies on the domain's other ranks
(a tensor-parallel-only weight beside data-parallel ones), one per copy of the mesh, and the copy
holding the anchor counts. A plain tensor is a mesh of one rank: the anchor counts it (plain
gradients are the same on every rank, as data-parallel copies are; see the README).

The domain is the union of the ranks of every parameter's mesh (and this rank). The sum runs over
one process group spanning it: the world's when the domain is the world (FSDP, HSDP, FSDP x TP,
FSDP x EP, any mix of sub-meshes of the world: **one** all-reduce), else the group of a 1-D mesh
spanning it (one), else each axis of an N-D mesh spanning it in turn (N). The inf norm is a max,
which needs no owner; it reduces ``[max, isnan]`` with MAX so that a NaN on one rank (which a MAX
may drop) reaches every rank. Ranks whose domain is only themselves (no DTensor, world size 1)
issue nothing, as torch.

Pipeline stages hold different parameters on disjoint domains, which this rank cannot see:
``pp_mesh`` names the axis along which the stages' sums add up. When the domain times the pipeline
axis is the whole world, the stages' sums fold into the same world all-reduce (one collective);
otherwise one more all-reduce over ``pp_mesh`` follows.

Every decision above reads meshes and placements, which every rank holding a parameter agrees on,
never whether a gradient is present: a rank with ``grad=None`` still joins with a zero sum, so
ranks cannot issue different collectives. The total is all-reduced, so every rank scales by the
same coefficient and raises alike on a non-finite total.
"""

from __future__ import annotations

import math
import types
import warnings
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils._foreach_utils import _device_has_foreach_support, _has_foreach_support

from fsdp2.engine import collectives

__all__ = ["CLIP_LABEL", "clip_grad_norm_"]

CLIP_LABEL = "clip_grad_norm_"  # the label of its all-reduces in record_collectives()


@dataclass(frozen=True)
class _Reduction:
    """Where the per-rank sums go: ``groups`` reduced in turn (none: this rank alone)."""

    groups: tuple[dist.ProcessGroup, ...]
    anchor: int  # the lowest rank of the domain: its copy of a smaller mesh's gradients counts
    device: torch.device  # where the collective's tensor lives (the backend's device)


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float | str = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    *,
    pp_mesh: DeviceMesh | None = None,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for gradients on any mix of meshes and placements.

    The total norm is that of the unsharded model's gradients, the same on every rank, returned
    as a plain tensor (in float32, or float64 for float64 gradients). Every gradient is scaled in
    place by ``min(max_norm / (total + 1e-6), 1)``, as in torch. One all-reduce in all, on the
    usual meshes; see [Note: one all-reduce for every mesh] in ``fsdp2/tools/clip.py``.

    Args:
        parameters: a tensor or an iterable of tensors whose ``.grad`` is clipped: DTensors on
            any meshes (FSDP, HSDP, tensor or expert parallel, ...) or plain tensors, which are
            taken to be the same on every rank (counted once). Pass the same parameters on
            every rank.
        max_norm: the largest total norm the gradients keep.
        norm_type: the order p of the norm, > 0, or ``inf`` (float, int or ``'inf'``).
        error_if_nonfinite: raise ``RuntimeError`` (on every rank) if the total norm is NaN or
            infinite, instead of scaling by it.
        foreach: ``True`` uses torch's foreach kernels (and raises where the device has none),
            ``False`` one kernel per tensor, ``None`` foreach where the device supports it.
        pp_mesh: the pipeline-parallel axis (a 1-D mesh over this rank's peers in the other
            stages), whose stages hold different parameters: the total covers them all.
            ``None``: the parameters passed are the whole model.
    """
    if isinstance(parameters, torch.Tensor):
        params = [parameters]
    else:
        is_generator = isinstance(parameters, types.GeneratorType)
        params = list(parameters)
        if is_generator and not params:
            warnings.warn(
                "`parameters` is an empty generator, no gradient clipping will occur.",
                stacklevel=2,
            )
    p = _norm_order(norm_type)
    max_norm = float(max_norm)
    with torch.no_grad():
        reduction = _reduction(params, pp_mesh)
        if not params and not reduction.groups:
            return torch.tensor(0.0)
        owned, grads = _local_pieces(params, reduction.anchor)
        total = _total_norm(owned, grads, p, foreach, reduction)
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError(
                f"clip_grad_norm_: the total norm of order {p} of the gradients is {total.item()}, "
                "so it cannot be clipped (the same on every rank). Find the non-finite gradient, "
                "or pass error_if_nonfinite=False to scale the gradients by it anyway"
            )
        _scale(grads, max_norm / (total + 1e-6), foreach)
    return total


def _norm_order(norm_type: float | str) -> float:
    try:
        p = float(norm_type)
    except (TypeError, ValueError):
        raise ValueError(
            f"clip_grad_norm_: norm_type must be a number > 0 or 'inf', got {norm_type!r}"
        ) from None
    if not p > 0:  # NaN too
        raise ValueError(
            f"clip_grad_norm_: norm_type must be > 0 or 'inf', got {norm_type!r}: a norm of "
            "order <= 0 is no sum over the gradients' shards. Pass 2.0 (the default) or 'inf'"
        )
    return p


def _mesh_of(param: torch.Tensor) -> DeviceMesh | None:
    """The mesh a parameter's gradient lives on: read from the parameter when it has no
    gradient, so that every rank decides alike."""
    grad = param.grad
    if isinstance(grad, DTensor):
        return grad.device_mesh
    if grad is None and isinstance(param, DTensor):
        return param.device_mesh
    return None


def _ranks(mesh: DeviceMesh) -> frozenset[int]:
    return frozenset(mesh.mesh.flatten().tolist())


def _reduction(params: list[torch.Tensor], pp_mesh: DeviceMesh | None) -> _Reduction:
    """The groups to sum over, decided from meshes alone (every rank alike)."""
    meshes = {id(m): m for m in map(_mesh_of, params) if m is not None}
    if not meshes and pp_mesh is None:  # plain tensors only: each rank counts its own
        return _Reduction((), dist.get_rank() if dist.is_initialized() else 0, torch.device("cpu"))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    world = frozenset(range(world_size))
    spans = {key: _ranks(m) for key, m in meshes.items()}
    domain = frozenset({rank}).union(*spans.values())
    any_mesh = next(iter(meshes.values())) if meshes else pp_mesh
    if any_mesh is None:
        raise AssertionError("clip_grad_norm_: no mesh, though the early return covers that")
    device_type = any_mesh.device_type
    cover = sorted((m for key, m in meshes.items() if spans[key] == domain), key=lambda m: m.ndim)
    if meshes and domain != world and not cover:
        domain = world  # sub-meshes that tile the world without one mesh spanning it
    groups: tuple[dist.ProcessGroup, ...] = ()
    if domain == world and world_size > 1:
        groups = (_world(),)
    elif cover and len(domain) > 1:
        groups = tuple(cover[0].get_group(axis) for axis in range(cover[0].ndim))
    if pp_mesh is not None:
        groups = _with_pipeline(groups, domain, pp_mesh, rank, world_size)
    return _Reduction(groups, min(domain), torch.device(device_type))


def _world() -> dist.ProcessGroup:
    group = dist.group.WORLD
    if group is None:  # DTensors exist, so the default group does
        raise AssertionError("clip_grad_norm_: DTensor gradients but no default process group")
    return group


def _with_pipeline(
    groups: tuple[dist.ProcessGroup, ...],
    domain: frozenset[int],
    pp_mesh: DeviceMesh,
    rank: int,
    world_size: int,
) -> tuple[dist.ProcessGroup, ...]:
    if pp_mesh.ndim != 1:
        raise ValueError(
            f"clip_grad_norm_: pp_mesh must be a 1-D mesh (the pipeline axis), got a "
            f"{pp_mesh.ndim}-D mesh of shape {tuple(pp_mesh.shape)}. Pass mesh['pp']"
        )
    stages = _ranks(pp_mesh)
    if domain & stages != {rank}:
        raise ValueError(
            f"clip_grad_norm_: pp_mesh's ranks {sorted(stages)} overlap the ranks of the "
            f"gradients' meshes {sorted(domain)} beyond this rank {rank}: pp_mesh must be the "
            "pipeline axis, across the stages, none of the axes the parameters are on"
        )
    if len(domain) * len(stages) == world_size:
        return (_world(),)  # every stage's domain together is the world: one sum
    return (*groups, pp_mesh.get_group())


def _owns(grad: DTensor) -> bool:
    """Whether this rank's local tensor of ``grad`` is its mesh's one to count (coordinate 0 of
    every Replicate axis)."""
    mesh = grad.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return False  # not on the mesh: no local data
    for axis, placement in enumerate(grad.placements):
        if placement.is_partial():
            raise ValueError(
                f"clip_grad_norm_: a gradient is Partial on axis {axis} of its mesh "
                f"{mesh.mesh_dim_names or tuple(mesh.shape)} (placements {grad.placements}): its "
                "local tensors are addends, not pieces. Redistribute it to Replicate first"
            )
        if placement.is_replicate() and coordinate[axis] != 0:
            return False
    return True


def _local_pieces(
    params: list[torch.Tensor], anchor: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The local tensors this rank counts in the total, and every local gradient (to scale)."""
    owned, grads = [], []
    rank = dist.get_rank() if dist.is_initialized() else 0
    holds_anchor: dict[int, bool] = {}  # by id of the mesh
    for param in params:
        grad = param.grad
        if grad is None:
            continue
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        grads.append(local)
        if not local.numel():  # an empty shard adds nothing (and has no inf norm)
            continue
        if isinstance(grad, DTensor):
            mesh = grad.device_mesh
            if id(mesh) not in holds_anchor:
                holds_anchor[id(mesh)] = anchor in _ranks(mesh)
            if _owns(grad) and holds_anchor[id(mesh)]:  # _owns first: it checks placements
                owned.append(local)
        elif rank == anchor:
            owned.append(local)
    return owned, grads


def _uses_foreach(tensors: list[torch.Tensor], device: torch.device, foreach: bool | None) -> bool:
    if foreach is None:
        return _has_foreach_support(tensors, device)
    if foreach and not _device_has_foreach_support(device):
        raise RuntimeError(
            f"foreach=True was passed, but can't use the foreach API on {device.type} tensors"
        )
    return foreach


def _by_device_and_dtype(
    tensors: list[torch.Tensor],
) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        buckets[(t.device, t.dtype)].append(t)
    return buckets


def _accumulation_dtype(grads: list[torch.Tensor]) -> torch.dtype:
    wide = (torch.float64, torch.complex128)
    return torch.float64 if any(g.dtype in wide for g in grads) else torch.float32


def _total_norm(
    owned: list[torch.Tensor],
    grads: list[torch.Tensor],
    p: float,
    foreach: bool | None,
    reduction: _Reduction,
) -> torch.Tensor:
    """The all-reduced total norm, on the first gradient's device (the reduction's device if
    this rank has none), in the accumulation dtype."""
    acc = _accumulation_dtype(grads)
    device = grads[0].device if grads else reduction.device
    norms: list[torch.Tensor] = []
    for (bucket_device, dtype), tensors in _by_device_and_dtype(owned).items():
        cast = acc if dtype.is_floating_point and dtype != acc else None
        if _uses_foreach(tensors, bucket_device, foreach):
            norms += torch._foreach_norm(tensors, p, dtype=cast)
        else:
            norms += [torch.linalg.vector_norm(t, p, dtype=cast) for t in tensors]
    local = torch.stack([n.to(device, acc) for n in norms]) if norms else None
    if math.isinf(p):
        peak = local.max() if local is not None else torch.zeros((), dtype=acc, device=device)
        # MAX may drop a NaN (backends compare with <): carry it as a flag.
        flags = torch.stack([peak, peak.isnan().to(acc)])
        flags = _all_reduce(flags, reduction, dist.ReduceOp.MAX)
        return torch.where(flags[1] > 0, torch.nan, flags[0])
    powers = local.pow(p).sum() if local is not None else torch.zeros((), dtype=acc, device=device)
    return _all_reduce(powers.reshape(1), reduction, dist.ReduceOp.SUM)[0].pow(1.0 / p)


def _all_reduce(
    tensor: torch.Tensor, reduction: _Reduction, op: dist.ReduceOp.RedOpType
) -> torch.Tensor:
    """``tensor`` reduced over each group in turn, through fsdp2's seam (recorded, and under the
    hang report's deadline)."""
    if not reduction.groups:
        return tensor
    out = tensor.to(reduction.device)
    for group in reduction.groups:
        collectives.all_reduce(out, group, CLIP_LABEL, op).wait()
    return out.to(tensor.device)


def _scale(grads: list[torch.Tensor], coef: torch.Tensor, foreach: bool | None) -> None:
    """Every local gradient times ``min(coef, 1)``: always multiplied, as torch does, so that
    no host sync decides whether to."""
    coef = torch.clamp(coef, max=1.0)
    for (device, _), tensors in _by_device_and_dtype(grads).items():
        on_device = coef.to(device)
        if _uses_foreach(tensors, device, foreach):
            torch._foreach_mul_(tensors, on_device)
        else:
            for t in tensors:
                t.mul_(on_device)
