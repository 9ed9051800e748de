"""Collectives per training step: one all-gather per group in forward, one more in backward for
each group resharded after forward, one reduce-scatter per group with gradients.

The expectations are computed from the model without FSDP: which groups exist (`plan_groups`),
which of their modules ran forward this step and which parameters got gradients (from a plain
reference run with hooks). They are checked twice: through fsdp2's own seam
(`fsdp2.engine.collectives.record_collectives`, kinds, labels and bytes), and through torch's
`CommDebugMode`, which counts c10d ops for either implementation, so the expectations themselves
are validated against torch's FSDP2.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode

from tests.harness import IMPL_UNDER_TEST, per_group_collectives, run_on_ranks
from tests.models import MODELS, build_model
from tests.parity import (
    LR,
    MODEL_SEED,
    local_batch,
    padded_shard_numel,
    plan_groups,
    shard_model,
)

FP32_BYTES = 4


def _ground_truth(name: str, step: int) -> dict[str, Any]:
    """Per group of a plain model at ``step``: whether its module ran and which params got grads."""
    ref = build_model(name, MODEL_SEED)
    groups = plan_groups(ref, name)
    ran: list[str] = []
    for group in groups:
        group.module.register_forward_pre_hook(lambda *_, label=group.label: ran.append(label))
    spec = MODELS[name]
    if spec.prepare_step is not None:
        spec.prepare_step(ref, step)
    ref(*local_batch(name, step, 0, dist.get_rank(), dist.get_world_size())).backward()
    return {
        "ran": ran,
        "groups": [
            {
                "label": g.label,
                "shapes": [tuple(p.shape) for p in g.params.values()],
                "with_grad": [p.grad is not None for p in g.params.values()],
                "trainable": [p.requires_grad for p in g.params.values()],
            }
            for g in groups
        ],
    }


@per_group_collectives  # one collective per group, as predicted and as torch's
def _run_step(
    impl: str, name: str, reshard_after_forward: bool | None, step: int, recorder: str
) -> dict[str, Any]:
    """Train ``step`` steps, then record the collectives of step ``step`` phase by phase."""
    model = build_model(name, MODEL_SEED)
    shard_model(model, name, impl, reshard_after_forward=reshard_after_forward)
    optim = torch.optim.AdamW(model.parameters(), lr=LR)
    spec = MODELS[name]
    phases: dict[str, Any] = {}
    for i in range(step + 1):
        if spec.prepare_step is not None:
            spec.prepare_step(model, i)
        batch = local_batch(name, i, 0, dist.get_rank(), dist.get_world_size())
        if i < step:  # warm-up, including lazy initialization
            model(*batch).backward()
        else:
            with _recording(recorder, phases, "forward"):
                loss = model(*batch)
            with _recording(recorder, phases, "backward"):
                loss.backward()
        with _recording(recorder, phases, "optimizer") if i == step else nullcontext():
            optim.step()
            model.zero_grad()
    return {"phases": phases, **_ground_truth(name, step)}


@contextmanager
def _recording(recorder: str, phases: dict[str, Any], phase: str) -> Iterator[None]:
    """Records one phase's collectives into ``phases[phase]``: fsdp2's seam or CommDebugMode."""
    if recorder == "seam":
        from fsdp2.engine.collectives import record_collectives

        with record_collectives() as records:
            yield
        phases[phase] = [asdict(r) for r in records]
    else:
        mode = CommDebugMode()
        with mode:
            yield
        phases[phase] = {str(op): n for op, n in mode.get_comm_counts().items() if n}


# ---------------------------------------------------------------------------------------------
# Expectations
# ---------------------------------------------------------------------------------------------


def _resharded(label: str, reshard_after_forward: bool | None) -> bool:
    # None: True for every module but the root, which backward needs first anyway.
    return label != "" if reshard_after_forward is None else reshard_after_forward


def expected_records(
    truth: dict[str, Any], reshard_after_forward: bool | None, world_size: int
) -> dict[str, list[tuple[str, str, int, int]]]:
    """(kind, label, input bytes, output bytes) per phase; forward in order, others sorted."""
    by_label = {g["label"]: g for g in truth["groups"] if g["shapes"]}

    def shard_nbytes(shapes: list[tuple[int, ...]]) -> int:
        return sum(padded_shard_numel(torch.Size(s), world_size) for s in shapes) * FP32_BYTES

    forward, backward = [], []
    for label in truth["ran"]:
        if label not in by_label:
            continue  # a module without parameters of its own: no group, no collective
        ag = shard_nbytes(by_label[label]["shapes"])
        forward.append(("all_gather", label, ag, ag * world_size))
        if _resharded(label, reshard_after_forward):
            backward.append(("all_gather", label, ag, ag * world_size))
        group = by_label[label]
        if any(group["with_grad"]):
            # Every trainable parameter, used or not, and one flag each (whether this rank had
            # its gradient): [Note: gradients on some ranks only] in fsdp2/engine/reduce.py.
            trained = [s for s, t in zip(group["shapes"], group["trainable"], strict=True) if t]
            rs = shard_nbytes(trained) + len(trained) * FP32_BYTES
            backward.append(("reduce_scatter", label, rs * world_size, rs))
    return {"forward": forward, "backward": sorted(backward), "optimizer": []}


def _as_tuples(records: list[dict[str, Any]], world_size: int) -> list[tuple[str, str, int, int]]:
    assert all(r["world_size"] == world_size for r in records), records
    return [(r["kind"], r["label"], r["input_nbytes"], r["output_nbytes"]) for r in records]


def check_records(
    result: dict[str, Any], reshard_after_forward: bool | None, world_size: int, where: str
) -> None:
    expected = expected_records(result, reshard_after_forward, world_size)
    phases = result["phases"]
    assert set(phases) == set(expected)
    for phase, records in phases.items():
        actual = _as_tuples(records, world_size)
        if phase != "forward":
            actual.sort()  # backward order depends on prefetching; only forward's is fixed
        assert actual == expected[phase], f"{where}, {phase}: (kind, label, in bytes, out bytes)"


def _kind_of_c10d_op(op: str) -> str:
    op = op.replace("_", "")
    for kind in ("allgather", "reducescatter", "allreduce"):
        if kind in op:
            return kind
    return op


def _kind_counts(counts: dict[str, int]) -> Counter[str]:
    totals: Counter[str] = Counter()
    for op, n in counts.items():
        totals[_kind_of_c10d_op(op)] += n
    return totals


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------

# (model, step to count): step 1 of "unused" skips a parameter and a whole block.
CASES = [("mlp", 1), ("gpt", 1), ("frozen", 1), ("unused", 1), ("unused", 2), ("no_own_params", 1)]
RESHARD = [None, True, False]


@pytest.mark.parametrize("reshard_after_forward", RESHARD)
@pytest.mark.parametrize(("model", "step"), CASES)
def test_collectives_per_step(
    model: str, step: int, reshard_after_forward: bool | None, fsdp2_only: None
) -> None:
    world_size = 2
    results = run_on_ranks(
        world_size, _run_step, "fsdp2", model, reshard_after_forward, step, "seam"
    )
    for rank, result in enumerate(results):
        check_records(result, reshard_after_forward, world_size, f"rank {rank}")


@pytest.mark.parametrize("world_size", [2, 4])
def test_collective_bytes_odd_shapes(world_size: int, fsdp2_only: None) -> None:
    """Padding: each rank sends ceil(dim0 / W) rows of every parameter, a 0-d one as 1 element."""
    results = run_on_ranks(world_size, _run_step, "fsdp2", "odd_shapes_scalar", None, 1, "seam")
    for rank, result in enumerate(results):
        check_records(result, None, world_size, f"rank {rank}")


def _comm_mode_kinds(
    impl: str, model: str, reshard_after_forward: bool | None, step: int
) -> list[dict[str, Counter[str]]]:
    """Per rank and phase, c10d collectives by kind; asserts they match the expectations."""
    results = run_on_ranks(2, _run_step, impl, model, reshard_after_forward, step, "comm_mode")
    per_rank = []
    for rank, result in enumerate(results):
        expected = expected_records(result, reshard_after_forward, 2)
        kinds = {phase: _kind_counts(counts) for phase, counts in result["phases"].items()}
        expected_kinds = {
            phase: Counter(kind.replace("_", "") for kind, *_ in records)
            for phase, records in expected.items()
        }
        if impl == "fsdp2":
            expected_kinds = _reduce_scatter_as_all_reduce(expected_kinds)
        assert kinds == expected_kinds, f"{impl} rank {rank}"
        per_rank.append(kinds)
    return per_rank


def _reduce_scatter_as_all_reduce(kinds: dict[str, Counter[str]]) -> dict[str, Counter[str]]:
    """fsdp2 runs a reduce-scatter on gloo as an in-place all-reduce of its own input, which is
    what gloo's reduce-scatter does on a clone (fsdp2/engine/collectives.py ``reduce_scatter``)."""
    moved = {}
    for phase, counts in kinds.items():
        counts = Counter(counts)
        n = counts.pop("reducescatter", 0)
        if n:
            counts["allreduce"] += n
        moved[phase] = counts
    return moved


