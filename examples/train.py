"""Train a small character-level GPT on the shipped fables, sharded with fully_shard.

    torchrun --standalone --nproc-per-node 2 examples/train.py            # 2 ranks, ~1 minute on CPU
    torchrun --standalone --nproc-per-node 2 examples/train.py --impl torch   # torch's own FSDP2
    python examples/train.py --steps 50                                    # one process, no torchrun

Every rank builds the same model from the same seed, then fully_shard splits each parameter so
that a rank keeps 1/world_size of it. Each step, every rank draws the same global batch and
trains on its own slice of it; FSDP averages the gradients across ranks, so the run computes
what one process would on the whole global batch, whatever the number of ranks.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from model import GPT, GPTConfig

# -----------------------------------------------------------------------------------------------
# Settings

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--impl", choices=["fsdp2", "torch"], default="fsdp2", help="whose fully_shard")
parser.add_argument("--steps", type=int, default=500, help="optimizer steps")
parser.add_argument("--batch-size", type=int, default=32, help="global batch, split across ranks")
parser.add_argument("--block-size", type=int, default=64, help="sequence length in characters")
parser.add_argument("--num-layers", type=int, default=4)
parser.add_argument("--num-heads", type=int, default=4)
parser.add_argument("--embed-dim", type=int, default=128)
parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
parser.add_argument("--warmup-steps", type=int, default=20)
parser.add_argument("--weight-decay", type=float, default=0.1)
parser.add_argument("--grad-clip", type=float, default=1.0, help="max global grad norm; 0 = off")
parser.add_argument("--bf16", action="store_true", help="bf16 compute, fp32 gradient reduction")
parser.add_argument("--log-every", type=int, default=20, help="steps between loss lines")
parser.add_argument("--eval-batches", type=int, default=8, help="validation batches per estimate")
parser.add_argument("--seed", type=int, default=1337)
parser.add_argument("--ckpt-dir", default="checkpoints", help="where checkpoints go")
parser.add_argument(
    "--ckpt-every", type=int, default=100, help="steps between checkpoints; 0 = none"
)
parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
parser.add_argument(
    "--auto-shard", action="store_true", help="let fsdp2.auto_shard pick the groups (fsdp2 only)"
)
parser.add_argument(
    "--optimizer",
    choices=["adamw", "muon"],
    default="adamw",
    help="muon: fsdp2.optim.Muon on the blocks' matrices (AdamW at --lr for the rest)",
)
parser.add_argument("--muon-lr", type=float, default=0.02, help="Muon's peak learning rate")
parser.add_argument(
    "--export-hf",
    metavar="DIR",
    help="after training, write the weights to DIR as safetensors files (fsdp2 only; bf16 with --bf16)",
)
args = parser.parse_args()
if args.auto_shard and args.impl != "fsdp2":
    parser.error("--auto-shard is fsdp2's: use it with --impl fsdp2")
if args.export_hf and args.impl != "fsdp2":
    parser.error("--export-hf is fsdp2's (save_hf_safetensors): use it with --impl fsdp2")

# Switching implementations is this one import: both expose the same API.
if args.impl == "torch":
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
else:
    from fsdp2 import MixedPrecisionPolicy, fully_shard

# -----------------------------------------------------------------------------------------------
# Processes and devices

backend = "nccl" if torch.cuda.is_available() else "gloo"
if "RANK" in os.environ:  # launched by torchrun, which also sets MASTER_ADDR/PORT, WORLD_SIZE
    dist.init_process_group(backend)
else:  # plain `python train.py`: a world of one; a file rendezvous needs no free port
    store = Path(tempfile.mkdtemp()) / "store"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
rank, world_size = dist.get_rank(), dist.get_world_size()
local_rank = int(os.environ.get("LOCAL_RANK", 0))
if backend == "nccl":
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
else:
    device = torch.device("cpu")
    # The ranks on this host share its cores: more threads than cores makes every rank slower.
    num_cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(1, (num_cpus or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))

console = Console(quiet=rank != 0)  # rank 0 speaks for everyone
if args.batch_size % world_size != 0:
    parser.error(f"--batch-size {args.batch_size} must be divisible by the {world_size} ranks")
local_batch_size = args.batch_size // world_size

# -----------------------------------------------------------------------------------------------
# Data: characters of the fables, 90% to train on, the last 10% held out

text = (Path(__file__).parent / "data" / "fables.txt").read_text()
chars = sorted(set(text))
stoi = {c: i for i, c in enumerate(chars)}
data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
split = int(0.9 * len(data))
train_data, val_data = data[:split], data[split:]


def get_batch(data: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of a random global batch: inputs and next-character targets."""
    # Every rank's generator is in the same state, so all ranks draw the same global batch.
    starts = torch.randint(len(data) - args.block_size - 1, (args.batch_size,), generator=gen)
    starts = starts[rank * local_batch_size : (rank + 1) * local_batch_size]
    x = torch.stack([data[s : s + args.block_size] for s in starts.tolist()])
    y = torch.stack([data[s + 1 : s + 1 + args.block_size] for s in starts.tolist()])
    return x.to(device), y.to(device)


