"""The guessed prefetch that accelerators use ([Note: prefetch order] in fsdp2/engine/iteration.py), forced
on over gloo: each group, once gathered for forward, starts the gather of the group that came
next in the last forward (and backward gathers the group before). Timing changes; numbers, and
the number of collectives, must not. Trained in lockstep with an unsharded reference."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from tests.harness import per_group_collectives, run_on_ranks
from tests.parity import Lockstep, fsdp_modules, shard_model

NUM_STEPS = 3


@per_group_collectives  # the guess orders each group's own gather; coalescing would merge them
def _guessed(skip_block_in_last_step: bool) -> list[dict[str, Any]]:
    from fsdp2.engine.collectives import record_collectives

    t = Lockstep("mlp")
    shard_model(t.model, "mlp")
    for module in fsdp_modules(t.model):
        for group in module._get_fsdp_state().groups:
            group.settings.guess_prefetch = True
    t.make_optimizers()
    blocks: nn.ModuleList = t.model.blocks  # type: ignore[assignment]
    steps = []
    for step in range(NUM_STEPS):
        seen: dict[str, list[str]] = {}
        with record_collectives() as records:

            def note(name: str, seen: dict[str, list[str]] = seen, records: Any = records) -> None:
                seen[name] = [r.label for r in records if r.kind == "all_gather"]

            handles = [
                block[0].register_forward_pre_hook(lambda m, a, n=f"blocks.{i}": note(n))
                for i, block in enumerate(blocks)
            ]
            t.forward_backward(step)
            for handle in handles:
                handle.remove()
        t.check_grads(f"step {step}")
        t.optim_step()
        steps.append({"at_block": seen, "gathers": [r.label for r in records]})
    t.check_params("after training")
    if skip_block_in_last_step:
        # Control flow that skips the block the guess gathers: the wasted gather is freed at the
        # root's post-forward, and nothing is left gathered.
        block = blocks[1]
        blocks[1] = nn.Identity()
        with record_collectives() as records:
            t.model(*t.local(NUM_STEPS))
        blocks[1] = block
        steps.append({"gathers": [r.label for r in records if r.kind == "all_gather"]})
        states = [m._get_fsdp_state() for m in fsdp_modules(t.model)]
        steps.append(
            {
                "unsharded": [
                    g.label
                    for s in states
                    for g in s.groups
                    if g.state.name != "SHARDED" and g.label
                ]
            }
        )
    return steps


def test_guessed_prefetch_gathers_ahead_same_numbers(fsdp2_only: None) -> None:
    for steps in run_on_ranks(2, _guessed, True):
        *train, wasted, left = steps
        # First step: no recorded order, nothing guessed; each block gathers on arrival.
        assert train[0]["at_block"]["blocks.1"] == ["", "blocks.0", "blocks.1"]
        for s in train[1:]:
            # Later steps: block i's forward starts with block i+1's gather already issued.
            assert s["at_block"]["blocks.0"] == ["", "blocks.0", "blocks.1"]
            assert s["at_block"]["blocks.1"] == ["", "blocks.0", "blocks.1", "blocks.2"]
        # Same collectives as without the guess: each block twice, the root once, one RS each.
        for s in train:
            assert sorted(s["gathers"]) == sorted(train[0]["gathers"])
            assert len(s["gathers"]) == 4 + 3 + 4
        assert wasted["gathers"] == ["", "blocks.0", "blocks.1", "blocks.2"]
        assert left["unsharded"] == []
