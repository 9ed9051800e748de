"""Which ranks a group shards over, and the device that its collectives run on."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["MeshInfo", "default_mesh", "device_of", "mesh_info"]


@dataclass(frozen=True)
class MeshInfo:
    """The data-parallel view of a ``DeviceMesh`` as the runtime needs it, computed once."""

    mesh: DeviceMesh
    shard_group: dist.ProcessGroup
    shard_size: int  # ranks that split each parameter
    shard_rank: int  # this rank's index among them


def default_mesh() -> DeviceMesh:
    """A 1-D mesh over the default process group, on the current accelerator or CPU."""
    if not dist.is_initialized():
        raise RuntimeError(
            "fully_shard needs an initialized process group: call "
            "torch.distributed.init_process_group() (e.g. under torchrun) or pass mesh=..."
        )
    accelerator = torch.accelerator.current_accelerator()
    device_type = accelerator.type if accelerator is not None else "cpu"
    return init_device_mesh(device_type, (dist.get_world_size(),))


def device_of(mesh: DeviceMesh) -> torch.device:
    """The device tensors of this rank live on: the mesh's device type, current index."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    backend = getattr(torch, mesh.device_type, None)
    index = backend.current_device() if backend is not None else None
    return torch.device(mesh.device_type, index)


def mesh_info(mesh: DeviceMesh) -> MeshInfo:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"fully_shard expects mesh to be a DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim != 1:
        if mesh.ndim == 2:
            raise NotImplementedError(
                "fully_shard(mesh=<2-D mesh>) (HSDP) is not supported yet; pass a 1-D mesh"
            )
        raise ValueError(
            f"fully_shard expects a 1-D mesh (FSDP) or a 2-D mesh (HSDP), got a {mesh.ndim}-D "
            f"mesh of shape {tuple(mesh.shape)}; pass a 1-D or 2-D mesh, or name the "
            "data-parallel dims with dp_mesh_dims=DataParallelMeshDims(shard=..., replicate=...)"
        )
    return MeshInfo(
        mesh=mesh,
        shard_group=mesh.get_group(),
        shard_size=mesh.size(),
        shard_rank=mesh.get_local_rank(),
    )
