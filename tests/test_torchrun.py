"""The library under the real launcher: ``torchrun`` runs `tests/parity/__main__.py` on 2 processes.

Few and slow on purpose (each starts 3 fresh Python processes); the harness-based tests cover
the rest. A parity failure must surface as a non-zero exit, or these tests could not fail.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.harness import IMPL_UNDER_TEST, launch

REPO_ROOT = Path(__file__).resolve().parent.parent
PARITY_SCRIPT = REPO_ROOT / "tests" / "parity" / "__main__.py"
NPROC = 2
TIMEOUT_S = 180

pytestmark = pytest.mark.slow


def torchrun_parity(*args: str) -> subprocess.CompletedProcess[str]:
    return launch(PARITY_SCRIPT, NPROC, *args, timeout=TIMEOUT_S)


def ok_lines(stdout: str) -> dict[int, str]:
    pattern = r"PARITY OK rank=(\d+) .*?max_param_diff=[0-9.e+-]+"
    return {int(m.group(1)): m.group(0) for m in re.finditer(pattern, stdout)}


@pytest.mark.parametrize("model", ["gpt", "odd_shapes_scalar"])
def test_parity_under_torchrun(model: str) -> None:
    if model == "odd_shapes_scalar" and IMPL_UNDER_TEST != "fsdp2":
        pytest.skip("0-d parameters: fsdp2 only")
    proc = torchrun_parity("--model", model, "--impl", IMPL_UNDER_TEST)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    lines = ok_lines(proc.stdout)
    assert sorted(lines) == list(range(NPROC)), proc.stdout
    assert all(f"world_size={NPROC} model={model}" in line for line in lines.values())


def test_parity_failure_exits_nonzero_under_torchrun() -> None:
    proc = torchrun_parity("--model", "mlp", "--impl", IMPL_UNDER_TEST, "--corrupt", "grad")
    assert proc.returncode != 0
    assert ok_lines(proc.stdout) == {}
    assert "grad" in proc.stderr and "not close" in proc.stderr, proc.stderr[-5000:]
