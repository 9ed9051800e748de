"""All-gathers that nothing needs, counted per step against torch's own ``fully_shard``.

- Activation checkpointing: a reentrant checkpoint runs its first forward under ``no_grad``
  inside the training forward. That is not an evaluation: with ``reshard_after_forward=False``
  the block stays gathered and backward's recompute gathers nothing (torch: 0 all-gathers).
  Non-reentrant checkpointing, and both with ``reshard_after_forward=True``, alongside.
- A block that returns one of its inputs (T5 hands ``position_bias`` from block to block): its
  group is gathered once in backward, and every block reduce-scatters as soon as its backward
  is done, in torch's order, instead of all at once behind the first block's.

Each run also trains next to the unsharded reference (`tests/parity/lockstep.py`): gradients and
parameters must match.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from tests.harness import fsdp_api, per_group_collectives, run_on_ranks
from tests.models import Batch
from tests.parity import CollectiveCounter, Lockstep
from tests.parity.lockstep import SeamAwareMode

pytestmark = pytest.mark.usefixtures("fsdp2_only")  # runs torch's fully_shard itself

DIM, NUM_BLOCKS, NUM_STEPS = 8, 4, 3
IMPLS = ["fsdp2", "torch"]


def _batch(gen: torch.Generator, n: int) -> Batch:
    return torch.randn(n, DIM, generator=gen), torch.randn(n, DIM, generator=gen)


# ---------------------------------------------------------------------------------------------
# Activation checkpointing
# ---------------------------------------------------------------------------------------------


class Checkpointed(nn.Module):
    """An input layer, blocks each run under a checkpoint (HF's gradient checkpointing), a head."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.inp = nn.Linear(DIM, DIM)  # keeps a reentrant checkpoint's input requiring grad
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM))
            for _ in range(NUM_BLOCKS)
        )
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=self.reentrant)
        return F.mse_loss(self.head(h), y)


@per_group_collectives  # each group's own gathers, against torch's
def _counted_steps(impl: str, reentrant: bool, reshard_after_forward: bool) -> list[Any]:
    fully_shard = fsdp_api(impl).fully_shard
    t = Lockstep(functools.partial(Checkpointed, reentrant), _batch)
    for block in t.model.blocks:  # type: ignore[union-attr]
        fully_shard(block, reshard_after_forward=reshard_after_forward)
    fully_shard(t.model, reshard_after_forward=reshard_after_forward)
    t.make_optimizers()
    counts = []
    for step in range(NUM_STEPS):
        forward, backward = t.counted_step(step, CollectiveCounter)
        counts.append((dict(forward.counts), dict(backward.counts)))
    t.check_params("after training")
    return counts


@pytest.mark.parametrize("reshard_after_forward", [True, False])
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
@pytest.mark.parametrize("impl", IMPLS)
def test_checkpointed_blocks_gather_as_torch(
    impl: str, reentrant: bool, reshard_after_forward: bool
) -> None:
    """Forward gathers every group once; backward gathers each block again only if it was
    resharded after forward (the root, too, with reshard_after_forward=True); each group
    reduce-scatters once."""
    groups = NUM_BLOCKS + 1
    forward = {"allgather": groups}
    backward = {
        "allgather": groups if reshard_after_forward else 0,
        "reducescatter": groups,
    }
    backward = {kind: n for kind, n in backward.items() if n}
    for counts in run_on_ranks(2, _counted_steps, impl, reentrant, reshard_after_forward):
        assert counts == [(forward, backward)] * NUM_STEPS


# ---------------------------------------------------------------------------------------------
# A block that returns one of its inputs
# ---------------------------------------------------------------------------------------------


