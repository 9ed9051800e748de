"""Trails: how many of an implementation's files a gradient and a gather pass through.

    python benchmarks/trails.py                      # fsdp2, coalescing off and on
    python benchmarks/trails.py --impl torch         # torch's fully_shard, for comparison
    python benchmarks/trails.py --walk               # every change of file, not just the files

Two gloo ranks (spawned here, on a free port), a 3-block MLP (each block and then the root
sharded), one warm-up step and ``zero_grad()``; then, on the calling thread of each rank, a
profile hook (``sys.setprofile``) follows the implementation's code along three trails:

  backward → issue   from ``loss.backward()`` to the first reduce-scatter (or the all-reduce that
                     stands for one on gloo) called in ``torch.distributed``. It includes the
                     backward all-gather of the last block, which was resharded after forward.
  issue → .grad      from the reduce-scatter that carries the first block's gradient being
                     called in ``torch.distributed`` (the last one issued before that block's
                     ``.grad`` is set) to that ``.grad`` being set: the moment the sharded
                     parameter's post-accumulate-grad hooks run, which both implementations call
                     right after assigning (fsdp2: ``engine/grads.py:accumulate_grad``). The
                     first block is the last one to finish backward, so the trail holds that
                     gradient's way (wait, cut, hand over), not other blocks' backward work.
  forward → gather   from the middle block's own forward call, on its own after the step, to
                     its first all-gather (or broadcast) called in ``torch.distributed``.

A trail's walk is the implementation file being executed, each time it changes, returns
included: the innermost frame of the implementation's code, whatever torch code runs inside it.
``files`` are its distinct files in the order first entered, ``moves`` its changes of file. For
fsdp2 a file is a path under the ``fsdp2/`` package (``engine/state.py``, ``debug/hang.py``); for
torch, under ``torch/distributed/``: its ``fsdp/_fully_shard/`` package and the FSDP helpers it
calls outside it (``_composable/``, ``_composable_state.py``, ``fsdp/_common_utils.py``,
``utils.py``). DTensor, the device mesh and c10d count for neither. Coalescing
(``fsdp2.set_coalesce_bytes``: 0 is off, else the default budget) applies to fsdp2 only.

fsdp2 hands every gradient over at the end of backward, torch right after each reduce-scatter:
from the *first* reduce-scatter (the last block's) to its ``.grad``, fsdp2's trail would also
hold the other blocks' backward (with coalescing off, 16 files instead of 13 on 2026-11-29).

The files have been the same in every run. The moves need not be: in backward fsdp2 finishes
the reduce-scatters that have already completed (``Reductions.reap``), so when an earlier one
completes moves the same steps along the walk (seen: 73 or 93 moves for issue → .grad on one
commit, the same 14 files). A run takes 8-25 s on 2 cores, depending on their load, nearly all
of it two ranks starting.
``tests/test_trails.py`` pins fsdp2's counts; issue 41 aims at ≤ 6 files for backward → issue,
≤ 4 for issue → .grad and ≤ 6 for forward → gather (``TARGETS``).
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.multiprocessing.spawn import start_processes

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # fsdp2 from this checkout

IMPLS = ("fsdp2", "torch")
TRAILS = ("backward_to_issue", "issue_to_grad", "forward_to_gather")
TITLES = {
    "backward_to_issue": "backward → reduce-scatter issued",
    "issue_to_grad": "reduce-scatter issued → .grad set",
    "forward_to_gather": "forward → all-gather issued",
}
# Issue 41's targets: distinct files per trail.
TARGETS = {"backward_to_issue": 6, "issue_to_grad": 4, "forward_to_gather": 6}
# Where each trail ends, when it is reached: the implementation's function that called the
# collective in torch.distributed, or GRAD_SET.
GRAD_SET = ".grad set"

# The names, in distributed_c10d.py, of the collectives that end a trail (several torch
# releases: 2.13 renamed the tensor-in, tensor-out ones to *_single).
REDUCES = frozenset(
    {
        "reduce_scatter_single",
        "reduce_scatter_tensor",
        "reduce_scatter_tensor_coalesced",
        "_reduce_scatter_base",
        "reduce_scatter",
        "all_reduce",
        "all_reduce_coalesced",
    }
)
GATHERS = frozenset(
    {
        "all_gather_single",
        "all_gather_into_tensor",
        "all_gather_into_tensor_coalesced",
        "_all_gather_base",
        "all_gather",
        "broadcast",
    }
)
COLLECTIVES = REDUCES | GATHERS
_C10D = dist.distributed_c10d.__file__
_TORCH_PARTS = (
    "fsdp/_fully_shard/",
    "_composable/",
    "_composable_state.py",
    "fsdp/_common_utils.py",
    "utils.py",
)


@dataclass(frozen=True)
class Trail:
    """One trail: ``walk``, the implementation file executing, at each change; ``end``, where it
    stopped (the function that called the collective, or ``GRAD_SET``), empty if never reached."""

    walk: tuple[str, ...]
    end: str

    @property
    def files(self) -> tuple[str, ...]:
        """The distinct files of the walk, in the order first entered."""
        return tuple(dict.fromkeys(self.walk))

    @property
    def moves(self) -> int:
        """Changes of file along the walk."""
        return max(len(self.walk) - 1, 0)


class Recorder:
    """A profile hook: the implementation file executing, each time it changes, and marks where
    a collective is called in torch.distributed (``reduce``/``gather``) or a ``.grad`` is set."""

    def __init__(self, roots: dict[str, str]) -> None:
        self.roots = roots  # absolute prefix -> the prefix it is shown relative to
        self.known: dict[str, str | None] = {}
        self.events: list[tuple[str, str]] = []  # ("enter", file) or (mark, where)
        self.last: str | None = None
        self.done = False

    def file_of(self, filename: str) -> str | None:
        """``filename`` relative to its implementation's root; None if not the implementation's."""
        if filename not in self.known:
            self.known[filename] = next(
                (
                    filename[len(base) :]
                    for prefix, base in self.roots.items()
                    if filename.startswith(prefix)
                ),
                None,
            )
        return self.known[filename]

    def innermost(self, frame: FrameType | None) -> tuple[str, str] | None:
        """The implementation's innermost frame at or above ``frame``: its file and function."""
        while frame is not None:
            file = self.file_of(frame.f_code.co_filename)
            if file is not None:
                return file, frame.f_code.co_name
            frame = frame.f_back
        return None

    def enter(self, file: str) -> None:
        if file != self.last:
            self.events.append(("enter", file))
            self.last = file

    def mark(self, kind: str, where: str) -> None:
        self.events.append((kind, where))

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if self.done:
            return
        code = frame.f_code
        if event == "call":
            if code.co_filename == _C10D and code.co_name in COLLECTIVES:
                caller = self.innermost(frame.f_back)
                where = f"{caller[0]}:{caller[1]}" if caller else "?"
                self.mark("reduce" if code.co_name in REDUCES else "gather", where)
                return
            file = self.file_of(code.co_filename)
            if file is not None:
                self.enter(file)
        elif event == "return" and self.file_of(code.co_filename) is not None:
            back = self.innermost(frame.f_back)  # execution goes back to the caller
            if back is not None:
                self.enter(back[0])

    def run(self, fn: Any) -> None:
        sys.setprofile(self)
        try:
            fn()
        finally:
            sys.setprofile(None)


