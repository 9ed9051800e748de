"""One rank of a torchao training recipe under ``fully_shard``, run by ``torchrun``.

``--recipe qlora``: QLoRA as torchtune builds it, frozen 4-bit base weights (torchao's
``NF4Tensor``, gathered as its packed bytes) with trainable LoRA adapters beside them.
``--recipe float8``: ``convert_to_float8_training`` with ``enable_fsdp_float8_all_gather=True``
(the weights gathered as float8), and ``precompute_float8_dynamic_scale_for_fsdp`` after each
optimizer step (torchtitan's recipe). Both torchao subclasses define the one-argument
``fsdp_pre_all_gather(mesh)``.

``--impl fsdp2`` imports fsdp2's ``fully_shard``, ``--impl torch`` torch's; everything else is
identical: the init (one seed on every rank), the data (each step's global batch from a seeded
generator, each rank its rows), AdamW, gradient clipping.

Printed lines (rank 0 only), parsed by ``test_torchao.py``:

    SHARD <type>                                    the sharded base weight's local tensor type
    LOSS step=<i> value=<float> grad_norm=<float>   mean loss over the global batch, step i
    DONE                                            the script finished (not its exit code: gloo
                                                    may abort a rank after python is done)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

if __package__ in (None, ""):  # run as a script by torchrun: make `fsdp2` and `tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# NF4 packs blocks of 64 values and quantises their scales in blocks of 256: a 256 x 256 weight
# has 4 scaler blocks, which split over 2 ranks (the smallest power of two that does).
DIM, RANK, ROWS_PER_RANK, LR = {"qlora": 256, "float8": 64}, 8, 4, 5e-3


def _nf4() -> tuple[Any, Any]:
    """``to_nf4`` and ``linear_nf4``, from where this torchao release keeps them."""
    try:  # torchao >= 0.14
        from torchao.quantization import to_nf4
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4
    except ImportError:  # torchao <= 0.13 (torchtune 0.6.1's)
        from torchao.dtypes.nf4tensor import linear_nf4, to_nf4
    return to_nf4, linear_nf4


class LoRALinear(nn.Module):
    """A frozen NF4 base weight plus a trainable low-rank update (torchtune's ``LoRALinear``)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        base = torch.randn(dim, dim) / dim**0.5
        self.weight = nn.Parameter(_nf4()[0](base), requires_grad=False)
        self.lora_a = nn.Linear(dim, RANK, bias=False)
        self.lora_b = nn.Linear(RANK, dim, bias=False)
        nn.init.normal_(self.lora_b.weight, std=0.02)  # nonzero: both adapters get gradients

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _nf4()[1](x, self.weight) + self.lora_b(self.lora_a(x))


class Block(nn.Module):
    def __init__(self, dim: int, recipe: str) -> None:
        super().__init__()
        # The norm keeps a plain parameter in every group: torch gathers a group of float8
        # weights alone as a float8 buffer, which gloo rejects.
        self.norm = nn.LayerNorm(dim)
        if recipe == "qlora":
            self.up, self.down = LoRALinear(dim), LoRALinear(dim)
        else:
            self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.silu(self.up(self.norm(x))))


def build_model(recipe: str) -> nn.Module:
    torch.manual_seed(0)
    dim = DIM[recipe]
    model = nn.Sequential(*[Block(dim, recipe) for _ in range(2)], nn.LayerNorm(dim))
    if recipe == "float8":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
        convert_to_float8_training(model, config=config)
    return model


def global_batch(step: int, world: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed random map to learn: inputs and targets of every rank, for one step."""
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(ROWS_PER_RANK * world, dim, generator=gen)
    teacher = torch.randn(dim, dim, generator=torch.Generator().manual_seed(7)) / dim**0.5
    return x, torch.tanh(x @ teacher)


def train_step(model: nn.Module, optimizer: Any, recipe: str, step: int) -> tuple[float, float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = global_batch(step, world, DIM[recipe])
    rows = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
    loss = (model(x[rows]) - y[rows]).pow(2).mean()
    loss.backward()
    trainable = [p for p in model.parameters() if p.requires_grad]
    grad_norm = torch.nn.utils.clip_grad_norm_(trainable, 1.0)
    optimizer.step()
    optimizer.zero_grad()
    if recipe == "float8":
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(model)
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    full_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    return mean.item() / world, float(full_norm)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=("fsdp2", "torch"), required=True)
    parser.add_argument("--recipe", choices=("qlora", "float8"), required=True)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    if args.impl == "fsdp2":
        from fsdp2 import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    model = build_model(args.recipe)
    for block in list(model)[:-1]:
        fully_shard(block)
    fully_shard(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    # eps as in tests/parity/build.py: bounds how far Adam amplifies rounding noise in ~0 gradients.
    optimizer = torch.optim.AdamW(trainable, lr=LR, weight_decay=0.1, eps=1e-5)

    def say(line: str) -> None:
        if dist.get_rank() == 0:
            print(line, flush=True)

    say(f"SHARD {type(model[0].up.weight._local_tensor).__name__}")
    for step in range(args.steps):
        loss, grad_norm = train_step(model, optimizer, args.recipe, step)
        say(f"LOSS step={step} value={loss:.10f} grad_norm={grad_norm:.10f}")
    dist.barrier()
    say("DONE")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
