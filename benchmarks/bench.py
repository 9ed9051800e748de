"""Step time, peak memory and communication of fsdp2 vs torch's FSDP2 vs DDP vs one process.

    torchrun --standalone --nproc-per-node 2 benchmarks/bench.py --model mlp-stack
    python benchmarks/bench.py                          # W=1: per-module overhead only
    python benchmarks/bench.py --device cuda            # NCCL; W GPUs with torchrun

Every contender trains the same model from the same init on the same global batch (AdamW):
  fsdp2   fsdp2.fully_shard on each block, then on the root
  torch   torch.distributed.fsdp.fully_shard, applied the same way
  ddp     DistributedDataParallel
  single  the plain model on this rank's slice of the batch, no communication (the lower bound)
  fsdp2-zero2  fsdp2 with memory_mode="zero2" (parameters kept gathered between steps)
  fsdp2-zero1  the same, gradient sync on the last micro-batch only (the ZeRO-1 recipe)
  fsdp2-hfsdp  fsdp2 with memory_mode="hfsdp" (needs --replicas)
With --replicas R the sharded contenders run on a (R, W/R) mesh: HSDP, or HFSDP.
plus a second, separately built `torch` whose distance from the first is the noise floor.
With --accumulate K each step is K micro-batches (the rank's slice cut in K): `ddp` syncs on the
last only (`no_sync` before), as accumulating DDP users write it; `ddp-sync` and the sharded
ones reduce every one.
With --collective-checks, also `fsdp2+checks`: fsdp2 with FSDP2_CHECK_COLLECTIVES on for its steps.
See benchmarks/README.md for what each column means.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import json
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table
from torch import nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # fsdp2 from this checkout
from measure import CommCounter, CommCounts, CPUMemory, exposed_comm_ms, leave, timed
from workloads import DEFAULT_SIZES, MODELS, blocks_of, build_model, make_batch, param_bytes

try:
    import fsdp2
    from fsdp2 import fully_shard as fsdp2_fully_shard
    from fsdp2.engine.coalesce import coalesce_bytes
except Exception as e:  # fsdp2 may be mid-rewrite: benchmark the others and say why
    fsdp2_fully_shard, fsdp2_missing = None, f"{type(e).__name__}: {e}"

# ---------------------------------------------------------------------------------------------
# arguments

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
parser.add_argument("--model", choices=MODELS, default="mlp-stack")
parser.add_argument("--layers", type=int, help="blocks (default: mlp-stack 96, gpt/llama 4)")
parser.add_argument("--dim", type=int, help="width (default: mlp-stack 64, gpt/llama 128)")
parser.add_argument("--heads", type=int, help="attention heads (gpt/llama, default 4)")
parser.add_argument("--seq", type=int, help="sequence length (gpt/llama, default 64)")
parser.add_argument("--batch", type=int, default=16, help="global batch (%(default)s)")
parser.add_argument(
    "--accumulate", type=int, default=1, help="micro-batches per step (%(default)s)"
)
parser.add_argument(
    "--replicas", type=int, default=0, help="a (R, W/R) mesh for the sharded ones (%(default)s)"
)
parser.add_argument("--contenders", default="fsdp2,torch,ddp,single", help="(%(default)s)")
parser.add_argument("--warmup", type=int, default=3, help="untimed steps each (%(default)s)")
parser.add_argument("--rounds", type=int, default=10, help="timing rounds, ≥5 (%(default)s)")
parser.add_argument("--steps", type=int, default=3, help="steps per round each (%(default)s)")
parser.add_argument(
    "--settle", type=int, default=4, help="untimed steps before each round's (%(default)s)"
)
parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (%(default)s)")
parser.add_argument("--no-memory", action="store_true", help="skip peak memory (needs g++)")
parser.add_argument("--json", type=Path, help="append one JSON line with all results here")
parser.add_argument(
    "--collective-checks", action="store_true", help="also time fsdp2 with collective checks on"
)
parser.add_argument(
    "--coalesce-off",
    action="store_true",
    help="also time `fsdp2-off`: fsdp2 with coalescing off (set_coalesce_bytes(0)) for its steps",
)
parser.add_argument(
    "--device", choices=("cpu", "cuda"), default="cpu", help="cpu: gloo; cuda: NCCL (%(default)s)"
)
parser.add_argument(
    "--fake-world",
    type=int,
    default=0,
    help="run as rank 0 of N on torch's fake process group: collectives cost nothing and move no "
    "data (losses are meaningless), so the step is the per-rank overhead of sharding N ways, "
    "e.g. on one GPU",
)
args = parser.parse_args()

overrides = {k: v for k in ("layers", "dim", "heads", "seq") if (v := getattr(args, k))}
size = replace(DEFAULT_SIZES[args.model], **overrides)
names = args.contenders.split(",")
if args.collective_checks and "fsdp2" in names:
    names.insert(names.index("fsdp2") + 1, "fsdp2+checks")
if args.coalesce_off and "fsdp2" in names:
    names.insert(names.index("fsdp2") + 1, "fsdp2-off")
KNOWN = {
    "fsdp2",
    "fsdp2+checks",
    "fsdp2-off",
    "fsdp2-zero2",
    "fsdp2-zero1",
    "fsdp2-hfsdp",
    "torch",
    "ddp",
    "ddp-sync",
    "single",
}
if unknown := set(names) - KNOWN:
    raise ValueError(f"--contenders: unknown {sorted(unknown)}; pick from {sorted(KNOWN)}")
if args.rounds < 5:
    raise ValueError(f"--rounds must be at least 5 for a meaningful median, got {args.rounds}")

# ---------------------------------------------------------------------------------------------
# process group, data

backend = "nccl" if args.device == "cuda" else "gloo"
if args.device == "cuda":
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else None
if args.fake_world:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    backend = "fake"
    dist.init_process_group(backend, store=FakeStore(), rank=0, world_size=args.fake_world)
elif "RANK" in os.environ:
    dist.init_process_group(backend)
else:  # plain `python benchmarks/bench.py`: one rank, as with --nproc-per-node 1
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
rank, world_size = dist.get_rank(), dist.get_world_size()
# One thread per rank, also at W=1: these ops are too small for intra-op threads to pay, and on a
# busy 2-core machine idle OpenMP threads spin against the ranks (W=1 with 2 threads: 10× slower).
torch.set_num_threads(args.threads)
if args.batch % (world_size * args.accumulate):
    raise ValueError(
        f"--batch {args.batch} must be divisible by the world size {world_size} times "
        f"--accumulate {args.accumulate}"
    )
inputs, targets = make_batch(args.model, size, args.batch)
local = slice(rank * args.batch // world_size, (rank + 1) * args.batch // world_size)
inputs, targets = inputs[local], targets[local]  # every contender sees this rank's slice
if device is not None:
    inputs, targets = inputs.to(device), targets.to(device)

if "fsdp2" in names and fsdp2_fully_shard is None:
    names = [n for n in names if not n.startswith("fsdp2")]
    if rank == 0:
        print(f"skipping fsdp2 (not importable yet): {fsdp2_missing}")
if "torch" in names:
    names.append("torch#2")  # a second torch, built separately: torch vs torch is the noise floor
hsdp_mesh = None
if args.replicas:
    from torch.distributed.device_mesh import init_device_mesh

    shape = (args.replicas, world_size // args.replicas)
    hsdp_mesh = init_device_mesh(args.device, shape, mesh_dim_names=("replicate", "shard"))
# Compile the allocator counter now, not after a minute of timing (g++, ~15 s the first time).
cpu_memory = None if args.no_memory or device is not None else CPUMemory()

# ---------------------------------------------------------------------------------------------
# contenders


@dataclass
class Contender:
    name: str
    model: nn.Module
    opt: torch.optim.Optimizer
    loss: torch.Tensor | None = None  # the last step's; read at the end (.item() would sync)


def build(name: str) -> Contender:
    torch.manual_seed(0)  # same init for every contender
    model = build_model(args.model, size)
    if device is not None:
        model = model.to(device)
    mesh = {"mesh": hsdp_mesh} if hsdp_mesh is not None else {}
    if name in ("fsdp2", "fsdp2+checks", "fsdp2-off", "torch", "torch#2"):
        shard = fsdp2_fully_shard if name.startswith("fsdp2") else torch_fully_shard
        for block in blocks_of(model):
            shard(block, **mesh)
        shard(model, **mesh)
    elif name in ("fsdp2-zero2", "fsdp2-zero1", "fsdp2-hfsdp"):
        mode = "hfsdp" if name == "fsdp2-hfsdp" else "zero2"
        for block in blocks_of(model):
            fsdp2_fully_shard(block, memory_mode=mode, **mesh)
        fsdp2_fully_shard(model, memory_mode=mode, **mesh)
    elif name in ("ddp", "ddp-sync"):
        # Our buffers (Llama's rotary table) never change: don't broadcast them every step.
        new_kwarg = "forward_sync_buffers" in inspect.signature(DDP).parameters
        model = DDP(model, **{"forward_sync_buffers" if new_kwarg else "broadcast_buffers": False})
    # foreach: the default on GPU; on CPU torch would pick the one-parameter-at-a-time loop.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    return Contender(name, model, opt)


coalesce_budget = coalesce_bytes() if fsdp2_fully_shard is not None else 0


def train_step(c: Contender) -> None:
    if fsdp2_fully_shard is not None:
        fsdp2.set_collective_checks(c.name == "fsdp2+checks")
        fsdp2.set_coalesce_bytes(0 if c.name == "fsdp2-off" else coalesce_budget)
    micro = args.accumulate
    for i, (x, y) in enumerate(zip(inputs.chunk(micro), targets.chunk(micro), strict=True)):
        last = i == micro - 1
        if c.name == "fsdp2-zero1":
            c.model.set_requires_gradient_sync(last)
        sync = c.model.no_sync() if c.name == "ddp" and not last else contextlib.nullcontext()
        with sync:
            _, loss = c.model(x, y)
            (loss / micro).backward()
    c.opt.step()
    c.opt.zero_grad(set_to_none=True)
    c.loss = loss.detach()


# ---------------------------------------------------------------------------------------------
# 1. step time: contenders interleaved round by round, so drift and others' load hit them all

load_before = os.getloadavg()[0]  # other processes on the machine: the main source of noise here
contenders = [build(n) for n in names]
for _ in range(args.warmup):
    for c in contenders:
        train_step(c)


def fsdp_collectives_alone() -> Callable[[], None] | None:
    """The collectives of one FSDP step (per-block fully_shard, blocks reshard after forward),
    issued back to back with no compute: what gloo alone costs, the floor under any FSDP."""
    if world_size == 1 or args.fake_world:
        return None
    model = build_model(args.model, size)
    blocks = [list(block.parameters()) for block in blocks_of(model)]
    in_blocks = {id(p) for params in blocks for p in params}
    root = [p for p in model.parameters() if id(p) not in in_blocks]

    def shard_numel(params: list[nn.Parameter]) -> int:  # dim 0 padded to a multiple of W
        return sum(-(-p.shape[0] // world_size) * p[0].numel() if p.dim() else 1 for p in params)

    bufs = [
        (torch.empty(n, device=device), torch.empty(n * world_size, device=device))
        for n in map(shard_numel, [root, *blocks])
    ]

    def step() -> None:
        for shard, full in bufs:  # forward: the root, then every block
            dist.all_gather_into_tensor(full, shard, async_op=True).wait()
        for shard, full in reversed(bufs[1:]):  # backward: each block again, then its gradients
            dist.all_gather_into_tensor(full, shard, async_op=True).wait()
            dist.reduce_scatter_tensor(shard, full, async_op=True).wait()
        dist.reduce_scatter_tensor(bufs[0][0], bufs[0][1], async_op=True).wait()

    return step


comm_alone = fsdp_collectives_alone()
comm_alone_s: list[float] = []
step_s: dict[str, list[float]] = {n: [] for n in names}
for _ in range(args.rounds):
    gc.collect()  # between measurements, not inside one
    for c in contenders:
        # Untimed steps first: right after another contender, a contender's steps are slower for
        # a few steps (mlp-stack W=2, fsdp2's k-th step after torch's: 189, 169, 151, 168, then
        # 129-145 ms; torch's after fsdp2's: 284, 236, then ~310), so short rounds would time the
        # switch instead of the contender. Users run one implementation: time the steady state.
        for _ in range(args.settle):
            train_step(c)
        step_s[c.name].append(timed(lambda c=c: train_step(c), args.steps))
    if comm_alone is not None:
        for _ in range(args.settle):
            comm_alone()
        comm_alone_s.append(timed(comm_alone, args.steps))
# same steps taken: fsdp2, torch and ddp agree
losses = {c.name: float(c.loss) if c.loss is not None else float("nan") for c in contenders}
load_after = os.getloadavg()[0]

# ---------------------------------------------------------------------------------------------
# 2. collectives and their bytes, seen at the dispatcher during one more (untimed) step

comms: dict[str, CommCounts] = {}
for c in contenders:
    with CommCounter(world_size) as counter:
        train_step(c)
    comms[c.name] = counter.counts
# On a GPU: collective kernel time not hidden behind any other kernel, from one profiled step.
exposed: dict[str, tuple[float, float]] = {}
if device is not None:
    for c in contenders:
        exposed[c.name] = exposed_comm_ms(lambda c=c: train_step(c))
del contenders, c

# ---------------------------------------------------------------------------------------------
# 3. memory: count every CPU allocation while building each contender and training it 3 steps


def measure_memory(name: str, mem: CPUMemory) -> tuple[int, int]:
    """(peak bytes during the third step, bytes live when it starts: params + optimizer state)."""
    gc.collect()
    base = mem.settled_live_bytes()
    c = build(name)
    for _ in range(2):  # the optimizer state exists, DDP has rebuilt its buckets
        train_step(c)
    state = mem.settled_live_bytes() - base
    mem.reset_peak()
    train_step(c)
    return mem.peak_bytes() - base, state


def measure_cuda_memory(name: str) -> tuple[int, int]:
    """As measure_memory, from the CUDA caching allocator's own counters."""
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    c = build(name)
    for _ in range(2):
        train_step(c)
    torch.cuda.synchronize()
    state = torch.cuda.memory_allocated() - base
    torch.cuda.reset_peak_memory_stats()
    train_step(c)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, state


