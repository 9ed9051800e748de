"""Hugging Face's tied embeddings sharded module by module ([Note: weights tied across calls]):
a tiny ``LlamaForCausalLM`` with ``tie_word_embeddings=True`` (built from a config, nothing
downloaded), ``fully_shard`` on ``embed_tokens``, each layer, ``lm_head``, then the model, trains
bit for bit as the usual sharding (layers, then the model, whose group holds the tie), on 2
ranks: the root's call takes the tie over, so both put the same parameters in the same groups
and run the same operations."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_on_ranks
from tests.integration.assets import tiny_llama

pytest.importorskip("transformers")

VOCAB, SEQ = 64, 8


def _train(per_module: bool) -> dict[str, Any]:
    from fsdp2 import fully_shard

    model = tiny_llama(True, VOCAB, SEQ)
    if per_module:
        fully_shard(model.model.embed_tokens)
    for layer in model.model.layers:
        fully_shard(layer)
    if per_module:
        fully_shard(model.lm_head)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(dist.get_rank())
    losses = []
    for _ in range(3):
        tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=gen)
        loss = model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return {
        "losses": losses,
        "tied": model.lm_head.weight is model.model.embed_tokens.weight,
        "state": {k: v.full_tensor() for k, v in model.state_dict().items()},
    }


def test_tied_embeddings_sharded_module_by_module() -> None:
    usual = run_on_ranks(2, _train, False)
    per_module = run_on_ranks(2, _train, True)
    for got, ref in zip(per_module, usual, strict=True):
        assert got["tied"]
        assert got["losses"] == ref["losses"]
        assert list(got["state"]) == list(ref["state"])
        for key, value in ref["state"].items():
            assert torch.equal(got["state"][key], value), key
