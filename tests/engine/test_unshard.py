"""Explicit ``unshard()`` / ``reshard()`` and ``set_unshard_in_backward``: trained next to the
unsharded reference (`tests/parity/lockstep.py`), with the all-gathers each step issues pinned."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from tests.harness import fsdp_api, per_group_collectives, run_on_ranks
from tests.models import MLP_IN, MLP_OUT, Batch
from tests.parity import Lockstep, backward_counts, labels, shard_model
from tests.tolerance import PARAM_ATOL, assert_fp32_close

NUM_STEPS = 3
VOCAB, SEQ = 16, 6


def _explicit_unshard() -> list[dict[str, Any]]:
    from fsdp2 import UnshardHandle
    from fsdp2.engine.collectives import record_collectives

    t = Lockstep("mlp")
    shard_model(t.model, "mlp")
    t.make_optimizers()
    block, ref_block = t.model.blocks[1], t.ref.blocks[1]
    t.forward_backward(0)  # lazy init through the root's forward first, as torch requires
    t.optim_step()
    steps = []
    for step in range(1, NUM_STEPS):
        with record_collectives() as issued:
            handle = block.unshard(async_op=True)
        assert isinstance(handle, UnshardHandle), handle
        handle.wait()
        # The gathered parameters are registered: plain tensors holding the full values.
        weight = block[0].weight
        assert not isinstance(weight, DTensor), type(weight)
        assert_fp32_close(weight.detach(), ref_block[0].weight.detach(), atol=PARAM_ATOL)
        with record_collectives() as forward:
            loss = t.model(*t.local(step))
        # The root keeps its parameters after forward; freeing them now means regathering them.
        t.model.reshard()
        assert isinstance(t.model.head.weight, DTensor)
        with record_collectives() as backward:
            loss.backward()
        t.reference_step(loss, step)
        t.check_grads(f"step {step}")
        t.optim_step()
        steps.append(
            {
                "issued": labels(issued, "all_gather"),
                "forward": labels(forward, "all_gather"),
                "backward": sorted(labels(backward, "all_gather")),
            }
        )
    # A synchronous unshard returns nothing and leaves the parameters gathered until reshard().
    assert t.model.unshard() is None
    assert not isinstance(t.model.head.weight, DTensor)
    t.model.reshard()
    t.check_params("after training")
    return steps


def _groups(gathered: list[str]) -> list[str]:
    """The groups of these gathers, in order: a coalesced one ("<root>+blocks.0") names several."""
    return [g.replace("<root>", "") for label in gathered for g in label.split("+")]


def test_unshard_async_handle_and_explicit_reshard(fsdp2_only: None) -> None:
    for steps in run_on_ranks(2, _explicit_unshard):
        for raw in steps:
            phases = {phase: _groups(gathered) for phase, gathered in raw.items()}
            phases["backward"].sort()
            assert phases["issued"] == ["blocks.1"]
            # blocks.1 was gathered ahead: forward gathers only the others.
            assert phases["forward"] == ["", "blocks.0", "blocks.2"]
            # The root was resharded by hand, so backward gathers it too.
            assert phases["backward"] == ["", "blocks.0", "blocks.1", "blocks.2"]


class EmbedMLP(nn.Module):
    """An embedding whose backward needs only the indices, never the weight."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, MLP_IN)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(MLP_IN, MLP_IN), nn.Tanh()) for _ in range(2)
        )
        self.head = nn.Linear(MLP_IN, MLP_OUT)

    def forward(self, idx: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx).mean(dim=1)
        for block in self.blocks:
            x = block(x)
        return F.mse_loss(self.head(x), y)


def _embed_batch(gen: torch.Generator, n: int) -> Batch:
    return torch.randint(0, VOCAB, (n, SEQ), generator=gen), torch.randn(n, MLP_OUT, generator=gen)


@per_group_collectives  # counted against torch's, which gathers each group alone
def _unshard_in_backward(impl: str, unshard_in_backward: bool) -> list[int]:
    fully_shard = fsdp_api(impl).fully_shard
    t = Lockstep(EmbedMLP, _embed_batch)
    for module in [t.model.embed, *t.model.blocks, t.model]:
        fully_shard(module)
    t.model.embed.set_unshard_in_backward(unshard_in_backward)
    t.make_optimizers()
    return backward_counts(t, NUM_STEPS, "allgather")


@pytest.mark.parametrize("impl", ["fsdp2", "torch"])
def test_unshard_in_backward_false_skips_the_gather(impl: str, fsdp2_only: None) -> None:
    # Backward regathers the two blocks; the embedding (resharded after forward) stays sharded.
    for gathers in run_on_ranks(2, _unshard_in_backward, impl, False):
        assert gathers == [2] * NUM_STEPS
    if impl == "fsdp2":  # the default regathers it
        for gathers in run_on_ranks(2, _unshard_in_backward, impl, True):
            assert gathers == [3] * NUM_STEPS


def _late_wait(impl: str, budget: int) -> list[str]:
    """An ``unshard(async_op=True)`` issued before the forward (which uses its gather), its
    handle waited for only after the backward: the wait has nothing left to do, and the next
    steps train on the parameters the optimizer updated, as the reference does."""
    from fsdp2.engine.coalesce import coalesce_bytes, set_coalesce_bytes

    saved = coalesce_bytes()
    set_coalesce_bytes(budget)
    try:
        t = Lockstep("mlp")
        shard_model(t.model, "mlp", impl)
        t.make_optimizers()
        block = t.model.blocks[0]
        t.forward_backward(0)  # lazy init first, as torch requires
        t.optim_step()
        kinds = []
        for step in range(1, NUM_STEPS):
            handle = block.unshard(async_op=True)
            t.forward_backward(step)
            t.check_grads(f"step {step}")
            handle.wait()  # late: the forward consumed the gather and resharded
            kinds.append(type(block[0].weight).__name__)
            t.optim_step()
        t.forward_backward(NUM_STEPS)  # the loss is checked against the reference's
        t.check_grads("after the late waits")
        return kinds
    finally:
        set_coalesce_bytes(saved)


@pytest.mark.parametrize("budget", [0, 256 * 1024], ids=["per-group", "coalesced"])
@pytest.mark.parametrize("impl", ["fsdp2", "torch"])
def test_late_unshard_wait_trains_on_current_parameters(impl: str, budget: int) -> None:
    for kinds in run_on_ranks(2, _late_wait, impl, budget):
        assert kinds == ["DTensor"] * (NUM_STEPS - 1)  # still sharded after the late wait
