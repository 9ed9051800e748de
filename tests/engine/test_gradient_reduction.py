"""Gradient reduction knobs: divide factor, forced sums, the all-reduce hook, the post-optimizer
event, the reduce-scatter's input buffers. Trained next to the unsharded reference
(`tests/parity/lockstep.py`), whose gradients are scaled as each knob promises."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.harness import run_on_ranks
from tests.models import MLP_DIM
from tests.parity import Lockstep, fsdp_modules, shard_model

# MLPStack's groups, in forward order: the root (its head), then one per block.
GROUPS = ["", "blocks.0", "blocks.1", "blocks.2"]
NUM_STEPS = 3


def _divide_factor(factor: float | None, how: str) -> list[str]:
    """Train with every module's gradients divided by ``factor`` (None: the default mean)."""
    t = Lockstep("mlp")
    shard_model(t.model, "mlp")
    caught: list[str] = []
    for module in fsdp_modules(t.model):
        with warnings.catch_warnings(record=True) as ws:
            warnings.simplefilter("always")
            if how == "set":
                module.set_gradient_divide_factor(factor)
            elif how == "deprecated":
                module.set_reduce_scatter_divide_factor(factor)
            elif how == "force_sum":
                module.set_force_sum_reduction_for_comms(True)
        caught += [f"{w.category.__name__}: {w.message}" for w in ws]
    t.make_optimizers()
    # The reference averages over ranks; a factor f instead gives sum / f = mean * W / f.
    scale = t.world_size / factor if factor is not None else 1.0
    for step in range(NUM_STEPS):
        t.forward_backward(step)
        t.check_grads(f"step {step}", lambda name: scale)
        for p in t.ref.parameters():
            p.grad.mul_(scale)  # so both take the same SGD step
        t.optim_step()
    t.check_params("after training")
    return caught


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("factor", [1.0, 3.0])
def test_gradient_divide_factor(world_size: int, factor: float, fsdp2_only: None) -> None:
    """sum / f for f != world size: torch 2.13 fails at this on gloo (no PREMUL_SUM)."""
    for caught in run_on_ranks(world_size, _divide_factor, factor, "set"):
        assert caught == []


def test_reduce_scatter_divide_factor_is_deprecated(fsdp2_only: None) -> None:
    for caught in run_on_ranks(2, _divide_factor, 3.0, "deprecated"):
        assert caught == [
            "FutureWarning: set_reduce_scatter_divide_factor is deprecated; use "
            "set_gradient_divide_factor"
        ] * len(GROUPS)


def test_force_sum_reduction_for_comms_same_numbers(fsdp2_only: None) -> None:
    for caught in run_on_ranks(2, _divide_factor, None, "force_sum"):
        assert caught == []


def _all_reduce_hook() -> list[list[int]]:
    """The root's hook doubles its reduced shard in place; the blocks keep plain means."""
    t = Lockstep("mlp")
    shard_model(t.model, "mlp")
    calls: list[list[int]] = []

    def hook(reduced: torch.Tensor) -> None:
        calls[-1].append(reduced.numel())
        reduced.mul_(2)

    t.model.set_all_reduce_hook(hook)
    t.make_optimizers()
    for step in range(NUM_STEPS):
        calls.append([])
        t.forward_backward(step)
        t.check_grads(f"step {step}", lambda name: 2.0 if name.startswith("head.") else 1.0)
        for p in t.ref.head.parameters():
            p.grad.mul_(2)
        t.optim_step()
    t.check_params("after training")
    return calls


def test_all_reduce_hook_sees_the_reduced_shard(fsdp2_only: None) -> None:
    for calls in run_on_ranks(2, _all_reduce_hook):
        # Once per backward, on the root's shard: head.weight (4, 16) and head.bias (4), two
        # rows of each per rank: 2 * 16 + 2.
        assert calls == [[2 * MLP_DIM + 2]] * NUM_STEPS


class _Event:
    """Stands in for a device event (CPU has none): counts waits."""

    def __init__(self) -> None:
        self.num_waits = 0

    def wait(self) -> None:
        self.num_waits += 1


def _post_optim_event() -> list[int]:
    t = Lockstep("mlp")
    shard_model(t.model, "mlp")
    t.make_optimizers()
    events = []
    for step in range(NUM_STEPS):
        t.forward_backward(step)
        t.check_grads(f"step {step}")
        t.optim_step()
        if step < NUM_STEPS - 1:
            events.append(_Event())
            t.model.set_post_optim_event(events[-1])  # type: ignore[arg-type]
    t.check_params("after training")
    return [e.num_waits for e in events]


def test_post_optim_event_waited_once_by_next_forward(fsdp2_only: None) -> None:
    for waits in run_on_ranks(2, _post_optim_event):
        assert waits == [1] * (NUM_STEPS - 1)


def _max_input_buffers(num: int) -> None:
    t = Lockstep("mlp")
    shard_model(t.model, "mlp")
    t.model.set_reduce_scatter_max_input_buffers(num)
    t.make_optimizers()
    t.train(NUM_STEPS)


@pytest.mark.parametrize("num", [2, 8])
def test_reduce_scatter_max_input_buffers(num: int, fsdp2_only: None) -> None:
    run_on_ranks(2, _max_input_buffers, num)
