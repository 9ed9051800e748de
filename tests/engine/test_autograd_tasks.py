"""Backward passes other than one ``loss.backward()``: activation checkpointing (reentrant, which
runs each block's backward as a nested autograd graph task, and non-reentrant),
``torch.autograd.grad`` with respect to inputs, backward through part of the graph, two
backwards accumulating, a gradient penalty (double backward), ``backward(create_graph=True)``
into sharded parameters (refused), and ``torch.func.jvp`` (forward mode).

Each trains a sharded model next to its unsharded reference (`tests/parity/lockstep.py`) and compares
gradients and parameters; checkpointing also pins the order of collectives in backward, which
shows whether each group reduce-scatters as soon as its gradients are in.
"""

from __future__ import annotations

import functools
from typing import Any

import expecttest
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from tests.errors import raised
from tests.harness import check_backward_order, per_group_collectives, run_on_ranks
from tests.models import Batch
from tests.parity import Lockstep, close

pytestmark = pytest.mark.usefixtures("fsdp2_only")

DIM, NUM_BLOCKS, NUM_STEPS = 8, 3, 3


def _block() -> nn.Module:
    return nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM), nn.Tanh())


class Checkpointed(nn.Module):
    """Runs its inner block under a checkpoint; ``fully_shard`` goes on this wrapper (as with
    torchtitan's and torch's ``checkpoint_wrapper``)."""

    def __init__(self, inner: nn.Module, reentrant: bool) -> None:
        super().__init__()
        self.inner = inner
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = checkpoint(self.inner, x, use_reentrant=self.reentrant)
        return out


