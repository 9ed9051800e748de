"""All-gather extensions on wrapper tensor subclasses (data in inner tensors, as torchao's float8
and NF4 weights) and on parameters whose dim 0 does not split evenly over the ranks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from tests.harness import run_on_ranks
from tests.tolerance import PARAM_ATOL, assert_fp32_close
from tests.wrapper_tensor import WrapperTensor

STEPS = 3


class PaddedBF16Weight(WrapperTensor):
    """A wrapper subclass over ``_data`` whose gather sends bf16 and pads its own inputs to the
    chunk every rank sends (from ``outer_size``), as torch's extension tests do."""

    def fsdp_pre_all_gather(
        self, mesh: Any, outer_size: torch.Size, outer_stride: Any, module: Any, mp: Any
    ) -> tuple[tuple[torch.Tensor], None]:
        chunk = -(-outer_size[0] // mesh.size())
        padded = self._data.new_zeros(chunk, *self._data.shape[1:])
        padded[: self._data.shape[0]] = self._data
        return (padded.to(torch.bfloat16),), None

    def fsdp_post_all_gather(
        self,
        outputs: tuple[torch.Tensor, ...],
        metadata: None,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor]] | None:
        full = outputs[0].to(param_dtype)
        if out is not None:  # refill the cut unsharded parameter in place
            with torch.no_grad():
                out.copy_(full[: out.shape[0]])
            return None
        return full, (full,)


def _two_tensor_hooks() -> type[torch.Tensor]:
    """torch's TwoTensor gathered as its two inner tensors; the post hook keeps the gathered
    outputs as the unsharded parameter's inner tensors and refills nothing (out=)."""
    from torch.testing._internal.two_tensor import TwoTensor

    def pre(self: Any, mesh: Any, size: Any, stride: Any, module: Any, mp: Any) -> Any:
        return (self.a, self.b), None

    def post(self: Any, outputs: Any, metadata: Any, dtype: Any, *, out: Any = None) -> Any:
        a, b = outputs
        return None if out is not None else (TwoTensor(a, b).to(dtype), (a, b))

    TwoTensor.fsdp_pre_all_gather = pre  # type: ignore[attr-defined]
    TwoTensor.fsdp_post_all_gather = post  # type: ignore[attr-defined]
    return TwoTensor


def _parts(t: torch.Tensor) -> list[torch.Tensor]:
    """A subclass's inner tensors as plain tensors (both of a TwoTensor, which stay equal)."""
    names = t.__tensor_flatten__()[0] if hasattr(t, "__tensor_flatten__") else []
    return [getattr(t, n).detach().clone() for n in names] or [t.detach().clone()]


def _model(kind: str, rows: int) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, rows), nn.Tanh(), nn.Linear(rows, 4))
    wrap = _two_tensor_hooks() if kind == "two" else PaddedBF16Weight
    for layer in (model[0], model[2]):
        w = layer.weight.detach()
        layer.weight = nn.Parameter(wrap(w, w.clone()) if kind == "two" else wrap(w.clone()))
    return model


def _train(impl: str, kind: str, rows: int) -> dict[str, Any]:
    from tests.harness import fsdp_api

    api = fsdp_api(impl)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model(kind, rows)
    api.fully_shard(model[0])
    api.fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], []
    for step in range(STEPS):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step * world + rank))
        loss = model(x).pow(2).mean()
        loss.backward()
        losses.append(_parts(loss)[0])
        grads.append([p.grad.to_local().clone() for p in model.parameters()])
        optimizer.step()
        optimizer.zero_grad()
    shards = [_parts(p.to_local()) for p in model.parameters()]
    full = [_parts(p.full_tensor()) for p in model.parameters()]
    result = {"losses": losses, "grads": grads, "shards": shards, "full": full}
    if impl == "fsdp2":
        result["reload"] = _reload(model, kind, rows)
    return result


