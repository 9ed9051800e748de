"""The benchmarks' own reference implementations are only worth their timings if they are right.

benchmarks/floor.py's ``least`` is the featureless FSDP that docs/performance.md measures fsdp2
against: if it skipped a reduce-scatter or averaged wrongly, it would be fast for the wrong reason.
It must train exactly like fsdp2 and torch on the same global batch.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.harness import launch

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fsdp2_only")]

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("world", [1, 2])
def test_floor_least_trains_like_fsdp2_and_torch(world: int) -> None:
    script = REPO / "benchmarks" / "floor.py"
    proc = launch(script, world, "--layers", "3", "--rounds", "1", "--steps", "1", timeout=300)
    out = proc.stdout + proc.stderr
    # Read what rank 0 printed before teardown (a gloo job can abort after Python finishes).
    found = re.findall(
        r"^(\w[\w ()]*?) +first losses (.+), gradient norm (\S+)$", out, re.MULTILINE
    )
    losses = {name: loss for name, loss, _ in found}
    norms = {name: norm for name, _, norm in found}
    assert set(losses) == {"plain", "least", "fsdp2", "torch", "torch (again)"}, out[-4000:]
    assert "noise floor" in out, out[-4000:]
    # plain trains on this rank's slice alone; the three FSDPs on the global batch, bit for bit
    # alike (the same reductions in the same order; six digits of three steps' losses).
    assert losses["least"] == losses["fsdp2"] == losses["torch"], losses
    # The first gradients to 10 digits: a factor (a sum for an average) shows here, not in the
    # losses, since AdamW normalizes the gradient's scale away.
    assert norms["least"] == norms["fsdp2"] == norms["torch"], norms
    if world > 1:
        assert losses["plain"] != losses["fsdp2"], losses  # the batch really is split
