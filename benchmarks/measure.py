"""Implementation-agnostic observers for the benchmarks: collectives and peak CPU memory.

Both work below any FSDP implementation, so fsdp2, torch's FSDP2 and DDP are measured the same way:

- `CommCounter` is a `TorchDispatchMode` that sees every `c10d` / `_c10d_functional` op. Eager
  `dist.*` calls (torch's FSDP2 on gloo issues `c10d._allgather_base_` / `_reduce_scatter_base_`)
  and DDP's C++ reducer (`c10d.allreduce_`) all reach the dispatcher, so nothing is monkeypatched.
- `CPUMemory` counts bytes in a wrapper around the CPU allocator (cpu_memory.cpp). CPU has no
  `torch.cuda.max_memory_allocated`; trackers built on dispatch (`MemTracker`) miss what C++ kernels
  allocate inside an op (gloo's reduce-scatter clones its input), and the profiler's memory events
  miss frees on threads it does not profile (gloo's workers). The allocator sees every block.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.cpp_extension import load

# Collective kind by op name; the same names exist in `c10d` (in-place, eager) and in
# `_c10d_functional` (functional, used by DTensor/compile). Anything else counts as "other".
_KINDS = {
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "allgather_coalesced_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_reduce_coalesced_": "all_reduce",
}
# Not collectives: waits and bookkeeping ops in the same namespaces.
_IGNORED = {"wait_tensor", "barrier", "monitored_barrier_", "recv_any_source_"}
KINDS = ("all_gather", "reduce_scatter", "all_reduce", "other")


def _nbytes(tree: Any) -> int:
    return sum(
        t.numel() * t.element_size() for t in tree_leaves(tree) if isinstance(t, torch.Tensor)
    )


def _payload_bytes(kind: str, functional: bool, args: tuple[Any, ...]) -> int:
    """Bytes of the full tensor a collective is about: all-gather output, reduce-scatter input."""
    if functional:  # (input, [reduce_op,] group_size, group_name, ...)
        return _nbytes(args[0]) * (int(args[1]) if kind == "all_gather" else 1)
    # c10d in-place ops: (outputs, inputs, ...) for gather/scatter, (tensors, ...) otherwise
    return _nbytes(args[1] if kind == "reduce_scatter" else args[0])


def _group_size(args: tuple[Any, ...], default: int) -> int:
    """The size of the process group a collective runs over: HSDP's and hfsdp's run over one
    mesh dim, not every rank. c10d's ops take the group itself, the functional ones its name."""
    for arg in args:
        if isinstance(arg, torch.ScriptObject):
            try:
                return int(dist.ProcessGroup.unbox(arg).size())
            except RuntimeError:
                continue  # another script object (a ReduceOp)
        if isinstance(arg, str):
            try:
                return int(_resolve_process_group(arg).size())
            except Exception:
                continue
    return default


def wire_bytes(kind: str, payload: int, world_size: int) -> float:
    """Bytes each rank receives under the bandwidth-optimal (ring) algorithm.

    All-gather and reduce-scatter move payload·(W−1)/W per rank; all-reduce is a reduce-scatter then
    an all-gather, so twice that. Other collectives (broadcasts) are counted at payload·(W−1)/W.
    """
    share = payload * (world_size - 1) / world_size
    return 2 * share if kind == "all_reduce" else share


@dataclass
class CommCounts:
    calls: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    payload: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    wire: float = 0.0  # bytes received per rank (ring algorithm)


