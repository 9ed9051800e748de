"""Small deterministic models for the tests, each built from a seed.

Every model's ``forward(*batch)`` returns the mean loss over the batch, so the mean of per-rank
losses over equal local batches equals the loss of one model on the concatenated global batch.
`MODELS` maps a name to a `ModelSpec`: how to build the model, make a batch, and which submodules to
``fully_shard`` (bottom-up) before the root.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

Batch = tuple[torch.Tensor, ...]


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    name: str
    build: Callable[[], nn.Module]
    """Builds the model from the current RNG state; `build_model` seeds it."""
    make_batch: Callable[[torch.Generator, int], Batch]
    """(generator, batch size) -> batch; the batch dim is dim 0 of every tensor."""
    shard_units: Callable[[nn.Module], list[nn.Module]]
    """Submodules to `fully_shard` before the root, in call order (bottom-up)."""
    has_scalar_param: bool = False
    """Has a 0-d parameter: torch's fully_shard rejects those, fsdp2 must support them."""
    prepare_step: Callable[[nn.Module, int], None] | None = None
    """Called on every model copy before each training step (e.g. to skip a parameter)."""


def build_model(name: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name].build()


def make_batch(name: str, seed: int, batch_size: int) -> Batch:
    return MODELS[name].make_batch(torch.Generator().manual_seed(seed), batch_size)


def _regression_batch(in_dim: int, out_dim: int) -> Callable[[torch.Generator, int], Batch]:
    def make(gen: torch.Generator, batch_size: int) -> Batch:
        return torch.randn(batch_size, in_dim, generator=gen), torch.randn(
            batch_size, out_dim, generator=gen
        )

    return make


# ---------------------------------------------------------------------------------------------
# MLP stack
# ---------------------------------------------------------------------------------------------

MLP_IN, MLP_DIM, MLP_OUT = 8, 16, 4


class MLPStack(nn.Module):
    """A ModuleList of Linear+ReLU blocks and a linear head; MSE loss."""

    def __init__(self, num_blocks: int = 3) -> None:
        super().__init__()
        dims = [MLP_IN] + [MLP_DIM] * num_blocks
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(d_in, d_out), nn.ReLU())
            for d_in, d_out in itertools.pairwise(dims)
        )
        self.head = nn.Linear(MLP_DIM, MLP_OUT)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return F.mse_loss(self.head(x), y)


def _blocks(model: nn.Module) -> list[nn.Module]:
    return list(model.blocks)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# GPT-like transformer
# ---------------------------------------------------------------------------------------------

GPT_VOCAB, GPT_SEQ, GPT_DIM, GPT_HEADS, GPT_BLOCKS = 64, 16, 32, 4, 2


class CausalSelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # No bias: a key bias gets a gradient that is exactly zero in theory (softmax is
        # shift-invariant), so it is pure rounding noise that Adam amplifies into real updates.
        self.qkv = nn.Linear(GPT_DIM, 3 * GPT_DIM, bias=False)
        self.proj = nn.Linear(GPT_DIM, GPT_DIM)
        # A non-persistent buffer: FSDP must leave buffers whole and unsharded.
        mask = torch.ones(GPT_SEQ, GPT_SEQ, dtype=torch.bool).tril()
        self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        head_dim = d // GPT_HEADS
        q, k, v = (
            z.view(b, t, GPT_HEADS, head_dim).transpose(1, 2) for z in self.qkv(x).split(d, dim=2)
        )
        att = (q @ k.transpose(-2, -1)) / math.sqrt(head_dim)
        att = att.masked_fill(~self.causal_mask[:t, :t], float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        return self.proj(y)


class GPTBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(GPT_DIM)
        self.attn = CausalSelfAttention()
        self.ln2 = nn.LayerNorm(GPT_DIM)
        self.mlp = nn.Sequential(
            nn.Linear(GPT_DIM, 4 * GPT_DIM), nn.GELU(), nn.Linear(4 * GPT_DIM, GPT_DIM)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """nanoGPT in miniature; ``lm_head.weight`` is tied to ``wte.weight``."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(GPT_VOCAB, GPT_DIM)
        self.wpe = nn.Embedding(GPT_SEQ, GPT_DIM)
        self.blocks = nn.ModuleList(GPTBlock() for _ in range(GPT_BLOCKS))
        self.ln_f = nn.LayerNorm(GPT_DIM)
        self.lm_head = nn.Linear(GPT_DIM, GPT_VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, GPT_VOCAB), targets.view(-1))


def _gpt_batch(gen: torch.Generator, batch_size: int) -> Batch:
    tokens = torch.randint(0, GPT_VOCAB, (batch_size, GPT_SEQ + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


# ---------------------------------------------------------------------------------------------
# Odd shapes
# ---------------------------------------------------------------------------------------------

ODD_IO = 3


class OddBlock(nn.Module):
    """Parameters whose dim 0 does not divide evenly over 2 or 4 ranks, or is smaller than 4."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(5, ODD_IO) / 2)  # dim 0 = 5: uneven over 2 and 4
        self.a_bias = nn.Parameter(torch.randn(5))  # 1-d, uneven
        self.b = nn.Parameter(torch.randn(1, 5))  # dim 0 = 1 < world size: mostly empty shards
        self.e = nn.Parameter(torch.randn(ODD_IO, 5) / 2)  # dim 0 = 3 < 4
        self.c = nn.Parameter(torch.randn(ODD_IO))  # 1-d, dim 0 = 3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x @ self.a.T + self.a_bias) * self.b
        return x + h @ self.e.T + self.c


class OddShapes(nn.Module):
    def __init__(self, with_scalar: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(OddBlock() for _ in range(2))
        self.shift = nn.Parameter(torch.randn(7) / 4)  # 1-d, 7 over 4 ranks: chunks 2,2,2,1
        # A 0-d parameter: torch's fully_shard rejects it, fsdp2 must replicate it.
        self.scale = nn.Parameter(torch.tensor(0.5)) if with_scalar else None

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        out = x + self.shift[:ODD_IO]
        if self.scale is not None:
            out = out * self.scale
        return F.mse_loss(out, y)


# ---------------------------------------------------------------------------------------------
# Frozen parameters, unused parameters, buffers, modules without parameters
# ---------------------------------------------------------------------------------------------


def _build_frozen() -> nn.Module:
    """MLPStack with frozen and trainable parameters mixed in one FSDP group (block 0) and a
    block that is entirely frozen (block 1: its group has no gradients to reduce)."""
    model = MLPStack()
    model.blocks[0][0].weight.requires_grad_(False)
    model.blocks[1].requires_grad_(False)
    return model


class SometimesUnused(nn.Module):
    """``gate`` is skipped on odd steps; on those steps the last block does not run at all."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(MLP_IN, MLP_IN), nn.Tanh()) for _ in range(3)
        )
        self.gate = nn.Parameter(torch.rand(MLP_IN) + 0.5)
        self.head = nn.Linear(MLP_IN, MLP_OUT)
        self.use_all = True

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = self.blocks[0](x)
        if self.use_all:
            x = x * self.gate
        x = self.blocks[1](x)
        if self.use_all:
            x = self.blocks[2](x)
        return F.mse_loss(self.head(x), y)


def _alternate_unused(model: nn.Module, step: int) -> None:
    model.use_all = step % 2 == 0  # type: ignore[assignment]


class ScaledLinear(nn.Module):
    """Linear layer scaled by buffers, which FSDP must keep whole on every rank."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, dim))
        self.register_buffer("temperature", torch.tensor(2.0))  # a 0-d buffer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x) * self.scale / self.temperature)


class WithBuffers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ScaledLinear(MLP_IN) for _ in range(2))
        self.register_buffer("out_scale", torch.arange(1.0, MLP_IN + 1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return F.mse_loss((x * self.out_scale)[:, :MLP_OUT], y)


class Activation(nn.Module):
    """No parameters at all; still gets its own `fully_shard` call."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x)


class NoOwnParams(nn.Module):
    """The root and ``body`` own no parameters; ``body[1]`` has none anywhere."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(MLP_IN, MLP_DIM), Activation(), nn.Linear(MLP_DIM, MLP_OUT)
        )

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.body(x), y)


def _no_own_params_units(model: nn.Module) -> list[nn.Module]:
    body = model.body
    return [body[0], body[1], body[2], body]  # type: ignore[index]


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in [
        ModelSpec(
            name="mlp",
            build=MLPStack,
            make_batch=_regression_batch(MLP_IN, MLP_OUT),
            shard_units=_blocks,
        ),
        ModelSpec(name="gpt", build=GPT, make_batch=_gpt_batch, shard_units=_blocks),
        ModelSpec(
            name="odd_shapes",
            build=lambda: OddShapes(with_scalar=False),
            make_batch=_regression_batch(ODD_IO, ODD_IO),
            shard_units=_blocks,
        ),
        ModelSpec(
            name="odd_shapes_scalar",
            build=lambda: OddShapes(with_scalar=True),
            make_batch=_regression_batch(ODD_IO, ODD_IO),
            shard_units=_blocks,
            has_scalar_param=True,
        ),
        ModelSpec(
            name="frozen",
            build=_build_frozen,
            make_batch=_regression_batch(MLP_IN, MLP_OUT),
            shard_units=_blocks,
        ),
        ModelSpec(
            name="unused",
            build=SometimesUnused,
            make_batch=_regression_batch(MLP_IN, MLP_OUT),
            shard_units=_blocks,
            prepare_step=_alternate_unused,
        ),
        ModelSpec(
            name="buffers",
            build=WithBuffers,
            make_batch=_regression_batch(MLP_IN, MLP_OUT),
            shard_units=_blocks,
        ),
        ModelSpec(
            name="no_own_params",
            build=NoOwnParams,
            make_batch=_regression_batch(MLP_IN, MLP_OUT),
            shard_units=_no_own_params_units,
        ),
    ]
}
