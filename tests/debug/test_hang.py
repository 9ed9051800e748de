"""Never a silent hang: collective checks (opt-in) and the hang report (always on).

Each scenario in `tests/hang_scenarios.py` makes the ranks stop issuing matching collectives (a
module skipped on one rank, an expert used on rank 0 only, a rank that raises in backward,
shapes that differ per rank, a rank that never enters the step). Each must end within seconds on
every rank blocked in fsdp2, with an error naming the module: the hang report (checks off), or
the mismatch report before anything mismatched is issued (checks on). The scenarios run once per
mode, on fresh process groups; the pool is discarded afterwards (those groups are half done).
"""

from __future__ import annotations

import functools
import json
import re
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import expecttest
import pytest
import torch

from tests.hang_scenarios import CHECKS_ONLY, SCENARIOS, TIMEOUT_S, train
from tests.harness import IMPL_UNDER_TEST, discard_pool, launch, run_on_ranks

pytestmark = pytest.mark.skipif(IMPL_UNDER_TEST != "fsdp2", reason="fsdp2's own reports")

Results = dict[str, list[tuple[str, float]]]  # scenario -> per rank (outcome, seconds)


COALESCE = 256 * 1024  # the coalescing budget of TestCoalescedHangReport's runs


@functools.cache
def _results(checks: bool, coalesce: bool = False) -> Results:
    from tests.hang_scenarios import run_scenarios

    names = [name for name in SCENARIOS if checks or name not in CHECKS_ONLY]
    if coalesce:
        names = [name for name in names if name in COALESCED]
    budget = COALESCE if coalesce else 0
    per_rank = run_on_ranks(2, run_scenarios, names, checks, budget, timeout=120)
    return {name: [per_rank[r][name] for r in range(2)] for name in names}


@pytest.fixture(scope="module", autouse=True)
def _discard_broken_groups() -> Iterator[None]:
    yield
    _results.cache_clear()
    discard_pool(2)  # the scenarios' groups have half-done collectives on their gloo threads


def _outcomes(name: str, checks: bool, coalesce: bool = False) -> list[str]:
    results = _results(checks, coalesce)[name]
    for rank, (_, seconds) in enumerate(results):
        # Bounded by the deadline, not by gloo's 30-minute timeout: the deadline, one
        # publishing interval of grace, and slack for a loaded machine.
        assert seconds < TIMEOUT_S * 1.25 + 5, f"rank {rank} took {seconds:.1f} s in {name}"
    return [text for text, _ in results]


