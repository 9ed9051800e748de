"""``fsdp2.plan`` predicts the coalesced collectives ([Note: the planner's coalesced step]).

A stack of tiny blocks, each its own group, trains two steps on gloo ranks with coalescing at a
budget; the second (steady-state) step's recorded collectives must be exactly the plan's,
planned in this process at the same budget: every all-gather (the coalesced ones named
``"a+b+c"``, with their bytes), in order. Reduce-scatters: the same once the engine coalesces
them (issue 24's rules; ``fsdp2.engine.coalesce_reduce``): until that module exists, that
test is an xfail saying so.

fsdp2-only: coalescing is fsdp2's.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp2
from fsdp2.engine.coalesce import bucket_label
from tests.harness import run_on_ranks
from tests.models import MLPStack
from tests.parity import MODEL_SEED, local_batch

pytestmark = pytest.mark.usefixtures("fsdp2_only")

NUM_BLOCKS = 12
# At 2 ranks a 16x16 block gathers 1,088 bytes (three fit: the root's 272 and the first
# block's 576 fit with two more), and reduce-scatters 1,104 (its two flags): two fit.
SEVERAL = 3_300
ALL = 10**6  # every group in one bucket

Record = tuple[str, str, int, int, int]


def _build(model_name: str) -> nn.Module:
    """``stack``: every block trainable; ``frozen``: block 0 frozen (backward never reaches it,
    but block 1's backward bucket takes it along) and block 5 (reached, never reduced);
    ``stack-k2``: the blocks sharded with ``reshard_after_forward=2`` (an int: at 2 ranks,
    the same as True)."""
    torch.manual_seed(MODEL_SEED)
    model = MLPStack(NUM_BLOCKS)
    model.reshard_blocks = 2 if model_name == "stack-k2" else None  # type: ignore[assignment]
    if model_name == "frozen":
        model.blocks[0].requires_grad_(False)
        model.blocks[5].requires_grad_(False)
    return model


def _shard(model: nn.Module) -> None:
    reshard = getattr(model, "reshard_blocks", None)
    for block in model.blocks:  # type: ignore[union-attr]
        fsdp2.fully_shard(block, reshard_after_forward=reshard)
    fsdp2.fully_shard(model, reshard_after_forward=reshard)


def _two_steps(model_name: str, budget: int, prefetch: bool) -> list[list[Record]]:
    """Two AdamW steps at ``budget``; each step's collectives. ``prefetch``: the groups guess
    prefetches as on an accelerator."""
    from fsdp2.engine.coalesce import coalesce_bytes, set_coalesce_bytes
    from fsdp2.engine.collectives import record_collectives
    from fsdp2.engine.module import state_of

    before = coalesce_bytes()
    set_coalesce_bytes(budget)
    try:
        model = _build(model_name)
        _shard(model)
        for m in model.modules():
            for group in s.groups if (s := state_of(m)) else []:
                group.settings.guess_prefetch = prefetch
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        steps = []
        for step in range(2):
            batch = local_batch("mlp", step, 0, dist.get_rank(), dist.get_world_size(), 2)
            with record_collectives() as records:
                model(*batch).backward()
            opt.step()
            opt.zero_grad()
            steps.append(
                [(r.kind, r.label, r.input_nbytes, r.output_nbytes, r.world_size) for r in records]
            )
    finally:
        set_coalesce_bytes(before)
    return steps


@functools.cache
def _run(model_name: str, budget: int, prefetch: bool) -> tuple[list[Record], list[Record]]:
    """(planned, recorded in the steady-state step), rank 0's (every rank forms the same)."""
    from fsdp2.engine.coalesce import coalesce_bytes, set_coalesce_bytes

    ranks = run_on_ranks(2, _two_steps, model_name, budget, prefetch, timeout=120)
    if ranks[0] != ranks[1]:
        raise AssertionError(f"ranks issued different collectives: {ranks}")
    before = coalesce_bytes()
    set_coalesce_bytes(budget)
    try:
        plan = fsdp2.plan(
            functools.partial(_build, model_name),
            _shard,
            world_size=2,
            device="cuda" if prefetch else "cpu",
        )
    finally:
        set_coalesce_bytes(before)
    assert plan.coalesce_bytes == budget
    predicted = [
        (c.kind, c.label, c.input_nbytes, c.output_nbytes, c.world_size) for c in plan.collectives
    ]
    return predicted, ranks[0][1]


CASES = [
    ("stack", SEVERAL, False),
    ("stack", 0, False),
    ("frozen", SEVERAL, False),
    ("frozen", ALL, False),
    ("stack", SEVERAL, True),
    ("frozen", SEVERAL, True),
    ("stack-k2", SEVERAL, False),
    ("stack-k2", ALL, False),
    ("stack-k2", SEVERAL, True),
]
IDS = [f"{m}-{b}-{'prefetch' if p else 'cpu'}" for m, b, p in CASES]


def _of(kind: str, records: list[Record]) -> list[Record]:
    return [r for r in records if r[0] == kind]


@pytest.mark.parametrize(("model_name", "budget", "prefetch"), CASES, ids=IDS)
def test_plan_predicts_coalesced_gathers(model_name: str, budget: int, prefetch: bool) -> None:
    """Every all-gather of the steady-state step, in order, with its label and bytes."""
    predicted, recorded = _run(model_name, budget, prefetch)
    assert _of("all_gather", predicted) == _of("all_gather", recorded)
    if budget:  # the case coalesces: it is there to test the buckets
        assert any("+" in r[1] for r in _of("all_gather", recorded))
    else:
        assert not any("+" in r[1] for r in recorded)
        assert predicted == recorded


@pytest.mark.parametrize(("model_name", "budget", "prefetch"), CASES, ids=IDS)
def test_plan_predicts_coalesced_reduce_scatters(
    model_name: str, budget: int, prefetch: bool
) -> None:
    """Every reduce-scatter of the steady-state step (held and issued per issue 24's rules),
    then the whole step in issue order."""
    if budget and importlib.util.find_spec("fsdp2.engine.coalesce_reduce") is None:
        pytest.xfail(
            "the engine does not coalesce reduce-scatters yet (no fsdp2.engine.coalesce_reduce, "
            "issue 24 item 1b): this test checks the planner's prediction once it does"
        )
    predicted, recorded = _run(model_name, budget, prefetch)
    if budget:
        assert any("+" in r[1] for r in _of("reduce_scatter", recorded))
    assert _of("reduce_scatter", predicted) == _of("reduce_scatter", recorded)
    assert predicted == recorded


def _plan_at(model_name: str, budget: int) -> fsdp2.Plan:
    from fsdp2.engine.coalesce import coalesce_bytes, set_coalesce_bytes

    before = coalesce_bytes()
    set_coalesce_bytes(budget)
    try:
        return fsdp2.plan(functools.partial(_build, model_name), _shard, world_size=2, device="cpu")
    finally:
        set_coalesce_bytes(before)


@pytest.mark.parametrize("model_name", ["stack", "frozen"])
def test_reduce_scatter_buckets_follow_the_rule(model_name: str) -> None:
    """Without ranks: backward order, trainable groups only, held while their rows (one
    rank's chunk each) fit the fixed row less its header (a greedy walk written out here),
    labels in issue order, every bucket of the one fixed size ([Note: coalesced
    reduce-scatters]): the budget's share per rank (1,648 B at 2 ranks), a 4-byte header
    element per group of the root, so two 552-byte rows fit and a third does not."""
    plan = _plan_at(model_name, SEVERAL)
    trainable = [g for g in reversed(plan.groups) if g.num_trainable]
    share = SEVERAL // 2 // 4 * 4
    header = 4 * len(plan.groups)
    rows = [g.reduce_out_bytes for g in trainable]
    fixed = min(share, header + sum(r for r in rows if header + r <= share))
    assert fixed == share == 1_648  # the stack's rows fill more than the share
    expected: list[Record] = []
    bucket: list[Any] = []
    for g in [*trainable, None]:
        total = sum(m.reduce_out_bytes for m in bucket)
        if bucket and (g is None or total + g.reduce_out_bytes > fixed - header):
            label = bucket_label([m.label for m in bucket])
            expected.append(("reduce_scatter", label, 2 * fixed, fixed, 2))
            bucket = []
        if g is not None:
            bucket.append(g)
    predicted = [
        (c.kind, c.label, c.input_nbytes, c.output_nbytes, c.world_size) for c in plan.collectives
    ]
    assert _of("reduce_scatter", predicted) == expected
    assert len(expected) < len(trainable)  # the case coalesces


def test_peaks_count_gathered_ahead_and_held_bytes() -> None:
    """The transients of the steady-state step at 2 gloo ranks (a block's gather output is
    1,088 B, its reduce-scatter input and output 1,104 + 552 B, the root's kept parameters and
    early gradients 272 B each; a coalesced gather's send and output bytes as the plan lists
    them: 1,632 and 3,264 with the shards concatenated, more with a fixed send size)."""
    off, on = _plan_at("stack", 0), _plan_at("stack", SEVERAL)
    sizes = {c.label: (c.input_nbytes, c.output_nbytes) for c in on.collectives}
    # Forward: one block's output, then its unsharded copy, beside the root's 272. Coalesced,
    # the bucket of blocks 3-5: its output and, while it runs, its send buffer and gloo's
    # temporary the output's size.
    assert off.forward_transient_bytes == 272 + 2 * 1088
    send, out = sizes["blocks.3+blocks.4+blocks.5"]
    assert on.forward_transient_bytes == 272 + out + send + out
    assert on.forward_transient_at == "blocks.3"
    # Backward, the larger of two moments: as blocks 5-3 are gathered, the root's parameters
    # and gradients (544), the held reduce-scatter inputs and outputs of blocks 7 and 6
    # (2 x 1,656), the bucket's output, send buffer and gloo temporary; or at block 7's
    # reduction, which issues the held bucket of blocks 9 and 8: their inputs and outputs,
    # copied into one input of the fixed size (2 ranks x 1,648), beside the output of the
    # bucket 8-6 (block 6 still to copy out), block 7's gradients (1,088) and its own input
    # and output.
    send, out = sizes["blocks.5+blocks.4+blocks.3"]
    gathering = 544 + 2 * 1656 + out + send + out
    reducing = 544 + 2 * 1656 + sizes["blocks.8+blocks.7+blocks.6"][1] + 1088 + 1656 + 2 * 1648
    assert on.backward_transient_bytes == max(gathering, reducing)
    assert on.backward_transient_at == ("blocks.5" if gathering > reducing else "blocks.7")
    assert on.peak_bytes > off.peak_bytes