def cut(events: list[tuple[str, str]], start: int, stop: int, first: str | None, end: str) -> Trail:
    """The trail of ``events[start:stop]``, beginning in ``first`` (where the start happened)."""
    walk: list[str] = [first] if first else []
    for kind, file in events[start:stop]:
        if kind == "enter" and (not walk or walk[-1] != file):
            walk.append(file)
    return Trail(tuple(walk), end)


def grad_trails(events: list[tuple[str, str]]) -> dict[str, Trail]:
    """Backward → issue and issue → .grad, from one backward's events."""
    reduces = [i for i, (kind, _) in enumerate(events) if kind == "reduce"]
    first = reduces[0] if reduces else len(events)
    trails = {"backward_to_issue": cut(events, 0, first, None, events[first][1] if reduces else "")}
    grad = next((i for i, (kind, _) in enumerate(events) if kind == GRAD_SET), None)
    issue = max((i for i in reduces if grad is not None and i < grad), default=None)
    if grad is None or issue is None:
        trails["issue_to_grad"] = Trail((), "")
    else:
        trails["issue_to_grad"] = cut(
            events, issue + 1, grad, events[issue][1].split(":")[0], GRAD_SET
        )
    return trails


def gather_trail(events: list[tuple[str, str]]) -> Trail:
    """Forward → gather, from one forward's events."""
    gather = next((i for i, (kind, _) in enumerate(events) if kind == "gather"), None)
    if gather is None:
        return cut(events, 0, len(events), None, "")
    return cut(events, 0, gather, None, events[gather][1])