# -----------------------------------------------------------------------------------------------
# Model, sharded block by block

# Same seed on every rank: fully_shard keeps each rank's slice of the parameters it is given and
# broadcasts nothing, so the ranks must start from identical full parameters.
torch.manual_seed(args.seed)
config = GPTConfig(
    vocab_size=len(chars),
    block_size=args.block_size,
    num_layers=args.num_layers,
    num_heads=args.num_heads,
    embed_dim=args.embed_dim,
)
model = GPT(config).to(device)
num_params = sum(p.numel() for p in model.parameters())

mesh = init_device_mesh(device.type, (world_size,))
mp_policy = MixedPrecisionPolicy(
    param_dtype=torch.bfloat16 if args.bf16 else None,
    reduce_dtype=torch.float32 if args.bf16 else None,
)
# One communication group per block: while block i computes, only block i's parameters are
# whole. Then the root, which takes what is left: embeddings, final norm and the tied head.
if args.auto_shard:  # the same groups, found from the model's structure; printed below
    from fsdp2 import auto_shard

    sharding = auto_shard(model, mesh=mesh, mp_policy=mp_policy)
else:
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
num_local_params = sum(
    p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters()
)

# No weight decay on gains and biases (1-D), as in GPT-2. DTensor.ndim is the full tensor's.
params = list(model.parameters())
optimizer: torch.optim.Optimizer
if args.optimizer == "muon":
    from fsdp2.optim import Muon

    # The usual recipe: Muon for the blocks' weight matrices, AdamW for the embeddings (the
    # output head is tied to tok_emb) and the 1-D gains and biases. Each matrix is
    # orthogonalised whole at one owner rank; momentum stays sharded (see fsdp2/optim/).
    optimizer = Muon(
        [
            {"params": [p for p in params if p.ndim >= 2]},
            {"params": [p for p in params if p.ndim < 2], "use_muon": False, "weight_decay": 0.0},
        ],
        lr=args.muon_lr,
        weight_decay=args.weight_decay,
        adamw_params=[model.tok_emb.weight, model.pos_emb.weight],
        adamw_lr=args.lr,
        adamw_betas=(0.9, 0.95),
        adamw_weight_decay=args.weight_decay,
    )
    for group in optimizer.param_groups:  # the schedule below scales each group's own peak
        group["lr_scale"] = group["lr"] / args.lr
else:
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": args.weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
    )


