"""Multi-rank test harness: long-lived gloo rank processes, reused across tests.

Importing torch costs ~3 s per process, so each world size gets one pool of spawned rank processes
that lives for the whole session. A test calls ``run_on_ranks(world_size, fn, *args)``; every rank
runs ``fn`` (a module-level function, pickled by reference) and the per-rank results come back in
rank order. Any failure or timeout tears the pool down: a rank that raised may have left its peers
blocked in a collective, and a failed gloo collective leaves the group unusable, so the next test
gets a fresh pool. A rank killed by a signal (a native crash) gets the call run once more in a
fresh pool, and the crash, with its faulthandler stacks, reported at the end (`crash_report`).

This file also holds the implementation switch (``fsdp2`` vs torch's own FSDP2) so that every test
reaches the library through one seam.
"""

from __future__ import annotations

import atexit
import faulthandler
import functools
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing import connection, get_context
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import ModuleType
from typing import Any

WORLD_SIZES = (1, 2, 4)
_REPO = Path(__file__).resolve().parents[1]
DEFAULT_TIMEOUT_S = 60.0
_START_TIMEOUT_S = 120.0  # 4 ranks importing torch on 2 cores, plus a loaded CI machine
_LOG_TAIL_CHARS = 6000
_GRACE_S = 1.0  # after a first failure, how long to wait for the other ranks' reports

# ---------------------------------------------------------------------------------------------
# Implementation switch
# ---------------------------------------------------------------------------------------------

IMPLS = ("fsdp2", "torch")
# The implementation the suite tests by default; `FSDP2_TEST_IMPL=torch` runs the same tests
# against torch's FSDP2 (how the suite was developed before fsdp2 existed).
IMPL_UNDER_TEST = os.environ.get("FSDP2_TEST_IMPL", "fsdp2")
if IMPL_UNDER_TEST not in IMPLS:
    raise ValueError(f"FSDP2_TEST_IMPL must be one of {IMPLS}, got {IMPL_UNDER_TEST!r}")


def fsdp_api(impl: str) -> ModuleType:
    """The module exposing ``fully_shard``, ``FSDPModule``, ... for ``impl``."""
    if impl == "fsdp2":
        import fsdp2

        return fsdp2
    if impl == "torch":
        import torch.distributed.fsdp

        return torch.distributed.fsdp
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


# ---------------------------------------------------------------------------------------------
# Rank side
# ---------------------------------------------------------------------------------------------


class RemoteError(Exception):
    """A rank function raised; the message carries that rank's traceback text."""


class RankCrash(RuntimeError):
    """A rank process was killed by a signal (a native crash such as SIGSEGV), not a Python
    error: ``crashed`` maps each such rank to its log tail (faulthandler's stacks)."""

    def __init__(self, message: str, crashed: dict[int, str]) -> None:
        super().__init__(message)
        self.crashed = crashed


def _worker_main(rank: int, world_size: int, init_file: str, log_path: str, conn: Any) -> None:
    # Everything a rank prints (including C++ aborts) goes to its log, shown on failure.
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    # On timeout the parent sends SIGUSR1 to get every thread's Python stack in the log; a
    # crash (SIGSEGV, SIGABRT, ...) writes them there too, so a dead rank says where it died.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    faulthandler.enable(all_threads=True)

    import torch
    import torch.distributed as dist

    # 2 cores shared by up to 4 ranks: intra-op threads would only oversubscribe.
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    conn.send(("ready", None))
    while True:
        task = conn.recv_bytes()
        if not task:  # shutdown
            break
        torch.manual_seed(0)  # results must not depend on which tests ran before
        try:
            fn, args, kwargs = pickle.loads(task)  # imports fn's module here, on first use
            payload = pickle.dumps(("ok", fn(*args, **kwargs)))
        except BaseException:  # report anything, SystemExit included
            payload = pickle.dumps(("error", traceback.format_exc()))
        conn.send_bytes(payload)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: gloo sometimes aborts in static destructors after Python is
    # done, and nothing useful happens after this point anyway.
    os._exit(0)


