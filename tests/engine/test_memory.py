"""What is allocated and registered when: fsdp2 frees unsharded parameters as promised.

fsdp2-only: reads fsdp2 internals (`FSDPState.group`, `FSDPParamGroup.state`,
`FlatLayout.unsharded_nbytes()`, `FSDPParam.sharded_param`); torch's names differ.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from tests.models import MODELS, build_model, make_batch
from tests.parity import MODEL_SEED, batch_seed, padded_shard_numel, plan_groups

pytestmark = pytest.mark.usefixtures("fsdp2_only")


def _group(module: nn.Module) -> Any:
    return module._get_fsdp_state().group  # type: ignore[operator]


def _snapshot(module: nn.Module, registered: list[torch.Tensor]) -> dict[str, Any]:
    """``module``'s group now; ``registered``: what its modules hold under the parameter names."""
    group = _group(module)
    return {
        "state": group.state.name,
        "unsharded_nbytes": group.layout.unsharded_nbytes(),
        "all_dtensor": all(isinstance(p, DTensor) for p in registered),
        "none_dtensor": not any(isinstance(p, DTensor) for p in registered),
        # Registered objects are exactly the sharded parameters the optimizer holds.
        "registered_are_sharded": {id(p) for p in registered}
        == {id(fp.sharded_param) for fp in group.fsdp_params},
    }


def _groups(model: nn.Module) -> list[Any]:
    found: dict[int, Any] = {}
    for module in model.modules():
        if hasattr(module, "_get_fsdp_state") and _group(module) is not None:
            found.setdefault(id(_group(module)), _group(module))
    return list(found.values())


def _snapshots(model: nn.Module, blocks: list[nn.Module]) -> dict[str, Any]:
    return {
        "blocks": [_snapshot(b, list(b.parameters())) for b in blocks],
        "root": _snapshot(model, list(model.head.parameters())),  # the root group: the head
    }


def _lifecycle(world_size_check: int) -> dict[str, Any]:
    """MLPStack: blocks reshard after forward, the root keeps its parameters (False)."""
    from fsdp2 import fully_shard

    if dist.get_world_size() != world_size_check:
        raise AssertionError("wrong pool")
    model = build_model("mlp", MODEL_SEED)
    blocks = list(model.blocks)
    for block in blocks:
        fully_shard(block, reshard_after_forward=True)
    fully_shard(model, reshard_after_forward=False)
    out: dict[str, Any] = {"during": [], "saved_storage_after_forward": []}
    saved: list[torch.Tensor] = []

    def inside_block(index: int) -> Any:
        def hook(linear: nn.Module, args: Any) -> None:
            # Inside block `index`: its weight is the full plain tensor autograd will save.
            saved.append(linear.weight)
            out["during"].append(
                {
                    "index": index,
                    "weight_is_dtensor": isinstance(linear.weight, DTensor),
                    "weight_shape": tuple(linear.weight.shape),
                    "states": [_group(b).state.name for b in blocks],
                    "root_state": _group(model).state.name,
                    "unsharded_nbytes": _group(blocks[index]).layout.unsharded_nbytes(),
                }
            )

        return hook

    for i, block in enumerate(blocks):
        block[0].register_forward_pre_hook(inside_block(i))
    loss = model(*make_batch("mlp", batch_seed(0, dist.get_rank()), 4))
    out["after_forward"] = _snapshots(model, blocks)
    out["root_registered_shapes"] = [tuple(p.shape) for p in model.head.parameters()]
    # Freed means the storage autograd's saved tensors point to is gone, not merely unreferenced.
    out["saved_storage_after_forward"] = [t.untyped_storage().nbytes() for t in saved]
    root_params = list(MODELS["mlp"].build().head.parameters())
    out["root_full_nbytes"] = sum(p.numel() * 4 for p in root_params)
    out["root_padded_nbytes"] = (
        sum(padded_shard_numel(p.shape, dist.get_world_size()) for p in root_params)
        * dist.get_world_size()
        * 4
    )
    loss.backward()
    out["after_backward"] = _snapshots(model, blocks)
    out["weight_shape"] = tuple(blocks[1][0].weight.shape)
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_parameters_through_forward_and_backward(world_size: int) -> None:
    from tests.harness import run_on_ranks

    for rank, r in enumerate(run_on_ranks(world_size, _lifecycle, world_size)):
        where = f"rank {rank}"
        # Inside each block's forward: that block is gathered, earlier blocks are freed again.
        for seen in r["during"]:
            i = seen["index"]
            assert not seen["weight_is_dtensor"], where
            assert seen["unsharded_nbytes"] > 0, where
            assert seen["states"][i] == "UNSHARDED", where
            assert seen["states"][:i] == ["SHARDED"] * i, f"{where}: earlier blocks not freed"
            assert seen["root_state"] == "UNSHARDED", where
        assert [s["index"] for s in r["during"]] == [0, 1, 2]
        assert r["during"][1]["weight_shape"] == (16, 16)  # full, not this rank's chunk

        blocks_after_forward = r["after_forward"]["blocks"]
        for snap in blocks_after_forward:  # reshard_after_forward=True
            assert snap["state"] == "SHARDED", where
            assert snap["unsharded_nbytes"] == 0, where
            assert snap["all_dtensor"] and snap["registered_are_sharded"], where
        assert r["saved_storage_after_forward"] == [0, 0, 0], f"{where}: storage not freed"

        root = r["after_forward"]["root"]  # reshard_after_forward=False
        assert root["state"] == "UNSHARDED", where
        assert root["none_dtensor"], f"{where}: root should register plain unsharded tensors"
        assert r["root_full_nbytes"] <= root["unsharded_nbytes"] <= r["root_padded_nbytes"]
        assert r["root_registered_shapes"] == [(4, 16), (4,)], where

        after_backward = [*r["after_backward"]["blocks"], r["after_backward"]["root"]]
        for snap in after_backward:
            assert snap["state"] == "SHARDED", where
            assert snap["unsharded_nbytes"] == 0, where
            assert snap["all_dtensor"] and snap["registered_are_sharded"], where
        assert r["weight_shape"] == (16, 16)  # the DTensor's global shape


