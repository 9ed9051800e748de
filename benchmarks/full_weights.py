"""Full weights out: fsdp2.iter_full_weights against torch's get_model_state_dict.

    torchrun --standalone --nproc-per-node 2 benchmarks/full_weights.py
    torchrun --standalone --nproc-per-node 4 benchmarks/full_weights.py --layers 8 --dim 512
    torchrun --standalone --nproc-per-node 2 benchmarks/full_weights.py --dim 512 \
        --bucket-mib 8 32 256 --contenders torch fsdp2

The examples' GPT, fsdp2's fully_shard on each block and on the root, gathered onto rank 0's
CPU by each contender in turn, round after round (the same load of a shared machine for all):
  torch       get_model_state_dict(full_state_dict=True, cpu_offload=True): the whole model
  fsdp2       iter_full_weights(device="cpu", rank=0), each bucket dropped once received
  fsdp2-all   the same with rank=None: every rank receives every bucket
With several --bucket-mib, fsdp2 and fsdp2-all run once per bucket size ("fsdp2@8"), all
interleaved in each round; each is also given as its median ratio to torch's time in the same
round. Time: the median over rounds, bracketed by barriers. Peak: bytes above what was live before,
counted by the CPU allocator (measure.CPUMemory, every thread) on CPU, or
torch.cuda.max_memory_allocated with --device cuda; on rank 0 and the largest over ranks.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # fsdp2 from this checkout
from fsdp2 import fully_shard, iter_full_weights
from measure import CPUMemory
from workloads import ModelSize, blocks_of, build_model

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
parser.add_argument("--layers", type=int, default=8, help="(%(default)s)")
parser.add_argument("--dim", type=int, default=256, help="(%(default)s)")
parser.add_argument(
    "--bucket-mib", type=float, nargs="+", default=[1.0], help="fsdp2's buckets (%(default)s)"
)
parser.add_argument(
    "--contenders",
    nargs="+",
    choices=["torch", "fsdp2", "fsdp2-all"],
    default=["torch", "fsdp2", "fsdp2-all"],
    help="(%(default)s)",
)
parser.add_argument("--rounds", type=int, default=5, help="(%(default)s)")
parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="(%(default)s)")
args = parser.parse_args()

backend = "nccl" if args.device == "cuda" else "gloo"
dist.init_process_group(backend)
rank, world = dist.get_rank(), dist.get_world_size()
if args.device == "cuda":
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
else:
    torch.set_num_threads(1)
device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else None

torch.manual_seed(0)
model = build_model("gpt", ModelSize(layers=args.layers, dim=args.dim))
if device is not None:
    model.to(device)
for block in blocks_of(model):
    fully_shard(block)
fully_shard(model)
model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())


def torch_full() -> None:
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    del state


def fsdp2_full(to_rank: int | None, bucket_bytes: int) -> Callable[[], None]:
    def run() -> None:
        for bucket in iter_full_weights(
            model, device="cpu", rank=to_rank, bucket_bytes=bucket_bytes
        ):
            del bucket

    return run


def contenders() -> dict[str, Callable[[], None]]:
    found: dict[str, Callable[[], None]] = {}
    if "torch" in args.contenders:
        found["torch"] = torch_full
    for mib in args.bucket_mib:
        suffix = f"@{mib:g}" if len(args.bucket_mib) > 1 else ""
        for name, to_rank in (("fsdp2", 0), ("fsdp2-all", None)):
            if name in args.contenders:
                found[name + suffix] = fsdp2_full(to_rank, int(mib * 2**20))
    return found


CONTENDERS = contenders()
counter = CPUMemory() if device is None else None


def measure(run: Callable[[], None]) -> tuple[float, int]:
    """Seconds and peak bytes above what was live before, on this rank."""
    if counter is not None:
        base = counter.settled_live_bytes()
        counter.reset_peak()
    else:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    dist.barrier()
    start = time.perf_counter()
    run()
    if device is not None:
        torch.cuda.synchronize()
    dist.barrier()
    seconds = time.perf_counter() - start
    peak = counter.peak_bytes() if counter is not None else torch.cuda.max_memory_allocated()
    return seconds, peak - base


times: dict[str, list[float]] = {name: [] for name in CONTENDERS}
peaks: dict[str, int] = dict.fromkeys(CONTENDERS, 0)
with counter if counter is not None else torch.no_grad():
    for run in CONTENDERS.values():  # a throwaway round: first-use allocations land here
        measure(run)
    for _ in range(args.rounds):
        for name, run in CONTENDERS.items():
            seconds, peak = measure(run)
            times[name].append(seconds)
            peaks[name] = max(peaks[name], peak)

mine = torch.tensor([peaks[name] for name in CONTENDERS], device=device)
every_peak = [torch.empty_like(mine) for _ in range(world)]
dist.all_gather(every_peak, mine)
if rank == 0:
    mib = 2**20
    print(f"GPT {args.layers}x{args.dim}: {model_bytes / mib:.1f} MiB of parameters, W={world}")
    buckets = ", ".join(f"{b:g}" for b in args.bucket_mib)
    print(f"fsdp2 bucket: {buckets} MiB; {args.rounds} rounds, {args.device}")
    print(
        f"{'contender':<14} {'median s':>9} {'min s':>8} {'/ torch':>8} "
        f"{'rank-0 peak MiB':>16} {'max peak MiB':>13}"
    )
    for i, name in enumerate(CONTENDERS):
        largest = max(int(p[i]) for p in every_peak)
        ratio = (
            statistics.median(t / r for t, r in zip(times[name], times["torch"], strict=True))
            if "torch" in times
            else float("nan")
        )
        print(
            f"{name:<14} {statistics.median(times[name]):9.4f} {min(times[name]):8.4f} "
            f"{ratio:8.2f} {peaks[name] / mib:16.2f} {largest / mib:13.2f}"
        )
dist.destroy_process_group()