memory: dict[str, tuple[int, int]] = {}
if device is not None and not args.no_memory:
    measure_cuda_memory("single")  # throwaway: cuBLAS workspaces and the like land here
    memory = {n: measure_cuda_memory(n) for n in names if n != "torch#2"}
if cpu_memory is not None:
    with cpu_memory:
        measure_memory("single", cpu_memory)  # throwaway: first-use allocations land here
        memory = {n: measure_memory(n, cpu_memory) for n in names if n != "torch#2"}

# ---------------------------------------------------------------------------------------------
# gather to rank 0: a step lasts as long as its slowest rank; memory is kept per rank

per_rank: list[dict[str, dict]] = [{}] * world_size
dist.all_gather_object(
    per_rank, {"step_s": step_s, "memory": memory, "comm_s": comm_alone_s, "exposed": exposed}
)


if rank != 0:
    leave()

plain = build_model(args.model, size)
total_bytes = param_bytes([plain])
block_bytes = param_bytes(list(blocks_of(plain)))
share = (world_size - 1) / world_size
# FSDP's least traffic: all-gather each block in forward and again in backward (it reshards after
# forward), the root once (it stays unsharded for backward), reduce-scatter every gradient once.
# Per step of K micro-batches: ZeRO-3 gathers and reduces every micro-batch; zero2 gathers once
# and reduces every micro-batch; zero1 and DDP (no_sync) gather and reduce once.
K = args.accumulate
R = args.replicas or 1
S = world_size // R
shard_share = (S - 1) / S  # with replicas the gathers run over the S ranks of a replica
# Reducing every gradient once: a reduce-scatter over S, then (HSDP) its 1/S all-reduced over R.
reduce_all = total_bytes * shard_share + 2 * total_bytes / S * (R - 1) / R
min_wire = {
    "fsdp": K * ((2 * block_bytes + (total_bytes - block_bytes)) * shard_share + reduce_all),
    "fsdp2-zero2": total_bytes * shard_share + K * reduce_all,
    "fsdp2-zero1": total_bytes * shard_share + reduce_all,
    "fsdp2-hfsdp": total_bytes * (R - 1) / (R * S)
    + K * ((2 * block_bytes + (total_bytes - block_bytes)) * (S - 1) / S + total_bytes * share),
    "ddp": 2 * total_bytes * share,  # ring all-reduce of every gradient
    "ddp-sync": K * 2 * total_bytes * share,
    "single": 0.0,
}


