"""Which process group each collective runs on, and where its buffers come from.

``set_separate_reduce_scatter_group`` moves reduce-scatters to a group of their own (one per set
of ranks); ``set_allocate_memory_from_process_group_for_comm`` takes buffers from the process
group's allocator (gloo has none: plain memory, so training is bitwise unchanged);
``set_symm_mem_for_comm`` needs CUDA and NCCL and says so elsewhere. Each trains in lockstep with
the unsharded reference; the collective recorder shows the group each collective ran on.
"""

from __future__ import annotations

import unittest
from collections.abc import Sequence
from typing import Any

import expecttest
import pytest
import torch
import torch.distributed as dist

from fsdp2 import LowPrecisionReduceScatter, record_collectives
from fsdp2.engine.comm import GroupAllocAllGather, GroupAllocReduceScatter
from tests.errors import raised
from tests.harness import IMPL_UNDER_TEST, per_group_collectives, run_on_ranks
from tests.parity import Lockstep, fsdp_modules, shard_model

NUM_STEPS = 3


def _train(t: Lockstep) -> tuple[list[float], list[Any]]:
    t.make_optimizers()
    losses = []
    with record_collectives() as records:
        for step in range(NUM_STEPS):
            losses.append(t.forward_backward(step))
            t.check_grads(f"step {step}")
            t.optim_step()
    t.check_params("after training")
    return losses, list(records)


@per_group_collectives  # counts one reduce-scatter per group, as torch issues them
def _separate_reduce_scatter_group(impl: str) -> dict[str, Any]:
    t = Lockstep("mlp")
    shard_model(t.model, "mlp", impl)
    root: Any = t.model
    root.set_separate_reduce_scatter_group()  # recurse: every module
    root.set_separate_reduce_scatter_group()  # idempotent: no second group
    _, records = _train(t)
    rs_groups = {r.group for r in records if r.kind == "reduce_scatter"}
    ag_groups = {r.group for r in records if r.kind == "all_gather"}
    # Back to the shard group: the next step's reduce-scatters run where the all-gathers do.
    root.set_separate_reduce_scatter_group(False)
    with record_collectives() as after:
        t.forward_backward(NUM_STEPS)
        t.check_grads("after disabling")
    return {
        "rs_groups": rs_groups,
        "ag_groups": ag_groups,
        "rs_after": {r.group for r in after if r.kind == "reduce_scatter"},
        "world_group": dist.group.WORLD.group_name,  # type: ignore[union-attr]
        "rs_count": sum(r.kind == "reduce_scatter" for r in records),
    }


@pytest.mark.parametrize("world_size", [2, 4])
def test_separate_reduce_scatter_group(world_size: int) -> None:
    for result in run_on_ranks(world_size, _separate_reduce_scatter_group, IMPL_UNDER_TEST):
        if IMPL_UNDER_TEST != "fsdp2":
            continue  # the recorder is fsdp2's seam; the lockstep checks ran for torch too
        assert len(result["rs_groups"]) == 1, result  # one group for every module
        assert result["rs_groups"].isdisjoint(result["ag_groups"]), result
        assert result["ag_groups"] == result["rs_after"], result
        assert result["rs_count"] == 4 * NUM_STEPS  # one per group and step, as before


def _allocate_from_group(enable: bool) -> list[float]:
    t = Lockstep("mlp")
    shard_model(t.model, "mlp")
    for module in fsdp_modules(t.model):
        module.set_allocate_memory_from_process_group_for_comm(enable)
        groups = module._get_fsdp_state().groups
        assert all(
            isinstance(g.settings.custom_all_gather, GroupAllocAllGather) == enable for g in groups
        )
        assert all(
            isinstance(g.settings.custom_reduce_scatter, GroupAllocReduceScatter) == enable
            for g in groups
        )
    losses, _ = _train(t)
    return losses


def test_allocate_memory_from_process_group(fsdp2_only: None) -> None:
    """gloo allocates nothing itself: the same arithmetic, so bitwise the same losses."""
    enabled = run_on_ranks(2, _allocate_from_group, True)
    default = run_on_ranks(2, _allocate_from_group, False)
    assert enabled == default


class _Backend:
    """Stands in for a backend with its own allocator (as NCCL has)."""

    def __init__(self) -> None:
        self.allocated: list[int] = []

    def supports_tensor_alloc(self, device: torch.device) -> bool:
        return True

    def allocate_tensor(self, numel: int, *, dtype: torch.dtype, device: torch.device) -> Any:
        self.allocated.append(numel)
        return torch.full((numel,), 7.0, dtype=dtype, device=device)


class _Group:
    def __init__(self) -> None:
        self.backend = _Backend()

    def _get_backend(self, device: torch.device) -> _Backend:
        return self.backend


def test_group_allocators_use_the_backends_allocator() -> None:
    group: Any = _Group()
    size: Sequence[int] = (2, 3)
    for comm in (GroupAllocAllGather(group), GroupAllocReduceScatter(group)):
        buf = comm.allocate(size, dtype=torch.float32, device=torch.device("cpu"))
        assert buf.shape == (2, 3) and bool((buf == 7.0).all())
    assert group.backend.allocated == [6, 6]


def _error_messages() -> dict[str, str]:
    t = Lockstep("mlp")
    shard_model(t.model, "mlp")
    root: Any = t.model
    block = root.blocks[0]
    block.set_custom_reduce_scatter(LowPrecisionReduceScatter())
    return {
        "symm_mem_on_cpu": raised(lambda: root.set_symm_mem_for_comm()),
        "symm_mem_backend": raised(lambda: root.set_symm_mem_for_comm("NVSHMEM")),  # type: ignore[arg-type]
        "custom_comm": raised(lambda: block.set_allocate_memory_from_process_group_for_comm(True)),
    }


class TestMessages(expecttest.TestCase):
    @unittest.skipIf(IMPL_UNDER_TEST != "fsdp2", "pins fsdp2's messages")
    def test_messages(self) -> None:
        messages = run_on_ranks(2, _error_messages)
        self.assertEqual(messages[0], messages[1])  # every rank raises alike
        self.assertExpectedInline(
            messages[0]["symm_mem_on_cpu"],
            """RuntimeError: set_symm_mem_for_comm: 'MLPStack' communicates on cpu through gloo, but symmetric memory needs CUDA devices and an NCCL process group. Call it only when training on CUDA with NCCL""",
        )
        self.assertExpectedInline(
            messages[0]["symm_mem_backend"],
            """ValueError: set_symm_mem_for_comm supports backend='NCCL' only, got 'NVSHMEM'""",
        )
        self.assertExpectedInline(
            messages[0]["custom_comm"],
            """RuntimeError: set_allocate_memory_from_process_group_for_comm: 'Sequential' uses a custom collective (LowPrecisionReduceScatter, from set_custom_all_gather or set_custom_reduce_scatter), which allocates its own buffers; use one or the other""",
        )
