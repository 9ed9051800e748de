"""fsdp2 trains on any process-group backend, not only gloo and NCCL.

fsdp2 waits on its CPU collectives with a deadline (``work.wait(timeout=...)``, the hang report).
Backends whose works reject a finite timeout must still train, with parity:

- torch's multi-threaded process group (``threaded``: what torch's own FSDP tests and many users'
  unit tests run on), whose ranks are threads of one process (so fsdp2 must keep its per-rank
  state per rank, not per process): :func:`run_on_threads`;
- a backend registered through ``torch.distributed.Backend.register_backend`` whose works raise
  on ``wait(timeout=...)`` with a message of its own (:class:`UntimedGloo`), launched with
  torchrun: this file is also its rank-side script.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import expecttest
import pytest
import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as a script by torchrun: make `tests` importable
    _repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, _repo)

from tests.hang_scenarios import logged_report, normalise
from tests.harness import IMPL_UNDER_TEST, launch, run_on_ranks
from tests.parity import ParityConfig

# ---------------------------------------------------------------------------------------------
# The multi-threaded process group
# ---------------------------------------------------------------------------------------------

_build_lock = threading.Lock()


def run_on_threads(
    world_size: int, fn: Callable[..., Any], *args: Any, timeout: float
) -> list[Any]:
    """``fn(*args)`` on ``world_size`` threads of this process, each a rank of torch's
    multi-threaded process group (as torch's ``MultiThreadedTestCase`` sets it up); per-rank
    results in rank order. A rank that raises wakes the others (their collectives exit) and its
    traceback is raised here; a rank still running after ``timeout`` seconds too."""
    from torch.testing._internal.distributed import multi_threaded_pg as mtpg

    import tests.parity.run

    # The parity models are initialised from torch's global RNG, which the threads share.
    build = tests.parity.run.twins

    def locked_build(*build_args: Any) -> tuple[torch.nn.Module, torch.nn.Module]:
        with _build_lock:
            return build(*build_args)

    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    store = dist.HashStore()

    def rank_main(rank: int) -> None:
        try:
            dist.init_process_group("threaded", rank=rank, world_size=world_size, store=store)
            try:
                results[rank] = fn(*args)
            finally:
                dist.destroy_process_group()
        except BaseException as e:  # SystemExit too: the threaded group's way to wake a rank
            errors[rank] = traceback.format_exc()
            mtpg.ProcessLocalGroup.exception_handle(e)

    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    mtpg._install_threaded_pg()
    tests.parity.run.twins = locked_build
    try:
        threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world_size)]
        for thread in threads:
            thread.start()
        for rank, thread in enumerate(threads):
            thread.join(timeout)
            if thread.is_alive():
                errors.setdefault(rank, f"still running after {timeout:.0f} s")
                mtpg.ProcessLocalGroup.exception_handle(TimeoutError())
                thread.join(5.0)
    finally:
        tests.parity.run.twins = build
        mtpg.ProcessLocalGroup.reset()
        mtpg._uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
    if errors:
        raise AssertionError(
            "".join(f"\nrank {r} (thread) failed:\n{tb}" for r, tb in sorted(errors.items()))
        )
    return [results[r] for r in range(world_size)]


def _threaded_parity(world_size: int, cfg: ParityConfig, checks: bool) -> list[dict[str, Any]]:
    """Rank side (a 1-rank pool process, so the test process keeps its own world): the parity
    run of ``cfg`` on ``world_size`` threads."""
    import fsdp2
    from tests.parity import run_parity

    fsdp2.set_collective_checks(checks)
    try:
        return run_on_threads(world_size, run_parity, cfg, timeout=150)
    finally:
        fsdp2.set_collective_checks(False)


def _check(results: list[dict[str, Any]], cfg: ParityConfig) -> None:
    for rank, result in enumerate(results[1:], start=1):
        assert result["losses"] == results[0]["losses"], f"rank {rank} global loss differs"
    assert len(results[0]["losses"]) == cfg.num_steps
    assert results[0]["num_grads_compared"] > 0


# The parity suite's models (tests/test_parity.py): its core cases.
CORE_MODELS = ["mlp", "gpt", "odd_shapes", "frozen", "unused", "buffers", "no_own_params"]


@pytest.mark.parametrize("model", CORE_MODELS)
def test_parity_on_threaded_process_group(model: str) -> None:
    cfg = ParityConfig(model=model, impl=IMPL_UNDER_TEST)
    (results,) = run_on_ranks(1, _threaded_parity, 2, cfg, False, timeout=180)
    _check(results, cfg)


@pytest.mark.parametrize(
    ("model", "world_size", "reshard_after_forward"), [("gpt", 4, None), ("gpt", 2, False)]
)
def test_parity_on_threaded_process_group_more(
    model: str, world_size: int, reshard_after_forward: bool | None
) -> None:
    cfg = ParityConfig(
        model=model, impl=IMPL_UNDER_TEST, reshard_after_forward=reshard_after_forward
    )
    (results,) = run_on_ranks(1, _threaded_parity, world_size, cfg, False, timeout=180)
    _check(results, cfg)


def test_collective_checks_on_threaded_process_group(fsdp2_only: None) -> None:
    """The checks compare each rank's sequence numbers: one counter per process (the threads'
    collectives interleaved in it) made the ranks disagree at once."""
    cfg = ParityConfig(model="gpt", impl="fsdp2", num_steps=2)
    (results,) = run_on_ranks(1, _threaded_parity, 2, cfg, True, timeout=180)
    _check(results, cfg)


# ---------------------------------------------------------------------------------------------
# An out-of-tree backend whose works reject finite timeouts
# ---------------------------------------------------------------------------------------------

BACKEND = "untimed_gloo"


class UntimedWork(dist.Work):
    """gloo works that can only be waited on without a timeout (its own error otherwise)."""

    def __init__(self, *inner: dist.Work) -> None:
        super().__init__()
        self._inner = inner

    def wait(self, timeout: timedelta | None = None) -> bool:
        if timeout is not None and timeout != timedelta(0):  # 0: c10d's "no timeout"
            raise ValueError("UntimedWork.wait: unsupported argument")
        for work in self._inner:  # every one, even after a False
            work.wait()
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._inner)


class UntimedGloo(dist.ProcessGroup):
    """gloo's collectives behind a Python process group, each work an :class:`UntimedWork`
    (the methods c10d's Python API calls on a Python process group, as torch's threaded one)."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta) -> None:
        super().__init__(rank, size)
        self._gloo = dist.ProcessGroupGloo(store, rank, size, timeout)

    def getBackendName(self) -> str:
        return BACKEND

    @property
    def group_name(self) -> str:  # c10d keeps a Python process group's name in its world
        return str(dist.distributed_c10d._world.pg_names[self])

    def allreduce(self, tensors: Any, opts: Any = None) -> dist.Work:
        return UntimedWork(self._gloo.allreduce(tensors, opts or dist.AllreduceOptions()))

    def allreduce_coalesced(self, tensors: Any, opts: Any = None) -> dist.Work:
        return UntimedWork(self._gloo.allreduce_coalesced(tensors))

    def allgather(self, outputs: Any, inputs: Any, opts: Any = None) -> dist.Work:
        return UntimedWork(self._gloo.allgather(outputs, inputs))

    def all_gather_single(self, output: Any, inp: Any, opts: Any = None) -> dist.Work:
        return UntimedWork(self._gloo._allgather_base(output, inp))

    def all_gather_single_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        pairs = zip(outputs, inputs, strict=True)
        return UntimedWork(*(self._gloo._allgather_base(o, i) for o, i in pairs))

    def reduce_scatter_single_coalesced(self, outputs: Any, inputs: Any, opts: Any) -> Any:
        pairs = zip(outputs, inputs, strict=True)
        return UntimedWork(*(self._gloo._reduce_scatter_base(o, i, opts) for o, i in pairs))

    def reduce_scatter_single(self, output: Any, inp: Any, opts: Any = None) -> dist.Work:
        return UntimedWork(self._gloo._reduce_scatter_base(output, inp, opts))

    def all_to_all_single(
        self, output: Any, inp: Any, out_splits: Any, in_splits: Any, opts: Any = None
    ) -> dist.Work:
        return UntimedWork(self._gloo.alltoall_base(output, inp, out_splits, in_splits))

    def broadcast(self, tensors: Any, opts: Any = None) -> dist.Work:
        return UntimedWork(self._gloo.broadcast(tensors, opts))

    def barrier(self, opts: Any = None) -> dist.Work:
        return UntimedWork(self._gloo.barrier())


