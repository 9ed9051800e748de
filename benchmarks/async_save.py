"""Step time with asynchronous checkpoints: fsdp2 vs torch's FSDP2, each with and without saves.

    torchrun --standalone --nproc-per-node 2 benchmarks/async_save.py
    torchrun --standalone --nproc-per-node 2 benchmarks/async_save.py --every 2 --dim 256
    torchrun --standalone --nproc-per-node 2 benchmarks/async_save.py --rounds 2 --steps 10

The same model (workloads.py's, `gpt` by default) from the same init, sharded per block and on
the root, trains on the same global batch with AdamW; four contenders:
  fsdp2        fsdp2.fully_shard, no checkpoints
  fsdp2+save   the same, with dcp.async_save of get_state_dict(model, optim) every --every steps
  torch        torch.distributed.fsdp.fully_shard, no checkpoints
  torch+save   the same, with the same saves
A save runs as torchtitan's async checkpointing does: on a gloo group of its own, into a new
directory under a temporary one (--dir), the previous save awaited only when the next one is
issued, training going on while it is written. So each save has --every steps to overlap. Between
rounds (untimed) rank 0 deletes all but each contender's latest checkpoint.

Contenders take turns round by round (the same load of a shared machine for all). In a round each
runs --settle untimed steps, then --steps timed steps between two barriers; a saving contender
issues a save at every --every-th of those, and awaits the last one before the closing barrier
(what the next round's first save would wait for). A round's time per step is its slowest rank's;
the table gives the median over rounds and the best round, and for the saving contenders the
milliseconds per save spent issuing it (get_state_dict, staging the copy, starting the writer)
and waiting for the previous one. Below it: the median over rounds of each round's ratios, saves
against none for each implementation and fsdp2 against torch with and without saves.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.checkpoint.state_dict_saver import async_save
from torch.distributed.fsdp import fully_shard as torch_fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # fsdp2 from this checkout
from fsdp2 import fully_shard as fsdp2_fully_shard
from measure import leave
from workloads import DEFAULT_SIZES, MODELS, blocks_of, build_model, make_batch, param_bytes

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
parser.add_argument("--model", choices=MODELS, default="gpt", help="(%(default)s)")
parser.add_argument("--layers", type=int, help="blocks (default: mlp-stack 96, gpt/llama 4)")
parser.add_argument("--dim", type=int, help="width (default: mlp-stack 64, gpt/llama 128)")
parser.add_argument("--batch", type=int, default=16, help="global batch (%(default)s)")
parser.add_argument("--every", type=int, default=5, help="steps between saves (%(default)s)")
parser.add_argument("--rounds", type=int, default=10, help="timing rounds (%(default)s)")
parser.add_argument(
    "--steps",
    type=int,
    default=10,
    help="timed steps per round, a multiple of --every (%(default)s)",
)
parser.add_argument(
    "--settle", type=int, default=2, help="untimed steps before each round's (%(default)s)"
)
parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (%(default)s)")
parser.add_argument("--dir", type=Path, help="where the checkpoints go (default: a temp dir)")
args = parser.parse_args()
if args.every < 1 or args.steps < 1 or args.steps % args.every:
    raise ValueError(
        f"--steps ({args.steps}) must be a positive multiple of --every ({args.every}): every "
        "save then has --every steps to overlap, as in a long run"
    )

overrides = {k: v for k in ("layers", "dim") if (v := getattr(args, k))}
size = replace(DEFAULT_SIZES[args.model], **overrides)
dist.init_process_group("gloo")  # from torchrun's environment
rank, world_size = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(args.threads)  # one per rank: idle OpenMP threads would spin against ranks
if args.batch % world_size:
    raise ValueError(f"--batch {args.batch} must be divisible by the world size {world_size}")
inputs, targets = make_batch(args.model, size, args.batch)
local = slice(rank * args.batch // world_size, (rank + 1) * args.batch // world_size)
inputs, targets = inputs[local], targets[local]

# The saves' own group: the writer thread's collectives must not interleave with training's.
save_group = dist.new_group(backend="gloo")
# Every rank writes its shard into the same directory: rank 0 picks it.
picked = [tempfile.mkdtemp(prefix="fsdp2-async-save-", dir=args.dir) if rank == 0 else ""]
dist.broadcast_object_list(picked, src=0)
root = Path(picked[0])

# ---------------------------------------------------------------------------------------------
# contenders


@dataclass
class Contender:
    name: str
    model: nn.Module
    opt: torch.optim.Optimizer
    ckpt_dir: Path | None  # None: no checkpoints; else one subdirectory per save
    num_saves: int = 0
    pending: Future[Any] | None = None  # the save being written
    loss: torch.Tensor | None = None  # the last step's
    issue_s: float = 0.0  # this round's, summed over its saves
    wait_s: float = 0.0
    step_ms: list[float] = field(default_factory=list)  # per round, this rank's
    issue_ms: list[float] = field(default_factory=list)  # per save, per round
    wait_ms: list[float] = field(default_factory=list)


def build(name: str) -> Contender:
    torch.manual_seed(0)  # the same init for every contender
    model = build_model(args.model, size)
    shard = fsdp2_fully_shard if name.startswith("fsdp2") else torch_fully_shard
    for block in blocks_of(model):
        shard(block)
    shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    ckpt_dir = root / name if name.endswith("+save") else None
    return Contender(name, model, opt, ckpt_dir)


def train_step(c: Contender) -> None:
    _, loss = c.model(inputs, targets)
    loss.backward()
    c.opt.step()
    c.opt.zero_grad(set_to_none=True)
    c.loss = loss.detach()


def wait_for_save(c: Contender) -> None:
    if c.pending is None:
        return
    start = time.perf_counter()
    c.pending.result()
    c.pending = None
    c.wait_s += time.perf_counter() - start


def issue_save(c: Contender) -> None:
    """The previous save awaited, the next one started; the writing goes on in DCP's thread."""
    if c.ckpt_dir is None:
        raise AssertionError(f"{c.name} takes no checkpoints")
    wait_for_save(c)
    start = time.perf_counter()
    model_sd, optim_sd = get_state_dict(c.model, c.opt)
    written = async_save(
        {"model": model_sd, "optim": optim_sd},
        checkpoint_id=c.ckpt_dir / f"save{c.num_saves}",
        process_group=save_group,
    )
    if not isinstance(written, Future):
        raise TypeError(f"expected async_save to return a Future, got {type(written)}")
    c.pending = written
    c.num_saves += 1
    c.issue_s += time.perf_counter() - start


