"""One ``fully_shard`` group holding parameters of several dtypes: LoRA/QLoRA (a frozen bf16, fp8 or
int8 base weight beside fp32 adapters) and two trainable dtypes.

The group's buffers are bytes (see [Note: mixed dtypes] in fsdp2/engine/layout.py): still one
all-gather per group, and one reduce-scatter, in the widest trainable reduce dtype. The frozen
weights are upcast exactly (``.float()``) in forward, so both models do fp32 arithmetic on the same
values and agree to fp32 summation order; a gather that misplaces a byte corrupts a weight.
"""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from fsdp2 import CPUOffloadPolicy, MixedPrecisionPolicy
from tests.harness import fsdp_api, per_group_collectives, run_on_ranks
from tests.parity import close, count, full, train_side_by_side
from tests.tolerance import BF16_TOL, FP32, Tolerance

SEED = 4321
DIM, RANK = 7, 3  # 7 rows over 2 ranks: uneven chunks, odd byte sizes to align
FP8 = torch.float8_e4m3fn


class LoRALinear(nn.Module):
    """A frozen ``base_dtype`` weight (and bias) plus trainable fp32 low-rank adapters."""

    def __init__(self, base_dtype: torch.dtype) -> None:
        super().__init__()
        weight = torch.randn(DIM, DIM) / DIM**0.5
        if not base_dtype.is_floating_point:  # int8 "quantized": small integers, scaled below
            weight = (weight * 8).round()
        self.scale = 1 / 8 if not base_dtype.is_floating_point else 1.0
        self.weight = nn.Parameter(weight.to(base_dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.randn(DIM).to(torch.bfloat16), requires_grad=False)
        self.lora_a = nn.Parameter(torch.randn(RANK, DIM) * 0.3)
        self.lora_b = nn.Parameter(torch.randn(DIM, RANK) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = self.lora_a.dtype  # fp32, or mixed precision's param_dtype: exact upcasts
        x = x.to(dtype)
        base = F.linear(x, self.weight.to(dtype) * self.scale, self.bias.to(dtype))
        return torch.tanh(base + x @ self.lora_a.t() @ self.lora_b.t())


class TwoTrainable(nn.Module):
    """An fp32 linear layer and a trainable ``other``-dtype projection in one module."""

    def __init__(self, other: torch.dtype) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.proj = nn.Parameter((torch.randn(DIM, DIM) / DIM**0.5).to(other))
        self.gain = nn.Parameter(torch.ones(DIM, dtype=other))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(x)).to(self.proj.dtype)
        return ((h @ self.proj) * self.gain).float()


class Net(nn.Module):
    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.frozen_norm = nn.Parameter(torch.rand(DIM).to(torch.bfloat16), requires_grad=False)
        self.head = nn.Linear(DIM, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        # Under bf16 mixed precision the cast is a no-op: autograd saves the root's unsharded
        # frozen parameter itself and reads it after the head's gradients are in, to compute
        # the blocks' output gradient (see backward_done.py: the root's call is held).
        norm = self.frozen_norm.to(x.dtype)
        return F.mse_loss(self.head(x * norm).float(), y.float())


def build(kind: str) -> Net:
    torch.manual_seed(SEED)
    if kind == "lora":
        return Net([LoRALinear(dtype) for dtype in (torch.bfloat16, FP8, torch.int8)])
    other = {"fp64": torch.float64, "bf16": torch.bfloat16}[kind]
    return Net([TwoTrainable(other), TwoTrainable(other)])


def make_batch(gen: torch.Generator, batch_size: int) -> tuple[torch.Tensor, ...]:
    return torch.randn(batch_size, DIM, generator=gen), torch.randn(batch_size, 2, generator=gen)


def shard(model: Net, impl: str = "fsdp2", **kwargs: Any) -> None:
    for block in model.blocks:
        fsdp_api(impl).fully_shard(block, **kwargs)
    fsdp_api(impl).fully_shard(model, **kwargs)


# ---------------------------------------------------------------------------------------------
# Parity: N steps vs a single process, one all-gather and one reduce-scatter per group
# ---------------------------------------------------------------------------------------------

TOLERANCES: dict[str, Tolerance] = {"lora": FP32, "fp64": FP32, "bf16": BF16_TOL}


@per_group_collectives  # counts each group's own gathers
def _parity(kind: str, offload: bool, no_sync: bool = False) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model, ref = build(kind), build(kind)
    shard(model, **({"offload_policy": CPUOffloadPolicy()} if offload else {}))
    for p in model.parameters():
        assert isinstance(p, DTensor) and p.to_local().is_contiguous()
    assert {p.dtype for p in model.parameters()} == {p.dtype for p in ref.parameters()}

    def sync_last_micro(step: int, micro: int) -> None:  # accumulate unreduced, then reduce
        model.set_requires_gradient_sync(micro == 1)  # type: ignore[operator]

    result = train_side_by_side(
        model,
        ref,
        make_batch,
        dp_rank=rank,
        dp_size=world,
        num_steps=3,
        tol=TOLERANCES[kind],
        num_micro=2 if no_sync else 1,
        before_micro=sync_last_micro if no_sync else None,
    )
    labels = ["blocks.0", "blocks.1", "blocks.2"][: len(model.blocks)]
    for records in result.records:
        # Forward gathers every group once, backward the resharded blocks again; one
        # reduce-scatter per group even where its gradients have two dtypes.
        if no_sync:
            assert count(records, "reduce_scatter") == {**dict.fromkeys(labels, 1), "": 1}
            continue
        assert count(records, "all_gather") == {**dict.fromkeys(labels, 2), "": 1}
        assert count(records, "reduce_scatter") == {**dict.fromkeys(labels, 1), "": 1}
    return result.losses


@pytest.mark.parametrize(
    ("kind", "offload"), [("lora", False), ("lora", True), ("fp64", False), ("bf16", False)]
)
def test_mixed_dtype_group_parity(kind: str, offload: bool) -> None:
    losses = run_on_ranks(2, _parity, kind, offload)
    assert losses[0] == losses[1] and losses[0][-1] < losses[0][0], losses


@pytest.mark.parametrize("kind", ["lora", "bf16"])
def test_mixed_dtype_group_accumulation_without_sync(kind: str) -> None:
    """Micro-steps without sync keep each unreduced gradient in the group's reduce dtype."""
    run_on_ranks(2, _parity, kind, False, True)


def _torch_parity() -> None:
    """LoRA under fsdp2 and torch's fully_shard, both with bf16 compute: the same arithmetic
    (bf16 casts of the same weights, fp32 reduction of the same two partial sums)."""
    rank = dist.get_rank()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    models = [build("lora"), build("lora")]
    for model, impl in zip(models, ("fsdp2", "torch"), strict=True):
        shard(model, impl, mp_policy=mp)
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=True) for m in models]
    for step in range(3):
        gen = torch.Generator().manual_seed(100 * step + rank)
        batch = make_batch(gen, 4)
        losses = [model(*batch) for model in models]
        for loss, optim in zip(losses, optims, strict=True):
            loss.backward()
            optim.step()
            optim.zero_grad()
        torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)
    for (name, p), tp in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
        # Equal up to where each rounds an average: AVG or SUM then divide.
        close(name, full(p), full(tp), Tolerance(rtol=1e-6, atol=1e-7))
        assert p.dtype == tp.dtype, name


