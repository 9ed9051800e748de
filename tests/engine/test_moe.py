"""Mixture of experts inside a sharded block: an expert that gets no tokens on some ranks.

The router's verdict is a fact of each rank's batch, so which expert parameters get a gradient
differs between ranks. Every rank must still issue the same reduce-scatter (a size mismatch
aborts gloo, and is worse on NCCL), and the step must equal plain data parallel on the same
batches: a rank without tokens adds zero to the average, and an expert no rank routed to keeps
``grad is None`` (as in the unsharded reference), so that the optimizer skips it. See
[Note: gradients on some ranks only] in fsdp2/engine/reduce.py.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.harness import run_on_ranks
from tests.models import Batch
from tests.parity import Lockstep, count

pytestmark = pytest.mark.usefixtures("fsdp2_only")

DIM, NUM_EXPERTS, NUM_BLOCKS, NUM_STEPS, LOCAL_BATCH = 8, 4, 2, 4, 6
UNUSED = NUM_EXPERTS - 1  # no rank ever routes to the last expert


def routes(step: int, rank: int) -> list[int]:
    """Each token's expert: every step some expert gets no tokens on one rank only (step 0:
    none; 1: expert 1 on rank 1; 2: expert 0 on rank 0; 3: expert 2 on every rank but 0)."""
    skipped = {(1, 1): 1, (2, 0): 0}.get((step, rank))
    if step == 3 and rank != 0:
        skipped = 2
    experts = [e for e in range(UNUSED) if e != skipped]
    return [experts[i % len(experts)] for i in range(LOCAL_BATCH)]


class MoEBlock(nn.Module):
    """A dense layer and experts; each token goes to the expert its route names, and an expert
    without tokens does not run (its parameters get no gradient on that rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(DIM, DIM)
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(NUM_EXPERTS))

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        x = x + torch.tanh(self.dense(x))
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            idx = (route == e).nonzero().squeeze(1)
            if idx.numel():
                out = out.index_add(0, idx, expert(x[idx]))
        return x + out


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MoEBlock() for _ in range(NUM_BLOCKS))
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, route: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, route)
        return F.mse_loss(self.head(x), y)


class Routed(Lockstep):
    """Each rank's batch carries its routes; the reference's global batch concatenates them, so
    every token meets the same expert in both."""

    def batch_for(self, step: int, micro: int, rank: int) -> Batch:
        x, y = super().batch_for(step, micro, rank)
        return x, torch.tensor(routes(step, rank)), y


def _batch(gen: torch.Generator, n: int) -> Batch:
    return torch.randn(n, DIM, generator=gen), torch.randn(n, DIM, generator=gen)


# Data parallel over 2 ranks; HSDP with one rank per shard group (the reduction is the
# all-reduce over replicas alone); HSDP 2 x 2.
MESHES = {"fsdp": (2, None), "hsdp_2x1": (2, (2, 1)), "hsdp_2x2": (4, (2, 2))}


def _sharded(shape: tuple[int, int] | None) -> Routed:
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp2 import fully_shard

    mesh = None if shape is None else init_device_mesh("cpu", shape)
    t = Routed(MoE, _batch, local_batch=LOCAL_BATCH)
    for block in t.model.blocks:  # type: ignore[union-attr]
        fully_shard(block, mesh=mesh)
    fully_shard(t.model, mesh=mesh)
    return t


def _per_group(labels: Counter[str]) -> Counter[str]:
    """Collective counts per group, a coalesced collective counting once for each member."""
    groups: Counter[str] = Counter()
    for label, n in labels.items():
        members = label.split("+") if "+" in label else [label]
        for member in members:
            groups["" if member == "<root>" else member] += n
    return groups


def _train(reduce_scatter_unused: bool, shape: tuple[int, int] | None) -> dict[str, Any]:
    from fsdp2.engine.collectives import record_collectives

    t = _sharded(shape)
    t.model.set_reduce_scatter_unused_params(reduce_scatter_unused)  # type: ignore[operator]
    t.make_optimizers()
    sizes = []
    unused_grads = []
    for step in range(NUM_STEPS):
        with record_collectives() as records:
            t.forward_backward(step)
        sizes.append([(r.kind, r.label, r.input_nbytes) for r in records])
        # Every group reduces once (a reduce-scatter, and with replicas an all-reduce), alone or
        # in a coalesced reduce-scatter ("blocks.1+blocks.0+<root>").
        reduced = _per_group(count(records, "reduce_scatter")) | count(records, "all_reduce")
        assert reduced == {"": 1, "blocks.0": 1, "blocks.1": 1}, reduced
        unused_grads.append(
            [b.experts[UNUSED].weight.grad is None for b in t.model.blocks]  # type: ignore[union-attr]
        )
        if not reduce_scatter_unused:  # the reference's: None for the expert no rank used
            t.check_grads(f"step {step}")
        t.optim_step()
    if not reduce_scatter_unused:
        t.check_params("after training")
    return {"sizes": sizes, "unused_grads": unused_grads}


@pytest.mark.parametrize("mesh", MESHES)
def test_expert_without_tokens_on_one_rank_trains_as_data_parallel(mesh: str) -> None:
    """The same collective sizes on every rank and step; gradients and parameters equal the
    reference's, the never-routed expert's gradient None like its."""
    world, shape = MESHES[mesh]
    from fsdp2.engine.coalesce import coalesce_bytes

    results = run_on_ranks(world, _train, False, shape)
    assert all(result["sizes"] == results[0]["sizes"] for result in results)
    # Coalescing: step 0 has no recorded order and gathers each group alone; later steps agree.
    steady = results[0]["sizes"][1:] if coalesce_bytes() else results[0]["sizes"]
    assert steady == [steady[0]] * len(steady)
    for result in results:
        assert result["unused_grads"] == [[True] * NUM_BLOCKS] * NUM_STEPS


def test_reduce_scatter_unused_params_gives_zeros() -> None:
    """With set_reduce_scatter_unused_params(True), asked for: zeros even for the expert no rank
    used (as torch), and the same sizes."""
    results = run_on_ranks(2, _train, True, None)
    assert results[0]["sizes"] == results[1]["sizes"]
    for result in results:
        assert result["unused_grads"] == [[False] * NUM_BLOCKS] * NUM_STEPS


def _grad_accumulation(shape: tuple[int, int] | None) -> None:
    """Two micro-steps without sync in between: the expert rank 1 lacks in the second (step 1)
    had its gradient from the first; the last expert none in either."""
    t = _sharded(shape)
    t.make_optimizers()
    for step in range(NUM_STEPS):
        for micro, sync in ((0, False), (1, True)):
            t.model.set_requires_gradient_sync(sync)  # type: ignore[operator]
            t.forward_backward(step if micro else (step + 1) % NUM_STEPS)
        t.check_grads(f"step {step}")
        t.optim_step()
    t.check_params("after training")


@pytest.mark.parametrize("mesh", MESHES)
def test_expert_without_tokens_with_gradient_accumulation(mesh: str) -> None:
    world, shape = MESHES[mesh]
    run_on_ranks(world, _grad_accumulation, shape)
