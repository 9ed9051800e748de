"""``reshard_after_forward=k``: after forward, each rank keeps its block of W/k ranks' chunks,
so that backward gathers within a k-rank group rather than over all W."""

from __future__ import annotations

import torch
import torch.distributed as dist

from fsdp2.engine.layout import FlatLayout
from fsdp2.engine.mesh import MeshInfo
from fsdp2.engine.modes.base import AllGatherFn, GatherInput, Mode, ModePlan, Zero3, planned_gather
from fsdp2.engine.param import FSDPParam

__all__ = ["ReshardToK"]


class ReshardToK(Mode):
    """``reshard_after_forward=k``: after forward, this rank keeps its block of W/k ranks'
    chunks (rows ``rows`` of the gathered buffer), and backward gathers over ``group``, the
    k ranks that together hold every chunk."""

    coalesces = False  # over a k-rank group, from the block: its own collective
    cuts_blocks = True
    traced_refusal = "reshard_after_forward=<int>"

    @staticmethod
    def check_value(value: object, info: MeshInfo, label: str) -> None:
        """The value alone: a bool, None, or a divisor of the shard world size."""
        if value is None or isinstance(value, bool):
            return
        world = info.shard_size
        divisors = [k for k in range(1, world + 1) if world % k == 0]
        if not isinstance(value, int) or value not in divisors:
            meaning = "1 means False" if world == 1 else f"1 means False, {world} means True"
            raise ValueError(
                f"fully_shard({label}): reshard_after_forward={value!r} must be a bool, None, or "
                f"a divisor of the shard world size {world}: one of {divisors} ({meaning})"
            )

    @classmethod
    def resolve(
        cls, value: bool | int | None, info: MeshInfo, params: list[FSDPParam], label: str
    ) -> tuple[bool | None, ReshardToK | None]:
        """``fully_shard``'s value as the state's bool (1 means False, the whole shard size
        True), and for another divisor k the mode of this rank's group: every rank creates
        every k-rank group (a collective call), so every rank calls this alike."""
        if value is None or isinstance(value, bool):
            return value, None
        cls.check_value(value, info, label)
        world = info.shard_size
        if value in (1, world):
            return value == world, None
        if any(p.outer_spec is not None for p in params):
            raise NotImplementedError(
                f"reshard_after_forward={value} with tensor-parallel (DTensor) parameters is not "
                "supported; use True or False for modules whose parameters are DTensors"
            )
        mesh = info.mesh
        if (
            mesh.mesh.numel() != dist.get_world_size()
            or info.shard_axis is None
            or len(info.shard_axes) > 1
        ):
            raise NotImplementedError(
                f"reshard_after_forward={value} needs a mesh over all {dist.get_world_size()} "
                f"ranks (got one of {mesh.mesh.numel()}): every rank must create every k-rank group"
            )
        # Every rank creates every group, in the same order: all shard rows of the mesh, cut in k.
        rows = mesh.mesh.movedim(info.shard_axis, -1).reshape(-1, world).tolist()
        mine = None
        for row in rows:
            for start in range(0, world, value):
                pg = dist.new_group(row[start : start + value])
                if dist.get_rank() in row[start : start + value]:
                    mine = pg
        if mine is None:
            raise AssertionError(f"reshard_after_forward={value}: this rank is in no k-rank group")
        block = info.shard_rank % value
        return True, cls(mine, (block * world // value, (block + 1) * world // value))

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

    def plan(self, layout: FlatLayout, shard_size: int) -> ModePlan:
        # backward: each of k ranks sends its block of W/k chunks
        backward = planned_gather(layout.send_bytes * (shard_size // self.k), self.k)
        return super().plan(layout, shard_size)._replace(backward_gathers=(backward,))