def keep_latest(c: Contender) -> None:
    """Delete all but the latest checkpoint (rank 0, between rounds: the disk stays small)."""
    if rank == 0 and c.ckpt_dir is not None:
        for old in range(c.num_saves - 1):
            shutil.rmtree(c.ckpt_dir / f"save{old}", ignore_errors=True)


def run_round(c: Contender, steps: int) -> float:
    """Seconds per step of ``steps`` steps on this rank, saves (where ``c`` saves) included."""
    c.issue_s = c.wait_s = 0.0
    dist.barrier()
    start = time.perf_counter()
    for i in range(steps):
        if c.ckpt_dir is not None and i % args.every == 0:
            issue_save(c)
        train_step(c)
    wait_for_save(c)  # no save of one contender may run into another's round
    dist.barrier()
    return (time.perf_counter() - start) / steps


# ---------------------------------------------------------------------------------------------
# rounds

NAMES = ("fsdp2", "fsdp2+save", "torch", "torch+save")
SAVES_PER_ROUND = args.steps // args.every
load_before = os.getloadavg()[0]
contenders = [build(name) for name in NAMES]
for c in contenders:
    # Steps before the first save: get_state_dict would make a missing AdamW state with a step
    # of lr 0, counted in AdamW's step, and this run would no longer train like the others.
    for _ in range(args.every):
        train_step(c)
    run_round(c, args.every)  # untimed: the first save (DCP's thread, planning, directories)
