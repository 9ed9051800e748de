"""torch 2.15's additions to ``FSDPModule`` that fsdp2 offers on every release: manual backward
finalization (``set_manual_backward_finalization``, ``finalize_backward``,
``GradientReductionHandle``), ``set_keep_unsharded_storage`` and
``MixedPrecisionPolicy.param_dtype_override_fn``. Each trains exactly as fsdp2's automatic path,
and, where the installed torch has the same API, exactly as torch's ``fully_shard`` with the same
collectives. Pipelining's use of them: tests/engine/test_pipelining.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp2
from tests.errors import raised
from tests.harness import fsdp_api, per_group_collectives, run_on_ranks
from tests.parity import CollectiveCounter, local_batch, shard_model, twins

MICRO = 3  # micro-batches per step
STEPS = 2
# Whether the installed torch's fully_shard has these APIs to compare with (2.15+).
TORCH_HAS_FINALIZE = hasattr(fsdp_api("torch").FSDPModule, "finalize_backward")
TORCH_HAS_OVERRIDE = "param_dtype_override_fn" in getattr(
    fsdp_api("torch").MixedPrecisionPolicy, "__dataclass_fields__", {}
)


@per_group_collectives  # compared with torch's, which reduces each group alone
def _train(impl: str, mode: str) -> dict[str, Any]:
    """``MICRO`` micro-batches per step, gradient sync off but for the end: ``mode`` "auto"
    turns it on for the last backward; "sync" / "async" run every backward without it and
    finalize by hand (waiting, or through the handle)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, _ = twins("mlp")
    shard_model(model, "mlp", impl)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if mode != "auto":
        model.set_manual_backward_finalization(True)
    out: dict[str, Any] = {"losses": [], "grads": [], "counts": []}
    for step in range(STEPS):
        with CollectiveCounter() as counter:
            for micro in range(MICRO):
                model.set_requires_gradient_sync(mode == "auto" and micro == MICRO - 1)
                loss = model(*local_batch("mlp", step, micro, rank, world))
                loss.backward()
                out["losses"].append(loss.item())
            if mode != "auto":
                model.set_requires_gradient_sync(True)
                handle = model.finalize_backward(async_op=mode == "async")
                if mode == "async":
                    assert isinstance(handle, fsdp_api(impl).GradientReductionHandle)
                    handle.wait()
                else:
                    assert handle is None
        out["counts"].append(dict(counter.counts))
        out["grads"].append([p.grad.full_tensor() for p in model.parameters()])
        out["sharded"] = all(
            isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters()
        )
        opt.step()
        opt.zero_grad()
    out["params"] = [p.full_tensor() for p in model.parameters()]
    return out


def _same(got: dict[str, Any], ref: dict[str, Any], where: str) -> None:
    # Bitwise: the same kernels on the same values in the same order (micro-batch gradients
    # summed by autograd, then averaged over 2 ranks, which is exact in either order).
    assert got["losses"] == ref["losses"], where
    for g, r in zip(got["grads"] + [got["params"]], ref["grads"] + [ref["params"]], strict=True):
        for a, b in zip(g, r, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=where)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_manual_finalization_trains_as_automatic(mode: str) -> None:
    auto = run_on_ranks(2, _train, "fsdp2", "auto")
    manual = run_on_ranks(2, _train, "fsdp2", mode)
    for rank, (got, ref) in enumerate(zip(manual, auto, strict=True)):
        _same(got, ref, f"{mode}, rank {rank}")
        assert got["sharded"], "finalize_backward left parameters unsharded"
        # One reduce-scatter per group and step, whichever side ends the backward.
        assert got["counts"] == ref["counts"], f"{mode}, rank {rank}"


@pytest.mark.skipif(not TORCH_HAS_FINALIZE, reason="torch's fully_shard has no finalize_backward")
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_manual_finalization_as_torch(mode: str) -> None:
    ours = run_on_ranks(2, _train, "fsdp2", mode)
    theirs = run_on_ranks(2, _train, "torch", mode)
    for rank, (got, ref) in enumerate(zip(ours, theirs, strict=True)):
        _same(got, ref, f"{mode}, rank {rank}")
        assert got["counts"] == ref["counts"], f"{mode}, rank {rank}"


