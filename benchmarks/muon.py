"""Muon on fully_shard's parameters: owner-per-matrix (fsdp2.optim.Muon) vs the naive way.

    torchrun --standalone --nproc-per-node 2 benchmarks/muon.py
    torchrun --standalone --nproc-per-node 4 benchmarks/muon.py --steps 5

Both contenders are the same `Muon` on the same sharded GPT (benchmarks/workloads.py) and the same
batch; they differ only in how each matrix's whole update is found:

- `owner`: each matrix has one owner rank; an all-to-all sends every shard to its owner, the
  owner orthogonalises its matrices, a second all-to-all returns the shards (fsdp2.optim).
- `naive`: every rank `full_tensor()`s every matrix (an all-gather each) and orthogonalises all
  of them, then keeps its own rows: what users of torch's FSDP2 write by hand.

Reported per contender: the optimizer step alone and the whole training step (median over
ranks' max, ms), and the bytes landing in this rank's collective output buffers per optimizer
step (the all-to-alls' outputs, recorded; the all-gathers' outputs, i.e. the full matrices).
Rounds alternate the contenders so both see the same machine load.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # fsdp2 from this checkout
from fsdp2 import fully_shard, record_collectives
from fsdp2.optim import Muon
from workloads import DEFAULT_SIZES, ModelSize, build_model, make_batch

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
parser.add_argument("--layers", type=int, default=DEFAULT_SIZES["gpt"].layers)
parser.add_argument("--dim", type=int, default=DEFAULT_SIZES["gpt"].dim)
parser.add_argument("--batch", type=int, default=8, help="global batch (%(default)s)")
parser.add_argument("--steps", type=int, default=5, help="timed steps per round (%(default)s)")
parser.add_argument("--rounds", type=int, default=2, help="(%(default)s)")
args = parser.parse_args()


class NaiveMuon(Muon):
    """Every rank gathers every matrix and orthogonalises all of them."""

    def whole_matrix_updates(
        self, items: list[tuple[int, torch.Tensor]]
    ) -> dict[int, torch.Tensor]:
        params = self.matrix_params()
        out = {}
        for i, x in items:
            p, group = params[i]
            assert isinstance(p, DTensor)
            full = DTensor.from_local(
                x, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
            ).full_tensor()
            self.gathered_bytes += full.numel() * full.element_size()
            update = self.whole_matrix_update(i, full, group)
            lay = self.layouts()[i]
            start, size = lay.rows(lay.rank)
            out[i] = update.narrow(lay.dim, start, size).to(x.dtype)
        return out


def build(cls: type[Muon], size: ModelSize) -> tuple[Any, Muon]:
    torch.manual_seed(0)
    model = build_model("gpt", size)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    params = list(model.parameters())
    opt = cls(
        [{"params": params}],
        adamw_params=[model.tok_emb.weight, model.pos_emb.weight],
        lr=0.02,
        adamw_lr=1e-3,
    )
    opt.gathered_bytes = 0  # type: ignore[attr-defined]
    return model, opt


def timed(fn: Any) -> float:
    dist.barrier()
    t = time.perf_counter()
    fn()
    dist.barrier()
    return 1000 * (time.perf_counter() - t)


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    size = ModelSize(layers=args.layers, dim=args.dim)
    x, y = make_batch("gpt", size, args.batch)
    n = args.batch // world
    x, y = x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]
    contenders = {"owner": build(Muon, size), "naive": build(NaiveMuon, size)}
    opt_ms: dict[str, list[float]] = {k: [] for k in contenders}
    step_ms: dict[str, list[float]] = {k: [] for k in contenders}
    bytes_out: dict[str, int] = {}
    for rnd in range(args.rounds + 1):  # round 0 warms up
        for name, (model, opt) in contenders.items():
            for _ in range(args.steps):
                t0 = time.perf_counter()
                model(x, y)[1].backward()
                opt.gathered_bytes = 0
                with record_collectives() as records:
                    ms = timed(opt.step)
                opt.zero_grad()
                if rnd:
                    opt_ms[name].append(ms)
                    step_ms[name].append(1000 * (time.perf_counter() - t0))
            recorded = sum(r.output_nbytes for r in records if r.kind == "all_to_all")
            bytes_out[name] = recorded + opt.gathered_bytes
    if rank == 0:
        print(f"W={world} gpt layers={size.layers} dim={size.dim} batch={args.batch}")
        print(f"{'':8}{'opt step ms':>12}{'train step ms':>15}{'bytes/step (rank 0)':>21}")
        for name in contenders:
            o, s = statistics.median(opt_ms[name]), statistics.median(step_ms[name])
            print(f"{name:8}{o:12.1f}{s:15.1f}{bytes_out[name]:21,}")
        ratio = statistics.median(opt_ms["naive"]) / statistics.median(opt_ms["owner"])
        print(f"naive/owner optimizer step time: {ratio:.2f}x")
        print(f"naive/owner bytes: {bytes_out['naive'] / bytes_out['owner']:.2f}x")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
