"""fsdp2 inside torchtitan 0.3.0, unchanged: torchtitan's llama3 debug model trains with fsdp2's
``fully_shard`` swapped in for torch's, and every step's loss and gradient norm equal those of the
same run (same seed, same data) on torch's own ``fully_shard``.

Each run is a real ``torchrun`` of titan_train.py (CPU, gloo), so these tests are slow (about 40 s
a run, mostly imports); they live outside the default test paths and need the ``integration``
extra: ``python3 -m pip install torch==2.13.0 -e '.[dev,integration]'`` then
``python3 -m pytest tests/integration``.

Tolerance: the two implementations sum the same fp32 gradients over 2 ranks, possibly in another
order (a few ulps per element), and a handful of AdamW steps carry that into the loss and the
gradient norm: rtol 1e-5 is far above that and far below what a wrong factor, a stale shard or a
skipped update does (all change the norm at once, the losses from step 2 on). A resumed run repeats
the uninterrupted run's arithmetic exactly, so it must match bitwise.
"""

from __future__ import annotations

import re
import subprocess
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("torchtitan", reason="needs the integration extra (torchtitan)")
pytest.importorskip("tokenizers", reason="needs the integration extra (tokenizers)")
pytest.importorskip("datasets", reason="needs the integration extra (datasets)")

import torch

from fsdp2.engine.releases import RULES
from tests.harness import launch_command
from tests.integration.assets import make_assets

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
STEPS = 4
RUN_TIMEOUT_S = 420
RTOL = 1e-5


@dataclass(frozen=True)
class Run:
    losses: list[float]
    grad_norms: list[float]
    steps: list[int]
    sharded_by: str
    seconds: float


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("titan_assets")
    make_assets(root)
    return root


_runs: dict[tuple[object, ...], Run] = {}


def _launch(cmd: list[str], env: dict[str, str], cwd: Path) -> str:
    """One torchrun launch: its stdout and stderr, whatever its exit code."""
    try:
        proc = subprocess.run(
            cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
        )
        return proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        text = [b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
                for b in (e.stdout, e.stderr)]  # fmt: skip
        return f"{text[0]}{text[1]}\n(timed out after {RUN_TIMEOUT_S} s)"


def titan_run(impl: str, world: int, assets: Path, dump: Path, **options: object) -> Run:
    """Train with torchtitan under torchrun, judged by its logged output: gloo on torch 2.13
    sometimes aborts a rank after the script finished, spoiling the exit code."""
    key = (impl, world, str(dump), tuple(sorted(options.items())))
    if key in _runs:
        return _runs[key]
    cmd, env = launch_command(
        HERE / "titan_train.py", world, impl, str(assets), str(dump), f"steps={STEPS}",
        *(f"{k}={v}" for k, v in options.items()),
    )  # fmt: skip
    start = time.perf_counter()
    out = _launch(cmd, env, dump.parent)
    if "\nDONE" not in out:
        # Rarely a run dies before its end (once in about 25 launches of this file here; its
        # output was lost, so the cause is open): run it once more, as tests/harness.py reruns
        # a crashed rank, and keep the first run's end in the session's warnings summary. A
        # run that resumed from the first one's checkpoints misses steps and still fails.
        warnings.warn(
            f"torchtitan run {' '.join(cmd[4:])} did not finish; ran it again. Its end:\n"
            f"{out[-3000:]}",
            stacklevel=1,
        )
        out = _launch(cmd, env, dump.parent)
    seconds = time.perf_counter() - start
    if "\nDONE" not in out:
        pytest.fail(f"torchtitan run {' '.join(cmd[4:])} did not finish:\n{out[-6000:]}")
    rows = re.findall(r"^LOSS (\d+) (\S+) (\S+)$", out, re.MULTILINE)
    by = re.search(r"^SHARDED_BY (\S+)$", out, re.MULTILINE)
    run = Run(
        losses=[float(r[1]) for r in rows],
        grad_norms=[float(r[2]) for r in rows],
        steps=[int(r[0]) for r in rows],
        sharded_by=by.group(1) if by else "unknown",
        seconds=seconds,
    )
    print(f"\n{impl} {world} ranks {options}: {run}")
    _runs[key] = run
    return run