def test_lora_matches_torch_fully_shard() -> None:
    run_on_ranks(2, _torch_parity)


# ---------------------------------------------------------------------------------------------
# Mixed precision per parameter, compared with torch
# ---------------------------------------------------------------------------------------------


def _dtypes_seen(impl: str, param_dtype: torch.dtype | None) -> dict[str, Any]:
    model = build("lora")
    shard(model, impl, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype))
    seen: dict[str, Any] = {}

    def record(module: nn.Module, args: Any) -> None:
        for name, p in module.named_parameters(recurse=False):
            seen[f"{id(module)}.{name}"] = str(p.dtype)

    for block in model.blocks:
        block.register_forward_pre_hook(record)
    model(*make_batch(torch.Generator().manual_seed(0), 4)).backward()
    grads = {name: str(p.grad.dtype) for name, p in model.named_parameters() if p.grad is not None}
    return {"forward": sorted(seen.values()), "grads": grads}


def _dtypes_vs_torch(param_dtype: torch.dtype | None) -> None:
    ours, theirs = (_dtypes_seen(impl, param_dtype) for impl in ("fsdp2", "torch"))
    assert ours == theirs, (ours, theirs)


@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_param_dtype_applies_per_parameter_as_torch(param_dtype: torch.dtype) -> None:
    """Floating parameters are cast (fp8 and bf16 up to fp32 included), int8 is left alone;
    gradients come back in each parameter's own dtype."""
    run_on_ranks(2, _dtypes_vs_torch, param_dtype)


# ---------------------------------------------------------------------------------------------
# state_dict, DCP, meta-device init and to_empty
# ---------------------------------------------------------------------------------------------


def _checkpoint() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    source, ref = build("lora"), build("lora")
    shard(source)
    with torch.device("meta"):
        model = build("lora")
    shard(model)
    model.to_empty(device="cpu")
    # A sharded state dict (DTensors of every dtype) loads into the materialised model...
    model.load_state_dict(source.state_dict())
    for (name, p), ref_p in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert p.dtype == ref_p.dtype and torch.equal(full(p), ref_p), name
    # ...and DCP round-trips it into a freshly sharded one.
    target = build("lora")
    for p in target.parameters():
        p.data.zero_()
    shard(target)
    path = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(path)
    dcp.save(model.state_dict(), checkpoint_id=path[0])
    state = target.state_dict()
    dcp.load(state, checkpoint_id=path[0])
    target.load_state_dict(state)
    train_side_by_side(target, ref, make_batch, dp_rank=rank, dp_size=world, num_steps=2)


def test_meta_init_state_dict_and_dcp() -> None:
    run_on_ranks(2, _checkpoint)
