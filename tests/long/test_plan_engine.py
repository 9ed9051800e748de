"""fsdp2.plan's collectives against the engine's own step on the planner's meta model, for every
configuration of benchmarks/plan_snapshot.py (benchmarks/plan_vs_engine.py): each plan must list
exactly the collectives the engine issues, in the same order. The real-run tests
(tests/tools/planner) check a few configurations on gloo; this checks them all, in one process,
with no collective actually run (~35 s)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fsdp2_only")]

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "plan_vs_engine.py"


def test_every_plan_lists_the_engines_collectives_in_order() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=900, check=False
    )
    out = proc.stdout + proc.stderr
    first = out.splitlines()[0] if out else ""
    # Only "in order: N" on the summary line: nothing differs, fails or matches only as a multiset
    done = re.fullmatch(r"in order: (\d+)", first)
    assert proc.returncode == 0 and done is not None and int(done[1]) > 300, out[-6000:]
