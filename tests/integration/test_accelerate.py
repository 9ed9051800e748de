"""Hugging Face accelerate's FSDP2 path with fsdp2 swapped in, against torch's ``fully_shard``.

``accelerate_run.py`` trains a tiny Llama (``LlamaConfig``, nothing downloaded) on 2 gloo ranks
under ``torchrun``, once per implementation, same seed and data: accelerate's auto-wrap, its
tied-embedding grouping, gradient clipping, ``get_state_dict``, ``save_model``, ``save_state``
and ``load_state``, and (second variant) ``cpu_ram_efficient_loading`` with garbage weights on
rank 1 and ``FULL_STATE_DICT`` checkpoints. fsdp2 must give torch's losses and gradient norms at
every step and the same saved weights.

Needs the ``integration`` extra (``pip install torch==2.13.0 -e '.[integration]'``); skipped
without it. A run is judged by its printed lines, not its exit code: gloo on torch 2.13 may
abort a rank after the script finished.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from tests.integration.torchrun_pair import collect, launch_pair

pytest.importorskip("accelerate")
pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parent / "accelerate_run.py"
TIMEOUT_S = 240
STEPS = 4
VARIANTS = {
    "untied": [],
    "tied-ram-efficient-full-sd": ["--tied", "--cpu-ram-efficient-loading", "--full-state-dict"],
}
# fp32 with the same reductions in a possibly different order (a ~1e5-element model, 4 steps).
LOSS_TOL = {"rtol": 1e-5, "atol": 1e-6}
# Parameters after 4 AdamW steps: a rounding-level gradient difference moves an element by up to
# lr * (grad difference) / eps; eps=1e-5 (as in tests/parity/build.py) keeps that below ~1e-5.
PARAM_TOL = {"rtol": 1e-5, "atol": 1e-5}


@dataclass
class Run:
    impl: str
    out: Path
    log: str
    losses: dict[int, float] = field(default_factory=dict)
    grad_norms: dict[int, float] = field(default_factory=dict)
    resumed: float | None = None
    model_class: str = ""
    tied: bool = False

    def tail(self) -> str:
        return f"--- {self.impl} run, last lines ---\n{self.log[-6000:]}"


def launch(impl: str, args: list[str], out: Path) -> subprocess.Popen[str]:
    out.mkdir(parents=True, exist_ok=True)
    return launch_pair(SCRIPT, ["--impl", impl, "--steps", str(STEPS), "--out", str(out), *args])


def finish(impl: str, proc: subprocess.Popen[str], out: Path) -> Run:
    # Only stdout is parsed: another rank's stderr can land inside a printed line.
    stdout, log = collect(impl, proc, TIMEOUT_S)
    run = Run(impl, out, log, tied="--tied" in proc.args)  # type: ignore[operator]
    for m in re.finditer(r"^LOSS step=(\d+) value=(\S+)(?: grad_norm=(\S+))?$", stdout, re.M):
        run.losses[int(m[1])] = float(m[2])
        if m[3] is not None:
            run.grad_norms[int(m[1])] = float(m[3])
    if m := re.search(r"^RESUMED step=\d+ value=(\S+)$", stdout, re.M):
        run.resumed = float(m[1])
    if m := re.search(r"^MODEL (\S+)", stdout, re.M):
        run.model_class = m[1]
    assert re.search(r"^DONE$", stdout, re.M), f"the {impl} run did not finish\n{run.tail()}"
    return run


@pytest.fixture(scope="module", params=list(VARIANTS))
def runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Run]:
    """Both implementations of one variant, launched side by side."""
    root = tmp_path_factory.mktemp(request.param)
    procs = {
        impl: launch(impl, VARIANTS[request.param], root / impl) for impl in ("torch", "fsdp2")
    }
    return {impl: finish(impl, proc, root / impl) for impl, proc in procs.items()}


def test_fsdp2_was_swapped_in(runs: dict[str, Run]) -> None:
    assert runs["fsdp2"].model_class.startswith("fsdp2."), runs["fsdp2"].tail()
    assert runs["torch"].model_class.startswith("torch.distributed.fsdp."), runs["torch"].tail()


def test_losses_and_grad_norms_match_torch(runs: dict[str, Run]) -> None:
    ours, theirs = runs["fsdp2"], runs["torch"]
    lines = [
        f"step {s}: fsdp2 {ours.losses.get(s)} torch {theirs.losses.get(s)}"
        for s in range(STEPS + 1)
    ]
    print("\n".join(lines))
    assert sorted(theirs.losses) == list(range(STEPS + 1)), theirs.tail()
    assert sorted(ours.losses) == list(range(STEPS + 1)), ours.tail()
    torch.testing.assert_close(ours.losses, theirs.losses, **LOSS_TOL, msg="\n".join(lines))
    torch.testing.assert_close(ours.grad_norms, theirs.grad_norms, **LOSS_TOL)
    assert theirs.losses[STEPS] < theirs.losses[0] - 0.1, "the reference run did not learn"


def test_load_state_restores_the_checkpoint(runs: dict[str, Run]) -> None:
    """The step after ``save_state``, rerun after ``load_state``: the same arithmetic on the
    same values, so bitwise the same loss (a load that restored nothing would see the weights
    one update later)."""
    for run in runs.values():
        assert run.resumed == run.losses[STEPS], (run.impl, run.resumed, run.losses[STEPS])


def test_saved_weights_match_torch(runs: dict[str, Run]) -> None:
    """``get_state_dict`` (full, on rank 0) equals torch's; ``save_model``'s safetensors hold
    exactly those values (tied duplicates dropped)."""
    saved = {impl: torch.load(run.out / "full_state_dict.pt") for impl, run in runs.items()}
    assert list(saved["fsdp2"]) == list(saved["torch"])
    for key, value in saved["fsdp2"].items():
        assert type(value) is torch.Tensor, (key, type(value))
        torch.testing.assert_close(value, saved["torch"][key], **PARAM_TOL, msg=key)
    for impl, run in runs.items():
        model_file = safetensors_torch.load_file(run.out / "model" / "model.safetensors")
        assert model_file and set(model_file) <= set(saved[impl]), impl
        for key, value in model_file.items():
            torch.testing.assert_close(value, saved[impl][key], rtol=0, atol=0, msg=key)


def test_saved_model_reproduces_the_loss(runs: dict[str, Run]) -> None:
    """``save_model``'s file in a plain (unsharded) Llama gives the sharded model's loss on the
    global batch of the step after the checkpoint."""
    from tests.integration.accelerate_run import build_model, global_batch

    for run in runs.values():
        model = build_model(run.tied)
        state = safetensors_torch.load_file(run.out / "model" / "model.safetensors")
        result = model.load_state_dict(state, strict=False)
        assert not result.unexpected_keys, result
        # (transformers may or may not list the tied alias safetensors dropped as missing)
        assert set(result.missing_keys) <= ({"lm_head.weight"} if run.tied else set()), result
        if run.tied:
            assert model.lm_head.weight is model.model.embed_tokens.weight
        ids = global_batch(STEPS, 2)
        with torch.no_grad():
            loss = model(input_ids=ids, labels=ids).loss.item()
        torch.testing.assert_close(loss, run.losses[STEPS], **LOSS_TOL, msg=run.impl)
