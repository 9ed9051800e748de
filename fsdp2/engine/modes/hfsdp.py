"""``memory_mode="hfsdp"``: parameters, gradients and optimizer state sharded over both dims of a
(replicate, shard) mesh, gathered and reduced in two levels.

[Note: two-level gathers]
hfsdp on a (replicate R, shard S) mesh shards the parameters over all R x S ranks, so the
optimizer steps 1/(R S) of each, and the gradients reach their shards by two reduce-scatters,
over the shard dim, then over the replicate dim, HSDP's sums in HSDP's order
(``reduce_scatter_in_levels`` below). The gather goes in two levels: over the replicate dim, this
rank's R peers' shards make its shard rank's 1/S, kept from one step to the next like zero2's
copy, under the same key; then over the shard dim, at every use, as HSDP gathers. DTensor nests
``Shard`` over (R, S) in that order, so rank (r, s) holds chunk ``r * S + s``: the second
gather's output comes shard-rank-major and the copy-out reads it transposed (layout.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from fsdp2.engine.collectives import Pending
from fsdp2.engine.kept import KeptCopy
from fsdp2.engine.layout import FlatLayout
from fsdp2.engine.mesh import MeshInfo, mesh_info
from fsdp2.engine.modes.base import (
    AllGatherFn,
    GatherInput,
    Mode,
    ModePlan,
    Planned,
    planned_gather,
    shard_key,
    snapshot_bytes,
)
from fsdp2.engine.policies import DataParallelMeshDims

__all__ = ["HFSDP", "reduce_scatter_in_levels"]


class HFSDP(Mode):
    """Shards over both dims of a (replicate, shard) mesh; gathers and reduces in two levels
    ([Note: two-level gathers])."""

    name = "hfsdp"
    coalesces = False  # two levels, each its own collective
    traced_refusal = "memory_mode='hfsdp'"

    def __init__(self, levels: tuple[dist.ProcessGroup, dist.ProcessGroup]) -> None:
        self.levels = levels  # the replicate dim's group, the shard dim's
        self._replica: KeptCopy | None = None  # this shard rank's 1/S, gathered over replicas

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
        """Parameters, gradients and optimizer state sharded over all R x S ranks (``Shard``
        over the mesh flattened, row-major, so uneven sizes split as on any 1-D mesh), gathered
        through both dims' groups in turn (``levels``)."""
        if mesh.ndim != 2 or not mesh.mesh_dim_names:
            raise ValueError(
                f"fully_shard({who}): memory_mode='hfsdp' needs a 2-D mesh with named dims "
                f"(replicate, shard), e.g. init_device_mesh(..., (R, S), mesh_dim_names=("
                f"'replicate', 'shard')); got a {mesh.ndim}-D mesh with dim names "
                f"{mesh.mesh_dim_names}"
            )
        flat = mesh_info(mesh._flatten(), who=who)
        return dataclasses.replace(flat, levels=(mesh.get_group(0), mesh.get_group(1)))

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

    def plan(self, layout: FlatLayout, shard_size: int) -> ModePlan:
        if shard_size == 1:
            return super().plan(layout, shard_size)
        replicas, send = self.levels[0].size(), layout.send_bytes
        # The first micro-batch's after an optimizer step: over the replicas in forward (the
        # copy kept), in backward the ranks' 4-byte agreement that it is current (kept.py);
        # then over the shard dim. Two reduce-scatter levels where both span several ranks.
        second = planned_gather(send * replicas, shard_size // replicas)
        first = planned_gather(send, replicas)
        agree = Planned("all_reduce", 4, 4, replicas)
        one_level = replicas in (1, shard_size)
        return ModePlan(
            kept_bytes=replicas * send + snapshot_bytes(layout),
            replica_world=replicas,
            copy_extra_bytes=shard_size * send,
            forward_gathers=(second,) if replicas == 1 else (first, second),
            backward_gathers=(second,) if replicas == 1 else (agree, second),
            reduce_worlds=(shard_size,) if one_level else (shard_size // replicas, replicas),
            note="memory_mode='hfsdp': the collectives are those of the first micro-batch after "
            "an optimizer step; later micro-batches of the step gather over the shard dim only",
        )


def reduce_scatter_in_levels(
    out: torch.Tensor,
    inp: torch.Tensor,
    op: dist.ReduceOp.RedOpType,
    levels: tuple[dist.ProcessGroup, dist.ProcessGroup],
    label: str,
    reduce_scatter: Callable[..., Pending],
) -> tuple[torch.Tensor, Pending]:
    """hfsdp's reduce-scatter of ``inp`` (rank-major over the flattened (R, S) mesh) in two
    levels, as HSDP reduces: over the shard dim first, whole gradients (the large stage, within
    a node where the mesh puts the shard dim), then the 1/S each rank got over the replicate dim
    (in place of HSDP's all-reduce), so the sums are HSDP's, in its order.

    Rank (r, s) holds chunk ``r * S + s``, so the shard dim's input is ``inp``'s rows reordered
    shard-rank-major (a copy: rank s of the first level gets rows ``r * S + s`` for every r,
    which ``inp`` does not hold together); its output, R rows, is the second level's input as it
    stands. The first level is waited on before the second is issued (its output is the
    second's input, on another process group). ``reduce_scatter``: the reducer's seam function.
    Returns the second level's input (to keep alive until it finishes) and its pending
    collective."""
    replicate, shard = levels
    replicas, shards = replicate.size(), shard.size()
    numel = inp.shape[-1]
    by_shard = inp.view(replicas, shards, numel).transpose(0, 1).contiguous()
    inp.untyped_storage().resize_(0)  # ours (built by the group): copied, free it
    middle = inp.new_empty(replicas * numel)
    reduce_scatter(middle, by_shard.view(-1), shard, label, op, None).wait()
    by_shard.untyped_storage().resize_(0)
    return middle, reduce_scatter(out, middle, replicate, label, op, None)
