"""Memory modes: what a group keeps of its gathered parameters between uses, and over which
mesh levels it gathers and reduces. One class per mode; each group holds one (``group.mode``)
and asks it. Coalescing, reduction, traced mode and the planner ask the mode too, so that no
code elsewhere branches on which mode a group runs.

- ``Zero3`` (``memory_mode="zero3"``): nothing kept; every gather is over the shard dim.
- ``ReshardToK`` (``reshard_after_forward=k``): after forward, keeps this rank's block of W/k
  ranks' chunks, so that backward gathers within a k-rank group.
- ``Zero2`` (``memory_mode="zero2"``): keeps the gathered parameters across reshards
  ([Note: parameters kept gathered between steps]).
- ``HFSDP`` (``memory_mode="hfsdp"``): gathers and reduces in two levels
  ([Note: two-level gathers]).

A new mode is a subclass here (its checks at ``fully_shard``, its gather input, what it keeps),
its entry in ``MODES``, and its tests (CONTRIBUTING.md, "Adding a memory mode").

[Note: parameters kept gathered between steps]
zero2's reshard registers the sharded parameters as always, so that between steps the module
holds what the optimizer and the state dict see, but keeps the gathered copy. The next unshard
registers that copy again without an all-gather while it is current: while no rank's shard
changed since its gather (``KeptCopy``, [Note: when a kept copy is current] in kept.py: a key of
optimizer steps and version counters first, then the shards' bytes, agreed by every rank). A
re-pack or a freed buffer means gathering anew too. So K micro-batches of accumulation cost one
all-gather per step, the first forward's after the optimizer step, and no write to the shards
is ever trained on stale.

[Note: two-level gathers]
hfsdp on a (replicate R, shard S) mesh shards the parameters over all R x S ranks, so the
optimizer steps 1/(R S) of each, and the gradients reach their shards by two reduce-scatters,
over the shard dim, then over the replicate dim, HSDP's sums in HSDP's order
(``GradientReducer._in_levels``). The gather goes in two levels: over the replicate dim, this
rank's R peers' shards make its shard rank's 1/S, kept from one step to the next like zero2's
copy, under the same key; then over the shard dim, at every use, as HSDP gathers. DTensor nests
``Shard`` over (R, S) in that order, so rank (r, s) holds chunk ``r * S + s``: the second
gather's output comes shard-rank-major and the copy-out reads it transposed (layout.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from fsdp2.engine.collectives import Pending
from fsdp2.engine.kept import KeptCopy
from fsdp2.engine.layout import FlatLayout
from fsdp2.engine.mesh import MeshInfo, hfsdp_info, mesh_info
from fsdp2.engine.packing import Packing
from fsdp2.engine.policies import DataParallelMeshDims
from fsdp2.engine.steps import optimizer_steps, watch_optimizer_steps

__all__ = [
    "HFSDP",
    "MODES",
    "GatherInput",
    "KeptPlan",
    "Mode",
    "ReshardToK",
    "Zero2",
    "Zero3",
    "mode_for",
]

# The seam's all-gather as a group holds it (``FSDPParamGroup.all_gather``: a test may swap it).
AllGatherFn = Callable[..., Pending]


class GatherInput(NamedTuple):
    """What a group's next all-gather sends, and over which process group."""

    source: torch.Tensor  # 1-D: this rank's contribution
    packing: Packing | None  # the extension parameters' metadata, if any
    group: dist.ProcessGroup | None
    replicas: int = 1  # >1: the output comes shard-rank-major over this many replicas (hfsdp)


class KeptPlan(NamedTuple):
    """What the planner counts for a mode (bytes per rank)."""

    kept_bytes: int = 0  # held between steps: a kept copy and the snapshot it is checked against
    replica_world: int = 0  # hfsdp: the replicas of its first-level gather (0: one level)
    copy_extra_bytes: int = 0  # hfsdp: the transposed copy-out's buffer


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

    def plan(self, layout: FlatLayout, shard_size: int) -> KeptPlan:
        """The planner's view of what this mode keeps (groups built on meta)."""
        return KeptPlan()

    def __repr__(self) -> str:
        return type(self).__name__


class Zero3(Mode):
    """Shards between uses; every gather is over the shard dim."""


