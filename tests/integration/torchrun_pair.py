"""Launch one training script under ``torchrun`` (2 gloo ranks) once per implementation, side by
side, and parse what rank 0 printed: ``LOSS step=<i> value=<float> grad_norm=<float>`` lines, a
final ``DONE``, and any ``<KEY> <value>`` line asked for. A run is judged by its printed lines,
not its exit code: gloo on torch 2.13 may abort a rank after the script finished."""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from tests.harness import launch_command

REPO_ROOT = Path(__file__).resolve().parents[2]
IMPLS = ("torch", "fsdp2")
# fp32 with the same reductions in a possibly different order (tiny models, a few steps).
LOSS_TOL = {"rtol": 1e-5, "atol": 1e-6}


@dataclass
class Run:
    impl: str
    log: str
    losses: dict[int, float] = field(default_factory=dict)
    grad_norms: dict[int, float] = field(default_factory=dict)
    keys: dict[str, str] = field(default_factory=dict)

    def tail(self) -> str:
        return f"--- {self.impl} run, last lines ---\n{self.log[-6000:]}"


def run_both(
    script: Path,
    args: list[str],
    timeout_s: float,
    keys: tuple[str, ...] = (),
    out: Path | None = None,
) -> dict[str, Run]:
    """``script --impl <impl> *args`` for torch's ``fully_shard`` and fsdp2's, concurrently;
    with ``out``, each gets ``--out <out>/<impl>`` too."""
    procs = {}
    for impl in IMPLS:
        extra = []
        if out is not None:
            (out / impl).mkdir(parents=True, exist_ok=True)
            extra = ["--out", str(out / impl)]
        procs[impl] = launch_pair(script, ["--impl", impl, *args, *extra])
    return {impl: _finish(impl, proc, timeout_s, keys) for impl, proc in procs.items()}


def launch_pair(script: Path, args: list[str]) -> subprocess.Popen[str]:
    """``script *args`` under ``torchrun`` on 2 ranks, started in the background."""
    cmd, env = launch_command(script, 2, *args)
    return subprocess.Popen(
        cmd,
        cwd=REPO_ROOT,
        env=env,
        # Separate pipes: a rank's warning on stderr can land inside a line that rank 0 prints
        # (seen in CI: "SHARD NF4Tensor[rank1]:W..."), so only stdout is parsed.
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def collect(impl: str, proc: subprocess.Popen[str], timeout_s: float) -> tuple[str, str]:
    """Wait for a launch: (its stdout, to parse; stdout and stderr, to show on failure)."""
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"{impl} run timed out after {timeout_s}s\n{(out + err)[-6000:]}")
    return out, f"{out}\n--- stderr ---\n{err}"


def _finish(impl: str, proc: subprocess.Popen[str], timeout_s: float, keys: tuple[str, ...]) -> Run:
    out, log = collect(impl, proc, timeout_s)
    run = Run(impl, log)
    for m in re.finditer(r"^LOSS step=(\d+) value=(\S+) grad_norm=(\S+)$", out, re.M):
        run.losses[int(m[1])] = float(m[2])
        run.grad_norms[int(m[1])] = float(m[3])
    for key in keys:
        if m := re.search(rf"^{key} (.+)$", out, re.M):
            run.keys[key] = m[1]
    assert re.search(r"^DONE$", out, re.M), f"the {impl} run did not finish\n{run.tail()}"
    return run


def assert_same_training(runs: dict[str, Run], steps: int) -> None:
    """fsdp2's losses and gradient norms are torch's at every step, and the reference learned."""
    ours, theirs = runs["fsdp2"], runs["torch"]
    lines = [
        f"step {s}: fsdp2 {ours.losses.get(s)} / {ours.grad_norms.get(s)}, "
        f"torch {theirs.losses.get(s)} / {theirs.grad_norms.get(s)}"
        for s in range(steps)
    ]
    print("\n".join(lines))
    assert sorted(theirs.losses) == list(range(steps)), theirs.tail()
    assert sorted(ours.losses) == list(range(steps)), ours.tail()
    torch.testing.assert_close(ours.losses, theirs.losses, **LOSS_TOL, msg="\n".join(lines))
    torch.testing.assert_close(ours.grad_norms, theirs.grad_norms, **LOSS_TOL, msg="\n".join(lines))
    assert theirs.losses[steps - 1] < theirs.losses[0], f"the reference did not learn\n{lines}"