class Stack(nn.Module):
    """An input layer and a head (the root's group) around blocks; ``where`` puts a checkpoint
    around each sharded block (HF's ``gradient_checkpointing_enable``), inside it (a wrapper),
    or nowhere. The input layer keeps a reentrant checkpoint's input requiring grad."""

    def __init__(self, where: str = "nowhere", reentrant: bool = True) -> None:
        super().__init__()
        self.where, self.reentrant = where, reentrant
        self.inp = nn.Linear(DIM, DIM)
        blocks = [_block() for _ in range(NUM_BLOCKS)]
        if where == "inside":
            blocks = [Checkpointed(b, reentrant) for b in blocks]
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(DIM, DIM)
        self.aux = nn.Linear(DIM, 1)  # a second loss, for backward through part of the graph

    def trunk(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            if self.where == "around":
                x = checkpoint(block, x, use_reentrant=self.reentrant)
            else:
                x = block(x)
        return x

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.head(self.trunk(x)), y)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.trunk(x)

    def losses(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.trunk(x)
        return {"main": F.mse_loss(self.head(h), y), "aux": self.aux(h).pow(2).mean()}


def _batch(gen: torch.Generator, n: int) -> Batch:
    return torch.randn(n, DIM, generator=gen), torch.randn(n, DIM, generator=gen)


def _sharded(**kwargs: Any) -> Lockstep:
    from fsdp2 import fully_shard, register_fsdp_forward_method

    t = Lockstep(functools.partial(Stack, **kwargs), _batch)
    for block in t.model.blocks:  # type: ignore[union-attr]
        fully_shard(block)
    fully_shard(t.model.aux)  # type: ignore[arg-type]
    fully_shard(t.model)
    register_fsdp_forward_method(t.model, "losses")
    t.make_optimizers()
    return t


# ---------------------------------------------------------------------------------------------
# Activation checkpointing
# ---------------------------------------------------------------------------------------------

# Each block is gathered (a reentrant checkpoint's recompute, or the pre-backward hook) and
# reduce-scattered before the next block's gather; the root (inp, head) reduces last, once the
# input layer's gradients are in.
BACKWARD_ORDER = [
    *[
        (kind, f"blocks.{i}")
        for i in reversed(range(NUM_BLOCKS))
        for kind in ("all_gather", "reduce_scatter")
    ],
    ("reduce_scatter", ""),
]


@per_group_collectives  # each block's own reduce-scatter, issued as soon as it is done
def _checkpointed(where: str, reentrant: bool) -> list[list[tuple[str, str]]]:
    from fsdp2.engine.collectives import record_collectives

    t = _sharded(where=where, reentrant=reentrant)
    orders = []
    for step in range(NUM_STEPS):
        loss = t.model(*t.local(step))
        with record_collectives() as records:
            loss.backward()
        orders.append([(r.kind, r.label) for r in records])
        t.reference_step(loss, step)
        t.check_grads(f"step {step}")
        t.optim_step()
    t.check_params("after training")
    return orders


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
@pytest.mark.parametrize("where", ["around", "inside", "nowhere"])
def test_activation_checkpointing_reduces_each_block_in_turn(where: str, reentrant: bool) -> None:
    """Under a reentrant checkpoint each block's backward is a nested graph task; its group
    still reduce-scatters as soon as the block is done, not at the end of backward (which holds
    every block's unsharded gradients at once), and is gathered once, not twice."""
    if where == "nowhere" and not reentrant:
        pytest.skip("the same run as reentrant")
    for orders in run_on_ranks(2, _checkpointed, where, reentrant):
        assert len(orders) == NUM_STEPS
        for order in orders:
            check_backward_order(order, BACKWARD_ORDER)


# ---------------------------------------------------------------------------------------------
# Other backward passes
# ---------------------------------------------------------------------------------------------


def _grad_of_inputs(t: Lockstep, step: int) -> None:
    """``torch.autograd.grad(loss, x)``: the input's gradient, no parameter gradients."""
    x, y = (v.clone() for v in t.local(step))
    gx, gref = x.requires_grad_(), t.global_(step)[0].requires_grad_()
    (grad,) = torch.autograd.grad(t.model(gx, y), gx)
    (ref_grad,) = torch.autograd.grad(t.ref(gref, t.global_(step)[1]), gref)
    rows = x.shape[0]
    # The local loss averages over the local rows: W times the global loss's gradient.
    close("input grad", grad, ref_grad[t.rank * rows : (t.rank + 1) * rows] * t.world_size)
    assert all(p.grad is None for p in t.model.parameters())
    assert all(isinstance(p, DTensor) for p in t.model.parameters())  # resharded


def _two_backwards(t: Lockstep, step: int) -> None:
    loss = t.model(*t.local(step))
    loss.backward(retain_graph=True)
    loss.backward()
    ref_loss = t.ref(*t.global_(step))
    ref_loss.backward(retain_graph=True)
    ref_loss.backward()


def _part_of_graph(t: Lockstep, step: int) -> None:
    """Backward of the main loss only: the auxiliary head (its own group) gets no gradient."""
    t.model.losses(*t.local(step))["main"].backward()  # type: ignore[operator]
    t.ref.losses(*t.global_(step))["main"].backward()  # type: ignore[operator]
    assert t.model.aux.weight.grad is None  # type: ignore[union-attr]


def _gradient_penalty(t: Lockstep, step: int) -> None:
    """A penalty on the input gradient (WGAN-GP, R1): ``autograd.grad(create_graph=True)``, then
    a backward through the graph it built, which uses the unsharded parameters again."""
    x, y = t.local(step)
    gx, gy = t.global_(step)
    for model, inp, tgt, scale in ((t.model, x, y, t.world_size), (t.ref, gx, gy, 1)):
        inp = inp.clone().requires_grad_()
        loss = model(inp, tgt)
        (grad,) = torch.autograd.grad(loss, inp, create_graph=True)
        # Local input gradients are W times the global ones: scale the penalty to match.
        (loss + grad.pow(2).sum() / scale).backward()


SCHEDULES = {
    "grad_of_inputs": _grad_of_inputs,
    "two_backwards": _two_backwards,
    "part_of_graph": _part_of_graph,
    "gradient_penalty": _gradient_penalty,
}


def _schedule(name: str, where: str) -> int:
    """Alternate ``name``'s backward with ordinary training steps."""
    t = _sharded(where=where, reentrant=False)  # a reentrant checkpoint refuses autograd.grad
    compared = 0
    for step in range(2 * NUM_STEPS):
        if step % 2 == 0:
            SCHEDULES[name](t, step)
            if name == "grad_of_inputs":
                continue
        else:
            t.forward_backward(step)
        compared += t.check_grads(f"step {step}")
        t.optim_step()
    t.check_params("after training")
    return compared


@pytest.mark.parametrize("where", ["nowhere", "around"], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_other_backward_passes(name: str, where: str) -> None:
    """Each gives the unsharded reference's gradients, and training goes on exactly after."""
    for compared in run_on_ranks(2, _schedule, name, where):
        assert compared > 0


def _create_graph_into_params() -> str:
    t = _sharded()
    loss = t.model(*t.local(0))
    text = raised(lambda: loss.backward(create_graph=True))
    t.forward_backward(1)  # the next forward recovers: the step trains as usual
    t.check_grads("after the refused backward")
    return text


def _sparse_embedding() -> str:
    """``nn.Embedding(sparse=True)`` gives a sparse gradient, which no reduce-scatter takes: a
    clear error on every rank, and after ``sparse = False`` the same step trains as unsharded."""
    import torch.distributed as dist

    from fsdp2 import fully_shard

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 2))
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
    model.load_state_dict(ref.state_dict())
    fully_shard(model[0])
    fully_shard(model)
    tokens = torch.randint(10, (2, 6), generator=torch.Generator().manual_seed(1))
    mine = tokens[dist.get_rank()]
    text = raised(lambda: model(mine).mean().backward())
    model[0].sparse = False
    model(mine).mean().backward()  # each rank's mean; the reduction averages them
    ref(tokens).mean().backward()
    for (name, p), ref_p in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert isinstance(p.grad, DTensor), name
        close(f"{name}.grad", p.grad.full_tensor(), ref_p.grad)
    return text