class ReshardToK(Mode):
    """``reshard_after_forward=k``: after forward, this rank keeps its block of W/k ranks'
    chunks (rows ``rows`` of the gathered buffer), and backward gathers over ``group``, the
    k ranks that together hold every chunk."""

    coalesces = False  # over a k-rank group, from the block: its own collective
    cuts_blocks = True
    traced_refusal = "reshard_after_forward=<int>"

    def __init__(self, group: dist.ProcessGroup, rows: tuple[int, int]) -> None:
        self.group = group
        self.rows = rows
        self._block: torch.Tensor | None = None  # after forward: this rank's block

    @property
    def k(self) -> int:
        return self.group.size()

    def fully_resharding(self) -> Mode:
        return Zero3()

    def gather_input(
        self, layout: FlatLayout, info: MeshInfo, reshards: int, gather: AllGatherFn
    ) -> GatherInput:
        if self._block is None:
            return super().gather_input(layout, info, reshards, gather)
        return GatherInput(self._block, None, self.group)

    def cut_block(self, layout: FlatLayout) -> bool:
        if layout.ext_params:  # extension outputs have no rows to cut: reshard fully
            return False
        self._block = layout.k_block(*self.rows)
        return True

    def drop_block(self) -> None:
        self._block = None


class Zero2(Mode):
    """Keeps the gathered parameters between steps ([Note: parameters kept gathered between
    steps]); ZeRO-1 is this with gradient sync on the last micro-batch only."""

    name = "zero2"
    keeps_gathered = True
    traced_refusal = "memory_mode='zero2'"

    def __init__(self) -> None:
        self._kept: KeptCopy | None = None  # the unsharded buffer a finished gather filled
        watch_optimizer_steps()

    @classmethod
    def check_args(cls, reshard_after_forward: object, dp_mesh_dims: object, who: str) -> None:
        if reshard_after_forward not in (None, False):
            raise ValueError(
                f"fully_shard({who}): memory_mode='zero2' keeps the parameters gathered between "
                f"steps, which reshard_after_forward={reshard_after_forward!r} contradicts; "
                "leave reshard_after_forward unset (or False)"
            )

    @classmethod
    def refused(cls, layout: FlatLayout) -> list[str]:
        return [p.fqn for p in layout.ext_params]  # a kept copy knows no extension packing

    @classmethod
    def reshard_after_forward(cls, resolved: bool | None) -> bool | None:
        return False  # kept gathered anyway: no reason to re-register

    def reuses_gathered(self, layout: FlatLayout, info: MeshInfo, reshards: int) -> bool:
        kept = self._kept
        if kept is None:
            return False
        flat = layout.unsharded_flat
        if (
            flat is None
            or kept.buffer is not flat
            or flat.untyped_storage().nbytes() == 0
            or not kept.current(
                layout.sharded_flat, shard_key(layout), info.shard_group, layout.label, reshards
            )
        ):
            self._kept = None
            return False
        return True

    def gathered(self, layout: FlatLayout) -> None:
        flat = layout.unsharded_flat
        if flat is not None:
            self._kept = KeptCopy(flat, layout.sharded_flat, shard_key(layout))

    def holds_unsharded(self) -> bool:
        return self._kept is not None

    def forget(self) -> None:
        self._kept = None

    def kept_nbytes(self, layout: FlatLayout) -> int:
        snapshot = self._kept.snapshot_nbytes() if self._kept is not None else 0
        return layout.unsharded_nbytes() + snapshot

    def plan(self, layout: FlatLayout, shard_size: int) -> KeptPlan:
        if layout.alias:
            return KeptPlan()
        return KeptPlan(kept_bytes=shard_size * _send_bytes(layout) + _snapshot_bytes(layout))


