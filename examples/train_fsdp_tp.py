"""Train a small Llama on the shipped fables with FSDP x TP: 2 data-parallel x 2 tensor-parallel.

    torchrun --standalone --nproc-per-node 4 examples/train_fsdp_tp.py            # ~30 s on CPU
    torchrun --standalone --nproc-per-node 4 examples/train_fsdp_tp.py --impl torch   # torch's FSDP2
    torchrun --standalone --nproc-per-node 4 examples/train_fsdp_tp.py --tp 4 --num-kv-heads 4

The 4 ranks form a (dp, tp) mesh. Tensor parallelism splits each transformer block's matrices
across the 2 ranks of a tp group (Megatron-style: q/k/v and the MLP's input projections by output
column, the attention and MLP output projections by input row), so the two ranks compute one
block together on the same batch. FSDP then shards every parameter again across the 2 tp groups
(the dp axis), each of which trains on its own half of the global batch. A rank therefore holds a
quarter of each block matrix, and the run computes what one process would on the whole batch.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from model import Llama, LlamaConfig

# -----------------------------------------------------------------------------------------------
# Settings

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument(
    "--impl",
    choices=["fsdp2", "torch"],
    default="fsdp2",
    help="whose fully_shard: this library's, or torch.distributed.fsdp's",
)
parser.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks per dp group")
parser.add_argument("--steps", type=int, default=60, help="optimizer steps")
parser.add_argument("--batch-size", type=int, default=16, help="global batch in sequences")
parser.add_argument("--block-size", type=int, default=64, help="sequence length in characters")
parser.add_argument("--num-layers", type=int, default=2)
parser.add_argument("--num-heads", type=int, default=4, help="query heads; divisible by --tp")
parser.add_argument(
    "--num-kv-heads", type=int, default=2, help="key/value heads; divisible by --tp"
)
parser.add_argument("--embed-dim", type=int, default=128)
parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
parser.add_argument("--warmup-steps", type=int, default=10)
parser.add_argument("--weight-decay", type=float, default=0.1)
parser.add_argument("--grad-clip", type=float, default=1.0, help="max global grad norm; 0 = off")
parser.add_argument(
    "--bf16",
    action="store_true",
    help="compute in bfloat16 (MixedPrecisionPolicy), reduce gradients in float32",
)
parser.add_argument("--log-every", type=int, default=10, help="steps between loss lines")
parser.add_argument("--seed", type=int, default=1337)
args = parser.parse_args()  # fmt: skip

# Switching implementations is this one import: both expose the same API.
if args.impl == "torch":
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
else:
    from fsdp2 import MixedPrecisionPolicy, fully_shard

# -----------------------------------------------------------------------------------------------
# Processes and the (dp, tp) mesh

if "RANK" not in os.environ:
    parser.error("launch with torchrun, e.g. torchrun --standalone --nproc-per-node 4 ...")
dist.init_process_group("gloo")  # CPU; tensor parallelism on GPUs would use nccl
rank, world_size = dist.get_rank(), dist.get_world_size()
if world_size % args.tp != 0:
    parser.error(f"--tp {args.tp} must divide the {world_size} ranks")
dp_size = world_size // args.tp
# Consecutive ranks share a tp group: tp talks every layer, so on a real cluster it belongs
# inside one host, and dp (one reduce-scatter per block per step) goes across hosts.
mesh = init_device_mesh("cpu", (dp_size, args.tp), mesh_dim_names=("dp", "tp"))
dp_rank = mesh.get_local_rank("dp")
num_cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
torch.set_num_threads(max(1, (num_cpus or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))

console = Console(quiet=rank != 0)  # rank 0 speaks for everyone
if args.batch_size % dp_size != 0:
    parser.error(f"--batch-size {args.batch_size} must divide by the {dp_size} dp groups")
for name in ("num_heads", "num_kv_heads"):
    if getattr(args, name) % args.tp != 0:
        parser.error(f"--{name.replace('_', '-')} must divide by --tp: tp splits whole heads")
local_batch_size = args.batch_size // dp_size

# -----------------------------------------------------------------------------------------------
# Data: characters of the fables, 90% to train on, the last 10% held out

text = (Path(__file__).parent / "data" / "fables.txt").read_text()
chars = sorted(set(text))
stoi = {c: i for i, c in enumerate(chars)}
data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
split = int(0.9 * len(data))
train_data, val_data = data[:split], data[split:]


def get_batch(data: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """This dp group's rows of a random global batch; the tp ranks of a group get the same."""
    starts = torch.randint(len(data) - args.block_size - 1, (args.batch_size,), generator=gen)
    starts = starts[dp_rank * local_batch_size : (dp_rank + 1) * local_batch_size]
    x = torch.stack([data[s : s + args.block_size] for s in starts.tolist()])
    y = torch.stack([data[s + 1 : s + 1 + args.block_size] for s in starts.tolist()])
    return x, y


# -----------------------------------------------------------------------------------------------
# Model: tensor parallel inside each block, then fully sharded over dp

torch.manual_seed(args.seed)  # every rank builds the same full model, then keeps its pieces
config = LlamaConfig(
    vocab_size=len(chars),
    max_seq_len=args.block_size,
    num_layers=args.num_layers,
    num_heads=args.num_heads,
    num_kv_heads=args.num_kv_heads,
    embed_dim=args.embed_dim,
)
model = Llama(config)
num_params = sum(p.numel() for p in model.parameters())

