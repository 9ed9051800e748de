"""``fsdp2.patch_torch_fsdp()``: the one-line switch for frameworks that import torch's FSDP2.

The swap changes module globals for the whole process, so each check runs in a fresh Python
(a subprocess) rather than in the test process or the shared rank pools.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# A framework module that imported torch's names at load time, before the swap, and one that
# looks them up when called (as accelerate does).
SCRIPT = textwrap.dedent(
    """
    import types, sys
    import torch, torch.nn as nn, torch.distributed as dist
    from torch.distributed.fsdp import fully_shard as early_fully_shard, FSDPModule as EarlyModule
    import torch.distributed.fsdp._fully_shard._fully_shard as torch_impl
    kept = [torch_impl.fully_shard]  # in a list: module globals are what the swap rewrites

    framework = types.ModuleType("framework")
    exec("from torch.distributed.fsdp import fully_shard, FSDPModule", framework.__dict__)
    sys.modules["framework"] = framework

    import fsdp2
    fsdp2.patch_torch_fsdp()
    fsdp2.patch_torch_fsdp()  # a second call changes nothing

    import torch.distributed.fsdp as public
    import torch.distributed._composable.fsdp as composable
    checks = {
        "public": public.fully_shard is fsdp2.fully_shard and public.FSDPModule is fsdp2.FSDPModule,
        "composable": composable.fully_shard is fsdp2.fully_shard,
        "policy": public.MixedPrecisionPolicy is fsdp2.MixedPrecisionPolicy,
        "loaded_module": framework.fully_shard is fsdp2.fully_shard
        and framework.FSDPModule is fsdp2.FSDPModule,
        "late_import": __import__("torch.distributed.fsdp", fromlist=["x"]).fully_shard
        is fsdp2.fully_shard,
        "torch_impl_untouched": torch_impl.fully_shard is kept[0],
        "early_names": early_fully_shard is fsdp2.fully_shard and EarlyModule is fsdp2.FSDPModule,
        "fsdp1_untouched": public.FullyShardedDataParallel.__module__.startswith("torch."),
    }
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    framework.fully_shard(model[0])
    framework.fully_shard(model)
    checks["sharded_by_fsdp2"] = type(model).__module__ == "fsdp2" or isinstance(model, fsdp2.FSDPModule)
    checks["isinstance_in_framework"] = isinstance(model, framework.FSDPModule)
    model(torch.randn(3, 4)).sum().backward()
    checks["trains"] = all(p.grad is not None for p in model.parameters())
    print("CHECKS", sorted(name for name, ok in checks.items() if not ok), flush=True)
    dist.destroy_process_group()
    """
)


def test_patch_torch_fsdp_reaches_every_reference() -> None:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("CHECKS")]
    assert lines, f"the script did not report:\n{result.stdout}\n{result.stderr[-3000:]}"
    assert lines[0] == "CHECKS []", f"failed checks: {lines[0]}\n{result.stderr[-3000:]}"