class TestHangReport(expecttest.TestCase):
    """Checks off: every rank blocked in an fsdp2 collective raises the hang report. Coalescing
    off: each group's own collectives (TestCoalescedHangReport: on)."""

    def test_skipped_block(self) -> None:
        rank0, rank1 = _outcomes("skipped_block", checks=False)
        self.assertExpectedInline(
            rank0,
            """\
CollectiveTimeoutError: fsdp2: rank 0 waited N s (FSDP2_COLLECTIVE_TIMEOUT) for the all-gather #7 for `experts.0` (36 elements, float32) on the process group of ranks [0, 1], and it has not finished.
Where each rank is (from the c10d store):
  rank 0 (this rank): blocked in it
  rank 1: DIFFERENT collective: blocked in reduce-scatter #7 for `experts.1` (76 elements, float32) for N s [published N s ago]
A rank MISSING from it skipped that module (control flow that depends on the rank or the data: MoE routing, a layer skipped for some inputs or shapes), raised, or never started the step. A rank on a DIFFERENT collective got out of step earlier: collectives pair up by order, not by module, so earlier ones may have exchanged wrong data. The process group is unusable now (a collective is half done): abort the job on every rank. FSDP2_CHECK_COLLECTIVES=1 stops at the first collective where the ranks disagree, with both sides named.""",
        )
        self.assertExpectedInline(
            rank1,
            """\
CollectiveTimeoutError: fsdp2: rank 1 waited N s (FSDP2_COLLECTIVE_TIMEOUT) for the reduce-scatter #7 for `experts.1` (76 elements, float32) on the process group of ranks [0, 1], and it has not finished.
Where each rank is (from the c10d store):
  rank 0: DIFFERENT collective: blocked in all-gather #7 for `experts.0` (36 elements, float32) for N s [published N s ago]
  rank 1 (this rank): blocked in it
A rank MISSING from it skipped that module (control flow that depends on the rank or the data: MoE routing, a layer skipped for some inputs or shapes), raised, or never started the step. A rank on a DIFFERENT collective got out of step earlier: collectives pair up by order, not by module, so earlier ones may have exchanged wrong data. The process group is unusable now (a collective is half done): abort the job on every rank. FSDP2_CHECK_COLLECTIVES=1 stops at the first collective where the ranks disagree, with both sides named.""",
        )

    def test_expert_on_rank0(self) -> None:
        rank0, rank1 = _outcomes("expert_on_rank0", checks=False)
        self.assertExpectedInline(
            rank0,
            """\
CollectiveTimeoutError: fsdp2: rank 0 waited N s (FSDP2_COLLECTIVE_TIMEOUT) for the all-gather #6 for `experts.1` (36 elements, float32) on the process group of ranks [0, 1], and it has not finished.
Where each rank is (from the c10d store):
  rank 0 (this rank): blocked in it
  rank 1: DIFFERENT collective, issued reduce-scatter #6 for `experts.0` (76 elements, float32); blocked in all-gather #7 for `blocks.2` (36 elements, float32) for N s [published N s ago]
A rank MISSING from it skipped that module (control flow that depends on the rank or the data: MoE routing, a layer skipped for some inputs or shapes), raised, or never started the step. A rank on a DIFFERENT collective got out of step earlier: collectives pair up by order, not by module, so earlier ones may have exchanged wrong data. The process group is unusable now (a collective is half done): abort the job on every rank. FSDP2_CHECK_COLLECTIVES=1 stops at the first collective where the ranks disagree, with both sides named.""",
        )
        self.assertExpectedInline(
            rank1,
            """\
CollectiveTimeoutError: fsdp2: rank 1 waited N s (FSDP2_COLLECTIVE_TIMEOUT) for the all-gather #7 for `blocks.2` (36 elements, float32) on the process group of ranks [0, 1], and it has not finished.
Where each rank is (from the c10d store):
  rank 0: MISSING, issued only #0-#6 on this group; blocked in all-gather #6 for `experts.1` (36 elements, float32) for N s [published N s ago]
  rank 1 (this rank): blocked in it
A rank MISSING from it skipped that module (control flow that depends on the rank or the data: MoE routing, a layer skipped for some inputs or shapes), raised, or never started the step. A rank on a DIFFERENT collective got out of step earlier: collectives pair up by order, not by module, so earlier ones may have exchanged wrong data. The process group is unusable now (a collective is half done): abort the job on every rank. FSDP2_CHECK_COLLECTIVES=1 stops at the first collective where the ranks disagree, with both sides named.""",
        )

    def test_raise_in_backward(self) -> None:
        rank0, rank1 = _outcomes("raise_in_backward", checks=False)
        self.assertExpectedInline(
            rank0,
            """\
CollectiveTimeoutError: fsdp2: rank 0 waited N s (FSDP2_COLLECTIVE_TIMEOUT) for the all-gather #12 for `blocks.1` (36 elements, float32) on the process group of ranks [0, 1], and it has not finished.
Where each rank is (from the c10d store):
  rank 0 (this rank): blocked in it
  rank 1: MISSING, issued only #0-#11 on this group; not in an fsdp2 collective (busy elsewhere, finished or raised); last seen N s ago issuing reduce-scatter #11 for `blocks.2` (76 elements, float32) [published N s ago]
A rank MISSING from it skipped that module (control flow that depends on the rank or the data: MoE routing, a layer skipped for some inputs or shapes), raised, or never started the step. A rank on a DIFFERENT collective got out of step earlier: collectives pair up by order, not by module, so earlier ones may have exchanged wrong data. The process group is unusable now (a collective is half done): abort the job on every rank. FSDP2_CHECK_COLLECTIVES=1 stops at the first collective where the ranks disagree, with both sides named.""",
        )
        self.assertEqual(rank1, "RuntimeError: tripwire fired in backward")

    def test_batch_shapes(self) -> None:
        rank0, rank1 = _outcomes("batch_shapes", checks=False)
        self.assertExpectedInline(
            rank0,
            """\
CollectiveTimeoutError: fsdp2: rank 0 waited N s (FSDP2_COLLECTIVE_TIMEOUT) for the all-gather #10 for `blocks.2` (36 elements, float32) on the process group of ranks [0, 1], and it has not finished.
Where each rank is (from the c10d store):
  rank 0 (this rank): blocked in it
  rank 1: MISSING, issued only #0-#9 on this group; blocked in all-gather #9 for `experts.1` (36 elements, float32) for N s [published N s ago]
A rank MISSING from it skipped that module (control flow that depends on the rank or the data: MoE routing, a layer skipped for some inputs or shapes), raised, or never started the step. A rank on a DIFFERENT collective got out of step earlier: collectives pair up by order, not by module, so earlier ones may have exchanged wrong data. The process group is unusable now (a collective is half done): abort the job on every rank. FSDP2_CHECK_COLLECTIVES=1 stops at the first collective where the ranks disagree, with both sides named.""",
        )
        self.assertExpectedInline(
            rank1,
            """\
CollectiveTimeoutError: fsdp2: rank 1 waited N s (FSDP2_COLLECTIVE_TIMEOUT) for the all-gather #9 for `experts.1` (36 elements, float32) on the process group of ranks [0, 1], and it has not finished.
Where each rank is (from the c10d store):
  rank 0: DIFFERENT collective, issued reduce-scatter #9 for `experts.0` (76 elements, float32); blocked in all-gather #10 for `blocks.2` (36 elements, float32) for N s [published N s ago]
  rank 1 (this rank): blocked in it
A rank MISSING from it skipped that module (control flow that depends on the rank or the data: MoE routing, a layer skipped for some inputs or shapes), raised, or never started the step. A rank on a DIFFERENT collective got out of step earlier: collectives pair up by order, not by module, so earlier ones may have exchanged wrong data. The process group is unusable now (a collective is half done): abort the job on every rank. FSDP2_CHECK_COLLECTIVES=1 stops at the first collective where the ranks disagree, with both sides named.""",
        )

    def test_never_enters(self) -> None:
        rank0, rank1 = _outcomes("never_enters", checks=False)
        self.assertExpectedInline(
            rank0,
            """\
CollectiveTimeoutError: fsdp2: rank 0 waited N s (FSDP2_COLLECTIVE_TIMEOUT) for the all-gather #17 for `<root>` (18 elements, float32) on the process group of ranks [0, 1], and it has not finished.
Where each rank is (from the c10d store):
  rank 0 (this rank): blocked in it
  rank 1: MISSING, issued only #0-#16 on this group; not in an fsdp2 collective (busy elsewhere, finished or raised); last seen N s ago issuing reduce-scatter #16 for `<root>` (40 elements, float32) [published N s ago]
A rank MISSING from it skipped that module (control flow that depends on the rank or the data: MoE routing, a layer skipped for some inputs or shapes), raised, or never started the step. A rank on a DIFFERENT collective got out of step earlier: collectives pair up by order, not by module, so earlier ones may have exchanged wrong data. The process group is unusable now (a collective is half done): abort the job on every rank. FSDP2_CHECK_COLLECTIVES=1 stops at the first collective where the ranks disagree, with both sides named.""",
        )
        self.assertEqual(rank1, "skipped step 1")

    def test_silent_peer(self) -> None:
        """A peer that does not answer the report's ask within the wait is said to be behind,
        with what its older entry knew, never MISSING ([Note: fresh entries])."""
        rank0, rank1 = _outcomes("silent_peer", checks=False)
        self.assertExpectedInline(
            rank0,
            """\
CollectiveTimeoutError: fsdp2: rank 0 waited N s (FSDP2_COLLECTIVE_TIMEOUT) for the all-gather #17 for `<root>` (18 elements, float32) on the process group of ranks [0, 1], and it has not finished.
Where each rank is (from the c10d store):
  rank 0 (this rank): blocked in it
  rank 1: NO ANSWER within N s, so its entry may be behind (its publisher thread did not run in time: a loaded machine, or a call holding the GIL); when published, it had issued #0-#16 on this group; not in an fsdp2 collective (busy elsewhere, finished or raised); last seen N s ago issuing reduce-scatter #16 for `<root>` (40 elements, float32) [published N s ago]
A rank MISSING from it skipped that module (control flow that depends on the rank or the data: MoE routing, a layer skipped for some inputs or shapes), raised, or never started the step. A rank on a DIFFERENT collective got out of step earlier: collectives pair up by order, not by module, so earlier ones may have exchanged wrong data. The process group is unusable now (a collective is half done): abort the job on every rank. FSDP2_CHECK_COLLECTIVES=1 stops at the first collective where the ranks disagree, with both sides named.""",
        )
        self.assertEqual(rank1, "skipped step 1")