def lr_at(step: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def mean_over_ranks(local_sum: torch.Tensor, count: int) -> float:
    total = local_sum.detach().clone()
    dist.all_reduce(total)  # SUM: gloo has no AVG
    return total.item() / (count * world_size)


@torch.no_grad()
def val_loss() -> float:
    """Mean loss on the same held-out batches every time, so estimates are comparable."""
    model.eval()
    gen = torch.Generator().manual_seed(args.seed + 1)
    total = torch.zeros((), device=device)
    for _ in range(args.eval_batches):
        total += model(*get_batch(val_data, gen))[1]
    model.train()
    return mean_over_ranks(total, args.eval_batches)


table = Table(title=f"fsdp2 example: {args.impl}'s fully_shard", show_header=False)
threads = f"{torch.get_num_threads()} intra-op thread(s) each"
table.add_row("ranks", f"{world_size} x {device.type} ({backend}), {threads}")
table.add_row("model", f"GPT, {num_params:,} parameters, {num_local_params:,} on rank 0")
table.add_row(
    "batch", f"{args.batch_size} x {args.block_size} characters, {local_batch_size} per rank"
)
table.add_row("optimizer", args.optimizer)
table.add_row("corpus", f"{len(train_data):,} train + {len(val_data):,} val characters")
console.print(table)
if args.auto_shard:
    console.print(str(sharding), markup=False, highlight=False, soft_wrap=True)

# -----------------------------------------------------------------------------------------------
# Checkpoints: every rank writes its own shards (torch.distributed.checkpoint), so saving never
# gathers the model; loading reshards, so a run may resume on a different number of ranks.

ckpt_dir = Path(args.ckpt_dir)
train_gen = torch.Generator().manual_seed(args.seed)


def training_state(step: int) -> dict[str, object]:
    model_state, optim_state = get_state_dict(model, optimizer)
    # The batch generator too: a resumed run draws exactly the batches it would have drawn.
    return {
        "model": model_state,
        "optim": optim_state,
        "rng": train_gen.get_state(),
        "step": torch.tensor(step),
    }


def save_checkpoint(step: int) -> None:
    # Written under a temporary name and renamed once every rank is done: a run killed mid-save
    # leaves a .partial directory that --resume never mistakes for a checkpoint.
    partial, final = ckpt_dir / f".step_{step:06d}.partial", ckpt_dir / f"step_{step:06d}"
    dcp.save(training_state(step), checkpoint_id=partial)
    dist.barrier()
    if rank == 0:
        partial.rename(final)
    dist.barrier()


def resume() -> int:
    """Load the latest complete checkpoint; return the step to start from."""
    done = sorted(p for p in ckpt_dir.glob("step_*") if (p / ".metadata").is_file())
    if not done:
        console.print(f"no checkpoint in {ckpt_dir}/: starting from step 0")
        return 0
    state = training_state(0)
    dcp.load(state, checkpoint_id=done[-1])
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    train_gen.set_state(state["rng"])
    step = int(state["step"]) + 1
    console.print(f"resumed from {done[-1]}: continuing at step {step}")
    return step


# -----------------------------------------------------------------------------------------------
# Training loop


def clear_earlier_run() -> None:
    """A fresh run (no --resume) owns the checkpoint folder: an earlier run's checkpoints would
    block its saves at the same steps, and a later --resume would mix the two runs."""
    earlier = sorted(ckpt_dir.glob("step_*")) + sorted(ckpt_dir.glob(".step_*.partial"))
    if rank == 0 and earlier:
        console.print(
            f"fresh run: removing {len(earlier)} checkpoint(s) of an earlier run from "
            f"{ckpt_dir}/ (pass --resume to continue that run instead)"
        )
        for path in earlier:
            shutil.rmtree(path)
    dist.barrier()


start_step = resume() if args.resume else 0
if not args.resume and args.ckpt_every:
    clear_earlier_run()
initial_val = val_loss()
window_loss, window_steps = torch.zeros((), device=device), 0
first_loss = last_loss = float("nan")
t_start = t_window = time.perf_counter()
progress = Progress(
    TextColumn("[bold]train"),
    BarColumn(),
    MofNCompleteColumn(),
    TextColumn("loss {task.fields[loss]}"),
    TimeRemainingColumn(),
    console=console,
    disable=rank != 0,
)
with progress:
    task = progress.add_task("train", total=args.steps, loss="-", completed=start_step)
    for step in range(start_step, args.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step) * group.get("lr_scale", 1.0)  # x1.0: AdamW's, exactly
        x, y = get_batch(train_data, train_gen)
        _, loss = model(x, y)
        assert loss is not None  # GPT returns a loss whenever it gets targets
        loss.backward()  # FSDP reduce-scatters gradients: each rank gets its shard of the mean
        if args.grad_clip > 0:
            # The norm of the whole gradient, across all shards (a collective under FSDP).
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        window_loss += loss.detach()
        window_steps += 1
        # Sync for logging only every few steps (and at step 0, for the starting loss).
        if step % args.log_every == 0 or step == args.steps - 1 or step == start_step:
            last_loss = mean_over_ranks(window_loss, window_steps)
            if step == start_step:
                first_loss = last_loss
            ms = 1000 * (time.perf_counter() - t_window) / window_steps
            progress.console.print(
                f"step {step:4d} | loss {last_loss:.4f} | lr {lr_at(step):.2e} | {ms:.0f} ms/step"
            )
            progress.update(task, loss=f"{last_loss:.3f}")
            window_loss.zero_()
            window_steps, t_window = 0, time.perf_counter()
        progress.advance(task)
        if args.ckpt_every and (step + 1) % args.ckpt_every == 0:
            save_checkpoint(step)

elapsed = time.perf_counter() - t_start
final_val = val_loss()
console.print(
    f"[bold green]done[/]: {args.steps - start_step} steps in {elapsed:.1f}s | "
    f"train loss {first_loss:.3f} -> {last_loss:.3f} | val loss {initial_val:.3f} -> {final_val:.3f}",
    soft_wrap=True,  # one line even in a narrow terminal or a CI log: easy to grep
)
if args.export_hf:
    # The full weights stream out in buckets, one all-gather each; file k is written by rank
    # k mod world_size, and no rank ever holds the whole model.
    from fsdp2 import save_hf_safetensors

    dtype = torch.bfloat16 if args.bf16 else None
    files = save_hf_safetensors(model, args.export_hf, dtype=dtype)
    console.print(f"exported the weights to {args.export_hf}/: {', '.join(files)}")
# Collect FSDP's reference cycles (which hold tensors and gloo work) while the process group is
# alive: left to interpreter exit, they abort the process about one run in three (torch 2.13:
# "terminate called without an active exception").
gc.collect()
dist.destroy_process_group()
