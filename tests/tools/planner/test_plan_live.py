"""``fsdp2.plan`` inside a running job: beside a live default process group it plans in a forked
copy of the process; the job's group, and its training, are untouched."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import expecttest
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp2
from tests.errors import raised
from tests.harness import run_on_ranks
from tests.models import MODELS, build_model
from tests.parity import MODEL_SEED, local_batch
from tests.tools.planner.test_plan import _records, shard_blocks

pytestmark = pytest.mark.usefixtures("fsdp2_only")


def _plan_then_train(plan_first: bool) -> dict[str, Any]:
    """A job that plans a larger run beside its live default group, then trains."""
    from torch.distributed import distributed_c10d as c10d

    world, names = dist.group.WORLD, dict(c10d._world.pg_names)
    planned = None
    if plan_first:
        plan = fsdp2.plan(MODELS["mlp"].build, shard_blocks, world_size=(2, 4), device="cpu")
        planned = (plan.held_bytes, _records(plan))
    untouched = dist.group.WORLD is world and dict(c10d._world.pg_names) == names
    model = build_model("mlp", MODEL_SEED)
    shard_blocks(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(3):
        loss = model(*local_batch("mlp", step, 0, dist.get_rank(), dist.get_world_size(), 2))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = [p.full_tensor() for p in model.parameters()]  # type: ignore[attr-defined]
    return {"planned": planned, "untouched": untouched, "losses": losses, "params": params}


def test_plan_inside_a_running_job() -> None:
    """fsdp2.plan beside a live gloo group: the same plan as outside one, and the job's group
    and training untouched (bitwise the same as without planning)."""
    plan = fsdp2.plan(MODELS["mlp"].build, shard_blocks, world_size=(2, 4), device="cpu")
    with_plan = run_on_ranks(2, _plan_then_train, True, timeout=120)
    without = run_on_ranks(2, _plan_then_train, False, timeout=120)
    for a, b in zip(with_plan, without, strict=True):
        assert a["planned"] == (plan.held_bytes, _records(plan))
        assert a["untouched"] and a["losses"] == b["losses"]
        for p, q in zip(a["params"], b["params"], strict=True):
            assert torch.equal(p, q)  # the same ops on the same values


class TestErrorsBesideALiveGroup(expecttest.TestCase):
    def test_error_beside_a_live_group(self) -> None:
        """The forked planner's errors come back as they are, with where they happened."""
        text, world = run_on_ranks(1, _plan_error_inside_process_group, timeout=60)[0]
        self.assertEqual(world, 1)  # the rank's own group is still there
        self.assertExpectedInline(
            text,
            """PlanError: world_size must be a positive int (FSDP) or a pair (replicate, shard) of positive ints (HSDP), got 0 | RuntimeError: your config is missing""",
        )


def _failing_build() -> nn.Module:
    raise RuntimeError("your config is missing")


def _plan_error_inside_process_group() -> tuple[str, int]:
    bad_world = raised(lambda: fsdp2.plan(MODELS["mlp"].build, world_size=0))
    try:
        fsdp2.plan(_failing_build, world_size=4)
        bad_build = "no error"
    except RuntimeError as e:
        bad_build = f"RuntimeError: {e}"
        if "_failing_build" not in "".join(getattr(e, "__notes__", [])):
            bad_build += " (the forked traceback is missing)"
    return f"{bad_world} | {bad_build}", dist.get_world_size()


JOB = """
import os, sys
import torch.distributed as dist
import fsdp2
from tests.models import MODELS

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)  # a fresh job: no collective run yet
plan = fsdp2.plan(MODELS["mlp"].build, world_size=1024)
print("planned", plan.world_size, dist.get_world_size(), flush=True)
dist.destroy_process_group()
"""


def test_plan_in_a_fresh_job() -> None:
    """A script's first act after init_process_group: plan (its gloo group has never run a
    collective; destroying its copy in the forked planner once aborted there)."""
    root = str(Path(__file__).resolve().parents[3])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run(
        [sys.executable, "-c", JOB, str(port)],
        env={**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert proc.returncode == 0 and "planned (1024,) 1" in proc.stdout, proc.stderr[-3000:]
