"""Forwards under ``torch.no_grad()`` and ``torch.inference_mode()``: evaluation before the first
training step (evaluation-only jobs, "evaluate before training"), between steps, and
generation-style repeated forwards through ``register_fsdp_forward_method``, with training
parity afterwards.

The first gather allocates the unsharded buffers and builds the unsharded parameters. Under
inference mode they must not become inference tensors (training could never save them for
backward), and under either mode the parameters must still be wired for the "gradients ready"
count, so that the first training step after evaluation reduce-scatters each group as soon as
its gradients are in, not all at the end of backward (checked on the collectives' order).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from tests.harness import check_backward_order, per_group_collectives, run_on_ranks
from tests.models import Batch
from tests.parity import Lockstep, close

pytestmark = pytest.mark.usefixtures("fsdp2_only")

DIM, NUM_BLOCKS, NUM_STEPS, GEN_STEPS = 8, 3, 3, 3


class LoopStack(nn.Module):
    """Blocks and a head of equal in/out width, so that ``generate`` can feed outputs back."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(NUM_BLOCKS)
        )
        self.head = nn.Linear(DIM, DIM)

    def step(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.step(x), y)

    def generate(self, x: torch.Tensor, steps: int) -> torch.Tensor:
        outs = []
        for _ in range(steps):
            x = self.step(x)
            outs.append(x)
        return torch.stack(outs)


def _batch(gen: torch.Generator, n: int) -> Batch:
    return torch.randn(n, DIM, generator=gen), torch.randn(n, DIM, generator=gen)


def _mode(name: str) -> contextlib.AbstractContextManager[Any]:
    if name == "grad_enabled":  # an eval loop that forgot no_grad: graphs never backpropagated
        return contextlib.nullcontext()
    return torch.inference_mode() if name == "inference_mode" else torch.no_grad()


@contextlib.contextmanager
def _backward_order(order: list[tuple[str, str]]) -> Iterator[None]:
    from fsdp2.engine.collectives import record_collectives

    with record_collectives() as records:
        yield
    order.extend((r.kind, r.label) for r in records)


# Backward of LoopStack (blocks reshard after forward, the root keeps its head): each block is
# gathered and reduced before the next one's gather; the root, whose inputs need no gradient and
# which runs the blocks inside its forward, is reduced at the end of backward (as in torch).
BACKWARD_ORDER = [
    *[
        (kind, f"blocks.{i}")
        for i in reversed(range(NUM_BLOCKS))
        for kind in ("all_gather", "reduce_scatter")
    ],
    ("reduce_scatter", ""),
]


def _evaluate(t: Lockstep, mode: str, step: int) -> None:
    x, y = t.local(100 + step)
    with _mode(mode):
        loss = t.model(x, y)
        tokens = t.model.generate(x, GEN_STEPS)  # type: ignore[operator]
        ref_tokens = t.ref.generate(x, GEN_STEPS)  # type: ignore[operator]
        ref_loss = t.ref(x, y)
    close(f"{mode} loss before step {step}", loss, ref_loss)
    close(f"{mode} generation before step {step}", tokens, ref_tokens)
    assert loss.is_inference() == (mode == "inference_mode")
    if mode != "grad_enabled":
        # Everything is resharded after a forward without grad.
        assert all(isinstance(p, DTensor) for p in t.model.parameters())


@per_group_collectives  # each group's own reduce-scatter, issued as soon as it is done
def _eval_and_train(mode: str, eval_steps: tuple[int, ...]) -> list[list[tuple[str, str]]]:
    from fsdp2 import fully_shard, register_fsdp_forward_method

    t = Lockstep(LoopStack, _batch)
    for block in t.model.blocks:  # type: ignore[union-attr]
        fully_shard(block)
    fully_shard(t.model)
    register_fsdp_forward_method(t.model, "generate")
    t.make_optimizers()
    orders: list[list[tuple[str, str]]] = []
    for step in range(NUM_STEPS):
        if step in eval_steps:
            _evaluate(t, mode, step)
        loss = t.model(*t.local(step))
        orders.append([])
        with _backward_order(orders[-1]):
            loss.backward()
        t.reference_step(loss, step)
        t.check_grads(f"step {step}")
        t.optim_step()
    t.check_params("after training")
    if eval_steps == (NUM_STEPS,):  # evaluation after the last step
        _evaluate(t, mode, NUM_STEPS)
    return orders


@pytest.mark.parametrize("mode", ["inference_mode", "no_grad", "grad_enabled"])
@pytest.mark.parametrize(
    "eval_steps", [(0,), (1,), (0, 1, 2), (NUM_STEPS,)], ids=["first", "between", "every", "after"]
)
def test_eval_and_generate_around_training(mode: str, eval_steps: tuple[int, ...]) -> None:
    """Evaluation (a loss and a generation loop) under ``mode`` at the given steps (or with
    grad enabled and never backpropagated, as an eval loop that forgot ``no_grad``), training
    in between: outputs, gradients and parameters match the unsharded reference, and every
    training backward reduces each group as soon as its gradients are in."""
    for orders in run_on_ranks(2, _eval_and_train, mode, eval_steps):
        assert len(orders) == NUM_STEPS
        for order in orders:
            check_backward_order(order, BACKWARD_ORDER)


def _inference_only() -> bool:
    from fsdp2 import fully_shard

    t = Lockstep(LoopStack, _batch)
    for block in t.model.blocks:  # type: ignore[union-attr]
        fully_shard(block, reshard_after_forward=False)
    fully_shard(t.model)
    x, y = t.local(0)
    with torch.inference_mode():
        for _ in range(2):  # again with everything still gathered
            close("inference loss", t.model(x, y), t.ref(x, y))
    return True


def test_inference_only_job_keeping_params_gathered() -> None:
    """An evaluation-only job whose groups stay gathered between forwards."""
    assert run_on_ranks(2, _inference_only) == [True, True]