@pytest.mark.parametrize("reshard_after_forward", RESHARD)
@pytest.mark.parametrize(("model", "step"), CASES)
def test_comm_debug_mode_matches_torch(
    model: str, step: int, reshard_after_forward: bool | None
) -> None:
    """c10d-level counts, no seam involved: the implementation under test issues what torch's
    FSDP2 issues, and both match the expectations above."""
    torch_kinds = _comm_mode_kinds("torch", model, reshard_after_forward, step)
    if IMPL_UNDER_TEST != "torch":
        ours = _comm_mode_kinds(IMPL_UNDER_TEST, model, reshard_after_forward, step)
        assert ours == [_reduce_scatter_as_all_reduce(k) for k in torch_kinds]


def _gloo_reduce_scatter_cases() -> dict[str, bool]:
    """fsdp2's reduce-scatter on gloo (an in-place all-reduce of its own input) against gloo's
    own ``reduce_scatter_single``, on the same inputs: bitwise, for odd sizes, fp32/bf16 and
    SUM/AVG; and its work reports completion before ``wait()`` (gloo's own never does)."""
    from fsdp2.engine import collectives

    group, rank, world = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(rank)
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        for numel in (1, 7, 4099):
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
                inp = torch.randn(world * numel, generator=gen).to(dtype)
                theirs = inp.new_empty(numel)
                dist.reduce_scatter_single(theirs, inp.clone(), op=op, group=group)
                ours = inp.new_empty(numel)
                collectives.reduce_scatter(ours, inp.clone(), group, "t", op).wait()
                results[f"{dtype} {numel} {op}"] = torch.equal(ours, theirs)
    pending = collectives.reduce_scatter(
        torch.empty(3), torch.ones(3 * world), group, "t", dist.ReduceOp.SUM
    )
    deadline = time.monotonic() + 20
    while not pending.done() and time.monotonic() < deadline:
        time.sleep(0.01)
    results["reports completion"] = pending.done()
    pending.wait()
    return results


@pytest.mark.parametrize("world_size", [2, 3])
def test_gloo_reduce_scatter_is_gloos_own_bitwise(world_size: int, fsdp2_only: None) -> None:
    for rank, result in enumerate(run_on_ranks(world_size, _gloo_reduce_scatter_cases)):
        assert all(result.values()), f"rank {rank}: {result}"
