"""A ``grad_dtype`` set on a parameter before ``fully_shard``: its gradients are reduced, summed
without sync and handed out in that dtype, and the setting survives ``.to()`` and
``load_state_dict(assign=True)``.

torch's ``fully_shard`` reads ``grad_dtype`` from 2.15 (earlier releases drop it: the sharded
parameter is a new object); fsdp2 follows it on every release it supports. The model here stores
and computes in bf16 with an fp32 ``grad_dtype`` on one weight, the case users report (LoRA
adapters, norms kept in fp32 gradients): each rank's bf16 gradient must be summed in fp32, not
rounded to bf16 before the sum.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp2.engine.releases import RULES
from tests.harness import fsdp_api, per_group_collectives, run_on_ranks

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
# torch's fully_shard follows grad_dtype from the release whose reduce_dtype=None follows it.
TORCH_FOLLOWS = RULES.reduce_dtype_follows_grad_dtype
IMPLS = ["fsdp2", "torch"] if TORCH_FOLLOWS else ["fsdp2"]


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 4)).to(BF16)
    model[0].weight.grad_dtype = FP32
    return model


def _batch(rank: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 + rank)).to(BF16)


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).float().pow(2).mean()


@per_group_collectives  # torch reduces each group alone; so must fsdp2 for a bitwise match
def _grads(impl: str) -> dict[str, tuple[torch.dtype, list[float]]]:
    api = fsdp_api(impl)
    model = _model()
    api.fully_shard(model[0])
    api.fully_shard(model)
    _loss(model, _batch(dist.get_rank())).backward()
    return {
        name: (p.grad.dtype, p.grad.full_tensor().float().flatten().tolist())
        for name, p in model.named_parameters()
    }


def _reference(world_size: int) -> dict[str, tuple[torch.dtype, list[float]]]:
    """What the sharded step computes, in one process: each rank's bf16 gradient (autograd
    hands it in grad_dtype: fp32 for the first weight), averaged over the ranks in the reduce
    dtype of the parameter's group (fp32 for the first layer's, which holds that weight; bf16
    for the second's, the parameters' own dtype)."""
    per_rank = []
    for rank in range(world_size):
        model = _model()
        _loss(model, _batch(rank)).backward()
        per_rank.append({n: p.grad for n, p in model.named_parameters()})
    out = {}
    for name in per_rank[0]:
        grads = [g[name] for g in per_rank]
        reduce_dtype = FP32 if name.startswith("0.") else BF16
        mean = torch.stack([g.to(reduce_dtype) for g in grads]).sum(0) / world_size
        dtype = FP32 if name == "0.weight" else BF16
        out[name] = (dtype, mean.to(dtype).float().flatten().tolist())
    return out


@pytest.mark.parametrize("impl", IMPLS)
def test_gradients_reduced_and_handed_out_in_grad_dtype(impl: str) -> None:
    """The first weight's gradient is fp32 and is the fp32 mean of the ranks' bf16 gradients
    (its group, the first layer, reduces in fp32, the promotion of fp32 and its bias's bf16);
    the rest stay bf16. The mean of two terms in fp32 differs from the reference's order by at
    most one fp32 rounding, far below bf16's 2**-9 that a bf16 reduction would cost."""
    ref = _reference(2)
    for got in run_on_ranks(2, _grads, impl):
        assert got.keys() == ref.keys()
        for name, (dtype, values) in got.items():
            assert dtype == ref[name][0], (name, dtype)
            torch.testing.assert_close(
                torch.tensor(values), torch.tensor(ref[name][1]), rtol=2**-22, atol=0, msg=name
            )


@pytest.mark.skipif(not TORCH_FOLLOWS, reason="torch's fully_shard reads grad_dtype from 2.15")
def test_bitwise_as_torch() -> None:
    """Same gradients, same casts, same reduction: bit for bit torch 2.15's."""
    ours, theirs = run_on_ranks(2, _grads, "fsdp2"), run_on_ranks(2, _grads, "torch")
    assert ours == theirs


TINY = 2.0**-9  # 1 + TINY rounds back to 1 in bf16 (8 bits), not in fp32
NUM_TINY = 3


class Probe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(4, dtype=BF16))
        self.w.grad_dtype = FP32

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        return (self.w * c).sum()


def _accumulate(impl: str) -> list[float]:
    module = Probe()
    fsdp_api(impl).fully_shard(module)
    coefficients = [1.0] + [TINY] * NUM_TINY
    for micro, c in enumerate(coefficients):
        module.set_requires_gradient_sync(micro == len(coefficients) - 1)
        module(torch.full((4,), c, dtype=BF16)).backward()
    assert module.w.grad is not None and module.w.grad.dtype == FP32
    return module.w.grad.full_tensor().tolist()


@pytest.mark.parametrize("impl", IMPLS)
def test_accumulation_without_sync_in_grad_dtype(impl: str) -> None:
    """Micro-batches without sync are summed in grad_dtype: the tiny ones survive."""
    for grad in run_on_ranks(2, _accumulate, impl):
        assert grad == [1 + NUM_TINY * TINY] * 4


