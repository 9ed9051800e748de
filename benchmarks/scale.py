"""Per-rank memory and step time as the world grows, simulated in one process.

    python benchmarks/scale.py                       # torch and fsdp2, W = 8, 16, …, 1024
    python benchmarks/scale.py --model gpt --dim 512 --worlds 8,64,512

A fake process group (backend "fake") lets this process play rank 0 of W ranks: every collective
returns at once and moves no data. So the bytes are rank 0's real allocations after a training step
(params + grads + AdamW state, ideally 4·P/W for P bytes of fp32 params, plus padding: each
parameter's dim 0 is padded to a multiple of W), and the step time is rank 0's CPU work (hooks,
copies in and out of the collective buffers, the sharded optimizer step) with no network time.
The loss is meaningless: all-gathered parameters are whatever the buffers held.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # fsdp2 from this checkout
from measure import CPUMemory
from workloads import MODELS, ModelSize, blocks_of, build_model, make_batch, param_bytes

try:
    from fsdp2 import fully_shard as fsdp2_fully_shard
except Exception as e:  # fsdp2 may be mid-rewrite: run torch alone and say why
    fsdp2_fully_shard, fsdp2_missing = None, f"{type(e).__name__}: {e}"

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
parser.add_argument("--model", choices=MODELS, default="llama", help="(%(default)s)")
parser.add_argument("--layers", type=int, default=4, help="blocks (%(default)s)")
parser.add_argument("--dim", type=int, default=256, help="width (%(default)s)")
parser.add_argument("--heads", type=int, default=4, help="attention heads (%(default)s)")
parser.add_argument("--seq", type=int, default=16, help="sequence length (%(default)s)")
parser.add_argument("--batch", type=int, default=1, help="rank 0's batch, small (%(default)s)")
parser.add_argument("--worlds", default="8,16,32,64,128,256,512,1024", help="(%(default)s)")
parser.add_argument("--impls", default="fsdp2,torch", help="comma-separated (%(default)s)")
parser.add_argument(
    "--steps", type=int, default=10, help="timed steps per W and impl (%(default)s)"
)
parser.add_argument("--json", type=Path, help="append one JSON line with all results here")
args = parser.parse_args()

size = ModelSize(layers=args.layers, dim=args.dim, heads=args.heads, seq=args.seq)
worlds = [int(w) for w in args.worlds.split(",")]
impls = {"fsdp2": fsdp2_fully_shard, "torch": torch_fully_shard}
impls = {name: impls[name] for name in args.impls.split(",")}
if impls.get("fsdp2", torch_fully_shard) is None:
    del impls["fsdp2"]
    print(f"skipping fsdp2 (not importable yet): {fsdp2_missing}")
torch.set_num_threads(1)  # as in bench.py: rank 0 of W gets one core
inputs, targets = make_batch(args.model, size, args.batch)
total_bytes = param_bytes([build_model(args.model, size)])
cpu_memory = CPUMemory()


def local_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the storages behind `tensors`, each storage once. torch's shards sit in padded
    per-parameter storages (padding counted); fsdp2's own exactly their rows (their padding lives
    in the group's flat buffer, which `allocated_bytes` counts)."""
    storages = {}
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(storages.values())


@dataclass
class Point:
    param_bytes: int  # this rank's parameter storage
    grad_bytes: int
    optim_bytes: int
    allocated_bytes: int  # everything built for this rank that is still live, by the allocator
    step_ms: float


def measure(shard: object, world_size: int) -> Point:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    gc.collect()
    with cpu_memory:
        base = cpu_memory.live_bytes()
        torch.manual_seed(0)
        model = build_model(args.model, size)
        for block in blocks_of(model):
            shard(block)  # type: ignore[operator]
        shard(model)  # type: ignore[operator]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        times = []
        for _ in range(1 + args.steps):  # the first step creates the optimizer state: untimed
            opt.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            _, loss = model(inputs, targets)
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - t0)
        params = list(model.parameters())  # gradients are still held: count them too
        optim_state = [t for s in opt.state.values() for t in s.values() if t.dim() > 0]
        point = Point(
            param_bytes=local_bytes(params),
            grad_bytes=local_bytes([p.grad for p in params if p.grad is not None]),
            optim_bytes=local_bytes(optim_state),  # exp_avg, exp_avg_sq; not the scalar step
            allocated_bytes=cpu_memory.live_bytes() - base,
            step_ms=1e3 * statistics.median(times[1:]),
        )
    del model, opt
    dist.destroy_process_group()
    return point


results: dict[str, dict[int, Point]] = {name: {} for name in impls}
for world_size in worlds:
    for name, shard in impls.items():
        results[name][world_size] = measure(shard, world_size)

MiB = 2**20
table = Table(
    title=f"{args.model} ({total_bytes / MiB:.1f} MiB fp32 params, {args.layers} blocks + root): "
    f"rank 0 of W, fake process group, torch {torch.__version__}"
)
table.add_column("W", justify="right")
table.add_column("ideal MiB\n4·P/W", justify="right")
for name in impls:
    for col in ("params+grads+optim MiB", "allocated MiB", "× ideal", "step ms"):
        table.add_column(f"{name}\n{col}", justify="right")
for world_size in worlds:
    ideal = 4 * total_bytes / world_size  # fp32 params, grads, AdamW exp_avg and exp_avg_sq
    row = [str(world_size), f"{ideal / MiB:.3f}"]
    for name in impls:
        p = results[name][world_size]
        tensors = p.param_bytes + p.grad_bytes + p.optim_bytes
        row += [f"{tensors / MiB:.3f}", f"{p.allocated_bytes / MiB:.3f}"]
        row += [f"{p.allocated_bytes / ideal:.2f}×", f"{p.step_ms:.1f}"]
    table.add_row(*row)
Console(width=180).print(table)
if args.json:
    record = {
        "model": args.model,
        "size": asdict(size),
        "batch": args.batch,
        "torch": torch.__version__,
        "param_bytes": total_bytes,
        "results": {n: {w: asdict(p) for w, p in r.items()} for n, r in results.items()},
    }
    with args.json.open("a") as f:
        f.write(json.dumps(record) + "\n")
