"""A group is freed only once autograd is done with it, not merely once its trainable gradients
are in ([Note: when a module's backward is done] in fsdp2/engine/backward_done.py).

Frozen parameters read to compute input gradients after the last trainable gradient landed
(LoRA: a frozen base Linear beside trainable adapters in one group; a frozen norm in a chunked
head), and a reentrant checkpoint on a submodule whose unit has parameters outside it. Each
trains the sharded model next to its unsharded reference and compares losses, gradients
(including the inputs'), and parameters; before the fix these read freed storage (garbage or a
segfault) or raised "mixed torch.Tensor and DTensor".
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from tests.harness import (
    IMPL_UNDER_TEST,
    check_backward_order,
    fsdp_api,
    per_group_collectives,
    run_on_ranks,
)
from tests.models import Batch
from tests.parity import Lockstep, close, fsdp_modules, mean_over_ranks

DIM, RANK, NUM_BLOCKS, NUM_STEPS = 8, 2, 3, 3


class LoRALinear(nn.Module):
    """``base(x) + B(A(x))``: base frozen, adapters trainable (PEFT's layout)."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(DIM, DIM).requires_grad_(False)
        self.lora_a = nn.Linear(DIM, RANK, bias=False)
        self.lora_b = nn.Linear(RANK, DIM, bias=False)
        nn.init.normal_(self.lora_b.weight)  # PEFT starts at zero; nonzero tests more

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.base(x) + self.lora_b(self.lora_a(x))
        return out


class Head(nn.Module):
    """A frozen norm scaling a trainable projection's input; called once per chunk."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.rand(DIM) + 0.5, requires_grad=False)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.proj(x * self.scale)
        return out


class LoRAStack(nn.Module):
    """Blocks of two LoRA layers, optionally under a checkpoint, and a chunked head."""

    def __init__(self, ckpt: str = "none", frozen_input: bool = False) -> None:
        super().__init__()
        self.ckpt = ckpt
        self.inp = nn.Linear(DIM, DIM).requires_grad_(not frozen_input)
        self.blocks = nn.ModuleList(
            nn.Sequential(LoRALinear(), nn.Tanh(), LoRALinear()) for _ in range(NUM_BLOCKS)
        )
        self.head = Head()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            if self.ckpt == "none":
                h = block(h)
            else:
                h = checkpoint(block, h, use_reentrant=self.ckpt == "reentrant")
        out = torch.cat([self.head(c) for c in h.chunk(2)])
        return F.mse_loss(out, y)


class InnerCheckpoint(nn.Module):
    """A unit whose ``inner`` runs under a reentrant checkpoint and whose ``post`` does not:
    the unit's outside gradients are in before the checkpoint recomputes ``inner``."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh())
        self.post = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.post(checkpoint(self.inner, x, use_reentrant=True))
        return out


class InnerStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList(InnerCheckpoint() for _ in range(NUM_BLOCKS))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return F.mse_loss(h, y)


def _batch(gen: torch.Generator, n: int) -> Batch:
    return torch.randn(n, DIM, generator=gen), torch.randn(n, DIM, generator=gen)


def _shard(t: Lockstep, impl: str, **kwargs: Any) -> None:
    fully_shard = fsdp_api(impl).fully_shard
    for block in t.model.blocks:  # type: ignore[union-attr]
        fully_shard(block, **kwargs)
    if hasattr(t.model, "head"):
        fully_shard(t.model.head, **kwargs)  # type: ignore[arg-type]
    fully_shard(t.model, **kwargs)
    t.make_optimizers()


def _step(t: Lockstep, step: int, schedule: str) -> None:
    """One optimizer step; the input requires grad and its gradient is compared too."""
    micros = 2 if schedule == "no_sync" else 1
    for micro in range(micros):
        if schedule == "no_sync":
            t.model.set_requires_gradient_sync(micro == micros - 1)  # type: ignore[operator]
        x, y = (v.clone() for v in t.local(step, micro))
        gx, gy = t.global_(step, micro)
        x.requires_grad_()
        gx.requires_grad_()
        loss = t.model(x, y)
        loss.backward()
        ref_loss = t.ref(gx, gy)
        ref_loss.backward()
        close(f"step {step}.{micro} loss", mean_over_ranks(loss), ref_loss.detach())
        rows = x.shape[0]
        # The local loss averages over the local rows: W times the global loss's gradient.
        assert x.grad is not None and gx.grad is not None
        expected = gx.grad[t.rank * rows : (t.rank + 1) * rows] * t.world_size
        close(f"step {step}.{micro} input grad", x.grad, expected)


def _train(build: Any, schedule: str, impl: str) -> int:
    t = Lockstep(build, _batch)
    _shard(t, impl)
    if schedule == "keep_gathered":
        t.model.set_reshard_after_backward(False)  # type: ignore[operator]
    compared = 0
    for step in range(NUM_STEPS):
        _step(t, step, schedule)
        if schedule == "keep_gathered":  # the modules register the unsharded parameters
            for module in fsdp_modules(t.model, impl):
                module.reshard()
        compared += t.check_grads(f"step {step}")
        t.optim_step()
    t.check_params("after training")
    return compared


@pytest.mark.parametrize("schedule", ["plain", "no_sync", "keep_gathered"])
@pytest.mark.parametrize("ckpt", ["none", "reentrant", "non_reentrant"])
def test_lora_frozen_base_in_each_group(ckpt: str, schedule: str) -> None:
    """Each block's frozen base weights compute its input gradient after its adapters'
    gradients are in; the chunked head's frozen scale likewise, once per chunk."""
    if ckpt != "none" and schedule != "plain":
        pytest.skip("schedules are checkpoint-independent")
    build = functools.partial(LoRAStack, ckpt=ckpt)
    for compared in run_on_ranks(2, _train, build, schedule, IMPL_UNDER_TEST):
        assert compared == NUM_STEPS * (2 * 2 * NUM_BLOCKS + 2 + 2)  # adapters, head, inp


def _train_frozen_input(impl: str) -> int:
    """The first block's input requires no grad: only its parameters' gradients matter."""
    t = Lockstep(functools.partial(LoRAStack, frozen_input=True), _batch)
    _shard(t, impl)
    compared = 0
    for step in range(NUM_STEPS):
        t.forward_backward(step)
        compared += t.check_grads(f"step {step}")
        t.optim_step()
    t.check_params("after training")
    return compared


def test_lora_input_without_grad() -> None:
    for compared in run_on_ranks(2, _train_frozen_input, IMPL_UNDER_TEST):
        assert compared == NUM_STEPS * (2 * 2 * NUM_BLOCKS + 2)


def test_reentrant_checkpoint_on_a_submodule() -> None:
    """The unit stays gathered until its checkpoint has recomputed and run its backward."""
    for compared in run_on_ranks(2, _train, InnerStack, "plain", IMPL_UNDER_TEST):
        assert compared == NUM_STEPS * (2 * 2 * NUM_BLOCKS + 2)


@per_group_collectives  # each group reshards and reduces in turn, its own collectives
def _backward_order() -> list[list[tuple[str, str]]]:
    from fsdp2.engine.collectives import record_collectives

    t = Lockstep(LoRAStack, _batch)
    _shard(t, "fsdp2")
    orders = []
    for step in range(2):
        x, y = t.local(step)
        loss = t.model(x.requires_grad_(), y)
        with record_collectives() as records:
            loss.backward()
        orders.append([(r.kind, r.label) for r in records])
    return orders


@pytest.mark.usefixtures("fsdp2_only")
def test_each_group_freed_before_the_one_before_it_gathers() -> None:
    """Waiting for the inputs' gradients costs no memory: each group still reshards and
    reduce-scatters before the group that ran before it in forward gathers (its input hook runs
    before that group's pre-backward hook on the same tensor)."""
    expected = [
        ("all_gather", "head"),
        ("reduce_scatter", "head"),
        *[(k, f"blocks.{i}") for i in (2, 1, 0) for k in ("all_gather", "reduce_scatter")],
        ("reduce_scatter", ""),
    ]
    for orders in run_on_ranks(2, _backward_order):
        assert len(orders) == 2
        for order in orders:
            # Pinned per group: coalesced reduce-scatters wait for their bucket (test_coalesce*).
            check_backward_order(order, expected)