for _ in range(args.rounds):
    gc.collect()  # between rounds, not inside one
    for c in contenders:
        for _ in range(args.settle):  # a contender's first steps after another's are slower
            train_step(c)
        c.step_ms.append(1e3 * run_round(c, args.steps))
        c.issue_ms.append(1e3 * c.issue_s / SAVES_PER_ROUND)
        c.wait_ms.append(1e3 * c.wait_s / SAVES_PER_ROUND)
        keep_latest(c)
load_after = os.getloadavg()[0]

# A round lasts as long as its slowest rank: the largest over ranks of each number.
mine = torch.tensor([[c.step_ms, c.issue_ms, c.wait_ms] for c in contenders], dtype=torch.float64)
dist.all_reduce(mine, op=dist.ReduceOp.MAX)
step_ms = {name: mine[i, 0].tolist() for i, name in enumerate(NAMES)}
issue_ms = {name: mine[i, 1].tolist() for i, name in enumerate(NAMES)}
wait_ms = {name: mine[i, 2].tolist() for i, name in enumerate(NAMES)}
losses = {c.name: float(c.loss) if c.loss is not None else float("nan") for c in contenders}
saver = contenders[NAMES.index("fsdp2+save")]
latest = saver.ckpt_dir / f"save{saver.num_saves - 1}" if saver.ckpt_dir else None
del contenders, c, saver


def finish() -> NoReturn:
    dist.barrier()  # rank 0 has read the checkpoint's size and reported
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    leave()


if rank != 0:
    finish()


def ratio(num: str, den: str) -> float:
    """The median over rounds of the round's ratio: drift between rounds cancels."""
    return float(statistics.median(a / b for a, b in zip(step_ms[num], step_ms[den], strict=True)))


MiB = 2**20
ckpt_bytes = sum(f.stat().st_size for f in latest.iterdir()) if latest is not None else 0
print(
    f"{args.model} {size.layers}x{size.dim}: {param_bytes([build_model(args.model, size)]) / MiB:.2f}"
    f" MiB fp32 params, global batch {args.batch}, W={world_size} (gloo), "
    f"{torch.get_num_threads()} thread(s)/rank, torch {torch.__version__}"
)
print(
    f"async_save of model + AdamW state every {args.every} steps ({ckpt_bytes / MiB:.2f} MiB on "
    f"disk per checkpoint); {args.rounds} rounds of {args.steps} steps (+{args.settle} settle)"
)
print(
    f"{'contender':<12} {'median ms':>10} {'best ms':>8} {'issue ms/save':>14} "
    f"{'wait ms/save':>13}  loss (rank 0, last step)"
)
for name in NAMES:
    saves = name.endswith("+save")
    issue = f"{statistics.median(issue_ms[name]):14.1f}" if saves else f"{'—':>14}"
    wait = f"{statistics.median(wait_ms[name]):13.1f}" if saves else f"{'—':>13}"
    print(
        f"{name:<12} {statistics.median(step_ms[name]):10.1f} {min(step_ms[name]):8.1f} "
        f"{issue} {wait}  {losses[name]:.6f}"
    )
print(
    f"with saves / without (median of the rounds' ratios): fsdp2 {ratio('fsdp2+save', 'fsdp2'):.3f}×"
    f", torch {ratio('torch+save', 'torch'):.3f}×"
)
print(
    f"fsdp2 / torch: with saves {ratio('fsdp2+save', 'torch+save'):.3f}×, "
    f"without {ratio('fsdp2', 'torch'):.3f}×"
)
for impl in ("fsdp2", "torch"):  # saving must not change training
    same = losses[impl] == losses[f"{impl}+save"]
    print(f"{impl}+save's last loss is {'bitwise' if same else 'NOT'} {impl}'s")
cores = len(os.sched_getaffinity(0))
print(f"load average while timing: {load_before:.1f} → {load_after:.1f} on {cores} cores")
finish()
