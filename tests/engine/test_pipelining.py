"""Pipeline parallel x FSDP through ``torch.distributed.pipelining`` (torchtitan's 3-D path).

4 ranks as a (pp=2, dp=2) mesh: each pipeline stage is two blocks and a head, each block and the
stage root ``fully_shard``-ed over dp, trained over 4 microbatches with GPipe, 1F1B and
interleaved 1F1B (two stages per rank; that schedule also unshards and reshards them itself).
The stage's contract with FSDP2: it recognises the stage module with ``isinstance(m,
FSDPModule)``, turns gradient sync off for every microbatch's backward, and after the last one
reduces each group once through ``fully_shard.state(m)`` (see fsdp2/engine/torch_state.py). fsdp2 is
switched in both ways users do: ``fsdp2.patch_torch_fsdp()`` (the stage then calls fsdp2's
names), and ``from fsdp2 import fully_shard`` with torch left alone (the stage calls torch's
names on fsdp2's modules). Both must train exactly as torch's ``fully_shard`` does, with the
same collectives."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import expecttest
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

# Imported before any test patches torch: patch_torch_fsdp() rewrites the names the stage
# module imported, and unpatch_torch_fsdp() can only restore names it rewrote.
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torch.distributed.tensor import DTensor

import fsdp2
from fsdp2.engine.collectives import record_collectives
from fsdp2.engine.releases import RULES
from fsdp2.tools.swap import unpatch_torch_fsdp
from tests.harness import IMPL_UNDER_TEST, per_group_collectives, run_on_ranks
from tests.parity import CollectiveCounter

DIM, MICRO_BATCH, NUM_MICRO, NUM_STEPS = 8, 2, 4, 3
SCHEDULES: dict[str, Any] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved": ScheduleInterleaved1F1B,  # two stages per rank, UNSHARD/RESHARD actions
}
# torch 2.15's additions to the schedules, which drive FSDP through set_manual_backward_
# finalization / finalize_backward: each optimizer step as two step() calls, the first with
# finalize_gradients=False (gradients accumulate unreduced across the calls); and the
# interleaved schedule waiting for each stage's reduction only later (defer_reduce_grad_wait).
CASES = [(name, None) for name in sorted(SCHEDULES)] + [
    ("1f1b", "accumulate"),
    ("interleaved", "accumulate"),
    ("interleaved", "deferred"),
]
GROUPS = ["", "blocks.0", "blocks.1"]  # one per fully_shard call of a stage: root, blocks
# torch's fully_shard; fsdp2 through patch_torch_fsdp(); fsdp2 through its own import.
WAYS = ("torch", "patched", "import")


class Stage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(2))
        self.head = nn.Linear(DIM, DIM)  # the stage root's own parameters: a group of their own

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@contextlib.contextmanager
def _fully_shard_for(way: str) -> Iterator[Any]:
    if way == "torch":
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        yield torch_fully_shard
    elif way == "import":
        yield fsdp2.fully_shard
    else:
        fsdp2.patch_torch_fsdp()
        try:
            import torch.distributed.fsdp as public

            yield public.fully_shard
        finally:
            unpatch_torch_fsdp()  # this pool process runs later tests on torch's names


@per_group_collectives  # counted against torch's, which gathers each group alone
def _train(way: str, schedule: str, variant: str | None = None) -> dict[str, Any]:
    """Train ``NUM_STEPS`` steps; per step: losses, collectives, gradients; then parameters."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    num_stages = 4 if schedule == "interleaved" else 2
    mine = list(range(pp, num_stages, 2))  # interleaved: stages pp and pp + 2
    torch.manual_seed(0)
    every = [Stage() for _ in range(num_stages)]  # the same init on every rank
    models = [every[i] for i in mine]
    out: dict[str, Any] = {
        "losses": [],
        "counts": [],
        "reduce_scatters": [],
        "grads": [],
        "sharded": [],
    }
    with _fully_shard_for(way) as fully_shard:
        stages = []
        for index, model in zip(mine, models, strict=True):
            for block in model.blocks:
                fully_shard(block, mesh=mesh["dp"], reshard_after_forward=True)
            fully_shard(model, mesh=mesh["dp"])
            stages.append(
                PipelineStage(
                    model, index, num_stages, torch.device("cpu"), group=mesh["pp"].get_group()
                )
            )
        extra = {"defer_reduce_grad_wait": True} if variant == "deferred" else {}
        sched = SCHEDULES[schedule](
            stages if schedule == "interleaved" else stages[0],
            n_microbatches=NUM_MICRO,
            loss_fn=lambda y, t: (y - t).pow(2).mean(),
            **extra,
        )
        calls = 2 if variant == "accumulate" else 1
        params = [p for model in models for p in model.parameters()]
        opt = torch.optim.SGD(params, lr=0.5)
        gen = torch.Generator().manual_seed(1)
        for _ in range(NUM_STEPS):
            # The global batch on every rank; each dp rank takes its half.
            batches = torch.randn(calls, 2, 2, NUM_MICRO * MICRO_BATCH, DIM, generator=gen)
            losses: list[torch.Tensor] = []
            with CollectiveCounter() as counter, record_collectives() as records:
                for call, (x, y) in enumerate(batches[:, :, dp]):
                    last = {"finalize_gradients": False} if call < calls - 1 else {}
                    if pp == 0:
                        sched.step(x, **last)
                    else:
                        sched.step(target=y, losses=losses, **last)
            out["losses"].append([loss.item() for loss in losses])
            out["counts"].append(dict(counter.counts))
            out["reduce_scatters"].append(
                sorted(r.label for r in records if r.kind == "reduce_scatter")
            )
            # Every group resharded once the step is done (the stage's post_backward).
            out["sharded"].append(all(isinstance(p, DTensor) for p in params))
            out["grads"].append([p.grad.full_tensor() for p in params])
            opt.step()
            opt.zero_grad()
        out["params"] = [p.full_tensor() for p in params]
        out["fsdp2"] = all(isinstance(model, fsdp2.FSDPModule) for model in models)
    dist.barrier()
    return out


