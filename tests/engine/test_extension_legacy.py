"""All-gather extensions as torchao writes them (float8 training weights, QLoRA's NF4): the older
one-argument ``fsdp_pre_all_gather(mesh)``, on a wrapper subclass that implements only the ops
torchao's NF4 implements for sharding. No torchao needed: ``NarrowWeight`` stands in for it
(tests/integration/test_torchao.py runs the real ones)."""

from __future__ import annotations

from typing import Any

import expecttest
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from tests.harness import run_on_ranks
from tests.tolerance import PARAM_ATOL, assert_fp32_close
from tests.wrapper_tensor import WrapperTensor

aten = torch.ops.aten
STEPS = 3


class NarrowWeight(WrapperTensor):
    """A wrapper subclass over ``_data`` gathered as bf16 through the one-argument pre hook, and
    as narrow as torchao's NF4 (<= 0.13): ``aten.slice`` only of the whole tensor, ``view`` only
    flat (``view(-1)``; not ``DTensor.from_local``'s ``view_as``), no ``_to_copy``
    (``.to(copy=True)``)."""

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is aten._to_copy.default or (func is aten.view.default and args[1] != [-1]):
            raise NotImplementedError(f"{func}(NarrowWeight) with {args[1:]}")
        if func is aten.slice.Tensor:
            dim, start, end = (*args[1:4], 0, 0, None)[:3] if len(args) < 4 else args[1:4]
            if start or (end is not None and end < args[0].shape[dim]):
                raise NotImplementedError(f"aten.slice(NarrowWeight) with {args[1:]}")
        return super().__torch_dispatch__(func, types, args, kwargs)

    def fsdp_pre_all_gather(self, mesh: Any) -> tuple[tuple[torch.Tensor], None]:
        mesh.get_group()  # as NF4's hook does: torch hands it the 1-D mesh of the shard dim
        return (self._data.to(torch.bfloat16),), None

    def fsdp_post_all_gather(
        self,
        outputs: tuple[torch.Tensor, ...],
        metadata: None,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor]] | None:
        full = outputs[0].to(param_dtype)
        if out is not None:
            with torch.no_grad():
                out.copy_(full)
            return None
        return full, (full,)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    for layer in (model[0], model[2]):
        layer.weight = nn.Parameter(NarrowWeight(layer.weight.detach().clone()))
    return model


def _data(t: torch.Tensor) -> torch.Tensor:
    return (t._data if isinstance(t, NarrowWeight) else t).detach().clone()


def _train(impl: str, hsdp: bool) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from tests.harness import fsdp_api

    api = fsdp_api(impl)
    rank, world = dist.get_rank(), dist.get_world_size()
    shape = (2, world // 2) if hsdp else (world,)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")[-len(shape) :])
    model = _model()
    api.fully_shard(model[0], mesh=mesh)
    api.fully_shard(model, mesh=mesh)
    # (_local_tensor: to_local() is a view_as, which NarrowWeight refuses, as NF4 <= 0.13 does)
    shards = [type(p._local_tensor).__name__ for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], []
    for step in range(STEPS):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step * world + rank))
        loss = model(x).pow(2).mean()
        loss.backward()
        losses.append(loss.detach().clone())
        grads.append([p.grad.to_local().clone() for p in model.parameters()])
        optimizer.step()
        optimizer.zero_grad()
    params = [_data(p._local_tensor) for p in model.parameters()]
    return {"losses": losses, "grads": grads, "params": params, "shards": shards}


@pytest.mark.parametrize(("world", "hsdp"), [(2, False), (4, False), (4, True)])
def test_mesh_only_pre_hook_on_a_narrow_subclass_matches_torch(world: int, hsdp: bool) -> None:
    ours = run_on_ranks(world, _train, "fsdp2", hsdp)
    theirs = run_on_ranks(world, _train, "torch", hsdp)
    for rank, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        # The shards stay the user's subclass, cut into this rank's rows.
        assert a["shards"] == b["shards"] == ["NarrowWeight", "Tensor"] * 2, (rank, a, b)
        assert_fp32_close(a["losses"], b["losses"], msg=f"rank {rank}")
        assert_fp32_close(a["grads"], b["grads"], msg=f"rank {rank}")
        assert_fp32_close(a["params"], b["params"], atol=PARAM_ATOL, msg=f"rank {rank}")


class ThreeArgumentHook(NarrowWeight):
    def fsdp_pre_all_gather(  # type: ignore[override]
        self, mesh: Any, outer_size: Any, module: Any
    ) -> tuple[tuple[torch.Tensor], None]:
        return (self._data,), None


def _three_argument_hook() -> str:
    import fsdp2
    from tests.errors import raised

    model = nn.Linear(4, 4)
    model.weight = nn.Parameter(ThreeArgumentHook(model.weight.detach()))
    return raised(lambda: fsdp2.fully_shard(model))


class TestSignature(expecttest.TestCase):
    def test_pre_hook_of_neither_form_is_refused_at_fully_shard_on_every_rank(self) -> None:
        messages = run_on_ranks(2, _three_argument_hook)
        self.assertEqual(messages[0], messages[1])
        self.assertExpectedInline(
            messages[0],
            """TypeError: ThreeArgumentHook.fsdp_pre_all_gather(mesh, outer_size, module) takes 3 arguments after self; the all-gather extension calls it as fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy), or in its older form fsdp_pre_all_gather(mesh). Define one of the two""",
        )
