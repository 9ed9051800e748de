"""How fast any DTensor-based FSDP could be on this machine: the least one, against fsdp2 and torch.

    python benchmarks/floor.py                                        # W = 1
    torchrun --standalone --nproc-per-node 2 benchmarks/floor.py      # W = 2

``least`` (below) is per-parameter FSDP with nothing but the work itself: sharded ``DTensor``
parameters for the optimizer, one blocking all-gather per block before its forward and again
before its backward, one reduce-scatter per block once its gradients are in, a new gradient
``DTensor`` per parameter. It has no checks, no recovery, no hang report, no prefetch, no mixed
precision, and it handles only models like the mlp-stack (every parameter used once per forward,
dim 0 divisible by W, one tensor output per block). It exists to measure a floor: whatever step
time it takes, a complete implementation cannot beat by much.

Contenders take turns, round by round, on the same model, init and global batch (each rank its
slice): ``plain`` (no FSDP and no communication: this rank's compute and optimizer alone),
``least``, ``fsdp2`` (one collective per block: coalescing off, the floor's own terms),
``fsdp2 coal.`` (coalescing at its budget: fewer collectives than the floor), ``torch``
(``fully_shard``) and ``torch (again)``, whose distance from the first torch copy is the noise
floor. Losses are printed first: ``least`` must train exactly like
the others, or its time means nothing.

Build order matters at one rank. Where in the process a contender's model is built moves its
step by up to ~10% on this machine: two copies of fsdp2 in one process differ by that much with
the same instruction count and the same simulated cache misses (valgrind), so it is the memory
layout, not the code. ``--rotate R`` builds the models starting from the R-th contender;
``--all-rotations`` (one rank) runs every rotation in a fresh process and prints each ratio's
median over them, the figure to quote. With torchrun, run ``--rotate R`` for each R.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # fsdp2 from this checkout
from fsdp2 import fully_shard as fsdp2_fully_shard
from fsdp2 import set_coalesce_bytes
from fsdp2.engine.coalesce import coalesce_bytes
from workloads import DEFAULT_SIZES, build_model, make_batch

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
parser.add_argument("--layers", type=int, default=DEFAULT_SIZES["mlp-stack"].layers)
parser.add_argument("--batch", type=int, default=16, help="global batch (%(default)s)")
parser.add_argument("--rounds", type=int, default=12, help="timing rounds (%(default)s)")
parser.add_argument("--steps", type=int, default=4, help="steps per round each (%(default)s)")
parser.add_argument("--rotate", type=int, default=0, help="build from the R-th contender (0)")
parser.add_argument(
    "--all-rotations", action="store_true", help="one rank: every --rotate, fresh processes"
)
args = parser.parse_args()
NAMES = ["plain", "least", "fsdp2", "fsdp2 coal.", "torch", "torch (again)"]


def all_rotations() -> None:
    """Run this script once per build order and print the ratios' medians over the runs."""
    if "RANK" in os.environ:
        sys.exit("--all-rotations runs one-rank processes itself; with torchrun, use --rotate R")
    runs: list[dict[str, float]] = []
    for r in range(len(NAMES)):
        sizes = {"--layers": args.layers, "--batch": args.batch}
        sizes.update({"--rounds": args.rounds, "--steps": args.steps, "--rotate": r})
        argv = [sys.executable, __file__, *(str(x) for kv in sizes.items() for x in kv)]
        env = dict(os.environ, MASTER_PORT=str(29571 + r))
        out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True).stdout
        print("\n".join(x for x in out.splitlines() if not x.startswith("RESULT ")), flush=True)
        line = next(x for x in out.splitlines() if x.startswith("RESULT "))
        runs.append({k: float(v) for k, v in (kv.split("=") for kv in line[7:].split("\t"))})
    print(f"\nmedian over {len(runs)} build orders (ratios of medians, wall)")
    for name in NAMES:
        least = statistics.median(run[name] / run["least"] for run in runs)
        torch_ = statistics.median(run[name] / run["torch"] for run in runs)
        print(f"{name:14s} {least:5.2f}× least   {torch_:5.2f}× torch")