class TestGradientErrors(expecttest.TestCase):
    def _on_every_rank(self, fn: Any) -> str:
        texts = run_on_ranks(2, fn)
        assert texts[0] == texts[1]  # every rank raises alike
        return texts[0]

    def test_backward_create_graph_into_sharded_params(self) -> None:
        self.assertExpectedInline(
            self._on_every_rank(_create_graph_into_params),
            """RuntimeError: fsdp2: backward(create_graph=True) gave head.bias a gradient that requires grad, but the reduce-scatter that shards it is not differentiable, so its higher-order terms would be lost. Take higher-order gradients with respect to tensors that are not sharded parameters (torch.autograd.grad(loss, inputs, create_graph=True), as in a gradient penalty), or compute them on an unsharded copy of the model""",
        )

    def test_sparse_embedding_gradient(self) -> None:
        self.assertExpectedInline(
            self._on_every_rank(_sparse_embedding),
            """RuntimeError: fsdp2: 0.weight got a gradient of layout torch.sparse_coo, but sharded gradients are reduce-scattered as dense tensors. A sparse gradient comes from nn.Embedding(..., sparse=True) or nn.EmbeddingBag(..., sparse=True): build the module with sparse=False (the default), or set module.sparse = False; sharding already spreads the embedding's memory over the ranks""",
        )


# ---------------------------------------------------------------------------------------------
# Forward mode
# ---------------------------------------------------------------------------------------------


def _jvp(reshard_after_forward: bool) -> None:
    from fsdp2 import fully_shard, register_fsdp_forward_method

    t = Lockstep(Stack, _batch)
    with torch.device("meta"):
        meta = Stack()
    for block in meta.blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward)
    fully_shard(meta, reshard_after_forward=reshard_after_forward)
    register_fsdp_forward_method(meta, "features")
    meta.to_empty(device="cpu")
    with torch.no_grad():  # the reference's values, then train the materialised model
        for p, ref_p in zip(meta.parameters(), t.ref.parameters(), strict=True):
            p.copy_(fsdp_shard(p, ref_p))
    t.model = meta
    t.make_optimizers()
    x = t.local(0)[0]
    tangent = torch.randn(x.shape, generator=torch.Generator().manual_seed(7))
    # The very first gather happens inside the transform.
    out, tout = torch.func.jvp(t.model.features, (x,), (tangent,))
    ref_out, ref_tout = torch.func.jvp(t.ref.features, (x,), (tangent,))
    close("jvp primal", out, ref_out)
    close("jvp tangent", tout, ref_tout)
    t.train(2)


def fsdp_shard(sharded: torch.Tensor, full_tensor: torch.Tensor) -> torch.Tensor:
    """``full_tensor`` laid out like the DTensor ``sharded``."""
    assert isinstance(sharded, DTensor)
    return torch.distributed.tensor.distribute_tensor(
        full_tensor, sharded.device_mesh, sharded.placements
    )


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_jvp_through_sharded_modules(reshard_after_forward: bool) -> None:
    run_on_ranks(2, _jvp, reshard_after_forward)