@pytest.mark.parametrize(
    ("schedule", "variant"), CASES, ids=[f"{s}-{v}" if v else s for s, v in CASES]
)
def test_pipelining_trains_as_torch(schedule: str, variant: str | None) -> None:
    if variant is not None and not RULES.stage_finalizes_backward:
        pytest.skip(f"{variant}: a schedule option of torch 2.15's pipelining")
    ways = WAYS if IMPL_UNDER_TEST == "fsdp2" else ("torch",)
    runs = {way: run_on_ranks(4, _train, way, schedule, variant, timeout=120) for way in ways}
    reference = runs["torch"]
    groups = sorted(GROUPS * (2 if schedule == "interleaved" else 1))  # of this rank's stages
    for rank, ref in enumerate(reference):
        # torch's own path: gradient sync deferred to one reduce-scatter per group and step.
        reduce_scatters = [c.get("reducescatter", 0) for c in ref["counts"]]
        assert reduce_scatters == [len(groups)] * NUM_STEPS, ref["counts"]
        assert len(ref["losses"][-1]) == (NUM_MICRO if rank >= 2 else 0)  # the last call's
    for way in ways[1:]:
        for rank, (got, ref) in enumerate(zip(runs[way], reference, strict=True)):
            where = f"{way}, {schedule}, rank {rank}"
            assert got["fsdp2"], f"{where}: the model was not sharded by fsdp2"
            # Same collectives, step by step (step 1 includes the stage's shape inference).
            assert got["counts"] == ref["counts"], where
            assert got["reduce_scatters"] == [groups] * NUM_STEPS, where
            # Bitwise: both sides run the same kernels on the same values in the same process;
            # the one other operation, the mean of 2 dp ranks' gradient sums, is exact in
            # either order (a sum of two floats, halved). Microbatch gradients are summed
            # unreduced in autograd's order on both sides, then reduced once.
            assert got["sharded"] == ref["sharded"] == [True] * NUM_STEPS, where
            assert got["losses"] == ref["losses"], where
            for step, (g, r) in enumerate(zip(got["grads"], ref["grads"], strict=True)):
                for a, b in zip(g, r, strict=True):
                    torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"{where}, step {step}")
            for a, b in zip(got["params"], ref["params"], strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0, msg=where)


def _view_surface() -> dict[str, Any]:
    """On one rank: what torch's stage sees of an fsdp2 module without the patch."""
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    model = Stage()
    for block in model.blocks:
        fsdp2.fully_shard(block)
    fsdp2.fully_shard(model)
    view = torch_fully_shard.state(model)
    report: dict[str, Any] = {
        "isinstance": isinstance(model, TorchFSDPModule),
        "same_view": view is fsdp2.fully_shard.state(model),
        "fsdp2_methods": type(model).set_requires_gradient_sync
        is fsdp2.FSDPModule.set_requires_gradient_sync,
        "apply_is_fsdp2s": type(model)._apply is fsdp2.FSDPModule._apply,
        "num_states": len(view._state_ctx.all_states),
        "groups": [len(s._fsdp_param_groups) for s in view._state_ctx.all_states],
        "plain_module": torch_fully_shard.state(nn.Linear(2, 2)) is None,
    }
    try:
        _ = view._fsdp_param_group  # torch's name for one group: not among the supported ones
    except AttributeError as e:
        report["error"] = str(e)
    return report


@pytest.mark.usefixtures("fsdp2_only")
def test_torch_sees_fsdp2_modules() -> None:
    report = run_on_ranks(1, _view_surface)[0]
    error = report.pop("error")
    assert report == {
        "isinstance": True,
        "same_view": True,
        "fsdp2_methods": True,
        "apply_is_fsdp2s": True,
        "num_states": 3,
        "groups": [1, 1, 1],
        "plain_module": True,
    }
    expecttest.assert_expected_inline(
        error,
        """TorchStateView has no attribute '_fsdp_param_group': fsdp2's fully_shard.state(module) provides only the torch-internal names torch.distributed.pipelining uses (_state_ctx.all_states, _fsdp_param_groups[i].post_backward(), _root_post_backward_final_callback()); use FSDPModule's public methods for anything else""",
    )


def _patch_and_unpatch() -> list[str]:
    import torch.distributed.fsdp as public
    import torch.distributed.pipelining.stage as stage_module

    # The names the stage imported from torch's FSDP2: fully_shard up to 2.14, only the classes
    # from 2.15 (which drives FSDP through FSDPModule's methods).
    names = [
        n
        for n in ("fully_shard", "FSDPModule", "GradientReductionHandle")
        if hasattr(stage_module, n)
    ]

    def seen() -> list[object]:
        return [public.fully_shard] + [getattr(stage_module, n) for n in names]

    before = seen()
    fsdp2.patch_torch_fsdp()
    patched = [n for n in names if getattr(stage_module, n) is not getattr(fsdp2, n)]
    unpatch_torch_fsdp()
    after = seen()
    return (
        [] if not patched and after == before else [f"unpatched: {patched}", f"{after} != {before}"]
    )


@pytest.mark.usefixtures("fsdp2_only")
def test_unpatch_restores_torch() -> None:
    assert run_on_ranks(1, _patch_and_unpatch) == [[]]
