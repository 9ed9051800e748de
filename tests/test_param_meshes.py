"""Parameters on their own mesh: ``shard_placement_fn`` returning another mesh makes a group of
its own (e.g. MoE expert weights over an expert-data-parallel mesh)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn

from tests.harness import run_on_ranks

WORLD = 4
STEPS = 3


def _experts_on_hsdp_mesh() -> dict[str, object]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
    from torch.distributed.tensor import Replicate, Shard

    import fsdp2
    from fsdp2.collectives import record_collectives

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
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        x = torch.randn(WORLD * 2, 8, generator=torch.Generator().manual_seed(step))
        reference(x).pow(2).mean().backward()
        with record_collectives() as records:
            model(x[rank * 2 : (rank + 1) * 2]).pow(2).mean().backward()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-6)
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.full_tensor(), q, rtol=1e-5, atol=1e-6)
    weight = model[0][2].weight
    assert weight.placements == (Replicate(), Shard(0)), weight.placements
    assert model[0][0].weight.placements == (Shard(0),)
    return {
        kind: sorted((r.label, r.world_size) for r in records if r.kind == kind)
        for kind in ("all_gather", "reduce_scatter", "all_reduce")
    }


def test_expert_parameters_form_a_group_on_their_own_mesh() -> None:
    counts = run_on_ranks(WORLD, _experts_on_hsdp_mesh)[0]
    # Each block: one gather per mesh in forward and again in backward; the expert group reduces
    # over its shard axis (2 ranks) and all-reduces over its replicas, the rest over all 4.
    assert counts["all_gather"] == sorted([("0", 4), ("0", 2), ("1", 4), ("1", 2)] * 2), counts
    assert counts["reduce_scatter"] == sorted([("0", 4), ("0", 2), ("1", 4), ("1", 2)]), counts
    assert counts["all_reduce"] == [("0", 2), ("1", 2)], counts
