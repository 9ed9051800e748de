"""PyTorch Lightning's FSDP2 path (``ModelParallelStrategy``) with fsdp2 swapped in, against torch.

``lightning_run.py`` trains a tiny MLP through ``Trainer(strategy=ModelParallelStrategy(...),
accelerator="cpu", devices=2, gradient_clip_val=...)`` on 2 gloo ranks under ``torchrun``, once
per implementation, same seed and data: the user's ``configure_model()`` shards each block and
the model with ``fully_shard`` imported from ``torch.distributed.fsdp``, so
``fsdp2.patch_torch_fsdp()`` alone decides whose it is. Lightning clips the DTensor gradients
(``clip_grad_norm_``), saves its distributed checkpoint (DCP) mid-run, and a second ``Trainer``
resumes from it into a model built on the meta device (Lightning's ``to_empty`` +
``reset_parameters`` materialization). fsdp2 must give torch's losses, gradient norms and
clipped norms at every step, and the checkpoint must load back exactly.

Needs the ``integration`` extra (lightning pinned there); skipped without it. A run is judged by
its printed lines, not its exit code: gloo on torch 2.13 may abort a rank after the script
finished.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")

from tests.integration.lightning_run import CLIP
from tests.integration.torchrun_pair import LOSS_TOL, Run, assert_same_training, run_both

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parent / "lightning_run.py"
TIMEOUT_S = 180
STEPS = 5  # 3 in the first fit, the checkpoint, 2 more after resuming from it
# Parameters after 3 AdamW steps: a rounding-level gradient difference moves an element by up to
# lr * (grad difference) / eps; eps=1e-5 (as in tests/parity/build.py) keeps that at rounding level.
PARAM_TOL = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    out = tmp_path_factory.mktemp("lightning")
    return run_both(SCRIPT, ["--steps", str(STEPS)], TIMEOUT_S, out=out)


def lines(run: Run, key: str) -> list[str]:
    return re.findall(rf"^{key} (.+)$", run.log, re.M)


def test_fsdp2_was_swapped_in(runs: dict[str, Run]) -> None:
    # One line per fit: the first, and the one resumed from the checkpoint.
    ours, theirs = lines(runs["fsdp2"], "BLOCK"), lines(runs["torch"], "BLOCK")
    assert ours == ["fsdp2.api.FSDPBlock True"] * 2, runs["fsdp2"].tail()
    assert len(theirs) == 2, runs["torch"].tail()
    for line in theirs:
        assert line.startswith("torch.distributed.fsdp.") and line.endswith(" False"), line


def test_losses_and_grad_norms_match_torch(runs: dict[str, Run]) -> None:
    assert_same_training(runs, STEPS)


def test_lightning_clips_the_sharded_gradients(runs: dict[str, Run]) -> None:
    clipped = {}
    for impl, run in runs.items():
        found = re.findall(r"^CLIPPED step=(\d+) norm=(\S+)$", run.log, re.M)
        clipped[impl] = {int(step): float(norm) for step, norm in found}
        # One per training step: DCP's optimizer-state init step on resuming is not counted.
        assert [int(step) for step, _ in found] == list(range(STEPS)), run.tail()
        expected = {s: min(norm, CLIP) for s, norm in run.grad_norms.items()}
        assert any(norm > CLIP for norm in run.grad_norms.values()), run.grad_norms
        torch.testing.assert_close(clipped[impl], expected, rtol=1e-5, atol=1e-5, msg=impl)
    torch.testing.assert_close(clipped["fsdp2"], clipped["torch"], **LOSS_TOL)


def test_checkpoint_loads_back(runs: dict[str, Run]) -> None:
    params = {}
    for impl, run in runs.items():
        init = lines(run, "INIT")
        assert init == [
            "first meta_at_shard=False meta_after_setup=False",
            "loaded meta_at_shard=True meta_after_setup=False",  # Lightning materialized it
        ], run.tail()
        paths = dict(line.split(" ", 1) for line in lines(run, "PARAMS"))
        saved, loaded = torch.load(paths["saved"]), torch.load(paths["loaded"])
        assert len(saved) == 14 and list(loaded) == list(saved), (impl, list(saved))
        for name, value in saved.items():
            assert torch.equal(loaded[name], value), (impl, name)
        params[impl] = saved
    torch.testing.assert_close(params["fsdp2"], params["torch"], **PARAM_TOL)