COALESCED = (
    "zero2_step_on_rank0",
    "skipped_block",
    "skipped_kept_block",
    "expert_on_rank0",
    "raise_in_backward",
    "batch_shapes",
    "never_enters",
)


class TestCoalescedHangReport(expecttest.TestCase):
    """Checks off, coalescing on ([Note: coalesced gathers]): ranks whose coalesced gathers
    serve different groups exchange equal sizes and raise CollectiveMismatchError on every
    rank, naming each rank's groups; a rank missing from one gets the hang report, which names
    the coalesced gather's groups. Reduce-scatters are coalesced too ([Note: coalesced
    reduce-scatters]): held to the end of backward, so a rank raising in backward issues no
    reduce-scatter.
    Never gloo's abort, which reports nothing."""

    def _both(self, name: str) -> tuple[str, str]:
        rank0, rank1 = _outcomes(name, checks=False, coalesce=True)
        return rank0, rank1

    def test_skipped_block(self) -> None:
        rank0, rank1 = self._both("skipped_block")
        self.assertEqual(rank0, rank1)
        self.assertExpectedInline(
            rank0,
            """\
CollectiveMismatchError: fsdp2: the ranks gathered different groups in one coalesced all-gather:
  rank 0: `blocks.1`
  rank 1: `blocks.2`
The ranks ran different fully_shard modules in this iteration (control flow that depends on the rank or the data: MoE routing, a layer skipped for some inputs). Every rank must run every sharded module in each forward, in the same order (give an unused expert a zero-weighted call). The step raised before its gradients were reduced: discard this iteration. To see each collective on its own, turn coalescing off (FSDP2_COALESCE_BYTES=0).""",
        )

    def test_skipped_kept_block(self) -> None:
        """Backward's coalesced reduce-scatters carry one size and a header: every rank raises,
        naming the group only some ranks reduced (once gloo aborted the process)."""
        rank0, rank1 = self._both("skipped_kept_block")
        self.assertExpectedInline(
            rank0,
            """\
CollectiveMismatchError: fsdp2: the ranks reduced different groups in one coalesced reduce-scatter: this rank's bucket holds `<root>+blocks.0+blocks.1+blocks.2+experts.0+experts.1`; in some ranks' buckets only: blocks.1 (1 of 2 ranks).
The ranks ran different fully_shard modules in this iteration's backward (control flow that depends on the rank or the data: MoE routing, a layer skipped for some inputs). Every rank must run every sharded module in each step, in the same order (give an unused expert a zero-weighted call). The step raised before its gradients were handed out: discard this iteration. To see each collective on its own, turn coalescing off (FSDP2_COALESCE_BYTES=0).""",
        )
        self.assertExpectedInline(
            rank1,
            """\
CollectiveMismatchError: fsdp2: the ranks reduced different groups in one coalesced reduce-scatter: this rank's bucket holds `<root>+blocks.0+blocks.2+experts.0+experts.1`; in some ranks' buckets only: blocks.1 (1 of 2 ranks).
The ranks ran different fully_shard modules in this iteration's backward (control flow that depends on the rank or the data: MoE routing, a layer skipped for some inputs). Every rank must run every sharded module in each step, in the same order (give an unused expert a zero-weighted call). The step raised before its gradients were handed out: discard this iteration. To see each collective on its own, turn coalescing off (FSDP2_COALESCE_BYTES=0).""",
        )

    def test_expert_on_rank0(self) -> None:
        rank0, rank1 = self._both("expert_on_rank0")
        self.assertEqual(rank0, rank1)
        self.assertExpectedInline(
            rank0,
            """\
CollectiveMismatchError: fsdp2: the ranks gathered different groups in one coalesced all-gather:
  rank 0: `experts.1`
  rank 1: `blocks.0+blocks.1+blocks.2+experts.0`
The ranks ran different fully_shard modules in this iteration (control flow that depends on the rank or the data: MoE routing, a layer skipped for some inputs). Every rank must run every sharded module in each forward, in the same order (give an unused expert a zero-weighted call). The step raised before its gradients were reduced: discard this iteration. To see each collective on its own, turn coalescing off (FSDP2_COALESCE_BYTES=0).""",
        )

    def test_batch_shapes(self) -> None:
        rank0, rank1 = self._both("batch_shapes")
        self.assertEqual(rank0, rank1)
        self.assertExpectedInline(
            rank0,
            """\
CollectiveMismatchError: fsdp2: the ranks gathered different groups in one coalesced all-gather:
  rank 0: `blocks.0+blocks.1+blocks.2+experts.0+experts.1`
  rank 1: `long_context`
The ranks ran different fully_shard modules in this iteration (control flow that depends on the rank or the data: MoE routing, a layer skipped for some inputs). Every rank must run every sharded module in each forward, in the same order (give an unused expert a zero-weighted call). The step raised before its gradients were reduced: discard this iteration. To see each collective on its own, turn coalescing off (FSDP2_COALESCE_BYTES=0).""",
        )

    def test_raise_in_backward(self) -> None:
        rank0, rank1 = self._both("raise_in_backward")
        self.assertExpectedInline(
            rank0,
            """\
CollectiveTimeoutError: fsdp2: rank 0 waited N s (FSDP2_COLLECTIVE_TIMEOUT) for the reduce-scatter #7 for `experts.1+experts.0+blocks.2+blocks.1+blocks.0+<root>` (510 elements, float32) on the process group of ranks [0, 1], and it has not finished.
Where each rank is (from the c10d store):
  rank 0 (this rank): blocked in it
  rank 1: MISSING, issued only #0-#6 on this group; not in an fsdp2 collective (busy elsewhere, finished or raised); last seen N s ago issuing all-gather #6 for `experts.1+experts.0+blocks.2+blocks.1+blocks.0` (240 elements, float32) [published N s ago]
A rank MISSING from it skipped that module (control flow that depends on the rank or the data: MoE routing, a layer skipped for some inputs or shapes), raised, or never started the step. A rank on a DIFFERENT collective got out of step earlier: collectives pair up by order, not by module, so earlier ones may have exchanged wrong data. The process group is unusable now (a collective is half done): abort the job on every rank. FSDP2_CHECK_COLLECTIVES=1 stops at the first collective where the ranks disagree, with both sides named.""",
        )
        self.assertEqual(rank1, "RuntimeError: tripwire fired in backward")

    def test_never_enters(self) -> None:
        rank0, rank1 = self._both("never_enters")
        self.assertExpectedInline(
            rank0,
            """\
CollectiveTimeoutError: fsdp2: rank 0 waited N s (FSDP2_COLLECTIVE_TIMEOUT) for the all-gather #8 for `<root>+blocks.0+blocks.1+blocks.2+experts.0+experts.1` (240 elements, float32) on the process group of ranks [0, 1], and it has not finished.
Where each rank is (from the c10d store):
  rank 0 (this rank): blocked in it
  rank 1: MISSING, issued only #0-#7 on this group; not in an fsdp2 collective (busy elsewhere, finished or raised); last seen N s ago issuing reduce-scatter #7 for `experts.1+experts.0+blocks.2+blocks.1+blocks.0+<root>` (510 elements, float32) [published N s ago]
A rank MISSING from it skipped that module (control flow that depends on the rank or the data: MoE routing, a layer skipped for some inputs or shapes), raised, or never started the step. A rank on a DIFFERENT collective got out of step earlier: collectives pair up by order, not by module, so earlier ones may have exchanged wrong data. The process group is unusable now (a collective is half done): abort the job on every rank. FSDP2_CHECK_COLLECTIVES=1 stops at the first collective where the ranks disagree, with both sides named.""",
        )
        self.assertEqual(rank1, "skipped step 1")