# ---------------------------------------------------------------------------------------------
# Test side
# ---------------------------------------------------------------------------------------------


class RankPool:
    """``world_size`` spawned processes forming one gloo group, ready to run functions."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._dir = tempfile.TemporaryDirectory(prefix=f"fsdp2-pool-w{world_size}-")
        # A fresh, not-yet-existing file per pool: file rendezvous needs no ports, so no races.
        init_file = os.path.join(self._dir.name, "rendezvous")
        self._log_paths = [os.path.join(self._dir.name, f"rank{r}.log") for r in range(world_size)]
        ctx = get_context("spawn")
        self._procs: list[BaseProcess] = []
        self._conns: list[connection.Connection] = []
        for rank in range(world_size):
            parent_conn, child_conn = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_main,
                args=(rank, world_size, init_file, self._log_paths[rank], child_conn),
                name=f"fsdp2-test-rank{rank}",
                daemon=True,
            )
            proc.start()
            child_conn.close()
            self._procs.append(proc)
            self._conns.append(parent_conn)
        try:
            for rank, conn in enumerate(self._conns):
                self._recv(rank, conn, time.monotonic() + _START_TIMEOUT_S, "startup")
        except BaseException:
            self.shutdown()
            raise

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def run(self, fn: Callable[..., Any], task: bytes, timeout: float) -> list[Any]:
        """Run the pickled ``(fn, args, kwargs)`` on every rank."""
        for conn in self._conns:
            conn.send_bytes(task)
        deadline = time.monotonic() + timeout
        grace_end: float | None = None
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        dead: list[int] = []
        pending = dict(enumerate(self._conns))
        while pending:
            until = deadline if grace_end is None else min(deadline, grace_end)
            # Also wake when a process dies, so a crash is reported at once, not at the deadline.
            sentinels = [self._procs[r].sentinel for r in pending]
            connection.wait([*pending.values(), *sentinels], max(until - time.monotonic(), 0))
            self._collect(pending, results, errors, dead)
            now = time.monotonic()
            if errors or dead:
                # Fail fast (peers may be blocked in a collective a failed rank never joined),
                # after a moment to hear from the others: a crash or a first error on another
                # rank is the cause, the peers' gloo "connection reset" errors are symptoms.
                grace_end = grace_end or now + _GRACE_S
                if now >= grace_end:
                    break
            elif now >= deadline:
                raise TimeoutError(
                    f"{_qualname(fn)} did not finish within {timeout:.0f} s on ranks "
                    f"{sorted(pending)} of world size {self.world_size} (finished: "
                    f"{sorted(results)}); a collective issued by only some ranks, or in a "
                    f"different order, hangs like this.\n{self._stacks_and_logs()}"
                )
        failures = "".join(
            f"\nrank {r} of {self.world_size} raised:\n{tb}" for r, tb in sorted(errors.items())
        )
        if dead:
            codes = ", ".join(f"rank {r} exited with code {self._procs[r].exitcode}" for r in dead)
            message = f"{codes} while running {_qualname(fn)}{failures}\n{self._logs()}"
            crashed = {r: self._log_tail(r) for r in dead if (self._procs[r].exitcode or 0) < 0}
            if crashed:
                raise RankCrash(message, crashed)
            raise RuntimeError(message)
        if errors:
            raise RemoteError(failures.lstrip("\n"))
        return [results[r] for r in range(self.world_size)]

    def _collect(
        self,
        pending: dict[int, connection.Connection],
        results: dict[int, Any],
        errors: dict[int, str],
        dead: list[int],
    ) -> None:
        """Move every rank that replied or died out of ``pending``."""
        for rank, conn in list(pending.items()):
            try:
                reply = conn.recv_bytes() if conn.poll() else None
            except EOFError:  # the process died; its sentinel may not have fired yet
                reply = None
            if reply is None:
                if not self._procs[rank].is_alive():
                    self._procs[rank].join(timeout=1.0)  # to read its exit code
                    dead.append(rank)
                    del pending[rank]
                continue
            status, value = pickle.loads(reply)
            if status == "error":
                errors[rank] = value
            else:
                results[rank] = value
            del pending[rank]

    def shutdown(self) -> None:
        """Stop every rank. Exit codes are ignored on purpose (see `_worker_main`)."""
        for conn in self._conns:
            try:
                conn.send_bytes(b"")
            except OSError:
                pass  # already dead
        deadline = time.monotonic() + 5.0
        for proc in self._procs:
            proc.join(timeout=max(deadline - time.monotonic(), 0))
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5.0)
        for conn in self._conns:
            conn.close()
        self._dir.cleanup()

    def _recv(self, rank: int, conn: connection.Connection, deadline: float, what: str) -> Any:
        proc = self._procs[rank]
        while not conn.poll(0.05):
            if not proc.is_alive():
                raise RuntimeError(
                    f"rank {rank} exited with code {proc.exitcode} during {what}\n{self._logs()}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {rank} did not finish {what}\n{self._logs()}")
        return conn.recv()

    def _stacks_and_logs(self) -> str:
        for proc in self._procs:
            if proc.is_alive() and proc.pid is not None:
                os.kill(proc.pid, signal.SIGUSR1)
        time.sleep(0.5)  # let faulthandler write the stacks
        return self._logs()

    def _log_tail(self, rank: int) -> str:
        try:
            with open(self._log_paths[rank], errors="replace") as f:
                return f.read()[-_LOG_TAIL_CHARS:]
        except FileNotFoundError:
            return ""

    def _logs(self) -> str:
        parts = []
        for rank in range(self.world_size):
            text = self._log_tail(rank)
            if text.strip():
                parts.append(f"----- rank {rank} log (tail) -----\n{text}")
        return "\n".join(parts)


def _qualname(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


_POOLS: dict[int, RankPool] = {}


def get_pool(world_size: int) -> RankPool:
    """The session's pool for ``world_size``, started on first use (or after a failure)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    pool = _POOLS.get(world_size)
    if pool is not None and not pool.alive:
        pool.shutdown()
        pool = None
    if pool is None:
        pool = _POOLS[world_size] = RankPool(world_size)
    return pool