class HFSDP(Mode):
    """Shards over both dims of a (replicate, shard) mesh; gathers and reduces in two levels
    ([Note: two-level gathers])."""

    name = "hfsdp"
    coalesces = False  # two levels, each its own collective
    traced_refusal = "memory_mode='hfsdp'"

    def __init__(self, levels: tuple[dist.ProcessGroup, dist.ProcessGroup]) -> None:
        self.levels = levels  # the replicate dim's group, the shard dim's
        self._replica: KeptCopy | None = None  # this shard rank's 1/S, gathered over replicas
        watch_optimizer_steps()

    @classmethod
    def check_args(cls, reshard_after_forward: object, dp_mesh_dims: object, who: str) -> None:
        if dp_mesh_dims is not None:
            raise NotImplementedError(
                f"fully_shard({who}): memory_mode='hfsdp' with dp_mesh_dims is not supported "
                "yet; pass the (replicate, shard) mesh itself"
            )
        if not (reshard_after_forward is None or isinstance(reshard_after_forward, bool)):
            raise NotImplementedError(
                f"fully_shard({who}): memory_mode='hfsdp' takes reshard_after_forward True, "
                f"False or None, got {reshard_after_forward!r}"
            )

    @classmethod
    def mesh_info(
        cls, mesh: DeviceMesh, dp_mesh_dims: DataParallelMeshDims | None, who: str
    ) -> MeshInfo:
        return hfsdp_info(mesh, who)

    @classmethod
    def refused(cls, layout: FlatLayout) -> list[str]:
        # Two-level gathers know no extension packing; the flattened layout no tensor-parallel
        # placements.
        return [p.fqn for p in layout.ext_params] + [
            p.fqn for p in layout.params if p.outer_spec is not None
        ]

    def gather_input(
        self, layout: FlatLayout, info: MeshInfo, reshards: int, gather: AllGatherFn
    ) -> GatherInput:
        replicate, shard = self.levels
        return GatherInput(
            self._replica_gathered(layout, reshards, gather), None, shard, replicate.size()
        )

    def _replica_gathered(
        self, layout: FlatLayout, reshards: int, gather: AllGatherFn
    ) -> torch.Tensor:
        """The first level: this shard rank's 1/S, gathered over the replicate dim unless the
        copy kept from an earlier gather is current."""
        key = shard_key(layout)
        replicate = self.levels[0]
        replica = self._replica
        if replica is not None and replica.current(
            layout.sharded_flat, key, replicate, layout.label, reshards
        ):
            return replica.buffer
        self._replica = None  # a stale copy is not kept beside the new one
        source, _ = layout.gather_source()
        out = source.new_empty(replicate.size() * source.numel())
        if replicate.size() == 1:
            out.copy_(source)
        else:
            gather(out, source, replicate, layout.label, None).wait()
        self._replica = KeptCopy(out, layout.sharded_flat, key)
        return out

    def forget(self) -> None:
        self._replica = None

    def kept_nbytes(self, layout: FlatLayout) -> int:
        if self._replica is None:
            return 0
        return self._replica.buffer.untyped_storage().nbytes() + self._replica.snapshot_nbytes()

    def reduce_levels(self) -> tuple[dist.ProcessGroup, dist.ProcessGroup] | None:
        return self.levels

    def plan(self, layout: FlatLayout, shard_size: int) -> KeptPlan:
        if shard_size == 1:
            return KeptPlan()
        replicas, send = self.levels[0].size(), _send_bytes(layout)
        return KeptPlan(
            kept_bytes=replicas * send + _snapshot_bytes(layout),
            replica_world=replicas,
            copy_extra_bytes=shard_size * send,
        )


def _send_bytes(layout: FlatLayout) -> int:
    """What this rank sends in a gather of ``layout`` (a mixed-dtype group gathers bytes)."""
    return layout.plain_numel * (1 if layout.mixed else layout.param_dtype.itemsize)


def _snapshot_bytes(layout: FlatLayout) -> int:
    """Beside a kept copy: the snapshot of this rank's shard it is checked against (kept.py)."""
    return layout.sharded_flat.numel() * layout.sharded_flat.element_size()


# The modes ``fully_shard(memory_mode=...)`` takes, by name.
MODES: dict[str, type[Mode]] = {mode.name: mode for mode in (Zero3, Zero2, HFSDP)}


def mode_for(name: str, info: MeshInfo) -> Mode:
    """The mode a group of ``fully_shard(memory_mode=name)`` over ``info`` runs: hfsdp only
    where the mesh has its two levels (a parameter that ``shard_placement_fn`` put on another
    mesh is gathered as zero3 gathers)."""
    if name == "zero2":
        return Zero2()
    if name == "hfsdp" and info.levels is not None:
        return HFSDP(info.levels)
    return Zero3()