@dataclass
class Result:
    step_ms_median: float
    step_ms_rounds: list[float]  # per round, the slowest rank's
    peak_bytes_per_rank: list[int] | None  # during a step
    state_bytes_per_rank: list[int] | None  # between steps: params, optimizer state, buffers
    collectives_per_step: dict[str, int]
    payload_bytes_per_step: dict[str, int]  # full tensor: all-gather output, reduce-scatter input
    wire_bytes_per_step: float  # received per rank, ring algorithm
    min_wire_bytes_per_step: float
    loss: float  # rank 0's, after the timed steps

    @property
    def peak_bytes(self) -> int | None:
        return max(self.peak_bytes_per_rank) if self.peak_bytes_per_rank else None


results: dict[str, Result] = {}
for n in names:
    ms = [1e3 * max(r["step_s"][n][i] for r in per_rank) for i in range(args.rounds)]
    mem = [r["memory"][n] for r in per_rank] if n in memory else None
    results[n] = Result(
        step_ms_median=statistics.median(ms),
        step_ms_rounds=ms,
        peak_bytes_per_rank=[m[0] for m in mem] if mem else None,
        state_bytes_per_rank=[m[1] for m in mem] if mem else None,
        collectives_per_step=comms[n].calls,
        payload_bytes_per_step=comms[n].payload,
        wire_bytes_per_step=comms[n].wire,
        min_wire_bytes_per_step=min_wire.get(n, min_wire["fsdp"]),
        loss=losses[n],
    )