class TestCollectiveChecks(expecttest.TestCase):
    """Checks on: the first disagreement raises on every rank, before it is issued; a rank that
    is missing altogether still ends in the hang report, from the fingerprint exchange."""

    def _raised_alike(self, name: str) -> str:
        """What ``name`` raised, the same on both ranks (checks raise on every rank alike)."""
        rank0, rank1 = _outcomes(name, checks=True)
        self.assertEqual(rank0, rank1)
        return rank0

    def test_skipped_block(self) -> None:
        self.assertExpectedInline(
            self._raised_alike("skipped_block"),
            """\
CollectiveMismatchError: fsdp2: the ranks of the process group of ranks [0, 1] were about to issue different collectives (FSDP2_CHECK_COLLECTIVES):
  rank 0: all-gather #2 for `blocks.1` (36 elements, float32)
  rank 1: all-gather #2 for `blocks.2` (36 elements, float32)
Likely cause: a module, or a whole forward, ran on some ranks only (control flow that depends on the rank or the data: MoE routing, a layer skipped for some inputs or input shapes, an evaluation forward on rank 0 only). Fix: run every fully_shard module on every rank each step (e.g. call an unused expert on an empty batch), or decide the control flow from facts every rank shares.
Nothing was issued: every rank of the group raises this error.""",
        )

    def test_expert_on_rank0(self) -> None:
        self.assertExpectedInline(
            self._raised_alike("expert_on_rank0"),
            """\
CollectiveMismatchError: fsdp2: the ranks of the process group of ranks [0, 1] were about to issue different collectives (FSDP2_CHECK_COLLECTIVES):
  rank 0: all-gather #5 for `experts.1` (36 elements, float32)
  rank 1: all-gather #5 for `experts.0` (36 elements, float32)
Likely cause: a module, or a whole forward, ran on some ranks only (control flow that depends on the rank or the data: MoE routing, a layer skipped for some inputs or input shapes, an evaluation forward on rank 0 only). Fix: run every fully_shard module on every rank each step (e.g. call an unused expert on an empty batch), or decide the control flow from facts every rank shares.
Nothing was issued: every rank of the group raises this error.""",
        )

    def test_batch_shapes(self) -> None:
        self.assertExpectedInline(
            self._raised_alike("batch_shapes"),
            """\
CollectiveMismatchError: fsdp2: the ranks of the process group of ranks [0, 1] were about to issue different collectives (FSDP2_CHECK_COLLECTIVES):
  rank 0: all-gather #6 for `experts.1` (36 elements, float32)
  rank 1: all-gather #6 for `long_context` (36 elements, float32)
Likely cause: a module, or a whole forward, ran on some ranks only (control flow that depends on the rank or the data: MoE routing, a layer skipped for some inputs or input shapes, an evaluation forward on rank 0 only). Fix: run every fully_shard module on every rank each step (e.g. call an unused expert on an empty batch), or decide the control flow from facts every rank shares.
Nothing was issued: every rank of the group raises this error.""",
        )

    def test_raise_in_backward(self) -> None:
        rank0, rank1 = _outcomes("raise_in_backward", checks=True)
        self.assertExpectedInline(
            rank0,
            """\
CollectiveTimeoutError: fsdp2: rank 0 waited N s (FSDP2_COLLECTIVE_TIMEOUT) for the fingerprint exchange before the all-gather #12 for `blocks.1` (36 elements, float32) on the process group of ranks [0, 1], and it has not finished.
Where each rank is (from the c10d store):
  rank 0 (this rank): blocked in it
  rank 1: MISSING, issued only #0-#11 on this group; not in an fsdp2 collective (busy elsewhere, finished or raised); last seen N s ago issuing reduce-scatter #11 for `blocks.2` (76 elements, float32) [published N s ago]
A rank MISSING from it skipped that module (control flow that depends on the rank or the data: MoE routing, a layer skipped for some inputs or shapes), raised, or never started the step. A rank on a DIFFERENT collective got out of step earlier: collectives pair up by order, not by module, so earlier ones may have exchanged wrong data. The process group is unusable now (a collective is half done): abort the job on every rank. (Collective checks are on: the ranks agreed on every collective before this one.)""",
        )
        self.assertEqual(rank1, "RuntimeError: tripwire fired in backward")

    def test_never_enters(self) -> None:
        rank0, rank1 = _outcomes("never_enters", checks=True)
        self.assertExpectedInline(
            rank0,
            """\
CollectiveTimeoutError: fsdp2: rank 0 waited N s (FSDP2_COLLECTIVE_TIMEOUT) for the fingerprint exchange before the all-gather #17 for `<root>` (18 elements, float32) on the process group of ranks [0, 1], and it has not finished.
Where each rank is (from the c10d store):
  rank 0 (this rank): blocked in it
  rank 1: MISSING, issued only #0-#16 on this group; not in an fsdp2 collective (busy elsewhere, finished or raised); last seen N s ago issuing reduce-scatter #16 for `<root>` (40 elements, float32) [published N s ago]
A rank MISSING from it skipped that module (control flow that depends on the rank or the data: MoE routing, a layer skipped for some inputs or shapes), raised, or never started the step. A rank on a DIFFERENT collective got out of step earlier: collectives pair up by order, not by module, so earlier ones may have exchanged wrong data. The process group is unusable now (a collective is half done): abort the job on every rank. (Collective checks are on: the ranks agreed on every collective before this one.)""",
        )
        self.assertEqual(rank1, "skipped step 1")

    def test_eval_forward_on_rank0(self) -> None:
        self.assertExpectedInline(
            self._raised_alike("eval_on_rank0"),
            """\
CollectiveMismatchError: fsdp2: the ranks of the process group of ranks [0, 1] were about to issue different collectives (FSDP2_CHECK_COLLECTIVES):
  rank 0: all-gather #6 for `<root>` (18 elements, float32)
  rank 1: all-gather #6 for `experts.1` (36 elements, float32)
Likely cause: a module, or a whole forward, ran on some ranks only (control flow that depends on the rank or the data: MoE routing, a layer skipped for some inputs or input shapes, an evaluation forward on rank 0 only). Fix: run every fully_shard module on every rank each step (e.g. call an unused expert on an empty batch), or decide the control flow from facts every rank shares.
Nothing was issued: every rank of the group raises this error.""",
        )

    def test_parameter_unused_on_rank1(self) -> None:
        """Every trainable parameter is in the reduce-scatter, zeros where a rank has no
        gradient: the sizes agree ([Note: gradients on some ranks only] in fsdp2/engine/reduce.py)."""
        assert _outcomes("unused_param", checks=True) == ["finished the step"] * 2

    def test_unused_parameters_reduced_as_zeros(self) -> None:
        assert _outcomes("unused_param_fixed", checks=True) == ["finished the step"] * 2

    def test_scaler_step_on_rank0(self) -> None:
        self.assertExpectedInline(
            self._raised_alike("scaler_step_on_rank0"),
            """\
CollectiveMismatchError: fsdp2: the ranks of the process group of ranks [0, 1] were about to issue different collectives (FSDP2_CHECK_COLLECTIVES):
  rank 0: all-reduce #17 for `ShardedGradScaler` (1 elements, float32)
  rank 1: all-gather #17 for `<root>` (18 elements, float32)
Likely cause: an optimizer step ran on some ranks only: ShardedGradScaler's unscale_ (in scaler.step) decides skip-or-step with every rank. Fix: call scaler.step/unscale_ on every rank each step (a rank out of data must stop the job on every rank, not skip a step alone).
Nothing was issued: every rank of the group raises this error.""",
        )


