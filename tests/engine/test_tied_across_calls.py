"""A weight tied across ``fully_shard`` calls ([Note: weights tied across calls]).

The examples' GPT ties ``lm_head.weight`` to ``wte.weight``; sharding each module in its own call
(as per-module sharding of a Hugging Face model does) must train as the unsharded model: the
weight is managed by the group of the two modules' common ancestor (here the root's), its
gradient the sum of both uses. A weight shared by three blocks likewise. State dicts keep the
unsharded model's keys and a DCP checkpoint round-trips; the planner counts the weight once."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn

import fsdp2
from tests.errors import raised
from tests.harness import run_on_ranks
from tests.parity import adamw, local_batch, params_close_after_adamw, step_both, twins
from tests.parity.build import global_batch
from tests.tolerance import FP32_ATOL, FP32_RTOL

STEPS = 3


def shard_per_module(model: nn.Module) -> None:
    """wte, each block, lm_head: each its own call; then the root."""
    fsdp2.fully_shard(model.wte)
    for block in model.blocks:  # type: ignore[union-attr]
        fsdp2.fully_shard(block)
    fsdp2.fully_shard(model.lm_head)
    fsdp2.fully_shard(model)


class Shared(nn.Module):
    """Three blocks whose first layer shares one weight; a head."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16)) for _ in range(3)
        )
        for block in self.blocks[1:]:
            block[0].weight = self.blocks[0][0].weight
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x).pow(2).mean()


def _check_training(model: nn.Module, ref: nn.Module, batches: Any) -> list[float]:
    """AdamW steps on both; losses and gradients at the fp32 tolerance, parameters at
    PARAM_ATOL (tests/tolerance.py). ``batches(step)``: (this rank's, the whole)."""
    world = dist.get_world_size()
    opt, ref_opt = adamw(model.parameters()), adamw(ref.parameters())
    losses = []
    for step in range(STEPS):
        local, whole = batches(step)
        loss = model(*local)
        loss.backward()
        ref_loss = ref(*whole)
        ref_loss.backward()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        torch.testing.assert_close(mean / world, ref_loss.detach(), rtol=FP32_RTOL, atol=FP32_ATOL)
        step_both(model, ref, opt, ref_opt)
        losses.append(loss.item())
    params_close_after_adamw(model, ref)
    return losses


def _gpt(path: str) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model, ref = twins("gpt")
    shard_per_module(model)
    tied = model.lm_head.weight is model.wte.weight
    keys = list(model.state_dict()) == list(ref.state_dict())
    root_names = [p.fqn for g in model._groups(recurse=False) for p in g.fsdp_params]
    groups = {"count": len(model._groups(recurse=True)), "root": sorted(root_names)}

    def batches(step: int) -> tuple[Any, Any]:
        local = local_batch("gpt", step, 0, rank, world)
        return local, global_batch("gpt", step, 0, world * local[0].shape[0])

    _check_training(model, ref, batches)
    # A DCP round trip: saved, loaded into a fresh model sharded the same way, bitwise.
    dcp.save({"model": model.state_dict()}, checkpoint_id=path)
    fresh, _ = twins("gpt")
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    shard_per_module(fresh)
    state = {"model": fresh.state_dict()}
    dcp.load(state, checkpoint_id=path)
    fresh.load_state_dict(state["model"])
    same = all(
        torch.equal(a.full_tensor(), b.full_tensor())
        for a, b in zip(fresh.parameters(), model.parameters(), strict=True)
    )
    return {"tied": tied, "keys": keys, "groups": groups, "dcp": same}


def test_tied_embedding_and_head_in_separate_calls(tmp_path: Any) -> None:
    path = str(tmp_path / "ckpt")
    for result in run_on_ranks(2, _gpt, path):
        assert result["tied"]  # one parameter again, in both places
        assert result["keys"]  # the unsharded model's state dict keys, both of the tie's
        # wte's call held only the tied weight: its group is gone, and lm_head's call held
        # nothing of its own: the root's group and one per block. The root's holds the tie.
        assert result["groups"] == {
            "count": 3,
            "root": ["ln_f.bias", "ln_f.weight", "wpe.weight", "wte.weight"],
        }
        assert result["dcp"]


def _shared() -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Shared()
    ref = copy.deepcopy(model)
    for block in model.blocks:
        fsdp2.fully_shard(block)
    fsdp2.fully_shard(model)
    assert model.blocks[2][0].weight is model.blocks[0][0].weight

    def batches(step: int) -> tuple[Any, Any]:
        whole = torch.randn(4 * world, 16, generator=torch.Generator().manual_seed(step))
        return (whole.chunk(world)[rank],), (whole,)

    return _check_training(model, ref, batches)


