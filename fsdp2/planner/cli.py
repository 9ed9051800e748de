"""``python -m fsdp2.plan``: the planner from the command line."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fsdp2.planner import plan
from fsdp2.planner.world import PlanError

__all__ = ["main"]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _load(spec: str) -> Callable[..., Any]:
    """``pkg.module:attr`` (or a file path ``path/to/x.py:attr``) to the object it names."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not attr:
        raise PlanError(f"expected MODULE:FUNCTION (e.g. mypkg.model:build), got {spec!r}")
    if module_name.endswith(".py"):
        loc = importlib.util.spec_from_file_location("_fsdp2_plan_user", module_name)
        if loc is None or loc.loader is None:
            raise PlanError(f"cannot load {module_name!r}")
        module = importlib.util.module_from_spec(loc)
        loc.loader.exec_module(module)
    else:
        sys.path.insert(0, "")  # the working directory, as python -m does
        module = importlib.import_module(module_name)
    obj = module
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj  # type: ignore[return-value]


def _world(text: str) -> int | tuple[int, ...]:
    """``8`` or ``2x4`` (replicate x shard)."""
    if not re.fullmatch(r"\d+(x\d+)?", text.strip().lower()):
        raise PlanError(f"--world-size: expected N or RxS (e.g. 8 or 2x4), got {text!r}")
    parts = tuple(int(n) for n in text.strip().lower().split("x"))
    return parts[0] if len(parts) == 1 else parts


def _batch(text: str) -> tuple[torch.Tensor, ...]:
    """``8x64,8x64`` token-id tensors, or ``8x3x224x224:fp32,8:int64`` with dtypes (meta)."""
    tensors = []
    for item in text.split(","):
        shape, _, dtype = item.partition(":")
        kind = DTYPES.get(dtype, getattr(torch, dtype, None)) if dtype else torch.int64
        if not isinstance(kind, torch.dtype):
            raise PlanError(f"--batch: unknown dtype {dtype!r} in {item!r}")
        size = [int(n) for n in shape.lower().split("x")]
        tensors.append(torch.zeros(size, dtype=kind, device="meta"))
    return tuple(tensors)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fsdp2.plan",
        description="Per-rank memory and communication of an fsdp2 run, before launching it.",
    )
    parser.add_argument("build", help="MODULE:FUNCTION that returns the model (run on meta)")
    parser.add_argument("--shard", help="MODULE:FUNCTION applying fully_shard (default: auto)")
    parser.add_argument("--world-size", default="8", help="e.g. 8 or 8,64,1024 or 2x4 (HSDP)")
    parser.add_argument("--param-dtype", choices=sorted(DTYPES), help="mixed precision")
    parser.add_argument("--reduce-dtype", choices=sorted(DTYPES))
    parser.add_argument("--optimizer", default="adamw", help="adamw, adam, sgd, none, or bytes")
    parser.add_argument("--batch", help="MODULE:FUNCTION returning one rank's inputs, or shapes")
    parser.add_argument("--device", default="cuda", help="target device type (cuda)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    args = parser.parse_args(argv)
    kwargs: dict[str, Any] = {}
    if args.param_dtype or args.reduce_dtype:
        from fsdp2 import MixedPrecisionPolicy

        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=DTYPES.get(args.param_dtype), reduce_dtype=DTYPES.get(args.reduce_dtype)
        )
    try:
        worlds = [_world(w) for w in args.world_size.split(",")]
        batch: Any = None
        if args.batch:
            batch = (
                _load(args.batch) if ":" in args.batch and "." in args.batch else _batch(args.batch)
            )
        optimizer: str | float = args.optimizer
        if args.optimizer.replace(".", "", 1).isdigit():
            optimizer = float(args.optimizer)
        if args.shard and kwargs:
            raise PlanError("--param-dtype/--reduce-dtype apply only without --shard")
        first = plan(
            _load(args.build),
            _load(args.shard) if args.shard else None,
            world_size=worlds[0],
            optimizer=optimizer,
            batch=batch,
            device=args.device,
            **kwargs,
        )
        result: Any = first if len(worlds) == 1 else first.compare(worlds)
    except PlanError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result.to_dict(), indent=1) if args.json else result)
    return 0
