"""The hang report where a rank has two threads in collectives: the training thread's step and a
thread taking state (``fsdp2.consistent_state``), whose agreement passes the seam.

Run as a script (``launch``) with a scenario's name; each rank prints one JSON line, then leaves
with ``os._exit`` (its groups are half done).
- ``missing_taker``: rank 0's taker enters ``consistent_state(takers)``, rank 1's never does.
  Rank 0's taker raises the hang report at ``FSDP2_COLLECTIVE_TIMEOUT`` (it once waited in a bare
  ``dist.all_reduce`` for the group's own timeout, unreported); its hold goes, and both ranks'
  training threads then take another step together.
- ``two_threads``: rank 1's training thread is blocked in a forward's all-gather that rank 0
  never issues, while both ranks' takers agree on a step. Rank 0 then waits in a collective
  rank 1 never joins; its report must still say rank 1 is blocked in the all-gather (a rank had
  one "waiting" slot, which the taker's finished agreement emptied: "not in an fsdp2
  collective").
A wait that raised is named for one more deadline, then dropped (a unit test).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from tests.harness import launch

# FSDP2_COLLECTIVE_TIMEOUT, the same on both ranks (a rank's publisher polls at a sixteenth of
# its own, a report waits a quarter of its own for the answers): rank 0's report waits 1.5 s
# for the peer's fresh entry, which a loaded machine needs (hang_scenarios.BUSY_STORE_TIMEOUT_S).
HANG_TIMEOUT_S = 6.0
BACKEND_TIMEOUT_S = 60.0  # the groups' own timeout: what ended a bare wait


def _lines(scenario: str) -> dict[int, dict[str, Any]]:
    proc = launch(__file__, 2, scenario, timeout=120)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    by_rank = {line["rank"]: line for line in lines}
    assert set(by_rank) == {0, 1}, proc.stdout + proc.stderr
    return by_rank


@pytest.mark.slow
def test_a_missing_taker_gets_the_report_and_training_goes_on() -> None:
    lines = _lines("missing_taker")
    taker = lines[0]["taker"]
    assert taker["seconds"] < BACKEND_TIMEOUT_S / 2, taker  # fsdp2's deadline, not the group's
    text = taker["outcome"]
    assert text.startswith("CollectiveTimeoutError: fsdp2: rank 0 waited 6 s"), text
    assert "the all-reduce #0 for `consistent_state` (1 elements, int64)" in text, text
    assert "rank 1: MISSING, issued none on this group" in text, text
    # The hold went with the failed take: a step on both ranks after it, the same on both.
    assert lines[0]["after"] == lines[1]["after"], lines


@pytest.mark.slow
def test_a_rank_blocked_in_a_step_while_its_taker_agreed_is_named_blocked() -> None:
    lines = _lines("two_threads")
    # Both takers agreed on the step after the first (the training threads took one).
    assert lines[0]["taker"]["outcome"] == lines[1]["taker"]["outcome"] == "1", lines
    text = lines[0]["outcome"]
    assert "the all-reduce #0 for `probe` (1 elements, float32)" in text, text
    rank1 = next(line for line in text.split("\n") if line.startswith("  rank 1:"))
    blocked = "  rank 1: MISSING, issued none on this group; blocked in all-gather #"
    assert rank1.startswith(blocked), rank1
    assert "for `<root>`" in rank1, rank1


def test_a_raised_wait_is_named_for_a_deadline_more(monkeypatch: pytest.MonkeyPatch) -> None:
    """A thread's wait that raised stays "blocked in" for one more FSDP2_COLLECTIVE_TIMEOUT (the
    peers' reports about then agree), then goes: a taker whose agreement failed goes on, and a
    later report must not name that collective for good. Waits still running always show."""
    from fsdp2.debug import hang

    monkeypatch.setenv("FSDP2_COLLECTIVE_TIMEOUT", "10")
    state = hang._Rank(0, None)
    event = object.__new__(hang.Event)  # only its identity matters to blocked()
    now = time.time()
    state.waits = {
        1: (event, now - 100, False, 0.0),  # still waiting, long: shown, first
        2: (event, now - 30, False, now - 11),  # raised 11 s ago: gone
        3: (event, now - 5, False, now - 9),  # raised 9 s ago: shown
    }
    assert state.blocked() == [state.waits[1], state.waits[3]]


def _model() -> nn.Module:
    import fsdp2

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    fsdp2.fully_shard(model)
    return model


def _take(group: dist.ProcessGroup, out: dict[str, Any]) -> None:
    import fsdp2

    start = time.monotonic()
    try:
        with fsdp2.consistent_state(group) as step:
            out["outcome"] = str(step)
    except Exception as e:
        out["outcome"] = f"{type(e).__name__}: {e}"
    out["seconds"] = time.monotonic() - start


def _main(scenario: str) -> None:
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    backend_timeout = datetime.timedelta(seconds=BACKEND_TIMEOUT_S)
    dist.init_process_group("gloo", timeout=backend_timeout)
    takers = dist.new_group(backend="gloo", timeout=backend_timeout)
    probe = dist.new_group(backend="gloo", timeout=backend_timeout)
    model = _model()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.ones(2, 4)  # the same on both ranks: so are their losses

    def step() -> float:
        loss = model(x).sum()
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss.item()

    step()  # both ranks: each rank's publisher is up
    # Only now the short deadline: on a busy machine one rank may reach the step seconds late.
    os.environ["FSDP2_COLLECTIVE_TIMEOUT"] = str(HANG_TIMEOUT_S)
    line: dict[str, Any] = {"rank": rank}
    taker: dict[str, Any] = {}
    if scenario == "missing_taker":
        if rank == 0:
            _take(takers, taker)
            line["taker"] = taker
        dist.barrier()  # rank 1 waits here, in no fsdp2 collective, until rank 0's take failed
        line["after"] = step()
    else:
        thread = threading.Thread(target=_take, args=(takers, taker))
        if rank == 1:
            thread.start()  # the agreement while this thread is blocked in the all-gather
            line["outcome"] = outcome(lambda: model(x))
            # Its wait raised at its deadline, a moment before rank 0's; its line stays
            # "blocked in" for a deadline more (hang._Rank.blocked): stay alive meanwhile.
            time.sleep(HANG_TIMEOUT_S)
        else:
            time.sleep(0.3)
            thread.start()
            thread.join()
            value = torch.ones(1)
            from fsdp2.engine.collectives import all_reduce

            line["outcome"] = outcome(
                lambda: all_reduce(value, probe, "probe", dist.ReduceOp.SUM).wait()
            )
        thread.join()
        line["taker"] = taker
    sys.stdout.write(json.dumps(line) + "\n")
    sys.stdout.flush()
    os._exit(0)  # skip teardown: the groups are half done


def outcome(fn: Any) -> str:
    try:
        return str(fn())
    except Exception as e:
        return f"{type(e).__name__}: {e}"


if __name__ == "__main__":
    _main(sys.argv[1])
