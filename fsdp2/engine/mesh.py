"""Which ranks a group shards and replicates over, and the device its collectives run on.

Three layouts share one runtime. FSDP: a 1-D mesh, parameters ``Shard(0)`` over it. HSDP: a 2-D
mesh (replicate, shard), parameters ``(Replicate(), Shard(0))``; gradients are reduce-scattered
over the shard axis, then all-reduced over the replicate axis. Replicate-only (DDP semantics):
no shard axis, i.e. a shard "group" of one rank, gradients all-reduced. ``dp_mesh_dims`` names
the axes on a larger mesh whose other axes (e.g. tensor parallel) fsdp2 leaves alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import _StridedShard

from fsdp2.engine.policies import DataParallelMeshDims

__all__ = ["MeshInfo", "default_mesh", "device_of", "mesh_info", "sharded_layout"]


@dataclass(frozen=True)
class MeshInfo:
    """The data-parallel view of a ``DeviceMesh`` as the runtime needs it, computed once."""

    mesh: DeviceMesh  # the mesh the sharded DTensors live on
    shard_axis: int | None  # mesh dim that splits parameters (None: replicate-only)
    replicate_axis: int | None  # mesh dim that holds replicas (None: plain FSDP)
    shard_group: dist.ProcessGroup | None
    shard_size: int  # ranks that split each parameter (1 without a shard axis)
    shard_rank: int  # this rank's index among them
    replicate_group: dist.ProcessGroup | None
    replicate_size: int
    # dp_mesh_dims naming several dims: all of them, in mesh order, flattened into one group
    # (``shard_axis`` is then the first). Parameters must split evenly over the product.
    shard_axes: tuple[int, ...] = ()
    # memory_mode="hfsdp" (``HFSDP.mesh_info``): the replicate and the shard dim's groups, which
    # the all-gather goes through in turn; None: one all-gather over ``shard_group``.
    levels: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None

    def placements(self, on_shard_axis: Placement) -> tuple[Placement, ...]:
        """Placements over every mesh dim: ``on_shard_axis`` on the shard dim(s), ``Replicate()``
        elsewhere. Over several flattened dims, DTensor nests the splits in mesh order, which is
        the flattened rank order for sizes that divide evenly."""
        placements: list[Placement] = [Replicate()] * self.mesh.ndim
        for axis in self.shard_axes or ((self.shard_axis,) if self.shard_axis is not None else ()):
            placements[axis] = on_shard_axis
        return tuple(placements)

    def dp_axes_on(self, mesh: DeviceMesh) -> frozenset[int]:
        """The dims of ``mesh`` (a DTensor parameter's own mesh) that are data-parallel dims
        of this one: all of them when it is this mesh, those of the same name on a slice of
        it (``dp_mesh_dims``), none on a mesh joined to it (tensor parallel over a dp slice)."""
        axes = {*self.shard_axes, self.shard_axis, self.replicate_axis} - {None}
        if mesh == self.mesh:
            return frozenset(cast("set[int]", axes))
        names = self.mesh.mesh_dim_names or ()
        dp_names = {names[a] for a in cast("set[int]", axes) if a < len(names)}
        return frozenset(i for i, n in enumerate(mesh.mesh_dim_names or ()) if n in dp_names)


def default_mesh() -> DeviceMesh:
    """A 1-D mesh over the default process group, on the current accelerator or CPU."""
    if not dist.is_initialized():
        raise RuntimeError(
            "fully_shard needs an initialized process group: call "
            "torch.distributed.init_process_group() (e.g. under torchrun) or pass mesh=..."
        )
    # check_available: a CUDA build of torch on a machine without a GPU names cuda otherwise,
    # and the mesh then fails at the first tensor; gloo on CPU is what such a machine can run.
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    device_type = accelerator.type if accelerator is not None else "cpu"
    return init_device_mesh(device_type, (dist.get_world_size(),))


def device_of(mesh: DeviceMesh) -> torch.device:
    """The device tensors of this rank live on: the mesh's device type, current index."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    backend = getattr(torch, mesh.device_type, None)
    if backend is None:
        return torch.device(mesh.device_type)
    return torch.device(mesh.device_type, backend.current_device())


def mesh_info(
    mesh: DeviceMesh,
    dp_mesh_dims: DataParallelMeshDims | None = None,
    replicate_only: bool = False,
    who: str = "the module",
) -> MeshInfo:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"fully_shard expects mesh to be a DeviceMesh, got {type(mesh).__name__}")
    shard_axis: int | None
    replicate_axis: int | None
    if replicate_only and dp_mesh_dims is None:
        if mesh.ndim != 1:
            raise ValueError(
                f"replicate expects a 1-D mesh, got a {mesh.ndim}-D mesh of shape "
                f"{tuple(mesh.shape)}; name its data-parallel dim with "
                "dp_mesh_dims=DataParallelMeshDims(replicate=...)"
            )
        shard_axis, replicate_axis = None, 0
    elif dp_mesh_dims is not None:
        shard_axes = _axes_of(mesh, dp_mesh_dims.shard_names, "shard")
        replicate_axes = _axes_of(mesh, dp_mesh_dims.replicate_names, "replicate")
        if len(shard_axes) > 1 or len(replicate_axes) > 1:
            return _flattened(mesh, shard_axes, replicate_axes, replicate_only, dp_mesh_dims)
        shard_axis = shard_axes[0] if shard_axes else None
        replicate_axis = replicate_axes[0] if replicate_axes else None
    elif mesh.ndim == 1:
        shard_axis, replicate_axis = 0, None
    elif mesh.ndim == 2:
        shard_axis, replicate_axis = 1, 0
    else:
        names = mesh.mesh_dim_names
        slice_hint = (
            f"its data-parallel slice (mesh[name], name one of {names})"
            if names
            else "its data-parallel 1-D or 2-D slice"
        )
        raise ValueError(
            f"fully_shard({who}) expects a 1-D mesh (FSDP) or a 2-D mesh (HSDP: replicate, "
            f"shard), got a {mesh.ndim}-D mesh of shape {tuple(mesh.shape)}. Pass {slice_hint}, or name the data-parallel dims of the full mesh with "
            "dp_mesh_dims=DataParallelMeshDims(shard=..., replicate=...)"
        )
    if replicate_only and shard_axis is not None:
        raise ValueError(
            "replicate() takes replicate-only dims; dp_mesh_dims names a shard dim "
            f"({dp_mesh_dims}). Use fully_shard() to shard"
        )
    return MeshInfo(
        mesh=mesh,
        shard_axis=shard_axis,
        replicate_axis=replicate_axis,
        shard_group=mesh.get_group(shard_axis) if shard_axis is not None else None,
        shard_size=mesh.size(shard_axis) if shard_axis is not None else 1,
        shard_rank=mesh.get_local_rank(shard_axis) if shard_axis is not None else 0,
        replicate_group=mesh.get_group(replicate_axis) if replicate_axis is not None else None,
        replicate_size=mesh.size(replicate_axis) if replicate_axis is not None else 1,
    )


