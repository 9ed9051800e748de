"""Parameters on their own mesh: ``shard_placement_fn`` returning another mesh makes a group of
its own (e.g. MoE expert weights over an expert-data-parallel mesh).

Each trains next to an unsharded reference, compared after every backward and at the end as the
parity framework compares (`tests.parity.compare_grads`, `compare_params`, at
``tests.tolerance.FP32``), with the suite's AdamW (`tests.parity.adamw`): its eps of 1e-3 is what
``PARAM_ATOL`` is derived for (torch's default 1e-8 would turn a gradient's rounding near 0 into
a step of lr either way)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn

from tests.harness import run_on_ranks
from tests.parity import adamw, compare_grads, compare_params

WORLD = 4
STEPS = 3


def _experts_on_hsdp_mesh() -> dict[str, object]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
    from torch.distributed.tensor import Replicate, Shard

    import fsdp2
    from fsdp2.engine.collectives import record_collectives

    rank = dist.get_rank()
    flat = init_device_mesh("cpu", (WORLD,))
    hsdp = init_device_mesh("cpu", (2, WORLD // 2), mesh_dim_names=("rep", "shard"))
    torch.manual_seed(0)
    reference = nn.Sequential(
        *[nn.Sequential(nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 8)) for _ in range(2)]
    )
    model = copy.deepcopy(reference)
    expert = ShardPlacementResult(Shard(0), FSDPMeshInfo(hsdp, shard_mesh_dim=1))

    def placement(param: nn.Parameter) -> object:
        # The second Linear of each block plays the expert: its weight shards over `shard` only.
        return expert if param.shape == (8, 6) else None

    for block in model:
        fsdp2.fully_shard(block, mesh=flat, shard_placement_fn=placement)
    fsdp2.fully_shard(model, mesh=flat)
    ref_opt, opt = adamw(reference.parameters()), adamw(model.parameters())
    for step in range(STEPS):
        x = torch.randn(WORLD * 2, 8, generator=torch.Generator().manual_seed(step))
        reference(x).pow(2).mean().backward()
        with record_collectives() as records:
            model(x[rank * 2 : (rank + 1) * 2]).pow(2).mean().backward()
        assert compare_grads(model, reference, f"step {step}") == 8
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
    compare_params(model, reference, "after training")
    weight = model[0][2].weight
    assert weight.placements == (Replicate(), Shard(0)), weight.placements
    assert model[0][0].weight.placements == (Shard(0),)
    return {
        kind: sorted((r.label, r.world_size) for r in records if r.kind == kind)
        for kind in ("all_gather", "reduce_scatter", "all_reduce")
    }


def _experts_with_rank0_always_done() -> dict[str, object]:
    """Rank 0 sees every collective as done the moment it is issued (a fast rank), the others
    never before they wait: a rank finishing its HSDP reduce-scatters early would issue their
    all-reduce over replicas while its peer waits in a gather, and both would hang."""
    import os

    from fsdp2.engine.collectives import Pending

    # The pool's processes run later tests too: put both back.
    saved_timeout, saved_done = os.environ.get("FSDP2_COLLECTIVE_TIMEOUT"), Pending.done
    os.environ["FSDP2_COLLECTIVE_TIMEOUT"] = "10"  # a regression ends in the hang report
    if dist.get_rank() == 0:
        Pending.done = lambda self: True  # type: ignore[method-assign]
    try:
        return _experts_on_hsdp_mesh()
    finally:
        Pending.done = saved_done  # type: ignore[method-assign]
        if saved_timeout is None:
            os.environ.pop("FSDP2_COLLECTIVE_TIMEOUT", None)
        else:
            os.environ["FSDP2_COLLECTIVE_TIMEOUT"] = saved_timeout


def test_collectives_finished_early_only_where_that_issues_none() -> None:
    """``IterContext.reap`` finishes a reduce-scatter as soon as it is done, which depends on
    each rank's timing; finishing an HSDP one all-reduces over replicas: never early."""
    counts = run_on_ranks(WORLD, _experts_with_rank0_always_done)[0]
    assert counts["all_reduce"] == [("0", 2), ("1", 2)], counts