def _sharded_numels(name: str) -> dict[str, Any]:
    from fsdp2 import fully_shard

    model = build_model(name, MODEL_SEED)
    groups = plan_groups(model, name)
    world_size = dist.get_world_size()
    padded = sum(padded_shard_numel(p.shape, world_size) for g in groups for p in g.params.values())
    for group in groups[:-1]:
        fully_shard(group.module)
    fully_shard(model)
    return {
        "total": sum(p.numel() for p in build_model(name, MODEL_SEED).parameters()),
        "local": sum(p.to_local().numel() for p in model.parameters()),  # type: ignore[attr-defined]
        "padded": padded,
        # Every shard element fsdp2 allocates, padding included (one flat buffer per group).
        "allocated": sum(g.layout.shard_numel for g in _groups(model)),
    }


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("model", ["gpt", "odd_shapes_scalar"])
def test_sharded_storage_is_one_over_world_size(model: str, world_size: int) -> None:
    from tests.harness import run_on_ranks

    results = run_on_ranks(world_size, _sharded_numels, model)
    total = results[0]["total"]
    # No element lost or duplicated; a 0-d parameter is replicated, so every rank holds it.
    scalars = 1 if MODELS[model].has_scalar_param else 0
    assert sum(r["local"] for r in results) == total + scalars * (world_size - 1)
    for rank, r in enumerate(results):
        assert r["local"] <= r["padded"], f"rank {rank}"
        assert r["allocated"] == r["padded"], f"rank {rank}: one padded shard per rank, no more"
    if model == "gpt":  # every dim 0 divides by 2 and 4: exactly 1/W, no padding
        assert [r["allocated"] for r in results] == [total // world_size] * world_size


def _at_reduce_scatter() -> list[dict[str, Any]]:
    """What each group still holds at the moment its reduce-scatter is issued."""
    from fsdp2 import fully_shard
    from fsdp2.engine.collectives import all_gather, reduce_scatter

    model = build_model("mlp", MODEL_SEED)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    seen: list[dict[str, Any]] = []
    gathered: list[torch.Tensor] = []
    coalesced: list[bool] = []

    def spy_reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: Any, label: str, *a: Any):  # type: ignore[no-untyped-def]
        groups = {g.label: g for g in _groups(model)}  # labels are FQNs from lazy init
        # A coalesced bucket ("a+b", the root as "<root>") names each member (4 groups: no elision).
        names = [n if n != "<root>" else "" for n in label.split("+")] if "+" in label else [label]
        coalesced.append(len(names) > 1)
        for name in names:
            g = groups[name]
            seen.append(
                {
                    "label": name,
                    "unsharded_nbytes": g.layout.unsharded_nbytes(),
                    "grads_left": sum(p.unsharded_param.grad is not None for p in g.fsdp_params),
                }
            )
        return reduce_scatter(out, inp, group, label, *a)

    def spy_all_gather(out: torch.Tensor, *a: Any, **k: Any):  # type: ignore[no-untyped-def]
        gathered.append(out)
        return all_gather(out, *a, **k)

    # Each group's own collective seam (FSDPParamGroup.all_gather, GradientReducer.reduce_scatter),
    # and the coalesced gathers' (engine/coalesce.py): their shared outputs must go too; and the
    # coalesced reduce-scatters' (engine/coalesce_reduce.py): every member freed before it.
    from fsdp2.engine import coalesce, coalesce_reduce

    for g in _groups(model):
        g.all_gather = spy_all_gather
        g.reducer.reduce_scatter = spy_reduce_scatter
    coalesce.all_gather = spy_all_gather  # type: ignore[assignment]
    coalesce_reduce.reduce_scatter = spy_reduce_scatter  # type: ignore[assignment]
    try:
        model(*make_batch("mlp", batch_seed(0, dist.get_rank()), 4)).backward()
    finally:
        coalesce.all_gather = all_gather  # type: ignore[assignment]
        coalesce_reduce.reduce_scatter = reduce_scatter  # type: ignore[assignment]
    # Our gather outputs are freed once copied out, whoever else still references them.
    left = sum(t.untyped_storage().nbytes() for t in gathered)
    seen.append(
        {"gathers": len(gathered) > 0, "gather_outputs_left": left, "rs_coalesced": any(coalesced)}
    )
    return seen


def test_reduce_scatter_issued_after_parameters_and_gradients_are_freed() -> None:
    """Backward frees a group's unsharded parameters and gradients before its reduce-scatter
    allocates its buffers (gloo clones the input), so they never coexist with them."""
    from fsdp2.engine.coalesce import coalesce_bytes
    from tests.harness import run_on_ranks

    for rank, seen in enumerate(run_on_ranks(2, _at_reduce_scatter)):
        *issued, tail = seen
        assert sorted(s["label"] for s in issued) == ["", "blocks.0", "blocks.1", "blocks.2"]
        for s in issued:
            assert s["unsharded_nbytes"] == 0, f"rank {rank}: {s}"
            assert s["grads_left"] == 0, f"rank {rank}: {s}"
        # Coalescing on (the default): the small groups' reduce-scatters went as one bucket.
        coalescing = coalesce_bytes() > 0
        assert tail == {"gathers": True, "gather_outputs_left": 0, "rs_coalesced": coalescing}, (
            f"rank {rank}: {tail}"
        )
