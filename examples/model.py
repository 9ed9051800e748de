"""Two small decoder-only transformers for the examples and benchmarks.

- `GPT`: nanoGPT's shape. Learned positions, LayerNorm, GELU MLP, lm_head tied to the embedding.
- `Llama`: Llama's shape. Rotary positions, RMSNorm, SwiGLU MLP, grouped-query attention,
  untied output head.

Both keep their transformer blocks in one nn.ModuleList (`GPT.blocks`, `Llama.layers`) so a
training script can `fully_shard` each block and then the root, and both return
`(logits, loss)` from `forward(idx, targets=None)`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# ---------------------------------------------------------------------------------------------
# GPT


@dataclass(kw_only=True)
class GPTConfig:
    vocab_size: int = 65
    """Number of distinct tokens (65 for the character-level fables corpus)."""
    block_size: int = 64
    """Longest sequence the model sees; sizes the learned position embedding."""
    num_layers: int = 4
    """Number of transformer blocks."""
    num_heads: int = 4
    """Attention heads per block; must divide `embed_dim`."""
    embed_dim: int = 128
    """Width of the residual stream."""
    dropout: float = 0.0
    """Dropout after attention, MLP and embeddings; 0 keeps runs deterministic."""
    bias: bool = True
    """Bias in Linear and LayerNorm layers, as GPT-2 has."""

    def __post_init__(self) -> None:
        if self.embed_dim % self.num_heads != 0:
            raise ValueError(
                f"GPTConfig: embed_dim ({self.embed_dim}) must be divisible by num_heads "
                f"({self.num_heads}); pick num_heads from the divisors of embed_dim"
            )


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.dropout = config.dropout
        # One matmul for q, k and v: fewer, larger kernels.
        self.qkv = nn.Linear(config.embed_dim, 3 * config.embed_dim, bias=config.bias)
        self.proj = nn.Linear(config.embed_dim, config.embed_dim, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, T, C) -> (B, num_heads, T, head_dim): SDPA attends over the last two dims.
        q, k, v = (
            t.view(B, T, self.num_heads, C // self.num_heads).transpose(1, 2) for t in (q, k, v)
        )
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.embed_dim, 4 * config.embed_dim, bias=config.bias)
        self.proj = nn.Linear(4 * config.embed_dim, config.embed_dim, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.embed_dim, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.embed_dim, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.embed_dim)
        self.pos_emb = nn.Embedding(config.block_size, config.embed_dim)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.ln_f = nn.LayerNorm(config.embed_dim, bias=config.bias)
        self.lm_head = nn.Linear(config.embed_dim, config.vocab_size, bias=False)
        # Weight tying: one Parameter in two places. Under FSDP both uses must live in the same
        # group (here the root's), or the two groups would shard and all-gather it separately.
        self.lm_head.weight = self.tok_emb.weight
        self.init_weights()

    def init_weights(self) -> None:
        """GPT-2 init. Build GPT on a real device, not on meta: `to_empty()` replaces each
        reference to a tensor separately, which unties lm_head from tok_emb."""
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, nn.LayerNorm):
                module.reset_parameters()
        # Residual projections shrink with depth so the residual stream's variance stays ~1.
        for block in self.blocks:
            for proj in (block.attn.proj, block.mlp.proj):
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * self.config.num_layers))

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx, targets: (batch, seq) token ids. Returns logits (batch, seq, vocab) and the mean
        cross-entropy over all positions, or None without targets."""
        T = idx.size(1)
        if T > self.config.block_size:
            raise ValueError(
                f"GPT.forward: sequence length {T} exceeds block_size {self.config.block_size}; "
                "crop the input or build the model with a larger GPTConfig.block_size"
            )
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, cross_entropy(logits, targets)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor | None:
    if targets is None:
        return None
    # float32 loss even when the forward ran in bf16: the log-softmax over the vocab needs it.
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


# ---------------------------------------------------------------------------------------------
# Llama


