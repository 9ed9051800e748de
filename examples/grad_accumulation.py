"""Gradient accumulation with fully_shard: many micro-batches per optimizer step, one reduction.

    torchrun --standalone --nproc-per-node 2 examples/grad_accumulation.py
    torchrun --standalone --nproc-per-node 2 examples/grad_accumulation.py --keep-gathered
    torchrun --standalone --nproc-per-node 2 examples/grad_accumulation.py --impl torch
    python examples/grad_accumulation.py --steps 10                   # one process, no torchrun

A large global batch may not fit in memory at once: feed it in --micro-steps pieces, backward
each, and step the optimizer once. Under FSDP every backward would normally reduce-scatter its
gradients, once per micro-step. With set_requires_gradient_sync(False) on all but the last
micro-step, each rank instead sums its micro-step gradients locally (unsharded, like a plain
model) and the last backward reduce-scatters the sum once: 1/micro_steps of the traffic.

--keep-gathered goes further: set_reshard_after_forward(False) and set_reshard_after_backward(False)
keep every parameter gathered from the first micro-step to the last, so the later micro-steps
all-gather nothing either. It costs memory (all parameters whole, like DDP) for fewer
collectives.
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from model import GPT, GPTConfig

# -----------------------------------------------------------------------------------------------
# Settings

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument(
    "--impl",
    choices=["fsdp2", "torch"],
    default="fsdp2",
    help="whose fully_shard: this library's, or torch.distributed.fsdp's",
)
parser.add_argument("--steps", type=int, default=30, help="optimizer steps")
parser.add_argument(
    "--batch-size",
    type=int,
    default=32,
    help="global batch in sequences per optimizer step, across all ranks",
)
parser.add_argument(
    "--micro-steps", type=int, default=4, help="forward/backward passes per optimizer step"
)
parser.add_argument(
    "--keep-gathered",
    action="store_true",
    help="keep parameters gathered across micro-steps (more memory, fewer gathers)",
)
parser.add_argument("--block-size", type=int, default=64, help="sequence length in characters")
parser.add_argument("--num-layers", type=int, default=2)
parser.add_argument("--embed-dim", type=int, default=64)
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--log-every", type=int, default=5)
parser.add_argument("--seed", type=int, default=1337)
args = parser.parse_args()  # fmt: skip

if args.impl == "torch":
    from torch.distributed.fsdp import fully_shard
else:
    from fsdp2 import fully_shard
# -----------------------------------------------------------------------------------------------
# Processes

if "RANK" in os.environ:  # launched by torchrun
    dist.init_process_group("gloo")
else:  # plain `python grad_accumulation.py`: a world of one; a file rendezvous needs no port
    store = Path(tempfile.mkdtemp()) / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
rank, world_size = dist.get_rank(), dist.get_world_size()
# The ranks on this host share its cores: more threads than cores makes every rank slower.
torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
console = Console(quiet=rank != 0)  # rank 0 speaks for everyone

if args.batch_size % (world_size * args.micro_steps) != 0:
    parser.error(
        f"--batch-size {args.batch_size} must divide into {world_size} ranks x "
        f"{args.micro_steps} micro-steps"
    )
micro_batch_size = args.batch_size // (world_size * args.micro_steps)

# -----------------------------------------------------------------------------------------------
# Data: characters of the fables

text = (Path(__file__).parent / "data" / "fables.txt").read_text()
chars = sorted(set(text))
stoi = {c: i for i, c in enumerate(chars)}
data = torch.tensor([stoi[c] for c in text], dtype=torch.long)


def get_batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's micro_steps x micro_batch_size rows of a random global batch."""
    # Every rank's generator is in the same state, so all ranks draw the same global batch.
    starts = torch.randint(len(data) - args.block_size - 1, (args.batch_size,), generator=gen)
    local = args.batch_size // world_size
    starts = starts[rank * local : (rank + 1) * local].tolist()
    x = torch.stack([data[s : s + args.block_size] for s in starts])
    y = torch.stack([data[s + 1 : s + 1 + args.block_size] for s in starts])
    return x, y


# -----------------------------------------------------------------------------------------------
# Model, sharded block by block, then the root (embeddings, final norm, tied head)

