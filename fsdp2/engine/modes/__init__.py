"""Memory modes: what a group keeps of its gathered parameters between uses, and over which
mesh levels it gathers and reduces. ``Mode`` (base.py) is the interface, with zero3's answers;
each other mode is one file here. A group holds one (``group.mode``) and asks it; coalescing,
reduction, traced mode, auto-sharding and the planner ask it too, and nothing outside this
package tests which mode a group runs.

- ``Zero3`` (``memory_mode="zero3"``): nothing kept; every gather is over the shard dim.
- ``ReshardToK`` (``reshard_after_forward=k``, reshard_to_k.py): after forward, keeps this
  rank's block of W/k ranks' chunks, so that backward gathers within a k-rank group.
- ``Zero2`` (``memory_mode="zero2"``, zero2.py): keeps the gathered parameters across reshards.
- ``HFSDP`` (``memory_mode="hfsdp"``, hfsdp.py): gathers and reduces in two levels.

A new mode is a file here (a subclass of ``Mode``: its checks at ``fully_shard``, its gather
input, what it keeps and when that is stale, its plan: bytes kept and the collectives of its
gathers and reductions, what traced mode cannot do),
its entry in ``MODES``, and its tests (CONTRIBUTING.md, "Modes are classes").
"""

from __future__ import annotations

from fsdp2.engine.mesh import MeshInfo
from fsdp2.engine.modes.base import GatherInput, Mode, ModePlan, Zero3
from fsdp2.engine.modes.hfsdp import HFSDP
from fsdp2.engine.modes.reshard_to_k import ReshardToK
from fsdp2.engine.modes.zero2 import Zero2

__all__ = [
    "HFSDP",
    "MODES",
    "GatherInput",
    "Mode",
    "ModePlan",
    "ReshardToK",
    "Zero2",
    "Zero3",
    "mode_for",
]


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
