"""``python -m fsdp2.plan``: the planner from the command line."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import re
import sys
import sysconfig
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fsdp2.tools.planner import plan
from fsdp2.tools.planner.world import PlanError

__all__ = ["main"]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _load(spec: str, flag: str) -> Callable[..., Any]:
    """``pkg.module:attr`` (or a file path ``path/to/x.py:attr``) to the function it names. The
    user's mistakes in naming it are PlanErrors; errors inside their module propagate."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise PlanError(
            f"{_prefix(flag)}expected MODULE:FUNCTION (e.g. mypkg.model:build, or a file: "
            f"path/to/model.py:build), got {spec!r}"
        )
    if module_name.endswith(".py"):
        loc = importlib.util.spec_from_file_location("_fsdp2_plan_user", module_name)
        if not os.path.isfile(module_name) or loc is None or loc.loader is None:
            raise PlanError(
                f"{_prefix(flag)}no file {module_name!r} (from {spec!r}) in {os.getcwd()}; give its "
                "path, or MODULE:FUNCTION for an importable module"
            )
        module = importlib.util.module_from_spec(loc)
        loc.loader.exec_module(module)
    else:
        module = _import(module_name, spec, flag)
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            defined = sorted(
                n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
            )
            raise PlanError(
                f"{_prefix(flag)}{module_name} has no {part!r} (from {spec!r}); it defines "
                f"{', '.join(defined[:12]) or 'no functions'}"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise PlanError(f"{_prefix(flag)}{spec} is a {type(obj).__name__}, not a function")
    return obj  # type: ignore[no-any-return]


def _prefix(flag: str) -> str:
    """Messages about an option start with its name; about the positional BUILD, without."""
    return f"{flag}: " if flag else ""


def _import(module_name: str, spec: str, flag: str) -> Any:
    """The module, or a PlanError when it is the named module itself that is missing (a module
    it imports that is missing is an error in the user's code: it propagates)."""
    if "" not in sys.path:
        sys.path.insert(0, "")  # the working directory, as python -m does
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        missing = e.name or ""
        if module_name != missing and not module_name.startswith(missing + "."):
            raise
        raise PlanError(
            f"{_prefix(flag)}no module named {missing!r} (from {spec!r}); run from the directory that "
            f"holds it, add that directory to PYTHONPATH, or name a file: "
            f"path/to/{module_name.rsplit('.', 1)[-1]}.py:{spec.partition(':')[2]}"
        ) from None


def _world(text: str) -> int | tuple[int, ...]:
    """``8`` or ``2x4`` (replicate x shard)."""
    if not re.fullmatch(r"\d+(x\d+)?", text.strip().lower()):
        raise PlanError(f"--world-size: expected N or RxS (e.g. 8 or 2x4), got {text!r}")
    parts = tuple(int(n) for n in text.strip().lower().split("x"))
    return parts[0] if len(parts) == 1 else parts


_SHAPE = r"\d+(x\d+)*(:\w+)?"


def _batch(text: str) -> Any:
    """``8x64,8x64`` token-id tensors, ``8x3x224x224:fp32,8:int64`` with dtypes (meta), or
    MODULE:FUNCTION returning one rank's inputs."""
    items = [item.strip().lower() for item in text.split(",")]
    if not all(re.fullmatch(_SHAPE, item) for item in items):
        if ":" in text and "," not in text and not re.match(r"\d", text.strip()):
            return _load(text, "--batch")
        raise PlanError(
            "--batch: expected shapes such as 8x64 or 8x3x224x224:fp32,8:int64 (comma-separated, "
            f"a dtype after a colon), or MODULE:FUNCTION returning the inputs; got {text!r}"
        )
    tensors = []
    for item in items:
        shape, _, dtype = item.partition(":")
        kind = DTYPES.get(dtype, getattr(torch, dtype, None)) if dtype else torch.int64
        if not isinstance(kind, torch.dtype):
            raise PlanError(
                f"--batch: unknown dtype {dtype!r} in {item!r}; use bf16, fp16, fp32, or a "
                "torch dtype name (int64, float32, ...)"
            )
        tensors.append(torch.zeros([int(n) for n in shape.split("x")], dtype=kind, device="meta"))
    return tuple(tensors)


def _optimizer(text: str) -> str | float:
    try:
        return float(text)
    except ValueError:
        return text  # a name, checked by plan()


def _device(text: str) -> str:
    try:
        return torch.device(text).type
    except RuntimeError:
        raise PlanError(
            f"--device: expected a device type such as cuda, cpu or xpu, got {text!r}"
        ) from None


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
        from fsdp2.engine.policies import MixedPrecisionPolicy

        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=DTYPES.get(args.param_dtype), reduce_dtype=DTYPES.get(args.reduce_dtype)
        )
    try:
        result = _run(args, kwargs)
    except PlanError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except SyntaxError as e:  # in the user's module: where, not our import machinery's frames
        print("".join(traceback.format_exception_only(type(e), e)), end="", file=sys.stderr)
        print(f"error: {e.filename}, line {e.lineno}: {e.msg}", file=sys.stderr)
        return 2
    except Exception as e:
        frames = _user_frames(e)
        if not frames:
            raise  # fsdp2's own bug: the whole traceback
        _print_user_error(e, frames)
        return 2
    print(json.dumps(result.to_dict(), indent=1) if args.json else result)
    return 0


def _run(args: argparse.Namespace, kwargs: dict[str, Any]) -> Any:
    worlds = [_world(w) for w in args.world_size.split(",")]
    if args.shard and kwargs:
        raise PlanError("--param-dtype/--reduce-dtype apply only without --shard")
    batch = _batch(args.batch) if args.batch else None
    device = _device(args.device)
    first = plan(
        _load(args.build, ""),
        _load(args.shard, "--shard") if args.shard else None,
        world_size=worlds[0],
        optimizer=_optimizer(args.optimizer),
        batch=batch,
        device=device,
        **kwargs,
    )
    return first if len(worlds) == 1 else first.compare(worlds)


def _user_frames(error: BaseException) -> list[traceback.FrameSummary]:
    """The traceback from the first frame in the user's code (not fsdp2's, torch's or the
    standard library's) on; empty if the error did not pass through their code."""
    ours = [
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        os.path.dirname(torch.__file__),
    ]
    ours += [sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"]]
    frames = traceback.extract_tb(error.__traceback__)
    for i, frame in enumerate(frames):
        path = os.path.abspath(frame.filename)
        if not frame.filename.startswith("<") and not any(
            path.startswith(root + os.sep) for root in ours
        ):
            return frames[i:]
    return []


def _print_user_error(error: BaseException, frames: list[traceback.FrameSummary]) -> None:
    text = "".join(traceback.format_list(frames))
    text += "".join(traceback.format_exception_only(type(error), error))
    first = frames[0]
    print(f"Traceback (your code's frames):\n{text}", end="", file=sys.stderr)
    print(
        f"error: {first.name} ({first.filename}, line {first.lineno}) raised "
        f"{type(error).__name__}: {error}",
        file=sys.stderr,
    )