def _roots(impl: str) -> dict[str, str]:
    if impl == "fsdp2":
        import fsdp2

        base = str(Path(fsdp2.__file__).resolve().parent) + "/"
        return {base: base}
    base = str(Path(dist.__file__).resolve().parent) + "/"
    return {base + part: base for part in _TORCH_PARTS}


def _fully_shard(impl: str, coalesce: bool) -> Any:
    """``impl``'s ``fully_shard``; for fsdp2, with coalescing at its default budget or off."""
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard

        return fully_shard
    import fsdp2

    if not coalesce:
        fsdp2.set_coalesce_bytes(0)
    return fsdp2.fully_shard


def _rank(rank: int, impl: str, coalesce: bool, port: int, out: str) -> None:
    """One rank: build, warm up, follow the trails; rank 0 writes them to ``out`` (JSON)."""
    torch.set_num_threads(1)
    torch.autograd.set_multithreading_enabled(False)  # backward's hooks on this thread
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    fully_shard = _fully_shard(impl, coalesce)
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3)))
    for block in model:
        fully_shard(block)
    fully_shard(model)
    x = torch.randn(4, 16)
    model(x).sum().backward()
    model.zero_grad()  # .grad None again: the measured backward assigns, not adds

    recorder = Recorder(_roots(impl))
    first_block = model[0]

    def grad_set(param: torch.Tensor) -> None:
        recorder.mark(GRAD_SET, "")
        recorder.done = True

    for param in first_block.parameters():
        param.register_post_accumulate_grad_hook(grad_set)  # type: ignore[no-untyped-call]
    loss = model(x).sum()
    recorder.run(loss.backward)
    trails = grad_trails(recorder.events)

    recorder = Recorder(_roots(impl))
    recorder.run(lambda: model[1](torch.randn(4, 16)))
    trails["forward_to_gather"] = gather_trail(recorder.events)
    if rank == 0:
        found = {name: {"walk": list(t.walk), "end": t.end} for name, t in trails.items()}
        Path(out).write_text(json.dumps(found))
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(coalesce: bool, impl: str = "fsdp2", timeout: float = 180.0) -> dict[str, Trail]:
    """The three trails (``TRAILS``) at rank 0 of a 2-rank run spawned here; ``TimeoutError``
    if the ranks have not finished within ``timeout`` seconds (they are then killed)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    with tempfile.TemporaryDirectory(prefix="fsdp2-trails-") as tmp:
        out = str(Path(tmp) / "trails.json")
        context = start_processes(  # type: ignore[no-untyped-call]
            _rank,
            args=(impl, coalesce, free_port(), out),
            nprocs=2,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=max(deadline - time.monotonic(), 0.1)):
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"trails ({impl}, coalesce={coalesce}) not done in {timeout:.0f} s"
                    )
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                    process.join()
        found = json.loads(Path(out).read_text())
    return {name: Trail(tuple(found[name]["walk"]), found[name]["end"]) for name in TRAILS}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--impl", choices=(*IMPLS, "both"), default="fsdp2", help="(%(default)s)")
    parser.add_argument(
        "--coalesce", choices=("off", "on", "both"), default="both", help="fsdp2 only (%(default)s)"
    )
    parser.add_argument(
        "--walk", action="store_true", help="print every change of file, not just the files"
    )
    args = parser.parse_args()
    runs: list[tuple[str, str]] = []
    for impl in IMPLS if args.impl == "both" else (args.impl,):
        if impl == "torch":
            runs.append((impl, "—"))
        else:
            runs += [(impl, c) for c in ("off", "on") if args.coalesce in (c, "both")]
    rows = []
    for impl, coalescing in runs:
        trails = measure(coalescing != "off", impl)
        print(f"{impl}, coalescing {coalescing}:")
        for name in TRAILS:
            trail = trails[name]
            rows.append(
                (impl, coalescing, TITLES[name], len(trail.files), trail.moves, TARGETS[name])
            )
            end = trail.end or "NOT REACHED"
            counts = f"{len(trail.files)} files, {trail.moves} moves"
            print(f"  {TITLES[name]} (ends in {end}): {counts}")
            print("    " + " > ".join(trail.walk if args.walk else trail.files))
    print()
    head = f"{'impl':<6} {'coalescing':<10} {'trail':<36} {'files':>5} {'moves':>5}"
    print(f"{head}  issue-41 target (files)")
    for impl, coalescing, title, files, moves, target in rows:
        print(f"{impl:<6} {coalescing:<10} {title:<36} {files:>5} {moves:>5}  ≤ {target}")


if __name__ == "__main__":
    main()