def _axes_of(mesh: DeviceMesh, names: tuple[str, ...], role: str) -> tuple[int, ...]:
    """The mesh dims ``names`` refer to, in mesh order."""
    if not names:
        return ()
    dims = mesh.mesh_dim_names
    if dims is None:
        raise ValueError(
            f"dp_mesh_dims names mesh dims ({role}={names}), but the mesh has no dim names. "
            "Build it with init_device_mesh(..., mesh_dim_names=(...))"
        )
    for name in names:
        if name not in dims:
            raise ValueError(
                f"dp_mesh_dims {role}={name!r} is not a dim of the mesh; its dims are {dims}"
            )
    return tuple(sorted(dims.index(name) for name in names))


def _flattened(
    mesh: DeviceMesh,
    shard_axes: tuple[int, ...],
    replicate_axes: tuple[int, ...],
    replicate_only: bool,
    dp_mesh_dims: DataParallelMeshDims,
) -> MeshInfo:
    """MeshInfo for dp_mesh_dims naming several dims per role: each role's dims flattened into
    one process group (``DeviceMesh._flatten``; every rank builds it at fully_shard time)."""
    if replicate_only and shard_axes:
        raise ValueError(
            "replicate() takes replicate-only dims; dp_mesh_dims names a shard dim "
            f"({dp_mesh_dims}). Use fully_shard() to shard"
        )
    names = mesh.mesh_dim_names or ()

    def flat(axes: tuple[int, ...]) -> DeviceMesh | None:
        if not axes:
            return None
        sub = mesh[tuple(names[a] for a in axes)]
        return sub._flatten() if len(axes) > 1 else sub

    shard, replicate = flat(shard_axes), flat(replicate_axes)
    if len(replicate_axes) > 1:
        raise NotImplementedError(
            f"dp_mesh_dims replicate={dp_mesh_dims.replicate}: several replicate dims are not "
            "supported yet (their placements would nest); name one replicate dim"
        )
    return MeshInfo(
        mesh=mesh,
        shard_axis=shard_axes[0] if shard_axes else None,
        replicate_axis=replicate_axes[0] if replicate_axes else None,
        shard_group=shard.get_group() if shard is not None else None,
        shard_size=shard.size() if shard is not None else 1,
        shard_rank=shard.get_local_rank() if shard is not None else 0,
        replicate_group=replicate.get_group() if replicate is not None else None,
        replicate_size=replicate.size() if replicate is not None else 1,
        shard_axes=shard_axes,
    )


