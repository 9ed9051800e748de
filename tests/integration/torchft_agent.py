"""Run replica groups of ``torchft_run.py`` as torchrun runs them, with a Lighthouse of our own.

``run_replicas`` starts a torchft ``LighthouseServer`` in this process, then each replica group's
2 ranks (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` of the group's own store,
``TORCHELASTIC_RESTART_COUNT``) and watches them as torchrun's elastic agent does: when a rank of
a group dies, the group's other rank is stopped (SIGTERM, then SIGKILL) and both are started
again, the restart count one higher and a fresh store, up to ``max_restarts`` times per group.
Every process is in its own session and killed on the way out; the whole run is bounded.

Why not torchrun itself: on this machine a torchrun restart takes 8-18 s (rendezvous of the new
round), and with its default shared agent store the restarted ranks hang in
``init_process_group`` on torch 2.13 (seen with a 10-line script, no torchft); with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` it works but is as slow. torchft's ``Manager`` keys its
store without the attempt prefix torch's own process group uses, so a restarted group needs a
fresh store (a stale ``manager_addr`` would point rank 1 at the dead Manager): the agent here
gives each attempt a new port, as torchrun's c10d rendezvous does when the store is not shared.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent / "torchft_run.py"
REPO_ROOT = Path(__file__).resolve().parents[2]
GROUP_SIZE = 2


@dataclass
class Rank:
    """What one rank (group, rank) wrote over all its attempts."""

    starts: list[int] = field(default_factory=list)  # attempt of each start
    steps: list[dict] = field(default_factory=list)  # every "step" record, in order
    done: dict | None = None

    def committed_steps(self) -> list[int]:
        """The steps committed, in order, over all attempts."""
        return [s["committed"] for s in self.steps if s["committed"] is not None]

    def committed(self) -> dict[int, str]:
        """Committed step -> the loss (hex) of the iteration that committed it."""
        return {s["committed"]: s["loss"] for s in self.steps if s["committed"] is not None}


@dataclass
class Outcome:
    """One run: whether every group finished, its restarts, each rank's records, the logs."""

    finished: bool
    restarts: dict[int, int]
    ranks: dict[tuple[int, int], Rank]
    logs: str
    seconds: float

    def tail(self, n: int = 8000) -> str:
        return self.logs[-n:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(procs: list[subprocess.Popen[bytes]], grace_s: float = 3.0) -> None:
    """SIGTERM each rank's session, then SIGKILL what is left after ``grace_s``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass
        end = time.monotonic() + grace_s
        while time.monotonic() < end and any(p.poll() is None for p in procs):
            time.sleep(0.05)
    for p in procs:
        p.wait()


def _read(out: Path, groups: int) -> dict[tuple[int, int], Rank]:
    ranks = {}
    for g in range(groups):
        for r in range(GROUP_SIZE):
            rank = ranks[(g, r)] = Rank()
            path = out / f"g{g}r{r}.jsonl"
            lines = path.read_text().splitlines() if path.exists() else []
            for line in lines:
                rec = json.loads(line)
                if rec["event"] == "start":
                    rank.starts.append(rec["attempt"])
                elif rec["event"] == "step":
                    rank.steps.append(rec)
                elif rec["event"] == "done":
                    rank.done = rec
    return ranks


def run_replicas(
    impl: str,
    quorum: str,
    out: Path,
    steps: int,
    die_at: dict[tuple[int, int, int], str],
    max_restarts: dict[int, int],
    timeout_s: float,
    groups: int = 2,
) -> Outcome:
    """Train ``groups`` replica groups of ``torchft_run.py`` to ``steps`` committed steps.

    ``die_at``: (group, rank, attempt) -> ``STEP:WHERE`` for the ranks that kill themselves
    (``--die-at``) in that attempt; ``max_restarts``: group -> how many restarts it may have
    (none where absent). Returns when every rank of every group has exited 0 (``finished``), or
    a group fails once more than it may restart, or ``timeout_s`` has passed; every process
    still running is then killed."""
    from torchft.coordination import LighthouseServer

    out.mkdir(parents=True, exist_ok=True)
    begin = time.monotonic()
    # min_replicas=2: no quorum, hence no commit, without both groups. A dead group's Manager
    # stops heartbeating; after heartbeat_timeout the quorum forms without waiting for it.
    lighthouse = LighthouseServer(
        bind="[::]:0", min_replicas=groups, join_timeout_ms=1000, heartbeat_timeout_ms=2000
    )
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    base_env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": path,
        "TORCHFT_LIGHTHOUSE": lighthouse.address(),
        "MASTER_ADDR": "127.0.0.1",
        "WORLD_SIZE": str(GROUP_SIZE),
        "LOCAL_WORLD_SIZE": str(GROUP_SIZE),
    }
    log_files = []

    def start(group: int, attempt: int) -> list[subprocess.Popen[bytes]]:
        port = _free_port()
        procs = []
        for rank in range(GROUP_SIZE):
            cmd = [sys.executable, str(SCRIPT), "--impl", impl, "--group", str(group)]
            cmd += ["--steps", str(steps), "--quorum", quorum, "--out", str(out)]
            if (group, rank, attempt) in die_at:
                cmd += ["--die-at", die_at[(group, rank, attempt)]]
            env = {**base_env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            env.update(MASTER_PORT=str(port), TORCHELASTIC_RESTART_COUNT=str(attempt))
            log_path = out / f"g{group}r{rank}.a{attempt}.log"
            log_files.append(log_path)
            with open(log_path, "wb") as log:
                procs.append(
                    subprocess.Popen(
                        cmd,
                        cwd=REPO_ROOT,
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        return procs

    running = {g: start(g, 0) for g in range(groups)}
    restarts = dict.fromkeys(range(groups), 0)
    finished = False
    try:
        while time.monotonic() - begin < timeout_s:
            codes = {g: [p.poll() for p in procs] for g, procs in running.items()}
            if all(c == 0 for cs in codes.values() for c in cs):
                finished = True
                break
            failed = [g for g, cs in codes.items() if any(c not in (None, 0) for c in cs)]
            if any(restarts[g] >= max_restarts.get(g, 0) for g in failed):
                break
            for g in failed:
                _stop(running[g])
                restarts[g] += 1
                running[g] = start(g, restarts[g])
            time.sleep(0.05)
    finally:
        _stop([p for procs in running.values() for p in procs])
        lighthouse.shutdown()
    logs = "\n".join(f"--- {p.name} ---\n{p.read_text(errors='replace')}" for p in log_files)
    return Outcome(finished, restarts, _read(out, groups), logs, time.monotonic() - begin)