@dataclass(kw_only=True)
class LlamaConfig:
    vocab_size: int = 65
    """Number of distinct tokens."""
    max_seq_len: int = 256
    """Longest sequence the model sees; sizes the precomputed rotary table."""
    num_layers: int = 4
    """Number of transformer blocks."""
    num_heads: int = 8
    """Query heads per block; must divide `embed_dim`."""
    num_kv_heads: int = 2
    """Key/value heads per block (grouped-query attention); must divide `num_heads`."""
    embed_dim: int = 256
    """Width of the residual stream."""
    ffn_multiple_of: int = 64
    """The SwiGLU hidden width (about 8/3 of `embed_dim`) is rounded up to a multiple of this."""
    rope_theta: float = 10000.0
    """Base of the rotary frequencies."""
    norm_eps: float = 1e-5
    """Epsilon of RMSNorm."""

    def __post_init__(self) -> None:
        if self.embed_dim % self.num_heads != 0 or (self.embed_dim // self.num_heads) % 2 != 0:
            raise ValueError(
                f"LlamaConfig: embed_dim ({self.embed_dim}) / num_heads ({self.num_heads}) must "
                "be an even integer (rotary embeddings rotate pairs of channels)"
            )
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"LlamaConfig: num_heads ({self.num_heads}) must be divisible by num_kv_heads "
                f"({self.num_kv_heads}); each key/value head serves a whole group of query heads"
            )

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def ffn_dim(self) -> int:
        hidden = int(8 * self.embed_dim / 3)  # 8/3: SwiGLU's three matrices cost what GELU's two do
        return self.ffn_multiple_of * math.ceil(hidden / self.ffn_multiple_of)


def rotary_table(config: LlamaConfig, device: torch.device | None = None) -> torch.Tensor:
    """(max_seq_len, head_dim) float32: cos in the first half of the last dim, sin in the second."""
    half = config.head_dim // 2
    freqs = config.rope_theta ** (-torch.arange(half, device=device, dtype=torch.float32) / half)
    angles = torch.outer(
        torch.arange(config.max_seq_len, device=device, dtype=torch.float32), freqs
    )
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def apply_rotary(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate each (x[i], x[i + head_dim/2]) pair of x (batch, heads, seq, head_dim) by its
    position's angle; table is rotary_table()[:seq]."""
    cos, sin = table.to(x.dtype).chunk(2, dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.wq = nn.Linear(config.embed_dim, config.num_heads * config.head_dim, bias=False)
        self.wk = nn.Linear(config.embed_dim, config.num_kv_heads * config.head_dim, bias=False)
        self.wv = nn.Linear(config.embed_dim, config.num_kv_heads * config.head_dim, bias=False)
        self.wo = nn.Linear(config.num_heads * config.head_dim, config.embed_dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, rope), apply_rotary(k, rope)
        # Each k/v head serves num_heads // num_kv_heads query heads. repeat_interleave rather than
        # SDPA's enable_gqa: the same code then runs on every backend and torch version we support.
        groups = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.embed_dim, config.ffn_dim, bias=False)
        self.w3 = nn.Linear(config.embed_dim, config.ffn_dim, bias=False)
        self.w2 = nn.Linear(config.ffn_dim, config.embed_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(config.embed_dim, eps=config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = nn.RMSNorm(config.embed_dim, eps=config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.embed_dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.num_layers))
        self.norm = nn.RMSNorm(config.embed_dim, eps=config.norm_eps)
        self.output = nn.Linear(config.embed_dim, config.vocab_size, bias=False)
        # A buffer, not a Parameter: FSDP shards parameters only, so every rank keeps the whole
        # table. Not persistent: it is recomputed, never loaded from a checkpoint.
        self.register_buffer("rope", rotary_table(config), persistent=False)
        self.init_weights()

    def init_weights(self) -> None:
        """Also call after `to_empty()` when the model was built on the meta device: that leaves
        the rotary buffer uninitialized too."""
        self.rope = rotary_table(self.config, device=self.rope.device)
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, nn.RMSNorm):
                module.reset_parameters()
        for layer in self.layers:
            for proj in (layer.attention.wo, layer.feed_forward.w2):
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * self.config.num_layers))

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx, targets: (batch, seq) token ids. Returns logits (batch, seq, vocab) and the mean
        cross-entropy over all positions, or None without targets."""
        T = idx.size(1)
        if T > self.config.max_seq_len:
            raise ValueError(
                f"Llama.forward: sequence length {T} exceeds max_seq_len "
                f"{self.config.max_seq_len}; crop the input or raise LlamaConfig.max_seq_len"
            )
        x = self.tok_embeddings(idx)
        rope = self.rope[:T]
        for layer in self.layers:
            x = layer(x, rope)
        logits = self.output(self.norm(x))
        return logits, cross_entropy(logits, targets)
