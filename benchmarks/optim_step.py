"""The optimizer step alone: fsdp2's sharded parameters against torch's, and against plain ones.

    python benchmarks/optim_step.py                      # mlp-stack, W = 1 and 2
    python benchmarks/optim_step.py --model gpt --worlds 2 --rounds 80

One process plays rank 0 of W on a fake process group (W = 1: a real one-rank gloo group), so
``opt.step()`` is exactly what a rank runs, with no network in the way. Each contender trains a
few steps to make its gradients and AdamW state, then the contenders take turns, round by round,
timing ``opt.step()`` alone in thread CPU time (other processes' load does not count). The
gradients stay in place between rounds, so every timed step sees the same tensors.

Contenders: ``fsdp2`` and ``torch`` (``fully_shard`` per block and on the root), ``torch
(again)``, a second torch copy whose distance from the first is the noise floor, and at W = 1
``plain`` (no FSDP: the same optimizer over plain tensors, what DTensor dispatch adds on top).
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
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.testing._internal.distributed.fake_pg import FakeStore

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # fsdp2 from this checkout
from fsdp2 import fully_shard as fsdp2_fully_shard
from workloads import DEFAULT_SIZES, MODELS, blocks_of, build_model, make_batch

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
parser.add_argument("--model", choices=MODELS, default="mlp-stack", help="(%(default)s)")
parser.add_argument("--worlds", default="1,2", help="(%(default)s)")
parser.add_argument("--rounds", type=int, default=60, help="(%(default)s)")
parser.add_argument(
    "--impl",
    choices=("foreach", "fused"),
    default="foreach",
    help="AdamW's implementation (%(default)s)",
)
args = parser.parse_args()
torch.set_num_threads(1)
size = DEFAULT_SIZES[args.model]
inputs, targets = make_batch(args.model, size, 8)


def make(shard: Callable[..., object] | None) -> Callable[[], float]:
    torch.manual_seed(0)
    model = build_model(args.model, size)
    if shard is not None:
        for block in blocks_of(model):
            shard(block)
        shard(model)
    kwargs = {"fused": True} if args.impl == "fused" else {"foreach": True}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **kwargs)
    for _ in range(3):  # the AdamW state exists; gradients stay for the timed steps
        opt.zero_grad(set_to_none=True)
        _, loss = model(inputs, targets)
        loss.backward()
        opt.step()

    def step() -> float:
        start = time.thread_time()
        opt.step()
        return time.thread_time() - start

    return step


for world in [int(w) for w in args.worlds.split(",")]:
    if world == 1:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group("gloo", rank=0, world_size=1)
    else:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    contenders: dict[str, Callable[[], float]] = {
        "fsdp2": make(fsdp2_fully_shard),
        "torch": make(torch_fully_shard),
        "torch (again)": make(torch_fully_shard),
    }
    if world == 1:
        contenders["plain"] = make(None)
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(args.rounds):
        for name, step in contenders.items():
            step()  # settle after the switch
            times[name].append(step())
    base = statistics.median(times["torch"])
    print(
        f"{args.model}, W={world}, AdamW {args.impl}: opt.step() thread CPU ms, "
        f"median of {args.rounds} rounds"
    )
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:14s} {1e3 * med:8.2f}  {med / base:5.2f}× torch")
    dist.destroy_process_group()