def test_mismatch_causes() -> None:
    """The causes the report names for disagreements the scenarios above do not reach."""
    from fsdp2.debug.checks import _cause

    def row(op: str, numel: int = 36, dtype: str = "float32") -> dict[str, object]:
        return {"op": op, "label": "blocks.1", "numel": numel, "dtype": dtype, "seq": 3}

    found = {
        "forward vs backward": _cause([row("all_gather"), row("reduce_scatter")]),
        "parameter dtypes": _cause([row("all_gather"), row("all_gather", dtype="bfloat16")]),
        "parameter shapes": _cause([row("all_gather"), row("all_gather", numel=40)]),
        "trainable": _cause([row("reduce_scatter"), row("reduce_scatter", numel=40)]),
    }
    assert (
        "some ranks are in forward (all-gather) while others are in backward"
        in found["forward vs backward"]
    )
    assert "the module's parameters differ between ranks" in found["parameter dtypes"]
    assert "the module's parameters differ between ranks" in found["parameter shapes"]
    assert "trainable parameters differ between ranks" in found["trainable"]


def _compare_runs() -> dict[str, Any]:
    off, on = train(checks=False), train(checks=True)
    return {"off": off, "on": on}


def test_checks_change_no_numbers_and_cost_nothing_when_off() -> None:
    for rank, runs in enumerate(run_on_ranks(2, _compare_runs)):
        off, on = runs["off"], runs["on"]
        # The fingerprints never touch the model's tensors: the same ops on the same values.
        for step, (a, b) in enumerate(zip(off["losses"], on["losses"], strict=True)):
            assert torch.equal(a, b), f"rank {rank} step {step}: {a.item()} vs {b.item()}"
        real = sum(off["records"].values())
        assert real > 0 and "check" not in off["records"], off["records"]
        # Checks off: exactly the recorded collectives reach torch.distributed, nothing more.
        assert off["calls"] == real, (off["calls"], off["records"])
        # Checks on: one fingerprint all-gather before each of them.
        assert on["records"] == off["records"] + Counter(check=real), on["records"]
        assert on["calls"] == 2 * real, (on["calls"], on["records"])


