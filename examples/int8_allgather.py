"""Gather weights as int8: fsdp2's all-gather extension protocol, worked through.

Each sharded weight stays fp32 (the optimizer updates it exactly), but before the all-gather it is
quantised row by row to int8 plus one fp32 scale per row, so the gather moves about a quarter of
the bytes; after the gather every rank dequantises the full weight for compute. Gradients are not
affected: they are reduce-scattered in full precision.

    torchrun --standalone --nproc-per-node 2 examples/int8_allgather.py
"""

from __future__ import annotations

import gc
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp2 import fully_shard, record_collectives


class Int8GatherWeight(torch.Tensor):
    """A weight whose fsdp2 all-gather sends int8 rows plus one fp32 scale per row."""

    def fsdp_pre_all_gather(
        self,
        mesh: Any,
        outer_size: torch.Size,
        outer_stride: tuple[int, ...],
        module: nn.Module,
        mp_policy: Any,
    ) -> tuple[tuple[torch.Tensor, ...], None]:
        rows = self.as_subclass(torch.Tensor).detach()
        scale = rows.abs().amax(dim=1).clamp(min=1e-12) / 127.0  # one per row: outliers stay local
        quantised = torch.round(rows / scale[:, None]).to(torch.int8)
        return (quantised, scale), None

    def fsdp_post_all_gather(
        self,
        outputs: tuple[torch.Tensor, ...],
        metadata: None,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        quantised, scale = outputs
        full = quantised.to(param_dtype) * scale[:, None].to(param_dtype)
        if out is not None:  # later gathers refill the same unsharded tensor in place
            with torch.no_grad():
                # Rows that do not split evenly over the ranks arrive padded; ``out`` is the
                # parameter cut back to its real rows.
                out.copy_(full[: out.shape[0]])
            return None
        return full, (full,)


def int8_gathered(model: nn.Module) -> nn.Module:
    """Mark every Linear weight of ``model`` (before fully_shard) to be gathered as int8."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            weight = module.weight
            module.weight = nn.Parameter(weight.detach().as_subclass(Int8GatherWeight))
    return model


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = int8_gathered(
        nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(4)])
    )
    for block in model:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    target = nn.Linear(64, 64)  # a fixed random teacher to regress onto
    for step in range(int(os.environ.get("STEPS", "60"))):
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(step * world + rank))
        with torch.no_grad():
            y = target(x)
        with record_collectives() as records:
            loss = (model(x) - y).pow(2).mean()
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0 and step % 10 == 0:
            gathered = sum(r.input_nbytes for r in records if r.kind == "all_gather")
            print(f"step {step:3d}  loss {loss.item():.4f}  all-gather bytes sent {gathered}")
    gc.collect()  # FSDP's reference cycles go while gloo is alive (exit aborts otherwise)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