def discard_pool(world_size: int) -> None:
    pool = _POOLS.pop(world_size, None)
    if pool is not None:
        pool.shutdown()


def shutdown_pools() -> None:
    for world_size in list(_POOLS):
        discard_pool(world_size)


atexit.register(shutdown_pools)


def run_on_ranks(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT_S,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on every rank of a ``world_size`` gloo group.

    Returns the per-rank results in rank order. Re-raises a rank's exception as `RemoteError` with
    its traceback, and raises `TimeoutError` after ``timeout`` seconds; either way the pool is
    replaced before the next call.
    """
    # Pickle once, before touching the pool: an unpicklable argument (or a lambda) is the
    # caller's mistake and must not cost a pool restart.
    task = pickle.dumps((fn, args, kwargs))
    pool = get_pool(world_size)
    try:
        return pool.run(fn, task, timeout)
    except RankCrash as crash:
        discard_pool(world_size)
        if not RETRY_CRASHES:
            raise
        # A native crash of a long-lived rank process, once in several full runs and never
        # reproduced alone (also inside torch's own fully_shard): run the test again, once, in
        # fresh processes. It must pass again in full, and the crash is reported at the end of
        # the session with its stacks (`crash_report`), never dropped.
        CRASHES.append((os.environ.get("PYTEST_CURRENT_TEST", _qualname(fn)), crash.crashed))
        try:
            return get_pool(world_size).run(fn, task, timeout)
        except BaseException:
            discard_pool(world_size)
            raise
    except BaseException:
        discard_pool(world_size)
        raise


# A rank killed by a signal gets one retry in a fresh pool (FSDP2_TEST_RETRY_CRASHES=0: none).
RETRY_CRASHES = os.environ.get("FSDP2_TEST_RETRY_CRASHES", "1") != "0"
# (test, {rank: log tail}) for every crash retried this session.
CRASHES: list[tuple[str, dict[int, str]]] = []


def crash_report() -> str:
    """The crashes retried this session, with each crashed rank's log tail."""
    lines = []
    for test, crashed in CRASHES:
        for rank, tail in crashed.items():
            lines.append(f"--- {test}: rank {rank} crashed (retried in fresh processes) ---")
            lines.append(tail.rstrip() or "(empty log)")
    return "\n".join(lines)


def init_local_process_group() -> None:
    """A 1-rank gloo group in the calling process, for checks that need no peers (API, repr).

    Lets expecttest rewrite inline expectations, which it can only do in the test process.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise AssertionError(f"expected a 1-rank group, found {dist.get_world_size()} ranks")
        return
    tmp = tempfile.mkdtemp(prefix="fsdp2-local-pg-")
    atexit.register(shutil.rmtree, tmp, True)
    dist.init_process_group(
        "gloo", init_method=f"file://{os.path.join(tmp, 'rendezvous')}", rank=0, world_size=1
    )


def launch_command(
    script: str | os.PathLike[str], world_size: int, *args: str
) -> tuple[list[str], dict[str, str]]:
    """The command line and environment that run ``script`` as a user would: ``python`` for one
    rank, ``torchrun`` for more; one intra-op thread per rank (2 cores), and this checkout's
    fsdp2 first on the path of the rank processes."""
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}"]
    cmd = [sys.executable, *(launcher if world_size > 1 else []), str(script), *args]
    path = os.pathsep.join(p for p in (str(_REPO), os.environ.get("PYTHONPATH")) if p)
    return cmd, {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}


def launch(
    script: str | os.PathLike[str], world_size: int, *args: str, timeout: float
) -> subprocess.CompletedProcess[str]:
    """`launch_command`, run from the repository root to its end, output captured."""
    cmd, env = launch_command(script, world_size, *args)
    return subprocess.run(cmd, cwd=_REPO, env=env, capture_output=True, text=True, timeout=timeout)


def per_group_collectives(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run the rank function ``fn`` with coalescing off ([Note: coalesced gathers] and
    [Note: coalesced reduce-scatters]),
    whatever FSDP2_COALESCE_BYTES says: for a test of one group's own collectives (their count,
    order or labels against torch's, which gathers each group alone)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from fsdp2.engine.coalesce import coalesce_bytes, set_coalesce_bytes

        saved = coalesce_bytes()
        set_coalesce_bytes(0)
        try:
            return fn(*args, **kwargs)
        finally:
            set_coalesce_bytes(saved)

    return wrapper


def check_backward_order(order: list[tuple[str, str]], expected: list[tuple[str, str]]) -> None:
    """A backward's collectives ``(kind, label)`` against ``expected``, written one gather per
    group: exactly when coalescing is off; with it on, the same reduce-scatters in the same
    order, and each group gathered as often, some of them in coalesced gathers ("a+b"). Since
    reduce-scatters coalesce too, the callers pin coalescing off (``per_group_collectives``)
    wherever a group's own reduce-scatter matters; the coalesced branch serves the rest."""
    from fsdp2.engine.coalesce import coalesce_bytes

    if not coalesce_bytes():
        assert order == expected, order
        return

    def reduces(records: list[tuple[str, str]]) -> list[tuple[str, str]]:
        return [r for r in records if r[0] != "all_gather"]

    def gathered(records: list[tuple[str, str]]) -> list[str]:
        return sorted(
            g for kind, label in records if kind == "all_gather" for g in label.split("+")
        )

    assert reduces(order) == reduces(expected), order
    assert gathered(order) == gathered(expected), order