def sharded_layout(
    info: MeshInfo, outer: DTensorSpec | None, inner: Placement, fqn: str = "a parameter"
) -> tuple[DeviceMesh, tuple[Placement, ...]]:
    """The mesh and placements of a sharded parameter whose local tensor is split by ``inner``
    over the shard axis. A plain parameter lives on ``info.mesh``. A DTensor parameter (tensor or
    expert parallel) keeps its own placements and gains ``inner`` on the data-parallel axis:
    of ``info.mesh`` itself (``dp_mesh_dims``: the parameter is already on it), or of the
    data-parallel mesh's dims followed by the parameter's mesh's dims."""
    if outer is None:
        return info.mesh, info.placements(inner)
    placements = _on_full_mesh(info.mesh, outer)
    if placements is not None:  # dp_mesh_dims: parameters on the full mesh or a slice of it
        for axis in (*info.shard_axes, info.shard_axis, info.replicate_axis):
            if axis is not None and not isinstance(placements[axis], Replicate):
                raise ValueError(
                    f"{fqn} is {placements[axis]!r} on data-parallel mesh dim {axis}; "
                    "dp_mesh_dims expects parameters replicated over the data-parallel dims"
                )
        mesh = info.mesh
        if len(info.shard_axes) > 1:
            if isinstance(inner, Shard) and any(
                isinstance(p, (Shard, _StridedShard)) and p.dim == inner.dim for p in placements
            ):
                raise NotImplementedError(
                    f"{fqn}: tensor parallelism already splits it as {inner!r}, and nesting "
                    "that under several flattened data-parallel dims is not supported; shard "
                    "another dim (shard_placement_fn) or name one shard dim"
                )
            for axis in info.shard_axes:
                placements[axis] = inner
            return mesh, tuple(placements)
    else:
        mesh = joined_mesh(info.mesh, outer.mesh, fqn)
        placements = [*info.placements(Replicate()), *outer.placements]
    if info.shard_axis is None:
        return mesh, tuple(placements)
    placements[info.shard_axis] = _dp_placement(mesh, placements, info.shard_axis, inner)
    return mesh, tuple(placements)


def _on_full_mesh(mesh: DeviceMesh, outer: DTensorSpec) -> list[Placement] | None:
    """``outer``'s placements over ``mesh``'s dims when ``outer`` lives on ``mesh`` or on a
    slice of it (e.g. ``mesh["tp"]``; ``Replicate()`` on the dims it lacks), else ``None``."""
    if outer.mesh == mesh:
        return list(outer.placements)
    names, own = mesh.mesh_dim_names or (), outer.mesh.mesh_dim_names or ()
    if not own or not set(own) <= set(names) or list(own) != sorted(own, key=names.index):
        return None
    if mesh[own] != outer.mesh:  # same names, other ranks: not a slice of this mesh
        return None
    placements: list[Placement] = [Replicate()] * mesh.ndim
    for name, placement in zip(own, outer.placements, strict=True):
        placements[names.index(name)] = placement
    return placements


def _dp_placement(
    mesh: DeviceMesh, placements: list[Placement], shard_axis: int, inner: Placement
) -> Placement:
    """Tensor parallelism split the dim first and fsdp2 splits the local piece again: for mesh
    dims after the data-parallel one that split the same dim, DTensor calls that order strided,
    with the number of pieces they cut as the split factor."""
    if not isinstance(inner, Shard):
        return inner
    split = 1
    for axis in range(shard_axis + 1, mesh.ndim):
        placement = placements[axis]
        if isinstance(placement, (Shard, _StridedShard)) and placement.dim == inner.dim:
            split *= mesh.size(axis)
    return _StridedShard(inner.dim, split_factor=split) if split > 1 else inner


def joined_mesh(dp: DeviceMesh, other: DeviceMesh, fqn: str = "a parameter") -> DeviceMesh:
    """One mesh with ``dp``'s dims, then ``other``'s: both must be views of the same ranks'
    mesh (slices of one ``init_device_mesh``, or ``_unflatten`` of one mesh) over disjoint
    dims. Its process groups are theirs; no collective is needed to build it."""
    problem = None
    if not dp.mesh_dim_names or not other.mesh_dim_names:
        problem = "both need dim names"
    elif set(dp.mesh_dim_names) & set(other.mesh_dim_names):
        problem = "they share dims"
    else:
        try:
            return DeviceMesh._concatenate([dp, other])
        except RuntimeError as error:  # another root mesh, or overlapping ranks
            problem = str(error).split(":")[0].lower()
    raise ValueError(
        f"{fqn} is a DTensor on mesh {other}, which cannot be joined with fully_shard's mesh "
        f"{dp} ({problem}). Build both as disjoint named dims of one mesh, e.g. mesh['dp'] and "
        "mesh['tp'] of init_device_mesh(..., mesh_dim_names=('dp', 'tp')), or "
        "world._unflatten(0, (dp, tp), ('dp', 'tp'))"
    )