def _create_untimed_gloo(
    store: dist.Store, rank: int, size: int, timeout: timedelta
) -> UntimedGloo:
    return UntimedGloo(store, rank, size, timeout)


def _main() -> None:
    """Under torchrun, on the ``untimed_gloo`` backend. ``parity IMPL MODEL...``: the parity run
    of each model, one JSON line per model and rank. ``hang``: rank 1 skips a step; rank 0
    prints one JSON line: what fsdp2 logged, what ended its step, and when."""
    torch.set_num_threads(1)
    dist.Backend.register_backend(BACKEND, _create_untimed_gloo, devices=["cpu"])
    mode, *args = sys.argv[1:]
    if mode == "parity":
        _parity_main(*args)
    elif mode == "short":  # plain gloo, its own timeout shorter than fsdp2's deadline
        _hang_main("gloo", SHORT_HANG_TIMEOUT_S, SHORT_BACKEND_TIMEOUT_S)
    else:
        _hang_main(BACKEND, HANG_TIMEOUT_S, BACKEND_TIMEOUT_S)
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown (gloo may abort in static destructors)


def _parity_main(impl: str, *models: str) -> None:
    from tests.parity import run_parity

    dist.init_process_group(BACKEND)
    for model in models:
        result = run_parity(ParityConfig(model=model, impl=impl))
        line = {"rank": dist.get_rank(), "model": model, "losses": result["losses"]}
        sys.stdout.write(json.dumps(line) + "\n")  # one write: the ranks share stdout
        sys.stdout.flush()