def test_expert_parameters_form_a_group_on_their_own_mesh() -> None:
    counts = run_on_ranks(WORLD, _experts_on_hsdp_mesh)[0]
    # Each block: one gather per mesh in forward and again in backward; the expert group reduces
    # over its shard axis (2 ranks) and all-reduces over its replicas, the rest over all 4.
    assert counts["all_gather"] == sorted([("0", 4), ("0", 2), ("1", 4), ("1", 2)] * 2), counts
    assert counts["reduce_scatter"] == sorted([("0", 4), ("0", 2), ("1", 4), ("1", 2)]), counts
    assert counts["all_reduce"] == [("0", 2), ("1", 2)], counts


NUM_EXPERTS, WIDTH, LOCAL_BATCH = 4, 4, 2


class MoE(nn.Module):
    """A dense layer, then every expert on every token (summed). Expert parallel: the experts
    are split over the ``ep`` ranks, whose tokens DTensor exchanges (``Shard(0)`` over ep)."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(WIDTH, WIDTH)
        self.experts = nn.Parameter(torch.randn(NUM_EXPERTS, WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Shard

        h = torch.tanh(self.dense(x))
        experts = self.experts
        if isinstance(experts, DTensor):  # this rank's tokens, within its ep group's batch
            y = torch.einsum(
                "bd,edf->bf", DTensor.from_local(h, experts.device_mesh, [Shard(0)]), experts
            )
            y = y.redistribute(placements=[Shard(0)]).to_local()
        else:
            y = torch.einsum("bd,edf->bf", h, experts)
        return y.pow(2).mean()


def _experts_on_unflattened_meshes() -> str:
    """torchtitan's MoE layout: every mesh a view unflattened from one 1-D world mesh; the
    expert weight a ``Shard(0)`` DTensor over ``ep`` placed (shard_placement_fn) on ``efsdp``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
    from torch.distributed.tensor import Shard, distribute_tensor

    from tests.harness import fsdp_api

    rank = dist.get_rank()
    world = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("world",))
    dp = world._unflatten(0, (WORLD,), ("fsdp",))["fsdp"]
    sparse = dp._unflatten(0, (WORLD // 2, 2), ("efsdp", "ep"))
    torch.manual_seed(0)
    reference = MoE()
    models = {}
    infos = {m: FSDPMeshInfo(mesh=m, shard_mesh_dim=0) for m in (sparse["efsdp"], dp)}
    for impl in ("fsdp2", "torch"):
        model = copy.deepcopy(reference)
        experts = distribute_tensor(model.experts.detach(), sparse["ep"], [Shard(0)])
        model.experts = nn.Parameter(experts)

        def place(p: nn.Parameter, model: MoE = model) -> object:
            mesh = sparse["efsdp"] if p is model.experts else dp
            return ShardPlacementResult(placement=Shard(0), mesh_info=infos[mesh])

        fsdp_api(impl).fully_shard(model, mesh=dp, shard_placement_fn=place)
        models[impl] = model
    model, theirs = models["fsdp2"], models["torch"]
    for (name, p), q in zip(model.named_parameters(), theirs.parameters(), strict=True):
        assert p.placements == q.placements, (name, p.placements, q.placements)
        assert p.device_mesh == q.device_mesh, (name, p.device_mesh, q.device_mesh)
        torch.testing.assert_close(p.to_local(), q.to_local(), rtol=0, atol=0, msg=name)
    # Experts reduce over efsdp only; their ep peers' tokens already summed into their
    # gradient: dividing by the whole dp size makes both kinds the global batch's mean.
    model.set_gradient_divide_factor(float(WORLD))
    ref_opt, opt = adamw(reference.parameters()), adamw(model.parameters())
    for step in range(STEPS):
        x = torch.randn(WORLD * LOCAL_BATCH, WIDTH, generator=torch.Generator().manual_seed(step))
        reference(x).backward()
        model(x[rank * LOCAL_BATCH : (rank + 1) * LOCAL_BATCH]).backward()
        assert compare_grads(model, reference, f"step {step}") == 3
        for optimizer in (ref_opt, opt):
            optimizer.step()
            optimizer.zero_grad()
    compare_params(model, reference, "after training")
    return str((model.experts.device_mesh.mesh_dim_names, model.experts.placements))


def test_expert_parallel_parameters_on_unflattened_meshes() -> None:
    """Parity with the single process, and the same layout as torch's fully_shard."""
    layout = run_on_ranks(WORLD, _experts_on_unflattened_meshes)[0]
    assert layout == "(('efsdp', 'ep'), (_StridedShard(dim=0, sf=2), Shard(dim=0)))", layout