# ---------------------------------------------------------------------------------------------
# report

MiB = 2**20


def label(name: str) -> str:
    return "torch (again)" if name == "torch#2" else name


def vs(value: float | None, ref: float | None, unit: str = "×") -> str:
    return f"{value / ref:.2f}{unit}" if value is not None and ref else "—"


torch_ref = results.get("torch")
title = (
    f"{args.model}: {total_bytes / MiB:.2f} MiB fp32 params in {len(blocks_of(plain))} blocks + "
    f"root, global batch {args.batch} in {K} micro-batch(es), W={world_size} ({backend}), {torch.get_num_threads()} "
    f"thread(s)/rank, torch {torch.__version__}"
)
table = Table(title=title)
columns = ["contender", "median ms", "best ms", "× torch", "peak MiB/rank", "× torch"]
columns += ["state MiB/rank", "AG/step", "RS/step", "AR/step", "MiB/step/rank", "× minimum"]
for col in columns:
    table.add_column(col, justify="left" if col == "contender" else "right")
for n, r in results.items():
    state = max(r.state_bytes_per_rank) if r.state_bytes_per_rank else None
    table.add_row(
        label(n),
        f"{r.step_ms_median:.1f}",
        f"{min(r.step_ms_rounds):.1f}",
        vs(r.step_ms_median, torch_ref and torch_ref.step_ms_median),
        f"{r.peak_bytes / MiB:.2f}" if r.peak_bytes is not None else "—",
        vs(r.peak_bytes, torch_ref and torch_ref.peak_bytes),
        f"{state / MiB:.2f}" if state is not None else "—",
        *(str(r.collectives_per_step[k]) for k in ("all_gather", "reduce_scatter", "all_reduce")),
        f"{r.wire_bytes_per_step / MiB:.3f}",
        f"{r.wire_bytes_per_step / r.min_wire_bytes_per_step:.3f}×"
        if r.min_wire_bytes_per_step
        else "—",
    )
