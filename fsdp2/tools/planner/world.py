"""A pretend world for the planner: the model built on the meta device, sharded over a fake
process group of any size, in this one process, with nothing real allocated."""

from __future__ import annotations

import inspect
import math
import os
import pickle
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.overrides import TorchFunctionMode

__all__ = [
    "PlanError",
    "beside_live_group",
    "build_on_meta",
    "call_shard",
    "fake_mesh",
    "mesh_shape_of",
]

# Real (non-meta) bytes a build function may allocate, e.g. a small table built with an explicit
# device. Beyond this it is building the model for real, which is what planning must avoid.
REAL_BYTES_LIMIT = 64 * 2**20


class PlanError(ValueError):
    """The planner's inputs cannot describe a run: what was expected, what was found, the fix."""


def mesh_shape_of(world_size: int | Sequence[int]) -> tuple[int, ...]:
    """``8`` is FSDP over 8 ranks; ``(2, 4)`` is HSDP: 2 replicas of 4 shard ranks each."""
    shape = (world_size,) if isinstance(world_size, int) else tuple(world_size)
    if not 1 <= len(shape) <= 2 or any(not isinstance(n, int) or n < 1 for n in shape):
        raise PlanError(
            f"world_size must be a positive int (FSDP) or a pair (replicate, shard) of positive "
            f"ints (HSDP), got {world_size!r}"
        )
    return shape


@contextmanager
def fake_mesh(shape: tuple[int, ...]) -> Iterator[DeviceMesh]:
    """A CPU mesh of ``shape`` over a fake process group (rank 0 of ``prod(shape)``), made the
    default group for the duration (fsdp2 and DTensor read ranks off the default group); it is
    destroyed on exit. Needs a process without a default group: see :func:`beside_live_group`."""
    if dist.is_initialized():
        raise AssertionError("fake_mesh needs a process without a default process group")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=math.prod(shape))
    try:
        names = ("shard",) if len(shape) == 1 else ("replicate", "shard")
        yield init_device_mesh("cpu", shape, mesh_dim_names=names)
    finally:
        if not _forked:
            # In a forked copy this would also unregister the job's copied groups from c10d's
            # registry, and destroying gloo's copies (their threads stayed in the parent)
            # aborts; the copy ends with os._exit instead.
            dist.destroy_process_group()


def beside_live_group(fn: Callable[[], Any]) -> Any:
    """``fn()`` (which shards over :func:`fake_mesh`) here, or, while this process has a default
    process group (a running job asking what a larger one would take), in a forked copy of the
    process: the fake group lives and dies there, and nothing of the job's (its groups, their
    names in c10d's registry, DTensor's caches keyed by meshes equal to the fake ones) is
    touched. ``fn``'s result or exception comes back pickled."""
    if not dist.is_initialized():
        return fn()
    if not hasattr(os, "fork"):
        raise PlanError(
            "fsdp2.plan shards over a fake process group of its own; beside this process's "
            "initialized group it needs os.fork, which this platform lacks. Plan before "
            "init_process_group(), or from the command line: python -m fsdp2.plan ..."
        )
    sys.stdout.flush()
    sys.stderr.flush()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the copy: forget the job's groups (copies too), plan, report, leave at once
        os.close(read)
        _run_forked(fn, write)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        data = pipe.read()
    _, status = os.waitpid(pid, 0)
    if not data:
        raise RuntimeError(f"the planner's forked process ended without a result ({status=})")
    ok, value, where = pickle.loads(data)
    if ok:
        return value
    if hasattr(value, "add_note"):  # Python 3.11+
        value.add_note(f"raised in the planner's forked process:\n{where}")
    raise value


_forked = False  # True in the planner's forked copy of a process with a live group


def _run_forked(fn: Callable[[], Any], write: int) -> NoReturn:
    from torch.distributed import distributed_c10d

    global _forked
    _forked = True
    try:
        distributed_c10d._world = distributed_c10d._World()
        result: tuple[bool, Any, str] = (True, fn(), "")
    except BaseException as e:  # every outcome goes back to the parent
        result = (False, e, traceback.format_exc())
    try:
        data = pickle.dumps(result)
    except Exception as e:  # an unpicklable result or exception
        data = pickle.dumps((False, RuntimeError(f"{type(e).__name__}: {e}"), result[2]))
    with os.fdopen(write, "wb") as pipe:
        pipe.write(data)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no atexit or destructors: they would act on the job's copied groups


class _RealMemoryGuard(TorchFunctionMode):
    """Counts what factory calls allocate off the meta device (a ``device=`` the meta context
    cannot override), and refuses before a call that would pass the limit."""

    def __init__(self) -> None:
        super().__init__()
        self.real_bytes = 0

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and torch.device(device).type != "meta":
            self._charge(_factory_bytes(args, kwargs), func)
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and out.device.type not in ("meta",) and device is None:
            self._charge(out.numel() * out.element_size(), func)
        return out

    def _charge(self, nbytes: int, func: Any) -> None:
        self.real_bytes += nbytes
        if self.real_bytes > REAL_BYTES_LIMIT:
            raise PlanError(
                f"the build function allocates real memory: {self.real_bytes / 2**20:.0f} MiB "
                f"off the meta device so far (at {getattr(func, '__name__', func)}), more than "
                f"the planner's limit of {REAL_BYTES_LIMIT // 2**20} MiB. fsdp2.plan runs it "
                "under torch.device('meta'): drop explicit device= arguments (and checkpoint "
                "loading) from the build function, or build on device='meta' yourself"
            )


def _factory_bytes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Bytes a factory call (``torch.empty(*size, dtype=...)``) asks for; 0 if not one."""
    size: Any = kwargs.get("size", args[0] if len(args) == 1 else args)
    if isinstance(size, torch.Size | list | tuple) and all(isinstance(n, int) for n in size):
        dtype = kwargs.get("dtype") or torch.get_default_dtype()
        return math.prod(size) * dtype.itemsize
    return 0


def build_on_meta(build: Callable[[], nn.Module]) -> nn.Module:
    """``build()`` under the meta device, refusing one that allocates a real model."""
    guard = _RealMemoryGuard()
    with guard, torch.device("meta"):
        model = build()
    if not isinstance(model, nn.Module):
        raise PlanError(f"the build function must return an nn.Module, got {type(model).__name__}")
    real = sum(t.numel() * t.element_size() for t in _tensors(model) if t.device.type != "meta")
    if real > REAL_BYTES_LIMIT:
        guard._charge(real, build)
    return model


def _tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    yield from model.parameters()
    yield from model.buffers()


def call_shard(shard: Callable[..., Any], model: nn.Module, mesh: DeviceMesh) -> None:
    """``shard(model)``, or ``shard(model, mesh)`` for a function that takes a mesh."""
    try:
        params = inspect.signature(shard).parameters
    except (TypeError, ValueError):  # a builtin or C callable: assume the simple form
        params = {}  # type: ignore[assignment]
    if "mesh" in params:
        shard(model, mesh=mesh)
    elif len([p for p in params.values() if p.default is inspect.Parameter.empty]) >= 2:
        shard(model, mesh)
    else:
        shard(model)