if args.all_rotations:
    all_rotations()
    sys.exit(0)

if "RANK" not in os.environ:  # plain `python`: a one-rank group
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29571")
dist.init_process_group("gloo")
torch.set_num_threads(1)
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,))


class _Unit:
    """One block's parameters: sharded for the optimizer, gathered for forward and backward."""

    def __init__(self, slots: list[tuple[nn.Module, str]], mesh: DeviceMesh) -> None:
        self.slots = slots
        self.sharded: list[nn.Parameter] = []
        self.shards: list[torch.Tensor] = []  # the sharded parameters' local tensors
        self.unsharded: list[nn.Parameter] = []
        for module, name in slots:
            full = module._parameters[name]
            assert full is not None and full.shape[0] % world == 0, "least: dim 0 must split evenly"
            local = full.detach().chunk(world)[rank].clone()
            dtensor = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
            sharded = nn.Parameter(dtensor)
            shard = dtensor._local_tensor
            if world == 1:  # the shard is the whole parameter: share it, gather nothing
                unsharded = nn.Parameter(shard)
            else:
                unsharded = nn.Parameter(torch.empty_like(full))
                unsharded.untyped_storage().resize_(0)
            unsharded.register_post_accumulate_grad_hook(self._grad_in)  # type: ignore[no-untyped-call]
            module._parameters[name] = sharded
            self.sharded.append(sharded)
            self.shards.append(shard)
            self.unsharded.append(unsharded)
        self.numels = [shard.numel() for shard in self.shards]
        self.total = sum(self.numels)
        self.grads_in = 0

    def _register(self, params: list[nn.Parameter]) -> None:
        for (module, name), param in zip(self.slots, params, strict=True):
            module._parameters[name] = param

    def gather(self) -> None:
        if world > 1:
            self._all_gather()
        self._register(self.unsharded)

    @torch.no_grad()
    def _all_gather(self) -> None:
        send = torch.cat([shard.view(-1) for shard in self.shards])
        out = send.new_empty(world * self.total)
        dist.all_gather_single(out, send)
        out = out.view(world, self.total)
        offset = 0
        for param, numel in zip(self.unsharded, self.numels, strict=True):
            param.untyped_storage().resize_(param.numel() * param.element_size())
            # .data: an untracked alias, so autograd does not take the refill for a change to a
            # tensor it saved (the same bytes as at forward)
            param.data.view(world, numel).copy_(out[:, offset : offset + numel])
            offset += numel

    def reshard(self) -> None:
        self._register(self.sharded)
        if world > 1:
            for param in self.unsharded:
                param.untyped_storage().resize_(0)

    def _grad_in(self, param: torch.Tensor) -> None:
        self.grads_in += 1
        if self.grads_in == len(self.unsharded):
            self.grads_in = 0
            self._reduce()
            self.reshard()

    def _reduce(self) -> None:
        if world == 1:
            reduced = [p.grad for p in self.unsharded]
        else:
            reduced = self._reduce_scatter()
        for sharded, shard, unsharded, local in zip(
            self.sharded, self.shards, self.unsharded, reduced, strict=True
        ):
            unsharded.grad = None
            spec = sharded._spec  # type: ignore[attr-defined]
            grad = DTensor(local.view(shard.shape), spec, requires_grad=False)  # type: ignore[no-untyped-call,union-attr]
            sharded.grad = grad if sharded.grad is None else sharded.grad + grad

    @torch.no_grad()
    def _reduce_scatter(self) -> list[torch.Tensor | None]:
        grads = [p.grad for p in self.unsharded]
        send = grads[0].new_empty(world, self.total)  # type: ignore[union-attr]
        offset = 0
        for grad, numel in zip(grads, self.numels, strict=True):
            send[:, offset : offset + numel].copy_(grad.view(world, numel))  # type: ignore[union-attr]
            offset += numel
        out = send.new_empty(self.total)
        dist.reduce_scatter_single(out, send.view(-1), op=dist.ReduceOp.AVG)
        return list(out.split(self.numels))