class CommCounter(TorchDispatchMode):
    """Counts collectives and their bytes, whatever issues them (FSDP, DDP, DTensor, funcol)."""

    def __init__(self, world_size: int) -> None:
        super().__init__()
        self.world_size = world_size
        self.counts = CommCounts()
        self._records: list[Any] = []
        self._seen = 0

    def __enter__(self) -> Any:
        # fsdp2 (where loaded) records each collective just before issuing it: how its
        # reduce-scatter on gloo, an in-place all-reduce, is told from an all-reduce.
        collectives = sys.modules.get("fsdp2.engine.collectives")
        self._recording = collectives.record_collectives() if collectives is not None else None
        if self._recording is not None:
            self._records = self._recording.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        try:
            return super().__exit__(*exc)
        finally:
            if self._recording is not None:
                self._recording.__exit__(None, None, None)

    def _fsdp2_reduce_scatter_on_gloo(self) -> bool:
        """Call once per collective: whether it is the reduce-scatter fsdp2 just recorded."""
        fresh = len(self._records) > self._seen
        self._seen = len(self._records)
        return fresh and self._records[-1].kind == "reduce_scatter"

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        namespace, name = func.namespace, func.overloadpacket.__name__
        if namespace in ("c10d", "_c10d_functional", "c10d_functional") and name not in _IGNORED:
            kind = _KINDS.get(name, "other")
            payload = _payload_bytes(kind, namespace != "c10d", args)
            if self._fsdp2_reduce_scatter_on_gloo() and kind == "all_reduce":
                # gloo's reduce-scatter is an all-reduce of a clone of its input; fsdp2 issues
                # that all-reduce itself, in place: count it as the reduce-scatter it stands for.
                kind = "reduce_scatter"
            self.counts.calls[kind] += 1
            self.counts.payload[kind] += payload
            world = _group_size(args, self.world_size)
            self.counts.wire += wire_bytes(kind, payload, world)
        return func(*args, **(kwargs or {}))


class CPUMemory:
    """While entered, every CPU tensor allocation is counted (cpu_memory.cpp), from any thread.

    `live_bytes()` counts only blocks allocated while entered, so build what you measure inside.
    The extension is compiled on first use (~15 s, cached in ~/.cache/torch_extensions).
    """

    def __init__(self) -> None:
        # One rank compiles while the others wait on the build directory's lock.
        self._ext = load(
            name="fsdp2_bench_cpu_memory",
            sources=[str(Path(__file__).with_name("cpu_memory.cpp"))],
            extra_cflags=["-O2"],
        )

    def __enter__(self) -> CPUMemory:
        self._ext.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self._ext.uninstall()

    def live_bytes(self) -> int:
        return int(self._ext.live_bytes())

    def settled_live_bytes(self, timeout_s: float = 1.0) -> int:
        """`live_bytes()` once it holds still for 20 ms: gloo's worker threads drop a finished
        collective's buffers a moment after `wait()` returns (seen: a whole unsharded block)."""
        last, steady = self.live_bytes(), 0
        deadline = time.monotonic() + timeout_s
        while steady < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
            now = self.live_bytes()
            steady = steady + 1 if now == last else 0
            last = now
        return last

    def peak_bytes(self) -> int:
        """Most bytes live since the last `reset_peak()`."""
        return int(self._ext.peak_bytes())

    def reset_peak(self) -> None:
        self._ext.reset_peak()


def _sync() -> None:
    """Wait for queued GPU work (no-op on CPU); a barrier alone does not wait for kernels."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], steps: int) -> float:
    """Seconds per call of `fn`, bracketed by barriers so every rank times the same collective work."""
    _sync()
    if dist.is_initialized():
        dist.barrier()
    _sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    _sync()
    if dist.is_initialized():
        dist.barrier()
    _sync()
    return (time.perf_counter() - t0) / steps


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length where two sorted, disjoint span lists intersect."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def exposed_comm_ms(fn: Callable[[], Any]) -> tuple[float, float]:
    """(exposed, total) ms of collective kernels in one call of `fn` on a GPU, from the profiler's
    kernel timeline: a collective kernel's time is exposed where no other kernel (compute,
    copies) runs at the same time, i.e. where the GPU does nothing but communicate. Same for any
    implementation: it looks only at kernels. (0, 0) if the profiler saw no GPU kernels."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    _sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        _sync()
    comm, other = [], []
    for event in prof.events():
        if event.device_type != DeviceType.CUDA:
            continue
        span = (float(event.time_range.start), float(event.time_range.end))  # µs
        (comm if "nccl" in event.name.lower() else other).append(span)
    comm_u, other_u = _union(comm), _union(other)
    total = sum(end - start for start, end in comm_u)
    return (total - _overlap(comm_u, other_u)) / 1e3, total / 1e3


def leave() -> NoReturn:
    """Leave together, without finalizing the interpreter. gloo's worker threads release a
    finished collective's tensors a moment after `wait()` returns; if that lands during
    interpreter shutdown, the worker's GIL acquire kills the thread inside a destructor and the
    process aborts ("terminate called without an active exception")."""
    dist.barrier()  # rank 0 has reported
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
