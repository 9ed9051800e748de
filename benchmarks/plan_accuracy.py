"""fsdp2.plan's predictions next to what a real run allocates (CPU allocator counter).

    torchrun --standalone --nproc-per-node 2 benchmarks/plan_accuracy.py --model gpt
    python benchmarks/plan_accuracy.py --model llama            # W=1
    torchrun --standalone --nproc-per-node 2 benchmarks/plan_accuracy.py --memory-mode zero2
    torchrun --standalone --nproc-per-node 4 benchmarks/plan_accuracy.py --memory-mode hfsdp

Rank 0 plans first (before the process group exists), then every rank trains: two AdamW steps,
then bytes live (held between steps: params, grads, optimizer state, buffers), then the peak of
one more forward+backward after zero_grad (the FSDP transient, activations and the gradients
arriving), against the plan's held bytes and its peak bound.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # fsdp2 from this checkout
import fsdp2
from measure import CPUMemory
from workloads import DEFAULT_SIZES, MODELS, blocks_of, build_model, make_batch

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
parser.add_argument("--model", choices=MODELS, default="gpt")
parser.add_argument("--batch", type=int, default=8, help="global batch (%(default)s)")
parser.add_argument(
    "--memory-mode",
    choices=("zero3", "zero2", "hfsdp"),
    default="zero3",
    help="hfsdp: on a (2, W/2) mesh (%(default)s)",
)
args = parser.parse_args()
torch.set_num_threads(1)
size = DEFAULT_SIZES[args.model]
world = int(os.environ.get("WORLD_SIZE", "1"))
rank = int(os.environ.get("RANK", "0"))
inputs, targets = make_batch(args.model, size, args.batch)
local = (inputs.chunk(world)[rank], targets.chunk(world)[rank])


def shard(model: torch.nn.Module, mesh: DeviceMesh | None = None) -> None:
    kwargs = {"memory_mode": args.memory_mode, **({"mesh": mesh} if mesh is not None else {})}
    for block in blocks_of(model):
        fsdp2.fully_shard(block, **kwargs)
    fsdp2.fully_shard(model, **kwargs)


shape = (2, world // 2) if args.memory_mode == "hfsdp" else (world,)
plan = fsdp2.plan(
    lambda: build_model(args.model, size), shard, world_size=shape, device="cpu", batch=local
)
mesh = None
if world > 1:
    dist.init_process_group("gloo")
    if len(shape) == 2:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
mem = CPUMemory()
with mem:
    gc.collect()
    base = mem.settled_live_bytes()
    torch.manual_seed(0)
    model = build_model(args.model, size)
    if world > 1:
        shard(model, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        model(*local)[1].backward()
        opt.step()
    held = mem.settled_live_bytes() - base
    opt.zero_grad(set_to_none=True)
    gc.collect()
    start = mem.settled_live_bytes() - base
    mem.reset_peak()
    model(*local)[1].backward()
    peak = mem.peak_bytes() - base
    opt.step()
helds = [held]
if world > 1:  # the last rank: fewest real rows, so padding in its buffers
    helds = [0] * world
    dist.all_gather_object(helds, held)
if rank == 0:
    MiB = 2**20
    print(plan)
    steps = 4 * sum(1 for p in model.parameters() if p.requires_grad)  # AdamW's 0-d step
    print(f"held: measured {held} B vs planned {plan.held_bytes} B + {steps} B of step counts")
    # Shard and gradient buffers are the same size on every rank; AdamW's state follows the
    # real rows, of which the last rank has the fewest (2 states x its real gradient rows).
    last = plan.held_bytes - plan.optim_bytes + 2 * sum(g.grad_last_bytes for g in plan.groups)
    print(f"last rank held: measured {helds[-1]} B vs planned {last} B + {steps} B")
    print(
        f"measured peak {peak / MiB:.3f} MiB (step start {start / MiB:.3f}) vs planned "
        f"{plan.peak_bytes / MiB:.3f} MiB ({(plan.peak_bytes / peak - 1) * 100:+.1f}%)",
        flush=True,
    )
if world > 1:
    # Reported before any rank tears down: a gloo rank that aborts in teardown gets the others
    # killed, and rank 0's buffered output would go with it.
    dist.barrier()
    dist.destroy_process_group()