def test_weight_shared_by_three_blocks() -> None:
    run_on_ranks(2, _shared)


def _shared_tp(dp: int) -> list[float]:
    """``Shared`` under tensor parallelism (each block's first layer column-wise, its second
    row-wise, over ``tp``), the tie restored after ``parallelize_module``, each block in its own
    ``fully_shard`` call over ``dp``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = Shared()
    ref = copy.deepcopy(model)
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    for block in model.blocks[1:]:
        block[0].weight = model.blocks[0][0].weight
    for block in model.blocks:
        fsdp2.fully_shard(block, mesh=mesh["dp"])
    fsdp2.fully_shard(model, mesh=mesh["dp"])
    assert model.blocks[2][0].weight is model.blocks[0][0].weight
    rank = mesh["dp"].get_local_rank()

    def batches(step: int) -> tuple[Any, Any]:
        whole = torch.randn(4 * dp, 16, generator=torch.Generator().manual_seed(step))
        return (whole.chunk(dp)[rank],), (whole,)

    return _check_training(model, ref, batches)


@pytest.mark.parametrize("dp", [1, 2])
def test_weight_shared_by_three_tensor_parallel_blocks(dp: int) -> None:
    # The group that takes the tie over gets tensor parallelism's piece of it, as it would get
    # from the original parameter (it once got the whole tensor: wrong values from the first
    # forward, 0.760 against 0.615, no error).
    run_on_ranks(2 * dp, _shared_tp, dp)


def _unresolved() -> str:
    model, _ = twins("gpt")
    fsdp2.fully_shard(model.wte)
    fsdp2.fully_shard(model.lm_head)  # no call on their common ancestor follows
    batch = local_batch("gpt", 0, 0, dist.get_rank(), dist.get_world_size())
    return raised(lambda: model(*batch))


def test_a_tie_without_a_common_ancestor_call_raises() -> None:
    for message in run_on_ranks(2, _unresolved):
        # Named from the module whose forward ran first (lm_head's call is the root there).
        assert "FSDPLinear.weight (tied to FSDPEmbedding.weight)" in message, message
        assert "fully_shard([embedding, lm_head])" in message, message


def test_planner_counts_the_tie_once() -> None:
    from tests.models import MODELS

    plan = fsdp2.plan(MODELS["gpt"].build, shard_per_module, world_size=2, device="cpu")
    natural = fsdp2.plan(
        MODELS["gpt"].build,
        lambda m: ([fsdp2.fully_shard(b) for b in m.blocks], fsdp2.fully_shard(m)),
        world_size=2,
        device="cpu",
    )
    assert plan.num_params == natural.num_params
    assert plan.param_bytes == natural.param_bytes
    assert plan.grad_bytes == natural.grad_bytes


class _EncoderWithEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.emb(x))


class _TiedHeadNet(nn.Module):
    """An HF-style model sharded module by module: the head may share the embedding."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.enc = _EncoderWithEmbedding()
        self.head = nn.Linear(16, 32, bias=False)
        if tied:
            self.head.weight = self.enc.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.enc(x)))


def _reduce_order(tied: bool) -> list[str]:
    """The groups' reduce-scatters of a second step in issue order, coalescing off (each group
    issues its own)."""
    from fsdp2.engine.coalesce import coalesce_bytes, set_coalesce_bytes

    saved = coalesce_bytes()
    set_coalesce_bytes(0)
    try:
        torch.manual_seed(0)
        model = _TiedHeadNet(tied)
        fsdp2.fully_shard(model.enc)
        fsdp2.fully_shard(model.head)
        fsdp2.fully_shard(model)
        x = torch.randint(0, 32, (8,))
        model(x).sum().backward()  # lazy init: the tie goes to the root's group
        with fsdp2.record_collectives() as records:
            model(x).sum().backward()
    finally:
        set_coalesce_bytes(saved)
    return [r.label or "<root>" for r in records if r.kind == "reduce_scatter"]


def test_each_group_reduces_in_its_own_post_backward_beside_a_tie() -> None:
    """A group that lost a tied weight to its ancestor's call reduces when its own backward is
    done, not at the end of backward after every other group: the root's group (holding the
    tie, whose last gradient comes from the embedding) reduces last, at the end of backward."""
    assert run_on_ranks(2, _reduce_order, False)[0] == ["head", "enc"]
    assert run_on_ranks(2, _reduce_order, True)[0] == ["enc", "<root>"]
