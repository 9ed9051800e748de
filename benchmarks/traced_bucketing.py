"""Traced mode with inductor's collective bucketing vs the eager paths, fsdp2 and torch.

    OMP_NUM_THREADS=1 TORCHINDUCTOR_COMPILE_THREADS=1 timeout 1200 \
        torchrun --standalone --nproc-per-node 2 benchmarks/traced_bucketing.py --model mlp-stack

Every contender trains the same model from the same init on the same batch (AdamW, as bench.py):
  fsdp2          eager fsdp2 (hooks), per-block fully_shard and the root
  fsdp2#2        the same, built separately: fsdp2 vs fsdp2#2 is the noise floor
  fsdp2+coalesce eager fsdp2 with coalesced all-gathers (set_coalesce_bytes(--coalesce-bytes))
  traced         set_traced + torch.compile(fullgraph=True), inductor, one collective per group
  traced+bucket  the same, compiled with inductor's FX bucketing on (BUCKETING below)
  torch          torch's fully_shard, eager
  torch+compile  torch's fully_shard with each block compiled in place (block.compile())
Rounds are interleaved (every contender once per round, the order rotated), so the machine's load
hits them all. Rank 0 prints, per compiled graph of the traced contenders, the fsdp2 collectives
before and after inductor's post-grad passes (where the bucketing runs). See docs/compile.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard as torch_fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # fsdp2 from this checkout
import fsdp2
from fsdp2.engine.coalesce import set_coalesce_bytes
from measure import timed
from workloads import DEFAULT_SIZES, MODELS, blocks_of, build_model, make_batch

# The inductor options that bucket fsdp2's traced collectives (docs/compile.md says why these).
BUCKETING: dict[str, Any] = {
    "bucket_all_gathers_fx": "all",
    "bucket_reduce_scatters_fx": "all",
}
CONTENDERS = (
    "fsdp2",
    "fsdp2#2",
    "fsdp2+coalesce",
    "traced",
    "traced+bucket",
    "torch",
    "torch+compile",
)

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
parser.add_argument("--model", choices=MODELS, default="mlp-stack")
parser.add_argument("--layers", type=int, help="blocks (default: mlp-stack 96, gpt/llama 4)")
parser.add_argument("--dim", type=int, help="width (default: mlp-stack 64, gpt/llama 128)")
parser.add_argument("--batch", type=int, default=16, help="global batch (%(default)s)")
parser.add_argument("--contenders", default=",".join(CONTENDERS), help="(%(default)s)")
parser.add_argument("--warmup", type=int, default=3, help="untimed steps each (%(default)s)")
parser.add_argument("--rounds", type=int, default=7, help="timing rounds (%(default)s)")
parser.add_argument("--steps", type=int, default=3, help="steps per round each (%(default)s)")
parser.add_argument(
    "--coalesce-bytes", type=int, default=1 << 20, help="fsdp2+coalesce's budget (%(default)s)"
)
parser.add_argument(
    "--options", type=json.loads, default=BUCKETING, help="traced+bucket's inductor options (JSON)"
)
args = parser.parse_args()

overrides = {k: v for k in ("layers", "dim") if (v := getattr(args, k))}
size = replace(DEFAULT_SIZES[args.model], **overrides)
names = args.contenders.split(",")
if unknown := set(names) - set(CONTENDERS):
    raise ValueError(f"--contenders: unknown {sorted(unknown)}; pick from {','.join(CONTENDERS)}")

dist.init_process_group("gloo")
rank, world_size = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(1)
inputs, targets = make_batch(args.model, size, args.batch)
local = slice(rank * args.batch // world_size, (rank + 1) * args.batch // world_size)
inputs, targets = inputs[local], targets[local]

# ---------------------------------------------------------------------------------------------
# counting the collectives inductor's post-grad passes leave (the bucketing is one of them)

_c10d = torch.ops._c10d_functional
_COUNTED = {
    "all_gather": (_c10d.all_gather_into_tensor.default, _c10d.all_gather_into_tensor_out.default),
    "reduce_scatter": (_c10d.reduce_scatter_tensor.default,),
}
graph_counts: list[tuple[str, dict[str, int], dict[str, int]]] = []
current_label = ""


def _count(gm: torch.fx.GraphModule) -> dict[str, int]:
    found = dict.fromkeys(_COUNTED, 0)
    for node in gm.graph.nodes:
        for kind, targets_ in _COUNTED.items():
            found[kind] += node.op == "call_function" and node.target in targets_
    return found


def _install_counter() -> None:
    import torch._inductor.compile_fx as compile_fx

    inner = compile_fx.post_grad_passes

    def counted(gm: torch.fx.GraphModule, is_inference: bool) -> None:
        before = _count(gm)
        inner(gm, is_inference)
        graph_counts.append((current_label, before, _count(gm)))

    compile_fx.post_grad_passes = counted  # type: ignore[assignment]


_install_counter()

# ---------------------------------------------------------------------------------------------
# contenders


@dataclass
class Contender:
    name: str
    model: Callable[..., Any]
    opt: torch.optim.Optimizer
    before: Callable[[], None]
    loss: torch.Tensor | None = None


def build(name: str) -> Contender:
    torch.manual_seed(0)
    model = build_model(args.model, size)
    shard = torch_fully_shard if name.startswith("torch") else fsdp2.fully_shard
    for block in blocks_of(model):
        if name == "torch+compile":
            block.compile()
        shard(block)
    shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    run: Callable[..., Any] = model
    if name.startswith("traced"):
        fsdp2.set_traced(model)
        options = args.options if name == "traced+bucket" else {}
        run = torch.compile(model, fullgraph=True, options=options)
    budget = args.coalesce_bytes if name == "fsdp2+coalesce" else 0
    return Contender(name, run, opt, lambda: set_coalesce_bytes(budget))


def train_step(c: Contender) -> None:
    global current_label
    current_label = c.name
    c.before()
    _, loss = c.model(inputs, targets)
    loss.backward()
    c.opt.step()
    c.opt.zero_grad(set_to_none=True)
    c.loss = loss.detach()


load_before = os.getloadavg()[0]
contenders = [build(n) for n in names]
first_step_s: dict[str, float] = {}  # compiling happens here, for the compiled contenders
for c in contenders:
    first_step_s[c.name] = timed(lambda c=c: train_step(c), 1)
for _ in range(args.warmup - 1):
    for c in contenders:
        train_step(c)

times: dict[str, list[float]] = {c.name: [] for c in contenders}
for r in range(args.rounds):
    shift = r % len(contenders)
    for c in contenders[shift:] + contenders[:shift]:
        times[c.name].append(timed(lambda c=c: train_step(c), args.steps))
load_after = os.getloadavg()[0]

# Every rank's median, then the slowest rank: the step is as slow as its slowest rank.
medians = torch.tensor([statistics.median(times[c.name]) for c in contenders])
dist.all_reduce(medians, op=dist.ReduceOp.MAX)
# Under load, the ratio within a round (the contenders ran back to back) is steadier than the
# ratio of medians: its median over rounds is the figure to quote.
ref = "fsdp2" if "fsdp2" in times else names[0]
ratios = {
    n: statistics.median(a / b for a, b in zip(t, times[ref], strict=True))
    for n, t in times.items()
}
losses = {c.name: float(c.loss) for c in contenders if c.loss is not None}
if rank == 0:
    what = f"{args.model} ({size.layers} layers, dim {size.dim}), W={world_size}"
    print(
        f"{what}, {args.rounds} rounds x {args.steps} steps, load {load_before:.1f}->{load_after:.1f}"
    )
    ms = {c.name: 1e3 * float(m) for c, m in zip(contenders, medians, strict=True)}
    base = ms.get("torch")
    print(f"  {'':15s} {'ms/step':>8s} {'x torch':>8s} {'x ' + ref:>8s} {'1st step s':>10s}  loss")
    for name, value in ms.items():
        vs = f"{value / base:8.2f}" if base else f"{'':8s}"
        print(
            f"  {name:15s} {value:8.1f} {vs} {ratios[name]:8.2f} {first_step_s[name]:10.1f}"
            f"  {losses[name]:.6f}"
        )
    print(
        f"  (x torch: ratio of slowest-rank medians; x {ref}: median over rounds of rank 0's "
        "ratio within the round)"
    )
    if "fsdp2" in ms and "fsdp2#2" in ms:
        floor = abs(ms["fsdp2"] - ms["fsdp2#2"]) / min(ms["fsdp2"], ms["fsdp2#2"])
        print(
            f"  noise floor: fsdp2 vs fsdp2#2 {100 * floor:.1f}% (medians), "
            f"{100 * abs(ratios['fsdp2#2'] - 1):.1f}% (within rounds)"
        )
    print(
        "compiled graphs (label: fsdp2 all-gathers / reduce-scatters, before -> after post-grad;"
        " a graph found in inductor's cache is not listed):"
    )
    for label, before, after in graph_counts:
        print(
            f"  {label:15s} AG {before['all_gather']:3d} -> {after['all_gather']:3d}   "
            f"RS {before['reduce_scatter']:3d} -> {after['reduce_scatter']:3d}"
        )
dist.destroy_process_group()