def least_fully_shard(module: nn.Module, owned: list[tuple[nn.Module, str]], root: bool) -> None:
    unit = _Unit(owned, mesh)

    def pre_forward(module: nn.Module, inputs: Any) -> None:
        unit.gather()

    def post_forward(module: nn.Module, inputs: Any, output: Any) -> None:
        if root:
            return  # as both FSDPs do by default: the root keeps its parameters for backward
        unit.reshard()
        if output.requires_grad:
            output.register_hook(lambda grad: unit.gather())

    module.register_forward_pre_hook(pre_forward)
    module.register_forward_hook(post_forward)


def least(model: nn.Module) -> None:
    blocks: nn.ModuleList = model.blocks  # type: ignore[assignment]
    head: nn.Module = model.head  # type: ignore[assignment]
    for block in blocks:
        owned = [(m, n) for m in block.modules() for n in m._parameters]
        least_fully_shard(block, owned, root=False)
    least_fully_shard(model, [(head, n) for n in head._parameters], root=True)


size = DEFAULT_SIZES["mlp-stack"]
size = type(size)(layers=args.layers, dim=size.dim)
inputs, targets = make_batch("mlp-stack", size, args.batch)
mine = slice(rank * args.batch // world, (rank + 1) * args.batch // world)
inputs, targets = inputs[mine], targets[mine]


norms: dict[str, float] = {}


def _grad_norm(model: nn.Module) -> float:
    total = torch.zeros((), dtype=torch.float64)
    for param in model.parameters():
        grad = param.grad
        assert grad is not None
        if isinstance(grad, DTensor):
            grad = grad.full_tensor()
        total += grad.double().square().sum()
    return float(total.sqrt())


def contender(name: str) -> Callable[[], float]:
    torch.manual_seed(0)
    model = build_model("mlp-stack", size)
    if name == "least":
        least(model)
    elif name != "plain":
        shard = fsdp2_fully_shard if name.startswith("fsdp2") else torch_fully_shard
        for block in model.blocks:  # type: ignore[union-attr]
            shard(block)
        shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    coalesce = budget if name == "fsdp2 coal." else 0
    set_coalesce_bytes(coalesce)
    # AdamW barely sees a gradient's scale, so equal losses would not catch a wrong average:
    # print the first gradient's norm as well.
    _, loss = model(inputs, targets)
    loss.backward()
    norms[name] = _grad_norm(model)
    opt.zero_grad()

    def step() -> float:
        set_coalesce_bytes(coalesce)
        _, loss = model(inputs, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()  # type: ignore[no-any-return]

    return step


budget = coalesce_bytes()  # the default, or FSDP2_COALESCE_BYTES
names = NAMES
built = names[args.rotate % len(names) :] + names[: args.rotate % len(names)]
steps = {name: contender(name) for name in built}
losses = {name: [f"{steps[name]():.6f}" for _ in range(3)] for name in names}
if rank == 0:
    for name in names:
        print(f"{name:14s} first losses {' '.join(losses[name])}, gradient norm {norms[name]:.9e}")
times: dict[str, list[float]] = {name: [] for name in names}
for r in range(args.rounds):
    order = names[r % len(names) :] + names[: r % len(names)]  # rotate: no contender always first
    for name in order:
        dist.barrier()
        for _ in range(args.steps):
            start = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - start)
if rank == 0:
    # The first round is a warm-up where there are more.
    median = {name: statistics.median(t[args.steps :] or t) * 1e3 for name, t in times.items()}
    print(f"\nmlp-stack, {args.layers} blocks, W={world}: median ms/step (wall)")
    for name in names:
        print(
            f"{name:14s} {median[name]:7.1f}   {median[name] / median['plain']:5.2f}× plain"
            f"   {median[name] / median['least']:5.2f}× least"
            f"   {median[name] / median['torch']:5.2f}× torch"
        )
    noise = abs(median["torch (again)"] / median["torch"] - 1)
    print(f"noise floor (torch vs torch again): {noise:.1%}")
    print(f"built in this order: {', '.join(built)}")
    print("RESULT " + "\t".join(f"{name}={median[name]:.4f}" for name in names), flush=True)
dist.barrier()
dist.destroy_process_group()
