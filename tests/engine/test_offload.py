"""CPU offload: ``CPUOffloadPolicy()`` keeps sharded parameters, gradients and optimizer state on
the CPU and copies shards to the mesh's device to gather. On a CPU-only machine the copy is a
no-op and ``pin_memory`` must be ignored (pinning needs an accelerator), but everything else must
behave: training keeps parity, and the collectives are those of plain FSDP.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import fsdp2
from fsdp2 import CPUOffloadPolicy, MixedPrecisionPolicy
from tests.harness import run_on_ranks
from tests.models import MODELS
from tests.parity import adamw, cast_forward, kinds, train_side_by_side, twins
from tests.tolerance import FP32, SAME_ARITHMETIC


def _offload(name: str, mesh_kind: str, precision: str, pin_memory: bool) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model, ref = twins(name)
    kwargs: dict[str, Any] = {"offload_policy": CPUOffloadPolicy(pin_memory=pin_memory)}
    if mesh_kind == "hsdp":
        kwargs["mesh"] = init_device_mesh("cpu", (2, world // 2))
    bf16 = precision == "bf16"
    if bf16:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    for unit in MODELS[name].shard_units(model):
        fsdp2.fully_shard(unit, **kwargs)
    fsdp2.fully_shard(model, **kwargs)
    optim = adamw(model.parameters())
    result = train_side_by_side(
        model,
        ref,
        MODELS[name].make_batch,
        dp_rank=rank,
        dp_size=world,
        # bf16: the reference does the same per-slice arithmetic, so it matches exactly.
        tol=SAME_ARITHMETIC if bf16 else FP32,
        ref_forward=cast_forward(torch.bfloat16, world) if bf16 else None,
        optim=optim,
    )
    # One more backward, to see the gradients the optimizer gets.
    model(*MODELS[name].make_batch(torch.Generator().manual_seed(rank), 2)).backward()
    where = {
        "params": {
            (type(p).__name__, p.to_local().device.type, p.dtype) for p in model.parameters()
        },
        "grads": {
            (type(p.grad).__name__, p.grad.to_local().device.type, p.grad.dtype)
            for p in model.parameters()
            if p.grad is not None
        },
        "optim_state": {
            (type(v).__name__, v.to_local().device.type, v.dtype)
            for state in optim.state.values()
            for v in state.values()
            if isinstance(v, DTensor)
        },
        "pinned": any(p.to_local().is_pinned() for p in model.parameters()),
    }
    return {"where": where, "kinds": [kinds(r) for r in result.records]}


@pytest.mark.parametrize(
    ("name", "world_size", "mesh_kind", "precision", "pin_memory"),
    [
        ("mlp", 2, "fsdp", "fp32", True),
        ("gpt", 2, "fsdp", "fp32", False),
        ("mlp", 4, "hsdp", "fp32", True),
        ("gpt", 2, "fsdp", "bf16", True),
    ],
)
def test_cpu_offload_parity(
    name: str, world_size: int, mesh_kind: str, precision: str, pin_memory: bool
) -> None:
    results = run_on_ranks(world_size, _offload, name, mesh_kind, precision, pin_memory)
    for result in results:
        assert result["where"] == {
            "params": {("DTensor", "cpu", torch.float32)},
            "grads": {("DTensor", "cpu", torch.float32)},
            "optim_state": {("DTensor", "cpu", torch.float32)},
            "pinned": False,  # no accelerator: pin_memory is ignored
        }
        assert result["kinds"] == results[0]["kinds"]
    if mesh_kind == "fsdp" and name == "mlp":
        # The collectives of plain FSDP: 4 groups gathered in forward, 3 again in backward.
        expected = Counter({("all_gather", 2): 7, ("reduce_scatter", 2): 4})
        assert results[0]["kinds"] == [expected] * 3
