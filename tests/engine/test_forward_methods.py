"""Modules called outside the plain forward: one group over two modules (``fully_shard([embed,
head])``) with the head called once per loss chunk, and ``register_fsdp_forward_method``.
Counted with `tests.parity.CollectiveCounter`, for fsdp2 and for torch's own ``fully_shard``."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from tests.harness import fsdp_api, per_group_collectives, run_on_ranks
from tests.models import MLP_IN, Batch
from tests.parity import CollectiveCounter, Lockstep
from tests.tolerance import assert_fp32_close

NUM_STEPS = 3
NUM_CHUNKS = 3
VOCAB, SEQ = 16, 6


class ChunkedLM(nn.Module):
    """The loss is computed in sequence chunks, calling ``head`` once per chunk."""

    def __init__(self, num_chunks: int = NUM_CHUNKS) -> None:
        super().__init__()
        self.num_chunks = num_chunks
        self.embed = nn.Embedding(VOCAB, MLP_IN)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(MLP_IN, MLP_IN), nn.Tanh()) for _ in range(2)
        )
        self.norm = nn.LayerNorm(MLP_IN)
        self.head = nn.Linear(MLP_IN, VOCAB)

    def hidden(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.norm(x)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.hidden(idx)
        total = sum(
            F.cross_entropy(self.head(xc).flatten(0, 1), tc.flatten(), reduction="sum")
            for xc, tc in zip(
                x.chunk(self.num_chunks, 1), targets.chunk(self.num_chunks, 1), strict=True
            )
        )
        return total / targets.numel()

    def generate(self, idx: torch.Tensor, num_new: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy decoding; uses the root's own ``norm`` outside ``forward``. Returns the
        tokens and the logits each new token was picked from. Call it under ``no_grad``: FSDP
        checks grad mode around the method, not inside it, to decide what to free."""
        all_logits = []
        for _ in range(num_new):
            logits = self.head(self.hidden(idx[:, -SEQ:])[:, -1])
            all_logits.append(logits)
            idx = torch.cat([idx, logits.argmax(dim=-1, keepdim=True)], dim=1)
        return idx, torch.stack(all_logits, dim=1)


def _lm_batch(gen: torch.Generator, n: int) -> Batch:
    tokens = torch.randint(0, VOCAB, (n, SEQ + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _shard_chunked_lm(model: nn.Module, impl: str) -> None:
    fully_shard = fsdp_api(impl).fully_shard
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block)
    fully_shard([model.embed, model.head])  # one group: the input and output embeddings
    fully_shard(model)


@per_group_collectives  # counted against torch's, which gathers each group alone
def _grouped(impl: str, num_chunks: int) -> list[dict[str, int]]:
    t = Lockstep(functools.partial(ChunkedLM, num_chunks), _lm_batch)
    _shard_chunked_lm(t.model, impl)
    t.make_optimizers()
    comms = []
    for step in range(NUM_STEPS):
        forward, backward = t.counted_step(step, CollectiveCounter)
        comms.append(
            {
                "forward all-gathers": forward.counts["allgather"],
                "backward all-gathers": backward.counts["allgather"],
                "reduce-scatters": forward.counts["reducescatter"]
                + backward.counts["reducescatter"],
            }
        )
    t.check_params("after training")
    return comms


# Groups: root, blocks.0, blocks.1, [embed, head]; the head runs 3 times per step.
GROUPED_COMMS = {
    # fsdp2 gathers [embed, head] once for the embedding and the first head call (held through
    # the blocks, as in torch), once more for the later head calls, and keeps that into
    # backward, where the head comes first: nothing to gather for the group there.
    "fsdp2": {"forward all-gathers": 1 + 2 + 2, "backward all-gathers": 2 + 0},
    # torch keeps [embed, head] gathered from the embedding until every module of the group
    # has run once (1 + 1 for the later head calls), and gathers it twice in backward.
    "torch": {"forward all-gathers": 1 + 2 + 2, "backward all-gathers": 2 + 2},
}


# The same with one head call: the group is gathered once for forward (held from the
# embedding to the head) and once for backward, the least a group that reshards can do.
GROUPED_COMMS_ONE_CALL = {
    "fsdp2": {"forward all-gathers": 1 + 2 + 1, "backward all-gathers": 2 + 1},
    "torch": {"forward all-gathers": 1 + 2 + 1, "backward all-gathers": 2 + 1},
}


@pytest.mark.parametrize("impl", ["fsdp2", "torch"])
@pytest.mark.parametrize("num_chunks", [1, NUM_CHUNKS])
def test_one_group_over_two_modules_with_chunked_loss(
    impl: str, num_chunks: int, fsdp2_only: None
) -> None:
    expected_gathers = (GROUPED_COMMS if num_chunks > 1 else GROUPED_COMMS_ONE_CALL)[impl]
    for comms in run_on_ranks(2, _grouped, impl, num_chunks):
        # One reduce-scatter per group and step, however many times the head ran.
        expected = {**expected_gathers, "reduce-scatters": 4}
        assert comms == [expected] * NUM_STEPS


def _forward_method() -> None:
    from fsdp2 import register_fsdp_forward_method

    t = Lockstep(ChunkedLM, _lm_batch)
    _shard_chunked_lm(t.model, "fsdp2")
    register_fsdp_forward_method(t.model, "generate")
    t.make_optimizers()
    prompt = t.local(100)[0][:, :2]
    for step in range(2):
        with torch.no_grad():
            tokens, logits = t.model.generate(prompt, 4)
            ref_tokens, ref_logits = t.ref.generate(prompt, 4)
        assert_fp32_close(logits, ref_logits)
        assert torch.equal(tokens, ref_tokens)
        # Under no_grad everything is freed again: training goes on as usual.
        assert all(isinstance(p, DTensor) for p in t.model.parameters())
        t.forward_backward(step)
        t.check_grads(f"step {step}")
        t.optim_step()
    t.check_params("after training")


def test_register_fsdp_forward_method(fsdp2_only: None) -> None:
    run_on_ranks(2, _forward_method)
