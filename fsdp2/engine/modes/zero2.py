"""``memory_mode="zero2"``: the gathered parameters kept between optimizer steps.

[Note: parameters kept gathered between steps]
zero2's reshard registers the sharded parameters as always, so that between steps the module
holds what the optimizer and the state dict see, but keeps the gathered copy. The next unshard
registers that copy again without an all-gather while it is current: while no rank's shard
changed since its gather (``KeptCopy``, [Note: when a kept copy is current] in kept.py: a key of
optimizer steps and version counters first, then the shards' bytes, agreed by every rank). A
re-pack or a freed buffer means gathering anew too. So K micro-batches of accumulation cost one
all-gather per step, the first forward's after the optimizer step, and no write to the shards
is ever trained on stale.
"""

from __future__ import annotations

from fsdp2.engine.kept import KeptCopy
from fsdp2.engine.layout import FlatLayout
from fsdp2.engine.mesh import MeshInfo
from fsdp2.engine.modes.base import Mode, ModePlan, shard_key, snapshot_bytes

__all__ = ["Zero2"]


class Zero2(Mode):
    """Keeps the gathered parameters between steps ([Note: parameters kept gathered between
    steps]); ZeRO-1 is this with gradient sync on the last micro-batch only."""

    name = "zero2"
    keeps_gathered = True
    traced_refusal = "memory_mode='zero2'"

    def __init__(self) -> None:
        self._kept: KeptCopy | None = None  # the unsharded buffer a finished gather filled

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

    def plan(self, layout: FlatLayout, shard_size: int) -> ModePlan:
        # The collectives are zero3's: those of the first micro-batch after an optimizer step.
        note = (
            "memory_mode='zero2': the collectives are those of the first micro-batch after an "
            "optimizer step; later micro-batches of the step gather nothing, each group "
            "issuing one 4-byte all-reduce instead (the check that its kept copy is current)"
        )
        kept = 0 if layout.alias else shard_size * layout.send_bytes + snapshot_bytes(layout)
        return super().plan(layout, shard_size)._replace(kept_bytes=kept, note=note)
