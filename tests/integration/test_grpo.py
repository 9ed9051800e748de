"""TRL's ``GRPOTrainer`` with FSDP2, fsdp2 swapped in, against torch, bit for bit.

``grpo_run.py`` trains a tiny Llama with GRPO (completions sampled by ``generate`` on the sharded
model, a reward computed in Python, a policy-gradient step) through accelerate's FSDP2 path on 2
gloo ranks under ``torchrun``, once per implementation, same seed and prompts. Both shard the same
groups and reduce in the same order, so fsdp2 must give exactly torch's logged losses, gradient
norms and rewards at every step (the rewards score what was sampled: generation through the
sharded model is compared too) and exactly the same trained parameters. The logged loss is zero
up to rounding (one update per generation and no KL term: the ratio is 1 and a group's advantages
sum to zero), so the gradient norms and the parameters carry most of the comparison.

Needs the ``integration`` extra (trl, transformers, accelerate, datasets pinned there); skipped
without it, and beside torch 2.15 until checked there.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("datasets")

from fsdp2.engine.releases import TORCH_RELEASE
from tests.integration.assets import VOCAB_SIZE, tiny_llama
from tests.integration.grpo_run import SEQ
from tests.integration.torchrun_pair import Run, run_both

pytestmark = [
    pytest.mark.slow,
    # Run bit for bit beside torch 2.13 only so far (session 19 had no 2.15 environment to spare);
    # drop this once a run beside 2.15 is seen to match.
    pytest.mark.skipif(
        TORCH_RELEASE >= (2, 15), reason="GRPO parity not yet checked beside torch 2.15"
    ),
]

SCRIPT = Path(__file__).resolve().parent / "grpo_run.py"
TIMEOUT_S = 300  # ~30 s each on 2 idle cores; ~170 s seen beside a busy CI run
STEPS = 3


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    out = tmp_path_factory.mktemp("grpo")
    return run_both(
        SCRIPT, ["--steps", str(STEPS)], TIMEOUT_S, keys=("MODEL", "REWARDS", "WEIGHTS"), out=out
    )


def test_fsdp2_was_swapped_in(runs: dict[str, Run]) -> None:
    assert runs["fsdp2"].keys.get("MODEL", "").startswith("fsdp2."), runs["fsdp2"].tail()
    assert runs["torch"].keys.get("MODEL", "").startswith("torch.distributed.fsdp."), runs[
        "torch"
    ].tail()


def test_losses_grad_norms_and_rewards_are_torchs(runs: dict[str, Run]) -> None:
    ours, theirs = runs["fsdp2"], runs["torch"]
    for run in (ours, theirs):
        assert sorted(run.losses) == list(range(STEPS)), run.tail()
        assert len(run.keys.get("REWARDS", "").split()) == STEPS, run.tail()
    lines = "\n".join(
        f"step {s}: fsdp2 {ours.losses[s]!r} / {ours.grad_norms[s]!r}, "
        f"torch {theirs.losses[s]!r} / {theirs.grad_norms[s]!r}"
        for s in range(STEPS)
    )
    print(lines)
    assert ours.losses == theirs.losses, lines
    assert ours.grad_norms == theirs.grad_norms, lines
    assert all(norm > 0 for norm in theirs.grad_norms.values()), lines  # the rewards told apart
    assert ours.keys["REWARDS"] == theirs.keys["REWARDS"]


def test_trained_parameters_are_torchs(runs: dict[str, Run]) -> None:
    saved = {impl: torch.load(run.keys["WEIGHTS"]) for impl, run in runs.items()}
    # Every parameter of the untied Llama, gathered as full plain tensors.
    assert len(saved["torch"]) == 21 and list(saved["fsdp2"]) == list(saved["torch"])
    for key, value in saved["fsdp2"].items():
        assert type(value) is torch.Tensor, (key, type(value))
        theirs = saved["torch"][key]
        assert torch.equal(value, theirs), f"{key}: max |diff| {(value - theirs).abs().max()}"
    # grpo_run.py's initial weights: training moved every one of them.
    initial = tiny_llama(False, VOCAB_SIZE, SEQ).state_dict()
    assert list(initial) == list(saved["torch"])
    for key, value in initial.items():
        assert value.shape == saved["torch"][key].shape, key
        assert not torch.equal(value, saved["torch"][key]), key