# Column-wise layers keep whole heads (q/k/v) or hidden units (w1/w3) per rank, so attention
# and the SwiGLU run locally; the row-wise output projections sum the ranks' partial results
# (one all-reduce each). Embeddings, norms and the head stay whole across tp (FSDP only).
tp_plan = {
    "attention.wq": ColwiseParallel(),
    "attention.wk": ColwiseParallel(),
    "attention.wv": ColwiseParallel(),
    "attention.wo": RowwiseParallel(),
    "feed_forward.w1": ColwiseParallel(),
    "feed_forward.w3": ColwiseParallel(),
    "feed_forward.w2": RowwiseParallel(),
}
for layer in model.layers:
    parallelize_module(layer, mesh["tp"], tp_plan)
    # The attention reshapes its projections by head count: a rank now has 1/tp of the heads.
    layer.attention.num_heads //= args.tp
    layer.attention.num_kv_heads //= args.tp

mp_policy = MixedPrecisionPolicy(
    param_dtype=torch.bfloat16 if args.bf16 else None,
    reduce_dtype=torch.float32 if args.bf16 else None,
)
# FSDP over the dp axis only: the tensor-parallel pieces are split again, dim 0 inside dim 0
# for the column-wise weights (DTensor calls that placement strided).
for layer in model.layers:
    fully_shard(layer, mesh=mesh["dp"], mp_policy=mp_policy)
fully_shard(model, mesh=mesh["dp"], mp_policy=mp_policy)
num_local_params = sum(
    p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters()
)

# No weight decay on norm gains (1-D), as in GPT-2. DTensor.ndim is the full tensor's.
params = list(model.parameters())
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


def clip_grad_norm(max_norm: float) -> float:
    """Clip the global gradient norm. The gradients live on two meshes (the tensor-parallel
    ones on (dp, tp), the rest on dp alone), which torch's clip_grad_norm_ cannot mix. Count
    every element once instead: each rank sums the squares of its local pieces, weighting a
    piece by 1 / (ranks holding a copy of it), and one all-reduce adds the ranks' sums."""
    grads = [p.grad for p in params if p.grad is not None]
    squares = torch.zeros(())
    for g in grads:
        pieces = math.prod(
            g.device_mesh.size(axis)
            for axis, placement in enumerate(g.placements)
            if not placement.is_replicate()
        )
        squares += g.to_local().float().square().sum() * pieces / world_size
    dist.all_reduce(squares)
    total = squares.sqrt().item()
    scale = max_norm / (total + 1e-6)
    if scale < 1.0:
        for g in grads:
            g.mul_(scale)
    return total


def mean_loss(loss: torch.Tensor) -> float:
    """The global batch's loss: the mean over dp groups (tp peers hold the same value)."""
    total = loss.detach().clone()
    dist.all_reduce(total)  # SUM over every rank: each dp group's loss counted tp times
    return total.item() / world_size


@torch.no_grad()
def val_loss(num_batches: int = 4) -> float:
    gen = torch.Generator().manual_seed(args.seed + 1)  # the same held-out batches every time
    return sum(mean_loss(model(*get_batch(val_data, gen))[1]) for _ in range(num_batches)) / (
        num_batches
    )


table = Table(title=f"fsdp2 example: FSDP x TP with {args.impl}'s fully_shard", show_header=False)
table.add_row("mesh", f"dp={dp_size} x tp={args.tp} ({world_size} CPU ranks, gloo)")
table.add_row(
    "model",
    f"Llama, {num_params / 1e6:.2f}M parameters, {num_local_params / 1e6:.3f}M on rank 0",
)
table.add_row("batch", f"{args.batch_size} x {args.block_size} chars, {local_batch_size} per dp")
table.add_row("precision", "bf16 compute, fp32 reduce" if args.bf16 else "fp32")
console.print(table)

# -----------------------------------------------------------------------------------------------
# Training loop

train_gen = torch.Generator().manual_seed(args.seed)
initial_val = val_loss()
losses: list[float] = []
t_start = t_window = time.perf_counter()
for step in range(args.steps):
    for group in optimizer.param_groups:
        group["lr"] = lr_at(step)
    _, loss = model(*get_batch(train_data, train_gen))
    assert loss is not None  # Llama returns a loss whenever it gets targets
    loss.backward()  # TP all-reduces inside each block; FSDP reduce-scatters over dp
    grad_norm = clip_grad_norm(args.grad_clip) if args.grad_clip > 0 else float("nan")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    losses.append(mean_loss(loss))
    if step % args.log_every == 0 or step == args.steps - 1:
        ms = 1000 * (time.perf_counter() - t_window) / (1 if step == 0 else args.log_every)
        console.print(
            f"step {step:4d} | loss {losses[-1]:.4f} | grad norm {grad_norm:.3f} | "
            f"lr {lr_at(step):.2e} | {ms:.0f} ms/step"
        )
        t_window = time.perf_counter()

elapsed = time.perf_counter() - t_start
final_val = val_loss()
# Cross-rank sanity check: every rank computed the same global losses.
gathered: list[list[float] | None] = [None] * world_size
dist.all_gather_object(gathered, losses)
agree = all(g == losses for g in gathered)
console.print(
    f"[bold green]done[/]: {args.steps} steps in {elapsed:.1f}s | train loss {losses[0]:.3f} -> "
    f"{losses[-1]:.3f} | val loss {initial_val:.3f} -> {final_val:.3f} | "
    f"ranks agree: {agree}"
)
# Collect FSDP's reference cycles (which hold tensors and gloo work) while the process group is
# alive: left to interpreter exit, they can abort the process (see examples/train.py).
gc.collect()
dist.destroy_process_group()
if not agree:
    raise SystemExit("ranks disagree on the losses")
