"""``fsdp2.save_hf_safetensors`` into transformers' ``from_pretrained``: a tiny
``LlamaForCausalLM`` (built from a ``LlamaConfig``, nothing downloaded), untied and with tied
embeddings, trained 3 steps under ``fully_shard`` on 2 ranks, exported in several files, loaded
by ``from_pretrained``: the loaded weights equal ``full_tensor()`` of the trained ones bit for
bit, and the loaded model's logits equal the trained model's (its full parameters summoned: the
same values and the same operations in one process, so bitwise).
"""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_on_ranks
from tests.integration.assets import tiny_llama

pytest.importorskip("transformers")

VOCAB, SEQ = 64, 8


def _build(tied: bool) -> Any:
    return tiny_llama(tied, VOCAB, SEQ)


def _train_export_load(directory: str, tied: bool, dtype: torch.dtype | None) -> None:
    from transformers import LlamaForCausalLM

    from fsdp2 import fully_shard, save_hf_safetensors, summon_full_params

    model = _build(tied)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(3):
        tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=gen)
        model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss.backward()
        optim.step()
        optim.zero_grad()
    files = save_hf_safetensors(model, directory, max_shard_size=20_000, dtype=dtype)
    assert len(files) > 1, files
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    idx = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(9))
    with summon_full_params(model, writeback=False), torch.no_grad():
        logits = LlamaForCausalLM.forward(model, input_ids=idx).logits
    if dist.get_rank() != 0:
        return
    model.config.save_pretrained(directory)
    loaded = LlamaForCausalLM.from_pretrained(directory, dtype=dtype or torch.float32)
    state = loaded.state_dict()
    assert list(state) == list(full), (list(state), list(full))
    for key, value in full.items():
        want = value.to(dtype) if dtype is not None else value
        assert torch.equal(state[key], want), key  # copies of the same values
    if tied:
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    if dtype is None:
        with torch.no_grad():
            got = loaded(input_ids=idx).logits
        torch.testing.assert_close(got, logits, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("tied", "dtype"), [(False, None), (True, None), (False, torch.bfloat16)], ids=str
)
def test_from_pretrained_loads_the_export(tied: bool, dtype: torch.dtype | None) -> None:
    with tempfile.TemporaryDirectory() as directory:
        run_on_ranks(2, _train_export_load, directory, tied, dtype, timeout=180)
