"""Hugging Face ``Trainer`` with FSDP2 on a peft LoRA model, fsdp2 swapped in, against torch.

``hf_trainer_run.py`` trains a tiny Llama with LoRA adapters (``get_peft_model``) through
``Trainer(fsdp="full_shard auto_wrap", fsdp_config={"fsdp_version": 2, ...})`` on 2 gloo ranks
under ``torchrun``, once per implementation, same seed and data: frozen base weights and
trainable adapters share each decoder layer's group. fsdp2 must give torch's logged losses and
gradient norms at every step and the same trained adapters.

Needs the ``integration`` extra (peft, transformers, accelerate pinned there); skipped without it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from tests.integration.torchrun_pair import Run, assert_same_training, run_both

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parent / "hf_trainer_run.py"
TIMEOUT_S = 180
STEPS = 5
# The adapters after 5 AdamW steps: a rounding-level gradient difference moves an element by up
# to lr * (grad difference) / eps; eps=1e-5 keeps that at rounding level too.
PARAM_TOL = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    out = tmp_path_factory.mktemp("hf_trainer")
    return run_both(SCRIPT, ["--steps", str(STEPS)], TIMEOUT_S, keys=("MODEL", "ADAPTER"), out=out)


def test_fsdp2_was_swapped_in(runs: dict[str, Run]) -> None:
    assert runs["fsdp2"].keys.get("MODEL", "").startswith("fsdp2."), runs["fsdp2"].tail()
    assert runs["torch"].keys.get("MODEL", "").startswith("torch.distributed.fsdp."), runs[
        "torch"
    ].tail()


def test_losses_and_grad_norms_match_torch(runs: dict[str, Run]) -> None:
    assert_same_training(runs, STEPS)


def test_trained_adapters_match_torch(runs: dict[str, Run]) -> None:
    saved = {impl: torch.load(run.keys["ADAPTER"]) for impl, run in runs.items()}
    # Both adapters of q_proj and v_proj in both layers, gathered as full plain tensors.
    assert len(saved["torch"]) == 8 and list(saved["fsdp2"]) == list(saved["torch"])
    for key, value in saved["fsdp2"].items():
        assert type(value) is torch.Tensor, (key, type(value))
        torch.testing.assert_close(value, saved["torch"][key], **PARAM_TOL, msg=key)
