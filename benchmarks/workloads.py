"""The benchmark workloads: models chosen by name, and the batches they train on.

`mlp-stack` is many tiny blocks: each block's compute is small, so what FSDP spends per module
(hooks, state changes, one all-gather and one reduce-scatter per block) dominates the step time.
`gpt` and `llama` are examples/model.py's transformers at small sizes.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from model import GPT, GPTConfig, Llama, LlamaConfig

MODELS = ("mlp-stack", "gpt", "llama")


@dataclass(kw_only=True)
class ModelSize:
    layers: int
    """Blocks, each its own FSDP group."""
    dim: int
    """Width of the residual stream."""
    heads: int = 4
    """Attention heads (gpt, llama)."""
    seq: int = 64
    """Tokens per sequence (gpt, llama)."""
    vocab: int = 65
    """Vocabulary (gpt, llama); 65 is the examples' character set."""


# Small enough that a default run (W=2, 2 CPU cores) of all contenders takes about a minute.
DEFAULT_SIZES = {
    "mlp-stack": ModelSize(layers=96, dim=64),
    "gpt": ModelSize(layers=4, dim=128),
    "llama": ModelSize(layers=4, dim=128),
}


class MLPBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.gelu(self.fc(self.norm(x)))  # residual: keeps 96 layers trainable


class MLPStack(nn.Module):
    """`blocks` of LayerNorm→Linear→GELU plus a Linear head; forward(x, y) -> (out, mse loss)."""

    def __init__(self, num_blocks: int, dim: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MLPBlock(dim) for _ in range(num_blocks))
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for block in self.blocks:
            x = block(x)
        out = self.head(x)
        return out, F.mse_loss(out, targets)


def build_model(name: str, size: ModelSize) -> nn.Module:
    if name == "mlp-stack":
        return MLPStack(size.layers, size.dim)
    if name == "gpt":
        cfg = GPTConfig(
            vocab_size=size.vocab,
            block_size=size.seq,
            num_layers=size.layers,
            num_heads=size.heads,
            embed_dim=size.dim,
        )
        return GPT(cfg)
    if name == "llama":
        cfg_l = LlamaConfig(
            vocab_size=size.vocab,
            max_seq_len=size.seq,
            num_layers=size.layers,
            num_heads=size.heads,
            num_kv_heads=max(1, size.heads // 2),
            embed_dim=size.dim,
        )
        return Llama(cfg_l)
    raise ValueError(f"model must be one of {MODELS}, got {name!r}")


def blocks_of(model: nn.Module) -> nn.ModuleList:
    """The per-block FSDP units: `blocks` (mlp-stack, GPT) or `layers` (Llama)."""
    blocks = getattr(model, "blocks", None) or getattr(model, "layers", None)
    if not isinstance(blocks, nn.ModuleList):
        raise TypeError(f"{type(model).__name__} has no `blocks` or `layers` ModuleList")
    return blocks


def make_batch(name: str, size: ModelSize, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed global batch (seeded, so identical on every rank): inputs and targets."""
    g = torch.Generator().manual_seed(1234)
    if name == "mlp-stack":
        return torch.randn(batch, size.dim, generator=g), torch.randn(batch, size.dim, generator=g)
    tokens = torch.randint(size.vocab, (batch, size.seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def param_bytes(modules: list[nn.Module]) -> int:
    """Bytes of the distinct parameters under `modules` (a tied weight counts once)."""
    params = {id(p): p for m in modules for p in m.parameters()}
    return sum(p.numel() * p.element_size() for p in params.values())