def _destroyed_group_is_freed() -> bool:
    import gc
    import weakref

    import torch.distributed as dist

    from fsdp2.debug import hang

    group = dist.new_group(backend="gloo")
    event = hang.note("all_gather", "x", torch.zeros(1), group)  # what every collective records
    # The publisher thread may publish the event before it is cleared below (it once kept the
    # group alive for up to half a minute that way, failing this test now and then): do it
    # here, every time.
    event.rank.publish()
    ref = weakref.ref(group)
    # A gloo group's constructor can return on one rank while its peer is still connecting;
    # destroying it then closes the socket under the peer ("Connection closed by peer").
    dist.barrier(group)
    dist.destroy_process_group(group)
    del group
    event.rank.ring.clear()  # the last few events hold their group, by design (8 at most)
    del event
    # The barrier's work may still be referenced from gloo's worker thread for a moment after
    # it returned (seen once on torch 2.15, rank 1): a leak holds the group for good, so give
    # the backend up to 5 s to let go before calling it one.
    deadline = time.monotonic() + 5.0
    gc.collect()
    while ref() is not None and time.monotonic() < deadline:
        time.sleep(0.05)
        gc.collect()
    return ref() is None


def test_the_hang_report_keeps_no_destroyed_group_alive() -> None:
    # Counting collectives per group object once kept every group a job ever made (and
    # destroyed) alive until exit.
    assert run_on_ranks(2, _destroyed_group_is_freed) == [True, True]


