"""``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch``: the order of the
all-gathers, trained next to the unsharded reference (`tests/parity/lockstep.py`)."""

from __future__ import annotations

from tests.harness import run_on_ranks
from tests.parity import Lockstep, labels, shard_model

NUM_STEPS = 3


def _explicit_prefetch() -> list[dict[str, list[str]]]:
    from fsdp2.engine.collectives import record_collectives

    t = Lockstep("mlp")
    shard_model(t.model, "mlp")
    t.make_optimizers()
    blocks = t.model.blocks
    t.model.set_modules_to_forward_prefetch([blocks[2]])
    blocks[2].set_modules_to_backward_prefetch([blocks[0]])
    steps = []
    for step in range(NUM_STEPS):
        forward, backward = t.counted_step(step, record_collectives)
        steps.append(
            {"forward": labels(forward, "all_gather"), "backward": labels(backward, "all_gather")}
        )
    t.check_params("after training")
    return steps


def test_explicit_prefetch_order(fsdp2_only: None) -> None:
    for steps in run_on_ranks(2, _explicit_prefetch):
        for phases in steps:
            # The root prefetches blocks.2 right after its own gather, ahead of blocks.0/1.
            assert phases["forward"] == ["", "blocks.2", "blocks.0", "blocks.1"]
            # blocks.2's backward prefetches blocks.0 before blocks.1 gathers on demand.
            assert phases["backward"] == ["blocks.2", "blocks.0", "blocks.1"]
