"""Instructions of fsdp2's steps at one rank, under callgrind: the check a refactor must pass.

    OMP_NUM_THREADS=1 valgrind --tool=callgrind --instr-atstart=no \\
        --callgrind-out-file=/tmp/cg.%p python benchmarks/instructions.py
    callgrind_annotate /tmp/cg.<pid> | head -20     # "PROGRAM TOTALS" is the figure

The mlp-stack (96 blocks, W=1, gloo), coalescing off, AdamW: two warm-up steps, then
collection switched on (``callgrind_control -i on``) for exactly three steps. Callgrind counts
every thread: with more than one intra-op thread, spinning workers make the count depend on
timing (9% apart between two runs here), so the script runs one (``OMP_NUM_THREADS=1`` as well,
for the pool's own start). ``python`` must be the interpreter itself, not a shell shim (pyenv's):
valgrind does not follow a shim's exec. Compare two commits with the same python and torch.
Outside valgrind it runs the same steps and collects nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # fsdp2 from this checkout
from fsdp2 import fully_shard, set_coalesce_bytes
from workloads import DEFAULT_SIZES, build_model, make_batch


def collect(on: bool) -> None:
    """Switch callgrind's collection for this process (nothing outside valgrind)."""
    try:
        subprocess.run(
            ["callgrind_control", "-i", "on" if on else "off", str(os.getpid())],
            check=True,
            capture_output=True,
        )
    except (OSError, subprocess.CalledProcessError):
        pass


def main() -> None:
    torch.set_num_threads(1)  # see above: no spinning workers in the count
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29581")
    dist.init_process_group("gloo", rank=0, world_size=1)
    size = DEFAULT_SIZES["mlp-stack"]
    torch.manual_seed(0)
    model = build_model("mlp-stack", size)
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block)
    fully_shard(model)
    set_coalesce_bytes(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    inputs, targets = make_batch("mlp-stack", size, 16)

    def step() -> float:
        _, loss = model(inputs, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return float(loss.item())

    losses = [step() for _ in range(2)]
    collect(True)
    losses += [step() for _ in range(3)]
    collect(False)
    print("losses", " ".join(f"{x:.6f}" for x in losses), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
