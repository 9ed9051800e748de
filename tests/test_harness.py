"""The harness itself: results in rank order, remote errors, hangs and crashes reported fast."""

from __future__ import annotations

import os
import pickle
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests import harness
from tests.harness import RankCrash, RemoteError, get_pool, run_on_ranks


def _whoami(tag: str) -> tuple[int, int, str, float]:
    # A collective proves the ranks form one working group, not W lone processes.
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total)
    return dist.get_rank(), dist.get_world_size(), tag, total.item()


def _random_draw() -> float:
    return torch.rand(()).item()


def _raise_on_rank_1_while_rank_0_waits() -> None:
    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")
    dist.all_reduce(torch.ones(1))  # never completes: rank 1 is gone


def _mismatched_collective() -> None:
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))


def _crash_rank_1() -> None:
    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()


def _segfault_rank_1(marker: str | None) -> int:
    """Rank 1 dies of SIGSEGV: every time, or (with ``marker``) only until the marker exists."""
    if dist.get_rank() == 1 and (marker is None or not Path(marker).exists()):
        if marker is not None:
            Path(marker).touch()
        os.kill(os.getpid(), signal.SIGSEGV)
    dist.barrier()
    return dist.get_rank()


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_results_in_rank_order(world_size: int) -> None:
    results = run_on_ranks(world_size, _whoami, "x")
    expected_sum = float(sum(range(world_size)))
    assert results == [(r, world_size, "x", expected_sum) for r in range(world_size)]


def test_each_call_starts_from_the_same_seed() -> None:
    first = run_on_ranks(2, _random_draw)
    run_on_ranks(2, _random_draw)
    assert run_on_ranks(2, _random_draw) == first


def test_remote_error_fails_fast_with_traceback() -> None:
    start = time.monotonic()
    with pytest.raises(RemoteError) as info:
        run_on_ranks(2, _raise_on_rank_1_while_rank_0_waits, timeout=30.0)
    # Reported when rank 1 raises, not when rank 0's collective would time out.
    assert time.monotonic() - start < 20.0
    message = str(info.value)
    assert "rank 1 of 2 raised" in message
    assert "ValueError: boom on rank 1" in message
    assert "_raise_on_rank_1_while_rank_0_waits" in message  # the remote traceback
    assert run_on_ranks(2, _whoami, "after error")[1] == (1, 2, "after error", 1.0)


def test_timeout_names_ranks_and_shows_stacks() -> None:
    with pytest.raises(TimeoutError) as info:
        run_on_ranks(2, _mismatched_collective, timeout=3.0)
    message = str(info.value)
    assert "did not finish within 3 s on ranks [0]" in message
    assert "_mismatched_collective" in message  # rank 0's Python stack, from faulthandler
    # A fresh pool replaced the broken group.
    assert run_on_ranks(2, _whoami, "after timeout")[0] == (0, 2, "after timeout", 1.0)


def test_crashed_rank_is_reported() -> None:
    with pytest.raises(RuntimeError, match="rank 1 exited with code 3"):
        run_on_ranks(2, _crash_rank_1, timeout=30.0)
    assert run_on_ranks(2, _whoami, "after crash")[1][2] == "after crash"


def test_a_native_crash_is_retried_once_and_reported(tmp_path: Path) -> None:
    before = len(harness.CRASHES)
    try:
        assert run_on_ranks(2, _segfault_rank_1, str(tmp_path / "crashed"), timeout=30.0) == [0, 1]
        [(test, crashed)] = harness.CRASHES[before:]
        assert "test_a_native_crash_is_retried_once_and_reported" in test
        assert list(crashed) == [1]
        # faulthandler's stack of the crashed rank: where it died, for the session's summary
        assert "Segmentation fault" in crashed[1] and "_segfault_rank_1" in crashed[1]
        assert "_segfault_rank_1" in harness.crash_report()
    finally:
        del harness.CRASHES[before:]  # a deliberate crash, not one to report


def test_a_native_crash_that_recurs_fails() -> None:
    before = len(harness.CRASHES)
    try:
        with pytest.raises(RankCrash, match="rank 1 exited with code -11"):
            run_on_ranks(2, _segfault_rank_1, None, timeout=30.0)
    finally:
        del harness.CRASHES[before:]
    assert run_on_ranks(2, _whoami, "after crashes")[1][2] == "after crashes"


def test_unpicklable_function_keeps_the_pool() -> None:
    pool = get_pool(2)
    with pytest.raises((AttributeError, TypeError, pickle.PicklingError)):
        run_on_ranks(2, lambda: 0)
    assert get_pool(2) is pool