console = Console(width=180)  # torchrun pipes stdout: rich would otherwise assume 80 columns
console.print(table)
if "torch#2" in results and torch_ref:
    spread = abs(results["torch#2"].step_ms_median / torch_ref.step_ms_median - 1)
    console.print(f"noise floor: two torch FSDP2 instances differ by {100 * spread:.1f}% (median)")
if comm_alone_s:
    floor = statistics.median(
        1e3 * max(r["comm_s"][i] for r in per_rank) for i in range(args.rounds)
    )
    against = ", ".join(
        f"{label(n)} {r.step_ms_median / floor:.2f}×" for n, r in results.items() if n != "single"
    )
    console.print(
        f"the same collectives alone, back to back, no compute: {floor:.1f} ms/step median "
        f"(step time over that: {against})"
    )
cores = len(os.sched_getaffinity(0))
console.print(f"load average while timing: {load_before:.1f} → {load_after:.1f} on {cores} cores")
if exposed:
    listed = ", ".join(
        f"{label(n)} {max(r['exposed'][n][0] for r in per_rank):.2f}"
        f" of {max(r['exposed'][n][1] for r in per_rank):.2f}"
        for n in names
    )
    console.print(f"exposed / total collective kernel ms in one profiled step (max rank): {listed}")
# Parity: the sharded contenders and DDP trained the same model on the same batches.
same = {n: r.loss for n, r in results.items() if n != "single"}
if same:
    spread = max(same.values()) - min(same.values())
    listed = ", ".join(f"{label(n)} {v:.6f}" for n, v in same.items())
    console.print(f"rank 0's loss after the timed steps: {listed} (spread {spread:.1e})")
if args.json:
    record = {
        "model": args.model,
        "size": asdict(size),
        "batch": args.batch,
        "accumulate": args.accumulate,
        "world_size": world_size,
        "threads_per_rank": torch.get_num_threads(),
        "torch": torch.__version__,
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "load_average": [load_before, load_after],
        "param_bytes": total_bytes,
        "results": {n: asdict(r) | {"peak_bytes": r.peak_bytes} for n, r in results.items()},
        "device": args.device,
        "exposed_comm_ms": [r["exposed"] for r in per_rank],
    }
    with args.json.open("a") as f:
        f.write(json.dumps(record) + "\n")
leave()
