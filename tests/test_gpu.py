"""fsdp2 on CUDA: the core training path over NCCL against a single-process reference, and peak
GPU memory against the budget of one unsharded group at a time (docs/accelerators.md).

Marked ``gpu``; skipped without CUDA and NCCL. Each test spawns its own rank processes (the
gloo pool in tests/harness.py is CPU-only): world size 1, and 2 where there are two GPUs.
TF32 is off, so the GPU computes in true fp32 and the suite's fp32 tolerances apply.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from tests.parity import (
    LOCAL_BATCH,
    Margin,
    adamw,
    close,
    compare_buffers,
    compare_grads,
    compare_params,
    global_batch,
    mean_over_ranks,
    rank_rows,
    shard_model,
    twins,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or not dist.is_nccl_available(),
        reason="needs CUDA and NCCL",
    ),
]

NUM_STEPS = 4
_TIMEOUT_S = 180


def _device() -> torch.device:
    # CPU only for a dry run of this file's plumbing (_spawn called by hand on a CPU machine).
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _rank_main(rank: int, fn: Callable[..., Any], world: int, tmp: str, args: tuple) -> None:
    if torch.cuda.is_available():
        torch.cuda.set_device(rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if fn is not _memory_budget:  # its own (fake) group
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(
            backend, init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world
        )
    result = fn(*args)
    with open(f"{tmp}/rank{rank}.json", "w") as f:
        json.dump(result, f)
    if dist.is_initialized():
        dist.destroy_process_group()


def _spawn(world: int, fn: Callable[..., Any], *args: Any) -> list[Any]:
    """Run ``fn(*args)`` on ``world`` fresh processes, one GPU each; their results, rank order."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="fsdp2-gpu-") as tmp:
        ctx = mp.start_processes(
            _rank_main, (fn, world, tmp, args), nprocs=world, start_method="spawn", join=False
        )
        deadline = time.monotonic() + _TIMEOUT_S
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                for proc in ctx.processes:
                    proc.kill()
                raise TimeoutError(f"{fn.__name__} on {world} GPU ranks: over {_TIMEOUT_S} s")
        results = []
        for rank in range(world):
            with open(os.path.join(tmp, f"rank{rank}.json")) as f:
                results.append(json.load(f))
        return results


def _worlds() -> list[int]:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [w for w in (1, 2) if w <= count] or [1]


def _to(batch: tuple[torch.Tensor, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    return tuple(t.to(device) for t in batch)


def _parity(model_name: str) -> dict[str, Any]:
    """Train fsdp2 (per block, then the root) on NCCL and the plain model on the global batch,
    on the same GPU; compare losses, gradients (full_tensor) and final parameters."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = _device()
    model, ref = (m.to(device) for m in twins(model_name))
    init = [p.detach().clone() for p in ref.parameters()]
    shard_model(model, model_name)
    for p in model.parameters():
        assert p.device == device, f"{p.device} != {device}"
    margin = Margin()
    optim, ref_optim = adamw(model.parameters()), adamw(ref.parameters())
    losses = []
    for step in range(NUM_STEPS):
        model.zero_grad()
        ref.zero_grad()
        ref_batch = _to(global_batch(model_name, step, 0, world * LOCAL_BATCH), device)
        loss = model(*rank_rows(ref_batch, rank, world))
        loss.backward()
        loss = mean_over_ranks(loss)
        ref_loss = ref(*ref_batch)
        ref_loss.backward()
        close(f"step {step} loss", loss, ref_loss.detach(), margin=margin)
        compare_grads(model, ref, f"step {step}", check_layout=True, margin=margin)
        optim.step()
        ref_optim.step()
        losses.append(loss.item())
    compare_params(model, ref, "after training", check_layout=True)
    compare_buffers(model, ref, "after training")
    moved = [not torch.equal(p0, p.detach()) for p0, p in zip(init, ref.parameters(), strict=True)]
    assert all(moved), "training left some parameter unchanged"
    return {"losses": losses, "max_diff": margin.max_diff}


@pytest.mark.parametrize("world", _worlds())
@pytest.mark.parametrize("model_name", ["mlp", "gpt"])
def test_nccl_parity_with_single_process(world: int, model_name: str) -> None:
    for result in _spawn(world, _parity, model_name):
        assert len(result["losses"]) == NUM_STEPS


# ---------------------------------------------------------------------------------------------
# Memory: rank 0 of 8 on a fake process group, so that sharding is real on one GPU
# ---------------------------------------------------------------------------------------------

FAKE_WORLD = 8
BLOCKS, DIM = 16, 512


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(BLOCKS))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(x).square().mean()


def _peak_of_step(impl: str) -> dict[str, int]:
    from tests.harness import fsdp_api

    fully_shard = fsdp_api(impl).fully_shard
    device = _device()
    torch.manual_seed(0)
    model = _Stack().to(device)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    x = torch.randn(2, DIM, device=device)  # activations: a few KiB, negligible here

    def step() -> None:
        model(x).backward()
        optim.step()
        optim.zero_grad(set_to_none=True)

    for _ in range(2):  # optimizer state exists, caches are warm
        step()
    if device.type == "cpu":  # dry run
        step()
        return {"base": 0, "peak": 0}
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    result = {"base": base, "peak": torch.cuda.max_memory_allocated() - base}
    return result


def _memory_budget() -> dict[str, Any]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=FAKE_WORLD)
    return {impl: _peak_of_step(impl) for impl in ("fsdp2", "torch")}


def test_peak_memory_within_unsharded_group_budget() -> None:
    """Above the sharded state (parameters and AdamW moments), a step may hold: the sharded
    gradients and AdamW's foreach temporaries (two of the same size), and of unsharded blocks
    at most four at once (in backward: the block computing, the previous one's gather in flight,
    the block's gradients and the reduce-scatter input they are copied into, while the last
    reduce-scatter's input is still in flight). Keeping every block gathered (16) breaks it."""
    result = _spawn(1, _memory_budget)[0]
    block = (DIM * DIM + DIM) * 4
    params = BLOCKS * block + (DIM + 1) * 4
    sharded = params // FAKE_WORLD
    budget = 4 * block + 3 * sharded + 2**20  # + 1 MiB: activations, small buffers, rounding
    print(
        f"peak above state, MiB: fsdp2 {result['fsdp2']['peak'] / 2**20:.2f}, torch "
        f"{result['torch']['peak'] / 2**20:.2f}, budget {budget / 2**20:.2f}"
    )
    assert result["fsdp2"]["peak"] <= budget, (result, budget)
    assert BLOCKS * block > budget  # the budget would catch a model kept unsharded