class PassingBlock(nn.Module):
    """T5's layer in small: the first block makes a bias from its own parameter, every block
    adds it and hands it on, unchanged, to the next."""

    def __init__(self, first: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.table = nn.Parameter(torch.randn(DIM)) if first else None

    def forward(
        self, x: torch.Tensor, bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if bias is None:
            if self.table is None:
                raise AssertionError("only the first block makes the bias")
            bias = self.table * 2.0
        return torch.tanh(self.lin(x) + bias), bias


class Passing(nn.Module):
    """Blocks handing a bias on, run plainly or each under a checkpoint."""

    def __init__(self, ac: str = "none") -> None:
        super().__init__()
        self.ac = ac
        self.inp = nn.Linear(DIM, DIM)  # keeps a reentrant checkpoint's input requiring grad
        self.blocks = nn.ModuleList(PassingBlock(i == 0) for i in range(NUM_BLOCKS))
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x, bias = self.inp(x), None
        for block in self.blocks:
            if self.ac == "none":
                x, bias = block(x, bias)
            else:
                x, bias = checkpoint(block, x, bias, use_reentrant=self.ac == "reentrant")
        return F.mse_loss(self.head(x), y)


class Sequence(SeamAwareMode):
    """The c10d collectives in issue order: "AG" or "RS" (fsdp2's in-place all-reduce on gloo
    is its reduce-scatter)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        namespace, _, name = func._schema.name.partition("::")
        name = name.replace("_", "")
        if namespace == "c10d":
            seam_reduce_scatter = self._is_fsdp2_reduce_scatter()
            if "allgather" in name:
                self.ops.append("AG")
            elif "reducescatter" in name or ("allreduce" in name and seam_reduce_scatter):
                self.ops.append("RS")
            else:
                self.ops.append(name)
        return func(*args, **(kwargs or {}))


@per_group_collectives  # each group's own gathers, against torch's
def _passing_steps(impl: str, ac: str) -> list[list[str]]:
    fully_shard = fsdp_api(impl).fully_shard
    t = Lockstep(functools.partial(Passing, ac), _batch)
    for block in t.model.blocks:  # type: ignore[union-attr]
        fully_shard(block)
    fully_shard(t.model)
    t.make_optimizers()
    orders = []
    for step in range(NUM_STEPS):
        with Sequence() as seq:
            loss = t.model(*t.local(step))
            loss.backward()
        orders.append(seq.ops)
        t.reference_step(loss, step)
        t.check_grads(f"step {step}")
        t.optim_step()
    t.check_params("after training")
    return orders


@pytest.mark.parametrize("ac", ["none", "reentrant", "non_reentrant"])
def test_block_returning_its_input_is_gathered_once(ac: str) -> None:
    """Forward: the root and every block (5 all-gathers). Backward: each block once (4), and
    without checkpoints, in torch's order: each block's reduce-scatter before the gather of the
    block two before it (prefetch keeping one ahead), the root's last. Under a reentrant
    checkpoint fsdp2 prefetches nothing (the recompute runs in backward's order), so each
    block reduces before the next is gathered: only the counts are torch's."""
    by_impl = {impl: run_on_ranks(2, _passing_steps, impl, ac) for impl in IMPLS}
    counted = {impl: [[sorted(o) for o in r] for r in runs] for impl, runs in by_impl.items()}
    assert counted["fsdp2"] == counted["torch"]
    for orders in by_impl["fsdp2"]:
        assert all(order.count("AG") == 2 * NUM_BLOCKS + 1 for order in orders)
        if ac == "none":
            assert by_impl["fsdp2"] == by_impl["torch"]
            forward = ["AG"] * (NUM_BLOCKS + 1)
            backward = ["AG", "AG", "RS", "AG", "RS", "AG", "RS", "RS", "RS"]
            assert orders == [forward + backward] * NUM_STEPS


# ---------------------------------------------------------------------------------------------
# A backward for the inputs only
# ---------------------------------------------------------------------------------------------


@per_group_collectives  # each group's own gathers, against torch's
def _input_grad_steps(impl: str) -> list[Any]:
    """Adversarial training (FGSM): each step first takes the loss's gradient with respect to
    the input alone (``torch.autograd.grad``), perturbs the input along it, then trains on the
    perturbed batch. The first backward gives no parameter a gradient on any rank."""
    fully_shard = fsdp_api(impl).fully_shard
    t = Lockstep(functools.partial(Checkpointed, False), _batch)
    for block in t.model.blocks:  # type: ignore[union-attr]
        fully_shard(block)
    fully_shard(t.model)
    t.make_optimizers()
    counts = []
    for step in range(NUM_STEPS):
        x, y = t.local(step)
        x = x.requires_grad_()
        with CollectiveCounter() as counter:
            (grad_x,) = torch.autograd.grad(t.model(x, y), x)
        counts.append(dict(counter.counts))
        if any(p.grad is not None for p in t.model.parameters()):
            raise AssertionError(f"{impl}: a parameter got a gradient from an input-only backward")
        loss = t.model(x.detach() + 0.01 * grad_x.sign(), y)
        loss.backward()
        t.optim_step()
    return counts


@pytest.mark.parametrize("impl", IMPLS)
def test_input_only_backward_reduces_nothing(impl: str) -> None:
    """``torch.autograd.grad`` of the input alone (adversarial examples, saliency,
    pipelining's shape inference): fsdp2 reduce-scatters nothing, as torch; the all-gathers
    are the forward's (every group once) and the blocks' again in backward."""
    groups = NUM_BLOCKS + 1
    for counts in run_on_ranks(2, _input_grad_steps, impl):
        assert counts == [{"allgather": groups + NUM_BLOCKS}] * NUM_STEPS, counts
