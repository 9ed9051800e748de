"""What the seam hands a backend, and exit after the backend let go
([Note: a backend thread's last reference] in fsdp2/engine/handover.py).

A script whose last act is ``iter_full_weights`` died of SIGABRT at exit in 1 to 7 runs of 25 on
a busy 2-core machine: a thread still letting go of Python objects when finalization began (a
gloo worker dropping the closing exchange's work; the hang report's publisher inside a store
call). The launch test runs that script again and again, and counts the ranks that die of a
signal; it cannot fail every time on the old code (the race is one of timing). The tests before
it pin the mechanisms, deterministically: the backend holds none of the caller's tensors, only
handed ones, which exit waits for, and nothing else on the caller's memory (gloo's
all_gather_into_tensor held views of its own: a path to the abort, found after one rank of 24
died at exit in a CI run); the publisher is stopped and joined at exit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_on_ranks

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().with_name("exit_after_export.py")
RUNS = 12  # pairs of ranks, one after the other; each a fresh pair of interpreters
TIMEOUT_S = 300  # per pair: ~10 s on 2 cores, a minute when the machine is very busy


def test_hand_shares_memory_and_version_and_holds_no_base() -> None:
    from fsdp2.engine.handover import hand

    base = torch.zeros(8)
    view = base.view(2, 4)[1]
    handed = hand(view)
    # A view would keep ``base`` alive through autograd's view tracking; the handed tensor not.
    assert handed._base is None and handed.data_ptr() == view.data_ptr()
    handed.add_(1)  # what a collective writes, the caller sees, version counter included
    assert base.tolist() == [0.0] * 4 + [1.0] * 4
    assert view._version == handed._version == 1


def _caller_tensors_not_held() -> list[tuple[str, int, int]]:
    from fsdp2.engine import collectives

    group, world = dist.group.WORLD, dist.get_world_size()
    out, inp = torch.zeros(4 * world), torch.ones(4)
    counts = []
    # (The gloo reduce-scatter's Pending holds a view of its input for the copy it makes once
    # waited on: the caller's, not the backend's, so not counted here.)
    for name, issue in (
        ("all_gather", lambda: collectives.all_gather(out, inp, group, "t")),
        ("all_reduce", lambda: collectives.all_reduce(inp, group, "t", SUM)),
    ):
        before = out._use_count() + inp._use_count()
        pending = issue()
        # The work is held until waited on, and with it what it was handed: not the caller's.
        counts.append((name, before, out._use_count() + inp._use_count()))
        pending.wait()
    return counts


SUM = dist.ReduceOp.SUM


def test_backend_holds_none_of_the_callers_tensors() -> None:
    for counts in run_on_ranks(2, _caller_tensors_not_held):
        for name, before, during in counts:
            assert during == before, (name, before, during)


def _beyond_handed(owner: torch.Tensor, pending: object) -> int:
    """References to ``owner``'s memory other than ``owner``'s own, its Python object's and
    the seam's (``pending``'s handed tensors and its copy to make): what the backend made."""
    ptr = owner.untyped_storage()._cdata  # the memory's Python object, made once and kept
    seams = [*(pending._handed or []), *(pending._then or ())]  # type: ignore[attr-defined]
    ours = {id(t) for t in seams if t is not owner and t.untyped_storage()._cdata == ptr}
    return int(torch._C._storage_Use_Count(ptr)) - 2 - len(ours)


def _finished_beyond_handed() -> dict[str, list[int]]:
    from fsdp2.engine import collectives

    group, world = dist.group.WORLD, dist.get_world_size()
    issues = {
        "all_gather": lambda o, i: collectives.all_gather(o, i, group, "t"),
        "reduce_scatter": lambda o, i: collectives.reduce_scatter(o, i, group, "t", SUM),
        "all_reduce": lambda o, i: collectives.all_reduce(i, group, "t", SUM),
        "all_to_all": lambda o, i: collectives.all_to_all(
            o, i, [4] * world, [4] * world, group, "t"
        ),
    }
    sizes = {
        "all_gather": (8, 4),
        "reduce_scatter": (4, 8),
        "all_reduce": (4, 4),
        "all_to_all": (8, 8),
    }
    counts = {}
    for name, issue in issues.items():
        out, inp = (torch.ones(n) for n in sizes[name])
        pending = issue(out, inp)
        # Finished, its work still held (as a backend's thread holds it a while): what the
        # work holds now outlives the collective. (While it runs, gloo's own views of the
        # input are locals of the run, gone before it finishes.)
        pending._work.wait()  # type: ignore[attr-defined]
        counts[name] = [_beyond_handed(out, pending), _beyond_handed(inp, pending)]
        pending.wait()
    return counts


def test_backend_holds_the_callers_memory_only_through_handed_tensors() -> None:
    # What a backend makes on the caller's memory outlives the handed tensors that exit waits
    # for (gloo's all_gather_into_tensor cuts its output into views of its own).
    for counts in run_on_ranks(2, _finished_beyond_handed):
        assert all(count == [0, 0] for count in counts.values()), counts


def _export_then_settle() -> tuple[bool, int, float]:
    import fsdp2
    from fsdp2.engine import handover

    model = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(2)))
    for layer in model:
        fsdp2.fully_shard(layer)
    fsdp2.fully_shard(model)
    model(torch.randn(2, 16)).sum().backward()
    for bucket in fsdp2.iter_full_weights(model, rank=0):
        del bucket
    start = time.monotonic()
    settled = handover.settle(timeout_s=5.0)
    return settled, handover.unsettled(), time.monotonic() - start


def test_the_backend_lets_go_of_every_handed_tensor() -> None:
    # The seam keeps no handed tensor itself: exit would wait SETTLE_TIMEOUT_S for one.
    for settled, left, seconds in run_on_ranks(2, _export_then_settle):
        assert settled and left == 0, (settled, left)
        assert seconds < 2.0, seconds


PUBLISHER_AT_EXIT = """
import os, torch, torch.distributed as dist
from fsdp2.debug import hang
from fsdp2.engine import collectives
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
dist.init_process_group("gloo", rank=0, world_size=1)
collectives.all_reduce(torch.ones(2), dist.group.WORLD, "t", dist.ReduceOp.SUM).wait()
alive = hang._thread is not None and hang._thread.is_alive()
hang._at_exit()
print(alive, hang._thread.is_alive())
"""


def test_hang_publisher_is_joined_at_exit() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT), "PORT": str(port)}
    proc = subprocess.run(
        [sys.executable, "-c", PUBLISHER_AT_EXIT],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # It ran, and it no longer runs once the exit hook returned.
    assert proc.stdout.split() == ["True", "False"], proc.stdout


def _launch_pair(directory: str, index: int) -> list[subprocess.Popen[str]]:
    init = f"file://{os.path.join(directory, f'store{index}')}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    return [
        subprocess.Popen(
            # faulthandler: a rank killed by a signal says which thread died, and where.
            [sys.executable, "-X", "faulthandler", str(SCRIPT), str(rank), "2", init],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]


@pytest.mark.slow
def test_export_then_exit_exits_zero() -> None:
    failed: list[str] = []
    with tempfile.TemporaryDirectory() as directory:
        for index in range(RUNS):
            deadline = time.monotonic() + TIMEOUT_S
            for rank, proc in enumerate(_launch_pair(directory, index)):
                try:
                    _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    _, err = proc.communicate()
                    err = f"timed out after {TIMEOUT_S} s\n{err}"
                if proc.returncode != 0:
                    how = (
                        signal.Signals(-proc.returncode).name
                        if proc.returncode < 0
                        else f"exit code {proc.returncode}"
                    )
                    failed.append(f"run {index} rank {rank}: {how}: {err[-2000:]}")
    assert not failed, f"{len(failed)} of {2 * RUNS} ranks failed:\n" + "\n".join(failed)