torch.manual_seed(args.seed)  # the same full parameters on every rank before sharding
config = GPTConfig(
    vocab_size=len(chars),
    block_size=args.block_size,
    num_layers=args.num_layers,
    embed_dim=args.embed_dim,
)
model = GPT(config)
mesh = init_device_mesh("cpu", (world_size,))
for block in model.blocks:
    fully_shard(block, mesh=mesh)
fully_shard(model, mesh=mesh)
if args.keep_gathered:
    model.set_reshard_after_forward(False)  # recurse=True: every block, not just the root
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)


def forward_backward(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """All micro-steps of one optimizer step; returns the mean loss over them."""
    total = torch.zeros(())
    for micro, (xm, ym) in enumerate(
        zip(x.split(micro_batch_size), y.split(micro_batch_size), strict=True)
    ):
        last = micro == args.micro_steps - 1
        # Reduce only on the last micro-step; before it, gradients pile up locally, unsharded.
        model.set_requires_gradient_sync(last)
        if args.keep_gathered:
            model.set_reshard_after_backward(last)  # free the parameters only at the very end
        _, loss = model(xm, ym)
        # Scale so the accumulated sum is the mean over the whole batch, not micro_steps times it.
        (loss / args.micro_steps).backward()
        total += loss.detach()
    return total / args.micro_steps


def local_grads() -> list[torch.Tensor]:
    return [p.grad.to_local().clone() for p in model.parameters() if isinstance(p.grad, DTensor)]


# -----------------------------------------------------------------------------------------------
# Proof first: the accumulated gradient is the gradient of the whole batch in one pass

train_gen = torch.Generator().manual_seed(args.seed)
x, y = get_batch(train_gen)
model(x, y)[1].backward()  # the whole local batch at once (sync on: the default)
full_batch = local_grads()
optimizer.zero_grad()
if args.impl == "fsdp2":  # fsdp2 reports each collective it issues; count this step's
    from fsdp2 import record_collectives

    with record_collectives() as records:
        forward_backward(x, y)
    counts = Counter(r.kind for r in records)
    comms = f"{counts['all_gather']} all-gathers, {counts['reduce_scatter']} reduce-scatters"
else:
    forward_backward(x, y)
    comms = "(counted with --impl fsdp2)"
accumulated = local_grads()
optimizer.zero_grad()
max_diff = torch.tensor(
    max((a - b).abs().max().item() for a, b in zip(full_batch, accumulated, strict=True))
)
dist.all_reduce(max_diff, op=dist.ReduceOp.MAX)

num_groups = args.num_layers + 1
table = Table(title=f"gradient accumulation, {args.impl}'s fully_shard", show_header=False)
table.add_row("ranks", f"{world_size} x cpu (gloo)")
table.add_row(
    "batch",
    f"{args.batch_size} sequences = {world_size} ranks x {args.micro_steps} "
    f"micro-steps x {micro_batch_size}",
)
table.add_row("accumulated vs one pass", f"max |grad difference| {max_diff.item():.2e}")
table.add_row("collectives per step", f"{comms} ({num_groups} groups)")
console.print(table)
if max_diff.item() > 1e-5:
    raise SystemExit(f"accumulated gradients differ from the one-pass ones by {max_diff.item()}")

# -----------------------------------------------------------------------------------------------
# Training loop

t0 = time.perf_counter()
first_loss = last_loss = float("nan")
for step in range(args.steps):
    x, y = get_batch(train_gen)
    loss = forward_backward(x, y)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # over the sharded gradients
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if step % args.log_every == 0 or step == args.steps - 1:
        dist.all_reduce(loss)  # SUM: gloo has no AVG
        last_loss = loss.item() / world_size
        if step == 0:
            first_loss = last_loss
        console.print(f"step {step:4d} | loss {last_loss:.4f}")

elapsed = time.perf_counter() - t0
console.print(
    f"[bold green]done[/]: {args.steps} steps in {elapsed:.1f}s | "
    f"loss {first_loss:.3f} -> {last_loss:.3f}"
)
# Collect FSDP's reference cycles while the process group is alive: left to interpreter exit
# they can abort the process (torch 2.13 + gloo: "terminate called without an active exception").
gc.collect()
dist.destroy_process_group()