def _survives() -> dict[str, Any]:
    model = _model()
    fsdp_api("fsdp2").fully_shard(model[0])
    fsdp_api("fsdp2").fully_shard(model)
    x = _batch(dist.get_rank())
    _loss(model, x).backward()
    seen: dict[str, Any] = {"after step": model[0].weight.grad.dtype}
    model.to(FP16)  # the explicit grad_dtype stays, as torch 2.15 keeps it on a plain module
    seen["to fp16"] = (model[0].weight.grad_dtype, model[0].weight.grad.dtype)
    model.zero_grad(set_to_none=True)
    _loss(model, x.to(FP16)).backward()
    seen["grad after to"] = (model[0].weight.grad.dtype, model[0].bias.grad.dtype)
    # load_state_dict(assign=True) brings new parameter objects without a grad_dtype: ours stays
    model.zero_grad(set_to_none=True)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.load_state_dict(state, assign=True)
    _loss(model, x.to(FP16)).backward()
    seen["grad after assign"] = model[0].weight.grad.dtype
    return seen


def test_grad_dtype_survives_to_and_load_state_dict_assign() -> None:
    for seen in run_on_ranks(2, _survives):
        assert seen == {
            "after step": FP32,
            "to fp16": (FP32, FP32),
            "grad after to": (FP32, FP16),
            "grad after assign": FP32,
        }


class TpScale(nn.Module):
    """A weight replicated over tp whose gradient is ``Partial`` there (each tp rank saw other
    rows of the input), like a SequenceParallel norm's."""

    def __init__(self, tp_mesh: Any) -> None:
        super().__init__()
        from torch.distributed.tensor import Replicate, distribute_tensor

        self.w = nn.Parameter(distribute_tensor(torch.ones(4), tp_mesh, [Replicate()]))

    def forward(self, x: Any) -> torch.Tensor:
        return (x * self.w).sum().to_local()


def _tp_partial_sum(impl: str) -> list[float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    api = fsdp_api(impl)
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    module = TpScale(mesh["tp"])
    mp = api.MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32)
    api.fully_shard(module, mesh=mesh["dp"], mp_policy=mp)
    # tp rank 0's rows weigh 1, tp rank 1's TINY: their bf16 partial gradients sum to 1 + TINY
    # in fp32, to 1 in bf16.
    c = 1.0 if mesh["tp"].get_local_rank() == 0 else TINY
    x = DTensor.from_local(torch.full((1, 4), c, dtype=BF16), mesh["tp"], [Shard(0)])
    module(x).backward()
    return module.w.grad.full_tensor().tolist()


@pytest.mark.parametrize("impl", ["fsdp2", "torch"])
def test_tp_partial_gradient_summed_in_reduce_dtype(impl: str) -> None:
    """The sum over tensor-parallel ranks of a ``Partial`` gradient runs in ``reduce_dtype``,
    as the reduce-scatter does (pytorch #190626), from torch 2.15 (it keeps autograd's upcast
    for such parameters); earlier releases sum in bf16. fsdp2 follows the installed torch
    (torchtitan's FSDP x TP runs are bit for bit torch's on both)."""
    expected = 1 + TINY if TORCH_FOLLOWS else 1.0
    for grad in run_on_ranks(2, _tp_partial_sum, impl):
        assert grad == [expected] * 4


def _tp_partial_recorded() -> list[tuple[str, str, int, bool]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import fsdp2

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    module = TpScale(mesh["tp"])
    fsdp2.fully_shard(module, mesh=mesh["dp"])
    x = DTensor.from_local(torch.ones(1, 4), mesh["tp"], [Shard(0)])
    with fsdp2.record_collectives() as records:
        module(x).backward()
    tp = mesh["tp"].get_group().group_name
    return [(r.kind, r.label, r.world_size, r.group == tp) for r in records]


@pytest.mark.usefixtures("fsdp2_only")
def test_tp_partial_gradient_sum_passes_the_seam() -> None:
    """The sum over tp of a ``Partial`` gradient is the seam's all-reduce (recorded, in the hang
    report), not a DTensor redistribution behind its back: at dp size 1 it is the backward's
    only collective, over the tp group, labelled with the group's modules ("" for the root)."""
    for records in run_on_ranks(2, _tp_partial_recorded):
        assert records == [("all_reduce", "", 2, True)]


class NormNet(nn.Module):
    """``nn.RMSNorm``'s backward on the CPU yields its bf16 weight's gradient in fp32."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm = nn.RMSNorm(8)
        self.proj = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x))


def _computed_dtype_grads(impl: str) -> dict[str, list[float]]:
    api = fsdp_api(impl)
    model = NormNet()
    api.fully_shard(model, mp_policy=api.MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(dist.get_rank()))
    model(x).float().pow(2).sum().backward()
    return {n: p.grad.full_tensor().tolist() for n, p in model.named_parameters()}


def test_gradient_kept_in_the_dtype_autograd_computes() -> None:
    """bf16 compute, fp32 reduce: torch 2.15 takes each gradient in the dtype its backward
    yields (the norm weight's fp32) where earlier releases round it to bf16 first
    (``RULES.unsharded_grad_as_computed``); fsdp2 matches the installed torch bit for bit
    (torchtitan's llama drifted one ulp in the gradient norm without it)."""
    assert run_on_ranks(2, _computed_dtype_grads, "fsdp2") == run_on_ranks(
        2, _computed_dtype_grads, "torch"
    )
