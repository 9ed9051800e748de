"""``reshard_after_forward=k``: after forward each rank keeps the parameters of k ranks, so
backward gathers within k ranks. Trained next to the unsharded reference (`tests/parity/lockstep.py`)."""

from __future__ import annotations

from typing import Any

from tests.harness import run_on_ranks
from tests.parity import Lockstep, shard_model

# MLPStack's groups, in forward order: the root (its head), then one per block.
GROUPS = ["", "blocks.0", "blocks.1", "blocks.2"]
NUM_STEPS = 3


def _reshard_after_forward_int(k: int, shard_dim: int | None = None) -> list[dict[str, Any]]:
    from torch.distributed.tensor import Shard

    from fsdp2.engine.collectives import record_collectives

    t = Lockstep("mlp")
    kwargs: dict[str, Any] = {"reshard_after_forward": k}
    if shard_dim is not None:
        kwargs["shard_placement_fn"] = lambda p: Shard(shard_dim) if p.ndim > 1 else None
    shard_model(t.model, "mlp", **kwargs)
    t.make_optimizers()
    steps = []
    for step in range(NUM_STEPS):
        forward, backward = t.counted_step(step, record_collectives)
        steps.append(
            {
                phase: sorted((r.kind, r.label, r.world_size, r.input_nbytes) for r in records)
                for phase, records in (("forward", forward), ("backward", backward))
            }
        )
    t.check_params("after training")
    return steps


def test_reshard_after_forward_int_gathers_within_k_ranks(fsdp2_only: None) -> None:
    """k=2 of 4 ranks: forward gathers over all 4; after it each rank keeps W/k = 2 chunks, so
    backward gathers within its pair of ranks, sending twice as much; reductions span all 4."""
    for steps in run_on_ranks(4, _reshard_after_forward_int, 2):
        for phases in steps:
            forward = {label: nbytes for _, label, _, nbytes in phases["forward"]}
            assert sorted(forward) == sorted(GROUPS)
            assert {ws for _, _, ws, _ in phases["forward"]} == {4}
            backward_gathers = [r for r in phases["backward"] if r[0] == "all_gather"]
            assert [(label, ws, nbytes) for _, label, ws, nbytes in backward_gathers] == [
                (label, 2, 2 * forward[label]) for label in sorted(GROUPS)
            ]
            # Each group reduced once over all 4, alone or in a coalesced reduce-scatter
            # ("blocks.2+blocks.1+blocks.0+<root>").
            reduce_scatters = [r for r in phases["backward"] if r[0] == "reduce_scatter"]
            assert {ws for _, _, ws, _ in reduce_scatters} == {4}
            reduced = [m for _, label, _, _ in reduce_scatters for m in label.split("+")]
            assert sorted("" if m == "<root>" else m for m in reduced) == sorted(GROUPS)


def test_reshard_after_forward_int_with_shard_dim1(fsdp2_only: None) -> None:
    """The kept W/k chunks of a Shard(1) weight are cut out of the full (contiguous) parameter,
    not sliced from it: backward must still gather the right values (checked against the
    reference), with the same collectives as Shard(0)."""
    for steps, dim0_steps in zip(
        run_on_ranks(4, _reshard_after_forward_int, 2, 1),
        run_on_ranks(4, _reshard_after_forward_int, 2),
        strict=True,
    ):
        assert steps == dim0_steps