class TestRankExitsEarly(expecttest.TestCase):
    def test_rank_exits_early(self) -> None:
        """Rank 1's data runs out a step early and its script ends; rank 0, in the next step's
        first all-gather, gets gloo's "Connection closed by peer" at once: it raises that, naming the
        collective and where each rank was (rank 1's last entry, published as it exited)."""
        # FSDP2_COLLECTIVE_TIMEOUT: 60 s, far beyond the test's bound: not the deadline.
        proc = launch("tests/hang_scenarios.py", 2, "early_exit", "60", timeout=120)
        lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        assert len(lines) == 1, proc.stdout + proc.stderr
        assert lines[0]["seconds"] < 20, lines[0]
        text = lines[0]["outcome"]
        assert re.search(r"Connection (closed|reset) by peer", text), text
        # gloo's words: the peer's address and port, and a line of advice.
        text = re.sub(r"(when the backend raised RuntimeError: ).*", r"\1<gloo's message>", text)
        self.assertExpectedInline(
            text,
            """\
CollectiveFailedError: fsdp2: rank 0 was waiting for the all-gather #17 for `<root>` (18 elements, float32) on the process group of ranks [0, 1] when the backend raised RuntimeError: <gloo's message>
Where each rank is (from the c10d store):
  rank 0 (this rank): waiting in it
  rank 1: MISSING, issued only #0-#16 on this group; its process EXITED N s ago (normally), after issuing reduce-scatter #16 for `<root>` (40 elements, float32) [published N s ago]
Likely cause: a peer rank is gone. A rank whose process EXITED ended its training loop before the others (e.g. its data loader ran out of batches first); one that published nothing more may have crashed (see its own log). Fix: give every rank the same number of batches (DistributedSampler(..., drop_last=True), or stop every rank's loop when one runs out). The process group is unusable now: abort the job on every rank.""",
        )