def _misuse() -> dict[str, str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model, _ = twins("mlp")
    shard_model(model, "mlp")
    batch = local_batch("mlp", 0, 0, rank, world)
    errors = {}
    model(*batch).backward()  # automatic mode
    errors["not manual"] = raised(model.finalize_backward)
    model.set_manual_backward_finalization(True)
    errors["not root"] = raised(lambda: model.blocks[0].set_manual_backward_finalization(True))
    model(*batch).backward()
    handle = model.finalize_backward(async_op=True)
    errors["forward while pending"] = raised(lambda: model(*batch))
    errors["finalize twice"] = raised(model.finalize_backward)
    handle.wait()
    model(*batch).backward()
    handle = model.finalize_backward(async_op=True)
    model.reset_iter_state()
    errors["wait after reset"] = raised(handle.wait)
    model(*batch).backward()  # trains on after the reset
    model.finalize_backward()
    return errors


def test_misuse_raises_a_clear_error() -> None:
    errors = run_on_ranks(1, _misuse)[0]
    assert "set_manual_backward_finalization(True)" in errors["not manual"]
    assert "not the root" in errors["not root"]
    assert "wait()" in errors["forward while pending"]
    assert "still pending" in errors["finalize twice"]
    assert "reset_iter_state" in errors["wait after reset"]


def _keep_storage(keep: bool) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model, _ = twins("mlp")
    shard_model(model, "mlp")
    model.set_keep_unsharded_storage(keep)
    block = model.blocks[0]
    pointers, sizes, losses = [], [], []
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        block.unshard()
        pointers.append(next(iter(block.parameters())).data_ptr())
        block.reshard()
        sizes.append(next(iter(block._get_fsdp_state().groups)).layout.unsharded_nbytes())
        loss = model(*local_batch("mlp", step, 0, rank, world))
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return {"pointers": pointers, "sizes": sizes, "losses": losses}


def test_keep_unsharded_storage() -> None:
    kept = run_on_ranks(2, _keep_storage, True)
    freed = run_on_ranks(2, _keep_storage, False)
    for k, f in zip(kept, freed, strict=True):
        assert k["losses"] == f["losses"]  # the same training
        assert len(set(k["pointers"])) == 1  # the same storage, step after step
        assert all(size > 0 for size in k["sizes"])  # kept after reshard
        assert f["sizes"] == [0, 0]  # freed


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 8).view(1, 8))  # kept in fp32 below

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.scale


def _override(impl: str) -> dict[str, Any]:
    api = fsdp_api(impl)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(Scaled(), Scaled())
    mp = api.MixedPrecisionPolicy(
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
        param_dtype_override_fn=lambda p: p.dtype if p.shape == (1, 8) else None,
    )
    for block in model:
        api.fully_shard(block, mp_policy=mp)
    api.fully_shard(model, mp_policy=mp)
    seen: set[tuple[str, torch.dtype]] = set()
    for block in model:
        block.register_forward_pre_hook(
            lambda m, a: seen.update({("fc.bias", m.fc.bias.dtype), ("scale", m.scale.dtype)})
        )
    gen = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(2):
        loss = model(torch.randn(4, 8, generator=gen)).float().pow(2).mean()
        loss.backward()
        losses.append(loss.item())
    return {
        "seen": seen,
        "losses": losses,
        "grads": [p.grad.full_tensor() for p in model.parameters()],
    }


def test_param_dtype_override_keeps_chosen_parameters() -> None:
    ours = run_on_ranks(2, _override, "fsdp2")
    for result in ours:
        assert result["seen"] == {("fc.bias", torch.bfloat16), ("scale", torch.float32)}
    if TORCH_HAS_OVERRIDE:
        theirs = run_on_ranks(2, _override, "torch")
        for got, ref in zip(ours, theirs, strict=True):
            assert got["losses"] == ref["losses"]
            for a, b in zip(got["grads"], ref["grads"], strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0)


def _bad_override() -> str:
    mp = fsdp2.MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, param_dtype_override_fn=lambda p: torch.float16
    )
    return raised(lambda: fsdp2.fully_shard(nn.Linear(2, 2), mp_policy=mp))


def test_param_dtype_override_refuses_other_dtypes() -> None:
    message = run_on_ranks(1, _bad_override)[0]
    assert "torch.float16" in message and "own dtype" in message
