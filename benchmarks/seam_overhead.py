"""What the hang report and the collective checks cost per training step, interleaved.

    torchrun --standalone --nproc-per-node 2 benchmarks/seam_overhead.py [--layers 24]

Three copies of the same fsdp2 model (mlp-stack, per-block ``fully_shard``) take turns, round by
round, so the machine's load hits them alike:
  bare    the hang report's hooks patched out (no event ring, plain ``work.wait()``)
  fsdp2   the default: event ring, bounded waits, publishing thread
  checks  the default plus FSDP2_CHECK_COLLECTIVES (one fingerprint all-gather per collective)
  bare again  a second bare copy: its distance from the first is the noise floor
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # fsdp2 from this checkout
import fsdp2
from fsdp2.debug import hang
from workloads import DEFAULT_SIZES, blocks_of, build_model, make_batch

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
parser.add_argument("--layers", type=int, default=24, help="blocks (%(default)s)")
parser.add_argument("--batch", type=int, default=16, help="global batch (%(default)s)")
parser.add_argument("--rounds", type=int, default=9, help="timing rounds (%(default)s)")
parser.add_argument("--steps", type=int, default=3, help="steps per round each (%(default)s)")
args = parser.parse_args()

dist.init_process_group("gloo")
torch.set_num_threads(1)
rank, world = dist.get_rank(), dist.get_world_size()
size = replace(DEFAULT_SIZES["mlp-stack"], layers=args.layers)
inputs, targets = make_batch("mlp-stack", size, args.batch)
local = slice(rank * args.batch // world, (rank + 1) * args.batch // world)
inputs, targets = inputs[local], targets[local]


def plain_wait(work: Any, event: Any, device: Any, phase: str = "") -> None:
    work.wait()


@contextmanager
def mode(name: str) -> Iterator[None]:
    saved = hang.note, hang.wait
    if name.startswith("bare"):
        hang.note = lambda *a: None  # type: ignore[assignment,return-value]
        hang.wait = plain_wait  # type: ignore[assignment]
    fsdp2.set_collective_checks(name == "checks")
    try:
        yield
    finally:
        hang.note, hang.wait = saved
        fsdp2.set_collective_checks(False)


def make(name: str) -> Callable[[], float]:
    torch.manual_seed(0)
    model = build_model("mlp-stack", size)
    for block in blocks_of(model):
        fsdp2.fully_shard(block)
    fsdp2.fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)

    def step() -> float:
        with mode(name):
            _, loss = model(inputs, targets)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


steps = {name: make(name) for name in ("bare", "fsdp2", "checks", "bare again")}
ms: dict[str, list[float]] = {name: [] for name in steps}
losses: dict[str, float] = {}
load_before = os.getloadavg()[0]
for _ in range(args.rounds):
    for name, step in steps.items():
        for _ in range(2):  # settle after the switch
            step()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(args.steps):
            losses[name] = step()
        ms[name].append((time.perf_counter() - start) / args.steps * 1e3)
load_after = os.getloadavg()[0]
if rank == 0:
    cores = len(os.sched_getaffinity(0))
    print(
        f"mlp-stack, {args.layers} blocks, W={world} (gloo), load {load_before:.1f} → "
        f"{load_after:.1f} on {cores} cores; median of {args.rounds} rounds"
    )
    base = statistics.median(ms["bare"])
    for name, times in ms.items():
        med = statistics.median(times)
        print(
            f"{name:10s} {med:8.1f} ms/step  best {min(times):8.1f}  {100 * (med / base - 1):+5.1f}%"
            f"  loss {losses[name]:.6f}"
        )
dist.barrier()
dist.destroy_process_group()