def test_peer_whose_store_client_is_busy() -> None:
    """A peer whose store client is held by another request (a rendezvous, a barrier) is read
    fresh all the same: its publisher writes through a client of its own and answers the
    report's ask ([Note: fresh entries]). Its entry once predated the whole step ("issued none
    on this group"), and the report called it MISSING from collectives it had issued."""
    proc = launch("tests/hang_scenarios.py", 2, "busy_store", timeout=120)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, proc.stdout + proc.stderr
    rank1 = lines[0]["outcome"].split("\n")[3]
    assert rank1.startswith(
        "  rank 1: MISSING, issued only #0-#16 on this group; not in an fsdp2 collective"
    ), lines[0]["outcome"]


@pytest.mark.parametrize("checks, coalesce", [(False, False), (False, True), (True, False)])
def test_zero2_step_on_one_rank_is_named(checks: bool, coalesce: bool) -> None:
    """One rank stepped its optimizer, the other did not: with memory_mode="zero2" only the
    first gathers its kept copies again, so the ranks' collectives part. Every rank raises one
    of fsdp2's named errors within the deadline (the hang report, or the checks' or coalesced
    buckets' mismatch report), never a hang or gloo's abort."""
    outcomes = _outcomes("zero2_step_on_rank0", checks=checks, coalesce=coalesce)
    for rank, text in enumerate(outcomes):
        assert text.startswith(("CollectiveTimeoutError", "CollectiveMismatchError")), (rank, text)
