"""Time to shard: a 7B-parameter Llama-shaped model (32 layers, dim 4096, vocab 32000) built on
the meta device, ``fully_shard`` on every layer and the root, ``to_empty(device="cpu")``, lazy
init; rank 0 of a fake process group of W ranks (default 1024). fsdp2 and torch's FSDP2,
interleaved, repeated; seconds per phase.

    python benchmarks/shard_time.py [--world 1024] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.testing._internal.distributed.fake_pg import FakeStore

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # fsdp2 from this checkout
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from fsdp2 import fully_shard as fsdp2_fully_shard
from model import Llama, LlamaConfig

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--world", type=int, default=1024)
parser.add_argument("--repeats", type=int, default=3)
args = parser.parse_args()
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world)
CONFIG = LlamaConfig(
    vocab_size=32000, max_seq_len=2048, num_layers=32, num_heads=32, num_kv_heads=32, embed_dim=4096
)


def once(shard: object) -> tuple[float, float, float]:
    with torch.device("meta"):
        model = Llama(CONFIG)
    t0 = time.perf_counter()
    for layer in model.layers:
        shard(layer)  # type: ignore[operator]
    shard(model)  # type: ignore[operator]
    t1 = time.perf_counter()
    model.to_empty(device="cpu")
    t2 = time.perf_counter()
    model._get_fsdp_state()._lazy_init()  # type: ignore[operator]
    return t1 - t0, t2 - t1, time.perf_counter() - t2


with torch.device("meta"):
    params = sum(p.numel() for p in Llama(CONFIG).parameters())
runs: dict[str, list[tuple[float, float, float]]] = {"fsdp2": [], "torch": []}
for _ in range(args.repeats):
    runs["fsdp2"].append(once(fsdp2_fully_shard))
    runs["torch"].append(once(torch_fully_shard))
print(f"{params / 1e9:.2f}B parameters, W={args.world}, torch {torch.__version__}; median s")
for name, times in runs.items():
    shard, empty, lazy = (statistics.median(t[i] for t in times) for i in range(3))
    print(
        f"{name:6s} fully_shard {shard:.3f}  to_empty {empty:.3f}  lazy init {lazy:.3f}  "
        f"total {shard + empty + lazy:.3f}"
    )
dist.destroy_process_group()
