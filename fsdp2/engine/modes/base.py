"""The interface every memory mode implements (``Mode``), with zero3's answers: nothing kept
between uses, every gather over the shard dim from the flat shard. And what the modes share:
a gather's input, the planner's view of a mode, the shards' key a kept copy is checked by.
The package's ``__init__`` says what each mode is and how to add one."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from fsdp2.engine.collectives import Pending
from fsdp2.engine.layout import FlatLayout
from fsdp2.engine.mesh import MeshInfo, mesh_info
from fsdp2.engine.packing import Packing
from fsdp2.engine.policies import DataParallelMeshDims
from fsdp2.engine.steps import optimizer_steps

__all__ = [
    "AllGatherFn",
    "GatherInput",
    "Mode",
    "ModePlan",
    "Planned",
    "Zero3",
    "shard_key",
    "snapshot_bytes",
]

# The seam's all-gather as a group holds it (``FSDPParamGroup.all_gather``: a test may swap it).
AllGatherFn = Callable[..., Pending]


class GatherInput(NamedTuple):
    """What a group's next all-gather sends, and over which process group."""

    source: torch.Tensor  # 1-D: this rank's contribution
    packing: Packing | None  # the extension parameters' metadata, if any
    group: dist.ProcessGroup | None
    replicas: int = 1  # >1: the output comes shard-rank-major over this many replicas (hfsdp)


class Planned(NamedTuple):
    """One collective of the planner's step, per rank, as ``record_collectives()`` sizes it."""

    kind: str
    input_nbytes: int
    output_nbytes: int
    world_size: int


def planned_gather(send: int, world: int) -> Planned:
    """An all-gather of ``send`` bytes from each of ``world`` ranks."""
    return Planned("all_gather", send, send * world, world)


class ModePlan(NamedTuple):
    """What the planner counts for a mode (bytes per rank): what it keeps, and the collectives
    of its gathers and reductions, stated here beside the code that issues them."""

    kept_bytes: int = 0  # held between steps: a kept copy and the snapshot it is checked against
    replica_world: int = 0  # hfsdp: the replicas of its first-level gather (0: one level)
    copy_extra_bytes: int = 0  # hfsdp: the transposed copy-out's buffer
    forward_gathers: tuple[Planned, ...] = ()  # one unshard's collectives in forward
    backward_gathers: tuple[Planned, ...] = ()  # and in backward, after a reshard
    # The process groups' sizes of the reduce-scatter's levels, first to last: each level's
    # output is its input over its size.
    reduce_worlds: tuple[int, ...] = ()
    note: str = ""  # what the plan's reader should know of these collectives


def shard_key(layout: FlatLayout) -> tuple[int, int]:
    """What moves whenever the shards may have been written: the optimizer steps so far, and
    the sum of every parameter's and local tensor's version counter (each only grows)."""
    versions = 0
    for p in layout.params:
        versions += p.sharded_param._version + p.local_tensor._version
    return optimizer_steps(), versions


class Mode:
    """The interface every mode implements, with zero3's answers: nothing kept, every gather
    over the shard dim."""

    name: ClassVar[str] = "zero3"
    # Its gathers may join a coalesced collective (coalesce.py): one collective over the shard
    # group, from the flat shard.
    coalesces: ClassVar[bool] = True
    # Capabilities the group tests before calling (a flag is a class attribute read, not a call
    # per group and step): keeps the unsharded buffer between steps (``reuses_gathered``,
    # ``gathered``, ``holds_unsharded``); cuts a block after forward (``cut_block``, ``drop_block``).
    keeps_gathered: ClassVar[bool] = False
    cuts_blocks: ClassVar[bool] = False
    # What traced mode cannot do with this mode (it gathers inside the graph at every forward).
    traced_refusal: ClassVar[str | None] = None

    # -- at fully_shard, before any module changes (every rank, the same answers) --

    @classmethod
    def check_args(cls, reshard_after_forward: object, dp_mesh_dims: object, who: str) -> None:
        """Raise for arguments this mode contradicts."""

    @classmethod
    def mesh_info(
        cls, mesh: DeviceMesh, dp_mesh_dims: DataParallelMeshDims | None, who: str
    ) -> MeshInfo:
        return mesh_info(mesh, dp_mesh_dims, who=who)

    @classmethod
    def refused(cls, layout: FlatLayout) -> list[str]:
        """The FQNs of parameters this mode cannot shard."""
        return []

    @classmethod
    def reshard_after_forward(cls, resolved: bool | None) -> bool | None:
        """The group's reshard-after-forward, given the user's (resolved) value."""
        return resolved

    # -- per group --

    @property
    def k(self) -> int:
        """reshard_after_forward=k: the ranks backward gathers over (0: not this mode)."""
        return 0

    def fully_resharding(self) -> Mode:
        """This mode once ``set_reshard_after_forward(bool)`` replaced an int."""
        return self

    def gather_input(
        self, layout: FlatLayout, info: MeshInfo, reshards: int, gather: AllGatherFn
    ) -> GatherInput:
        source, packing = layout.gather_source()
        return GatherInput(source, packing, info.shard_group)

    def reuses_gathered(self, layout: FlatLayout, info: MeshInfo, reshards: int) -> bool:
        """Whether the unsharded buffer is current and may be registered without a gather.
        Every rank of the gather's group calls this at the same point."""
        return False

    def gathered(self, layout: FlatLayout) -> None:
        """The unsharded buffer was just filled by a gather."""

    def holds_unsharded(self) -> bool:
        """Whether a reshard must leave the unsharded buffer allocated (a copy kept)."""
        return False

    def cut_block(self, layout: FlatLayout) -> bool:
        """After forward: keep what backward gathers from instead of the shard; whether kept."""
        return False

    def drop_block(self) -> None:
        """The block kept after forward is no longer needed (gathered, or resharded)."""

    def forget(self) -> None:
        """Stop trusting any kept copy: the next unshard gathers."""

    def kept_nbytes(self, layout: FlatLayout) -> int:
        """Bytes kept between steps (0: nothing)."""
        return 0

    def reduce_levels(self) -> tuple[dist.ProcessGroup, dist.ProcessGroup] | None:
        """The (replicate, shard) groups to reduce-scatter over in two levels (hfsdp)."""
        return None

    def plan(self, layout: FlatLayout, shard_size: int) -> ModePlan:
        """The planner's view of this mode (groups built on meta): every gather over the shard
        dim, from the flat shard; one reduce-scatter over it."""
        gather = planned_gather(layout.send_bytes, shard_size)
        return ModePlan(
            forward_gathers=(gather,), backward_gathers=(gather,), reduce_worlds=(shard_size,)
        )

    def __repr__(self) -> str:
        return type(self).__name__


class Zero3(Mode):
    """Shards between uses; every gather is over the shard dim."""


def snapshot_bytes(layout: FlatLayout) -> int:
    """Beside a kept copy: the snapshot of this rank's shard it is checked against (kept.py)."""
    return layout.sharded_flat.numel() * layout.sharded_flat.element_size()
