"""Models for tests/tools/test_auto_shard.py, each with the sharding a careful person writes by
hand.

Every ``Case`` holds a builder (the model's ``forward(*batch)`` returns the mean loss), the
hand-written ``fully_shard`` calls for it, and the exact (fqn, kwargs) list ``auto_shard`` must
produce. The hand-written functions are spelled out call by call, as a training script would,
rather than derived from the expected list.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from examples.model import GPT, GPTConfig, LlamaConfig, TransformerBlock, rotary_table
from tests.models import Batch

VOCAB, SEQ, DIM = 32, 8, 16
FullyShard = Callable[..., Any]


@dataclass(frozen=True, kw_only=True)
class Case:
    build: Callable[[], nn.Module]
    hand: Callable[[nn.Module, FullyShard], None]
    """The hand-written sharding, given the implementation's fully_shard."""
    expected: list[tuple[str, dict[str, Any]]]
    """What auto_shard must call: (fqn, kwargs), bottom-up, root last."""
    skipped: tuple[str, ...] = ()
    """Blocks auto_shard must leave to their ancestor (tied to something outside them)."""


def token_batch(gen: torch.Generator, batch_size: int) -> Batch:
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def block_calls(prefix: str, n: int, last_of_all: bool = True) -> list[tuple[str, dict[str, Any]]]:
    """n blocks resharded after forward, except the last one when it is the last of all."""
    return [
        (f"{prefix}.{i}", {"reshard_after_forward": not (last_of_all and i == n - 1)})
        for i in range(n)
    ]


# ---------------------------------------------------------------------------------------------
# The examples' GPT: tok_emb.weight is lm_head.weight, both at the root
# ---------------------------------------------------------------------------------------------


class GPTLoss(GPT):
    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(idx, targets)[1]


def build_gpt(num_layers: int = 3) -> GPTLoss:
    return GPTLoss(
        GPTConfig(
            vocab_size=VOCAB, block_size=SEQ, num_layers=num_layers, num_heads=2, embed_dim=DIM
        )
    )


def hand_gpt(model: nn.Module, fully_shard: FullyShard) -> None:
    blocks = list(model.blocks)  # type: ignore[arg-type]
    for block in blocks[:-1]:
        fully_shard(block, reshard_after_forward=True)
    fully_shard(blocks[-1], reshard_after_forward=False)  # backward needs it first
    fully_shard(model)


# ---------------------------------------------------------------------------------------------
# GPT with cross-layer weight sharing: blocks 1 and 2 share one weight
# ---------------------------------------------------------------------------------------------


def build_shared_layers() -> GPTLoss:
    model = build_gpt(num_layers=4)
    model.blocks[2].mlp.fc.weight = model.blocks[1].mlp.fc.weight  # type: ignore[index,union-attr]
    return model


def hand_shared_layers(model: nn.Module, fully_shard: FullyShard) -> None:
    # Blocks 1 and 2 share a weight: only their common ancestor (the root) may hold it.
    fully_shard(model.blocks[0], reshard_after_forward=True)  # type: ignore[index]
    fully_shard(model.blocks[3], reshard_after_forward=False)  # type: ignore[index]
    fully_shard(model)


# ---------------------------------------------------------------------------------------------
# Llama-shaped, as Hugging Face nests it: LlamaForCausalLM.model.layers
# ---------------------------------------------------------------------------------------------

LLAMA = LlamaConfig(
    vocab_size=VOCAB, max_seq_len=SEQ, num_layers=3, num_heads=4, num_kv_heads=2, embed_dim=32,
    ffn_multiple_of=16,
)  # fmt: skip


class LlamaLikeModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, LLAMA.embed_dim)
        self.layers = nn.ModuleList(TransformerBlock(LLAMA) for _ in range(LLAMA.num_layers))
        self.norm = nn.RMSNorm(LLAMA.embed_dim)
        self.register_buffer("rope", rotary_table(LLAMA), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(idx)
        for layer in self.layers:
            x = layer(x, self.rope[: idx.shape[1]])
        return self.norm(x)


class LlamaLikeForCausalLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = LlamaLikeModel()
        self.lm_head = nn.Linear(LLAMA.embed_dim, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.lm_head(self.model(idx)).flatten(0, 1), targets.flatten())


def hand_llama(model: nn.Module, fully_shard: FullyShard) -> None:
    layers = list(model.model.layers)  # type: ignore[union-attr,arg-type]
    for layer in layers[:-1]:
        fully_shard(layer, reshard_after_forward=True)
    fully_shard(layers[-1], reshard_after_forward=False)
    fully_shard(model)


def build_hf_llama(tied: bool = False) -> nn.Module:
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM

    class HFLlamaLoss(LlamaForCausalLM):
        def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            return super().forward(input_ids=idx, labels=targets).loss

    config = HFLlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        tie_word_embeddings=tied,
    )  # fmt: skip
    return HFLlamaLoss(config)


