"""A refactor's check for the planner: ``fsdp2.plan`` over many configurations, to compare before
and after a change that should change no plan.

    python benchmarks/plan_snapshot.py before.json      # on the old tree
    python benchmarks/plan_snapshot.py after.json       # on the new one
    python benchmarks/plan_snapshot.py --diff before.json after.json

The configurations: the workloads' models (small sizes, a frozen first block too) x sharding
(zero3, bf16 compute, zero2, HSDP, hfsdp, models mixing zero2 and hfsdp or zero3 and zero2,
reshard_after_forward=k or False) x device (cpu: no prefetch; cuda: prefetch) x coalescing
(off, on) x world sizes: 384 plans. Each plan is kept whole but for its groups' internal facts
(``groups``, which a refactor may reshape): its bytes, its collectives in order, its transients
and notes. A run takes ~12 s here.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # fsdp2 from this checkout
import fsdp2
import workloads

BF16 = fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
Shard = Callable[..., None]


def _blocks(**kwargs: Any) -> Shard:
    def shard(model: nn.Module) -> None:
        for block in workloads.blocks_of(model):
            fsdp2.fully_shard(block, **kwargs)
        fsdp2.fully_shard(model, **kwargs)

    return shard


def _on_mesh(first: str, second: str) -> Shard:
    """Over the planner's 2-D mesh: blocks alternating ``first``/``second``, the root ``second``."""

    def shard(model: nn.Module, mesh: Any) -> None:
        for i, block in enumerate(workloads.blocks_of(model)):
            fsdp2.fully_shard(block, mesh=mesh, memory_mode=first if i % 2 == 0 else second)
        fsdp2.fully_shard(model, mesh=mesh, memory_mode=second)

    return shard


def _alternating(first: str, second: str) -> Shard:
    """Over the default mesh: blocks alternating ``first``/``second``, the root ``second``."""

    def shard(model: nn.Module) -> None:
        for i, block in enumerate(workloads.blocks_of(model)):
            fsdp2.fully_shard(block, memory_mode=first if i % 2 == 0 else second)
        fsdp2.fully_shard(model, memory_mode=second)

    return shard


# sharding -> (its shard function, the world sizes it is planned at)
SHARDINGS: dict[str, tuple[Shard, list[Any]]] = {
    "zero3": (_blocks(), [1, 2, 4, 8]),
    "bf16": (_blocks(mp_policy=BF16), [2, 8]),
    "zero2": (_blocks(mp_policy=BF16, memory_mode="zero2"), [1, 2, 8]),
    "hsdp": (_on_mesh("zero3", "zero3"), [(2, 2), (1, 4), (2, 1)]),
    "hfsdp": (_on_mesh("hfsdp", "hfsdp"), [(2, 2), (2, 1), (1, 2), (2, 4)]),
    "zero2+hfsdp": (_on_mesh("zero2", "hfsdp"), [(2, 2)]),
    "hfsdp+zero2": (_on_mesh("hfsdp", "zero2"), [(2, 2)]),
    "k=2": (_blocks(reshard_after_forward=2), [4, 8]),
    "k=4": (_blocks(reshard_after_forward=4), [8]),
    "no-reshard": (_blocks(reshard_after_forward=False), [2, 4]),
    "zero3+zero2": (_alternating("zero3", "zero2"), [2]),
}


def _build(name: str, frozen_first: bool) -> Callable[[], nn.Module]:
    size = dataclasses.replace(workloads.DEFAULT_SIZES[name], layers=3)

    def build() -> nn.Module:
        model = workloads.build_model(name, size)
        if frozen_first:
            workloads.blocks_of(model)[0].requires_grad_(False)
        return model

    return build


def configurations() -> Iterator[tuple[str, Callable[[], nn.Module], Shard, Any, str]]:
    """Every configuration as ``(key, build, shard, world_size, device)``, the coalescing budget
    set for each as it is yielded (the default back after the last)."""
    from fsdp2.engine.coalesce import coalesce_bytes, set_coalesce_bytes

    default_budget = coalesce_bytes()
    models = [(m, False) for m in workloads.MODELS] + [("mlp-stack", True)]
    try:
        for (model, frozen), (sharding, (shard, worlds)), device, budget in itertools.product(
            models, SHARDINGS.items(), ["cpu", "cuda"], [0, default_budget or 25 * 2**20]
        ):
            set_coalesce_bytes(budget)
            for world in worlds:
                key = f"{model}{'-frozen' if frozen else ''}/{sharding}/{device}/{budget}/{world}"
                yield key, _build(model, frozen), shard, world, device
    finally:
        set_coalesce_bytes(default_budget)


def snapshot() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, build, shard, world, device in configurations():
        try:
            plan = fsdp2.plan(build, shard, world_size=world, device=device)
        except Exception as e:  # a refusal is part of the snapshot too
            out[key] = f"{type(e).__name__}: {e}"
            continue
        fields = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)}
        kept = {k: v for k, v in fields.items() if k != "groups" and not k.startswith("_")}
        out[key] = json.loads(json.dumps(kept, default=repr))
    return out


def diff(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    lines = [f"{key}: only in one" for key in sorted(set(before) ^ set(after))]
    for key in sorted(set(before) & set(after)):
        old, new = before[key], after[key]
        if not (isinstance(old, dict) and isinstance(new, dict)):
            if old != new:
                lines.append(f"{key}: {old!r} -> {new!r}")
            continue
        for field in sorted(set(old) | set(new)):
            if old.get(field) != new.get(field):
                lines.append(f"{key}: {field}: {old.get(field)!r} -> {new.get(field)!r}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("out", nargs="?", help="write the snapshot here (JSON)")
    parser.add_argument("--diff", nargs=2, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args()
    if args.diff:
        found = diff(*(json.loads(Path(p).read_text()) for p in args.diff))
        print("\n".join(found) or "no plan changed")
        sys.exit(1 if found else 0)
    if not args.out:
        parser.error("give a file to write, or --diff BEFORE AFTER")
    taken = snapshot()
    Path(args.out).write_text(json.dumps(taken, indent=1, sort_keys=True))
    print(f"{len(taken)} plans -> {args.out}")


if __name__ == "__main__":
    main()