def assert_same_training(ours: Run, theirs: Run) -> None:
    assert ours.sharded_by == "fsdp2" and theirs.sharded_by == "torch", (ours, theirs)
    assert ours.steps == theirs.steps == list(range(1, STEPS + 1)), (ours, theirs)
    torch.testing.assert_close(ours.losses, theirs.losses, rtol=RTOL, atol=0)
    torch.testing.assert_close(ours.grad_norms, theirs.grad_norms, rtol=RTOL, atol=0)


def test_fsdp_2_ranks_then_dcp_resume(assets: Path, tmp_path: Path) -> None:
    """FSDP over 2 ranks, saving DCP checkpoints at step 2 and 4; then a second run resumes
    from step 2 and must repeat steps 3 and 4 exactly."""
    ckpt = {"ckpt_interval": 2}
    ours = titan_run("fsdp2", 2, assets, tmp_path / "fsdp2", **ckpt)
    theirs = titan_run("torch", 2, assets, tmp_path / "torch")
    assert_same_training(ours, theirs)
    resumed = titan_run("fsdp2", 2, assets, tmp_path / "fsdp2", **ckpt, load_step=2)
    assert resumed.steps == [3, 4], resumed
    assert resumed.losses == ours.losses[2:], (resumed, ours)
    assert resumed.grad_norms == ours.grad_norms[2:], (resumed, ours)


@pytest.mark.parametrize("ac", ["full", "selective"])
def test_fsdp_with_activation_checkpointing(assets: Path, tmp_path: Path, ac: str) -> None:
    ours = titan_run("fsdp2", 2, assets, tmp_path / "fsdp2", ac=ac)
    theirs = titan_run("torch", 2, assets, tmp_path / "torch", ac=ac)
    assert_same_training(ours, theirs)


def test_fsdp_x_tp_2x2(assets: Path, tmp_path: Path) -> None:
    """4 ranks: FSDP over 2, tensor parallel (with sequence parallel) over 2."""
    ours = titan_run("fsdp2", 4, assets, tmp_path / "fsdp2", tp=2)
    theirs = titan_run("torch", 4, assets, tmp_path / "torch", tp=2)
    assert_same_training(ours, theirs)


def test_full_dtensor_fsdp_2_ranks(assets: Path, tmp_path: Path) -> None:
    """torchtitan's full_dtensor backend: parameters are DTensors on the whole SPMD mesh and
    fully_shard gets dp_mesh_dims; gradients arrive Partial over the data-parallel dims.
    (torchtitan logs twice the partial_dtensor run's loss in this mode, with torch's fully_shard
    as with ours: a reporting matter on its side; the gradient norms are the same.)"""
    mode = {"spmd_backend": "full_dtensor"}
    ours = titan_run("fsdp2", 2, assets, tmp_path / "fsdp2", **mode)
    theirs = titan_run("torch", 2, assets, tmp_path / "torch", **mode)
    assert_same_training(ours, theirs)


@pytest.mark.skipif(
    RULES.release < (2, 14), reason="torchtitan's spmd_types backend needs torch 2.14 or newer"
)
def test_spmd_types_fsdp_2_ranks(assets: Path, tmp_path: Path) -> None:
    """torchtitan's default backend since August (``spmd_types``), beside the torch releases
    that can run it."""
    mode = {"spmd_backend": "spmd_types"}
    ours = titan_run("fsdp2", 2, assets, tmp_path / "fsdp2", **mode)
    theirs = titan_run("torch", 2, assets, tmp_path / "torch", **mode)
    assert_same_training(ours, theirs)