# ---------------------------------------------------------------------------------------------
# Encoder-decoder: two block lists, a shared embedding module, experts inside each decoder
# layer (a run inside a block) and two tiny auxiliary heads (a run too small to shard apart)
# ---------------------------------------------------------------------------------------------


class EncoderLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.ff = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ff(self.norm(x))


class DecoderLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.cross = nn.Linear(2 * DIM, DIM)
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(2))

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        h = self.cross(torch.cat([self.norm(x), memory.expand_as(x)], dim=-1))
        return x + sum(F.gelu(expert(h)) for expert in self.experts)  # type: ignore[return-value]


class Stack(nn.Module):
    def __init__(self, embed: nn.Embedding, layers: list[nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = embed  # the same module in both stacks and at the root
        self.layers = nn.ModuleList(layers)


class EncoderDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Embedding(VOCAB, DIM)
        self.encoder = Stack(self.shared, [EncoderLayer() for _ in range(2)])
        self.decoder = Stack(self.shared, [DecoderLayer() for _ in range(3)])
        self.aux_heads = nn.ModuleList(nn.Linear(DIM, 1) for _ in range(2))
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.lm_head.weight = self.shared.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.encoder.embed_tokens(idx)
        for layer in self.encoder.layers:
            x = layer(x)
        memory = x.mean(dim=1, keepdim=True)
        y = self.decoder.embed_tokens(idx.flip(1))
        for layer in self.decoder.layers:
            y = layer(y, memory)
        loss = F.cross_entropy(self.lm_head(y).flatten(0, 1), targets.flatten())
        aux = sum(head(memory).square().mean() for head in self.aux_heads)
        return loss + 0.1 * aux


def hand_encoder_decoder(model: nn.Module, fully_shard: FullyShard) -> None:
    for layer in model.encoder.layers:  # type: ignore[union-attr]
        fully_shard(layer, reshard_after_forward=True)
    dec = list(model.decoder.layers)  # type: ignore[union-attr,arg-type]
    for layer in dec[:-1]:
        fully_shard(layer, reshard_after_forward=True)
    fully_shard(dec[-1], reshard_after_forward=False)
    fully_shard(model)  # embedding (tied to lm_head), the aux heads


CASES: dict[str, Case] = {
    "gpt": Case(build=build_gpt, hand=hand_gpt, expected=[*block_calls("blocks", 3), ("", {})]),
    "shared_layers": Case(
        build=build_shared_layers,
        hand=hand_shared_layers,
        expected=[
            ("blocks.0", {"reshard_after_forward": True}),
            ("blocks.3", {"reshard_after_forward": False}),
            ("", {}),
        ],
        skipped=("blocks.1", "blocks.2"),
    ),
    "llama_like": Case(
        build=LlamaLikeForCausalLM,
        hand=hand_llama,
        expected=[*block_calls("model.layers", 3), ("", {})],
    ),
    "encoder_decoder": Case(
        build=EncoderDecoder,
        hand=hand_encoder_decoder,
        expected=[
            *block_calls("encoder.layers", 2, last_of_all=False),
            *block_calls("decoder.layers", 3),
            ("", {}),
        ],
    ),
}

# Hugging Face's own Llama (tests/integration: importing transformers costs seconds per process).
# Tied or not, embed_tokens and lm_head stay with the root, their common ancestor.
HF_CASES: dict[str, Case] = {
    "hf_llama": Case(
        build=build_hf_llama, hand=hand_llama, expected=[*block_calls("model.layers", 2), ("", {})]
    ),
    "hf_llama_tied": Case(
        build=lambda: build_hf_llama(tied=True),
        hand=hand_llama,
        expected=[*block_calls("model.layers", 2), ("", {})],
    ),
}
ALL_CASES = {**CASES, **HF_CASES}