def _reload(model: nn.Module, kind: str, rows: int) -> bool:
    """A fresh sharded model loading ``model``'s sharded state dict holds the same shards."""
    import fsdp2

    other = _model(kind, rows)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(0.5)
    fsdp2.fully_shard(other[0])
    fsdp2.fully_shard(other)
    other.load_state_dict(model.state_dict())
    pairs = zip(model.parameters(), other.parameters(), strict=True)
    # Bitwise: the same shards, copied, run the same operations in the same process.
    same_shards = all(
        torch.equal(a, b)
        for p, q in pairs
        for a, b in zip(_parts(p.to_local()), _parts(q.to_local()), strict=True)
    )
    x = torch.randn(3, 8)
    with torch.no_grad():
        return same_shards and torch.equal(_parts(model(x))[0], _parts(other(x))[0])


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(("kind", "rows"), [("two", 8), ("bf16", 8), ("bf16", 7)])
def test_wrapper_extension_matches_torch(world: int, kind: str, rows: int) -> None:
    ours = run_on_ranks(world, _train, "fsdp2", kind, rows)
    theirs = run_on_ranks(world, _train, "torch", kind, rows)
    for rank, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        msg = f"rank {rank}"
        assert_fp32_close(a["losses"], b["losses"], msg=msg)
        assert_fp32_close(a["grads"], b["grads"], msg=msg)
        assert_fp32_close(a["shards"], b["shards"], atol=PARAM_ATOL, msg=msg)
        assert all(isinstance(g, torch.Tensor) for step in a["grads"] for g in step)
        assert a["reload"], msg
    # full_tensor() reassembles the shards, cut back to the real rows.
    assert_fp32_close(ours[0]["full"], theirs[0]["full"], atol=PARAM_ATOL)


def _uneven_two_tensor(rows: int) -> dict[str, Any]:
    """TwoTensor's hook sends its shard's own rows: fsdp2 pads them (torch refuses this)."""
    import fsdp2

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model("two", rows)
    reference = nn.Sequential(nn.Linear(8, rows), nn.Tanh(), nn.Linear(rows, 4))
    with torch.no_grad():
        for p, q in zip(reference.parameters(), model.parameters(), strict=True):
            p.copy_(_parts(q)[0])
    reference_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    fsdp2.fully_shard(model[0])
    fsdp2.fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        xs = [
            torch.randn(4, 8, generator=torch.Generator().manual_seed(step * world + r))
            for r in range(world)
        ]
        loss = model(xs[rank]).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total = _parts(loss)[0]
        dist.all_reduce(total)
        expected = reference(torch.cat(xs)).pow(2).mean()
        expected.backward()
        reference_opt.step()
        reference_opt.zero_grad()
        assert_fp32_close(total.item() / world, expected.item())
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        pieces: list[Any] = [None] * world
        dist.all_gather_object(pieces, _parts(p.to_local()))
        for i in range(len(pieces[0])):  # both inner tensors of a TwoTensor
            assert_fp32_close(torch.cat([pc[i] for pc in pieces]), q.detach(), atol=PARAM_ATOL)
    return {"ok": True}


@pytest.mark.parametrize("world", [2, 4])
def test_uneven_wrapper_extension_pads_its_inputs(world: int) -> None:
    assert run_on_ranks(world, _uneven_two_tensor, 7) == [{"ok": True}] * world


def _meta_init(impl: str) -> list[torch.Tensor]:
    """Built on meta, materialised by ``to_empty`` (the shards are re-packed), then filled."""
    from tests.harness import fsdp_api

    api = fsdp_api(impl)
    with torch.device("meta"):
        model = _model("bf16", 7)
    api.fully_shard(model[0])
    api.fully_shard(model)
    model.to_empty(device="cpu")
    torch.manual_seed(dist.get_rank())
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().copy_(torch.randn(p.to_local().shape))
    out = model(torch.ones(2, 8))
    out.sum().backward()
    return [_parts(out)[0]] + [p.grad.to_local() for p in model.parameters()]


def test_wrapper_extension_meta_init_matches_torch() -> None:
    ours, theirs = run_on_ranks(2, _meta_init, "fsdp2"), run_on_ranks(2, _meta_init, "torch")
    assert_fp32_close(ours, theirs)