HANG_TIMEOUT_S, BACKEND_TIMEOUT_S = 1.5, 8.0  # FSDP2_COLLECTIVE_TIMEOUT, the group's own
SHORT_HANG_TIMEOUT_S, SHORT_BACKEND_TIMEOUT_S = 60.0, 3.0  # the group's own ends the wait first


def _hang_main(backend: str, hang_timeout_s: float, backend_timeout_s: float) -> None:
    import logging
    import time

    from fsdp2.engine.coalesce import set_coalesce_bytes
    from tests.hang_scenarios import _step, build, outcome

    set_coalesce_bytes(0)  # the report pinned below names one group's gather
    dist.init_process_group(backend, timeout=timedelta(seconds=backend_timeout_s))
    logged: list[tuple[float, str]] = []  # (when, message)

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            logged.append((time.monotonic(), record.getMessage()))

    logging.getLogger("fsdp2").addHandler(Keep(logging.INFO))
    logging.getLogger("fsdp2").setLevel(logging.INFO)
    model = build()
    _step(model, 0)
    # Only now the short deadline: on a busy machine one rank may reach step 0 seconds late.
    os.environ["FSDP2_COLLECTIVE_TIMEOUT"] = str(hang_timeout_s)
    if dist.get_rank() == 1:  # skips step 1, and stays (its connections open) past the timeout
        time.sleep(backend_timeout_s + 4)
        return
    start = time.monotonic()
    text = outcome(lambda: _step(model, 1))
    seconds = time.monotonic() - start
    line = {"logged": [(t - start, m) for t, m in logged], "outcome": text, "seconds": seconds}
    sys.stdout.write(json.dumps(line) + "\n")
    sys.stdout.flush()


