"""Gradient accumulation: no-sync micro-steps, the last backward, and when to free parameters.

Each test steps a sharded `MLPStack` (a group per block, then the root: labels "blocks.i" and
"") and its unsharded reference through the same micro-batches (see `tests/parity/lockstep.py`). The
reference simply accumulates; the sharded model must end every step with the same gradients
while issuing only the collectives the knobs promise. Communication counts are also checked
against torch's own ``fully_shard`` (c10d-level counts from `tests.parity.CollectiveCounter`).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from torch.distributed.tensor import DTensor

from tests.harness import per_group_collectives, run_on_ranks
from tests.parity import CollectiveCounter, Lockstep, count, shard_model

NUM_STEPS, NUM_MICRO = 2, 3
GROUPS = ["blocks.0", "blocks.1", "blocks.2", ""]


def _is_unsharded(model: Any) -> list[bool]:
    """Per group (blocks, then the root's head): are the registered parameters unsharded?"""
    modules = [*model.blocks, model]
    weights = [m[0].weight for m in modules[:-1]] + [model.head.weight]
    return [not isinstance(w, DTensor) for w in weights]


# ---------------------------------------------------------------------------------------------
# set_requires_gradient_sync / set_is_last_backward
# ---------------------------------------------------------------------------------------------


@per_group_collectives  # counts each group's own reduce-scatters
def _no_sync() -> dict[str, Any]:
    from fsdp2.engine.collectives import record_collectives

    t = Lockstep("mlp")
    shard_model(t.model, "mlp")
    t.make_optimizers()
    reduce_scatters, grads_before_last = [], []
    for step in range(NUM_STEPS):
        with record_collectives() as records:
            for micro in range(NUM_MICRO):
                last = micro == NUM_MICRO - 1
                t.model.set_requires_gradient_sync(last)
                t.forward_backward(step, micro)
                if not last:  # nothing reduced yet: the sharded gradients are not even there
                    grads_before_last.append([p.grad is not None for p in t.model.parameters()])
        reduce_scatters.append(count(records, "reduce_scatter"))
        t.check_grads(f"step {step}")
        t.optim_step()
    t.check_params("after training")
    return {"reduce_scatters": reduce_scatters, "grads_before_last": grads_before_last}


@pytest.mark.parametrize("world_size", [2, 4])
def test_no_sync_accumulates_locally_then_reduces_once(world_size: int, fsdp2_only: None) -> None:
    for result in run_on_ranks(world_size, _no_sync):
        # One reduce-scatter per group for all NUM_MICRO micro-steps: the sum, reduced once.
        assert result["reduce_scatters"] == [Counter(GROUPS)] * NUM_STEPS
        assert not any(any(g) for g in result["grads_before_last"])


@per_group_collectives  # counts each group's own reduce-scatters
def _is_last_backward() -> list[Counter[str]]:
    from fsdp2.engine.collectives import record_collectives

    t = Lockstep("mlp")
    shard_model(t.model, "mlp")
    t.make_optimizers()
    reduce_scatters = []
    for step in range(NUM_STEPS):
        with record_collectives() as records:
            for micro in range(NUM_MICRO):
                # Sync every micro-step, but only the last backward must wait for its reductions.
                t.model.set_is_last_backward(micro == NUM_MICRO - 1)
                t.forward_backward(step, micro)
        reduce_scatters.append(count(records, "reduce_scatter"))
        t.check_grads(f"step {step}")
        t.optim_step()
    t.check_params("after training")
    return reduce_scatters


def test_is_last_backward_false_defers_waiting_not_gradients(fsdp2_only: None) -> None:
    for reduce_scatters in run_on_ranks(2, _is_last_backward):
        assert reduce_scatters == [Counter(dict.fromkeys(GROUPS, NUM_MICRO))] * NUM_STEPS


# ---------------------------------------------------------------------------------------------
# set_reshard_after_backward / set_reshard_after_forward
# ---------------------------------------------------------------------------------------------


@per_group_collectives  # counted against torch's, which gathers each group alone
def _keep_gathered(impl: str) -> dict[str, Any]:
    """No sync and no resharding until the last micro-step: later micro-steps gather nothing."""
    t = Lockstep("mlp")
    shard_model(t.model, "mlp", impl)
    t.make_optimizers()
    t.model.set_reshard_after_forward(False)
    comms, unsharded = [], []
    for step in range(NUM_STEPS):
        for micro in range(NUM_MICRO):
            last = micro == NUM_MICRO - 1
            t.model.set_requires_gradient_sync(last)
            t.model.set_reshard_after_backward(last)
            with CollectiveCounter() as counter:
                loss = t.model(*t.local(step, micro))
                loss.backward()
            t.reference_step(loss, step, micro)
            comms.append(dict(counter.counts))
            unsharded.append(_is_unsharded(t.model))
        t.check_grads(f"step {step}")
        t.optim_step()
    t.check_params("after training")
    return {"comms": comms, "unsharded": unsharded}


@pytest.mark.parametrize("impl", ["fsdp2", "torch"])
def test_reshard_after_backward_false_keeps_params_gathered(impl: str, fsdp2_only: None) -> None:
    gathered, kept = {"allgather": len(GROUPS)}, {}
    reduced = {"reducescatter": len(GROUPS)}
    # Per step: micro 0 gathers every group once; micro 1 gathers nothing; micro 2 (last)
    # gathers nothing and reduce-scatters each group once.
    expected = [gathered, kept, reduced] * NUM_STEPS
    for result in run_on_ranks(2, _keep_gathered, impl):
        assert result["comms"] == expected
        # Between micro-steps every group stays unsharded; after the last, all are sharded.
        assert result["unsharded"] == [[True] * 4, [True] * 4, [False] * 4] * NUM_STEPS


@per_group_collectives  # counted against torch's, which gathers each group alone
def _reshard_after_forward_phases(impl: str) -> list[dict[str, int]]:
    """Backward all-gathers under a sequence of set_reshard_after_forward calls."""
    t = Lockstep("mlp")
    shard_model(t.model, "mlp", impl)
    t.make_optimizers()
    phases = [
        None,  # defaults: blocks reshard, the root keeps its parameters
        (False, True),  # (reshard_after_forward, recurse): nobody reshards
        (True, False),  # only the root reshards
        (True, True),  # everybody reshards
    ]
    backward_gathers = []
    for step, phase in enumerate(phases):
        if phase is not None:
            t.model.set_reshard_after_forward(phase[0], recurse=phase[1])
        loss = t.model(*t.local(step))
        with CollectiveCounter() as counter:
            loss.backward()
        t.reference_step(loss, step)
        backward_gathers.append(dict(counter.counts).get("allgather", 0))
        t.check_grads(f"step {step}")
        t.optim_step()
    t.check_params("after training")
    return backward_gathers


@pytest.mark.parametrize("impl", ["fsdp2", "torch"])
def test_set_reshard_after_forward_recurse(impl: str, fsdp2_only: None) -> None:
    for backward_gathers in run_on_ranks(2, _reshard_after_forward_phases, impl):
        assert backward_gathers == [3, 0, 1, 4]