def test_parity_on_backend_without_timed_waits() -> None:
    models = ["mlp", "gpt", "unused"]
    proc = launch(__file__, 2, "parity", IMPL_UNDER_TEST, *models, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert sorted((x["model"], x["rank"]) for x in lines) == sorted(
        (m, r) for m in models for r in range(2)
    ), proc.stdout + proc.stderr
    for model in models:
        ranks = [x["losses"] for x in lines if x["model"] == model]
        assert ranks[0] == ranks[1] and len(ranks[0]) == 5, (model, ranks)


if __name__ == "__main__":
    _main()


@pytest.mark.skipif(IMPL_UNDER_TEST != "fsdp2", reason="fsdp2's own report")
class TestHangWithoutDeadline(expecttest.TestCase):
    def test_report_logged_at_the_deadline(self) -> None:
        """On a backend without timed waits, a rank that skips a step leaves its peer in an
        untimed wait: the hang report is logged at FSDP2_COLLECTIVE_TIMEOUT, and the backend's
        own timeout ends the wait, as CollectiveFailedError with the same per-rank lines."""
        proc = launch(__file__, 2, "hang", timeout=120)
        line, report = logged_report(proc, HANG_TIMEOUT_S, BACKEND_TIMEOUT_S)
        assert BACKEND_TIMEOUT_S <= line["seconds"] < BACKEND_TIMEOUT_S + 5, line
        self.assertExpectedInline(
            normalise(report),
            """\
fsdp2: rank 0 waited N s (FSDP2_COLLECTIVE_TIMEOUT) for the all-gather #17 for `<root>` (18 elements, float32) on the process group of ranks [0, 1], and it has not finished.
Where each rank is (from the c10d store):
  rank 0 (this rank): blocked in it
  rank 1: MISSING, issued only #0-#16 on this group; not in an fsdp2 collective (busy elsewhere, finished or raised); last seen N s ago issuing reduce-scatter #16 for `<root>` (40 elements, float32) [published N s ago]
A rank MISSING from it skipped that module (control flow that depends on the rank or the data: MoE routing, a layer skipped for some inputs or shapes), raised, or never started the step. A rank on a DIFFERENT collective got out of step earlier: collectives pair up by order, not by module, so earlier ones may have exchanged wrong data. The process group is unusable now (a collective is half done): abort the job on every rank. FSDP2_CHECK_COLLECTIVES=1 stops at the first collective where the ranks disagree, with both sides named.
This backend's works reject a finite timeout: fsdp2 cannot end the wait, which goes on until the backend's own timeout.""",
        )
        # gloo's all-gather times out in a send or a receive, as timing goes.
        outcome = re.sub(r"for (send|recv) operation", "for send/recv operation", line["outcome"])
        self.assertExpectedInline(
            normalise(outcome),
            """\
CollectiveFailedError: fsdp2: rank 0 was waiting for the all-gather #17 for `<root>` (18 elements, float32) on the process group of ranks [0, 1] when the backend raised RuntimeError: Timed out waiting 8000ms for send/recv operation to complete
Where each rank is (from the c10d store):
  rank 0 (this rank): waiting in it
  rank 1: MISSING, issued only #0-#16 on this group; not in an fsdp2 collective (busy elsewhere, finished or raised); last seen N s ago issuing reduce-scatter #16 for `<root>` (40 elements, float32) [published N s ago]
Likely cause: the backend's own timeout passed (its works take no finite timeout, so FSDP2_COLLECTIVE_TIMEOUT could not end the wait sooner): a rank MISSING from this collective skipped that module, raised, or never started the step. The process group is unusable now: abort the job on every rank.""",
        )


def test_a_shorter_process_group_timeout_is_not_reported_as_fsdp2s() -> None:
    """gloo's own timeout (the process group's ``timeout=``, 3 s) ends the wait long before
    FSDP2_COLLECTIVE_TIMEOUT (60 s): the report says how long it waited and what ended it (it
    used to say "waited 60 s (FSDP2_COLLECTIVE_TIMEOUT)" after 3)."""
    if IMPL_UNDER_TEST != "fsdp2":
        pytest.skip("fsdp2's own report")
    proc = launch(__file__, 2, "short", timeout=120)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, proc.stdout + proc.stderr
    (line,) = lines
    assert line["seconds"] < SHORT_HANG_TIMEOUT_S / 2, line
    assert line["seconds"] >= SHORT_BACKEND_TIMEOUT_S, line
    first = line["outcome"].splitlines()[0]  # its times normalised to "N s"
    assert first.startswith(
        "CollectiveTimeoutError: fsdp2: rank 0 waited N s (the process group's own timeout "
        "ended the wait, before FSDP2_COLLECTIVE_TIMEOUT's 60 s) for the all-gather #17"
    ), first
