"""Training a sharded model and its reference side by side, and counting what it communicates.

`train_side_by_side` runs a whole schedule (steps of micro-steps, AdamW on both, knobs turned
between micro-steps, any data-parallel layout: the data-parallel ranks need not be the world).
`Lockstep` holds the pair for tests that step both copies by hand through unusual schedules
(micro-steps without sync, explicit unshard, a failed step), with SGD on both.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.func import functional_call
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp2.engine.collectives import CollectiveRecord, record_collectives
from tests.models import MODELS, Batch
from tests.parity.build import (
    LOCAL_BATCH,
    MakeBatch,
    adamw,
    global_batch,
    local_batch,
    sgd,
    twins,
)
from tests.parity.compare import close, compare_grads, compare_params, mean_over_ranks
from tests.tolerance import FP32, SAME_ARITHMETIC, SGD_FP32, Tolerance

T = TypeVar("T")


class Lockstep:
    """``model`` (to be sharded by the caller) and ``ref``, an identical unsharded copy."""

    def __init__(
        self,
        build: Callable[[], nn.Module] | str,
        make_batch: MakeBatch | None = None,
        *,
        local_batch: int = LOCAL_BATCH,
    ) -> None:
        if isinstance(build, str):
            make_batch = MODELS[build].make_batch
        if make_batch is None:
            raise ValueError("Lockstep needs make_batch unless build names a model in MODELS")
        self.model, self.ref = twins(build)
        self.make_batch = make_batch
        self.local_batch = local_batch
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.optim: torch.optim.Optimizer | None = None
        self.ref_optim: torch.optim.Optimizer | None = None

    # -- data -------------------------------------------------------------------------------------

    def batch_for(self, step: int, micro: int, rank: int) -> Batch:
        """Rank ``rank``'s local micro-batch; override to make batches depend on the rank."""
        return local_batch(self.make_batch, step, micro, rank, self.world_size, self.local_batch)

    def local(self, step: int, micro: int = 0) -> Batch:
        return self.batch_for(step, micro, self.rank)

    def global_(self, step: int, micro: int = 0) -> Batch:
        parts = [self.batch_for(step, micro, r) for r in range(self.world_size)]
        return tuple(torch.cat(ts) for ts in zip(*parts, strict=True))

    # -- training ---------------------------------------------------------------------------------

    def make_optimizers(self) -> None:
        """SGD on both. Call after sharding: the sharded model's parameters are new objects."""
        self.optim = sgd(self.model.parameters())
        self.ref_optim = sgd(self.ref.parameters())

    def forward_backward(self, step: int, micro: int = 0, *, check: bool = True) -> float:
        """One forward and backward of each copy on micro-batch ``(step, micro)``; returns the
        global loss and (``check``) compares it with the reference's."""
        loss = self.model(*self.local(step, micro))
        loss.backward()
        return self.reference_step(loss, step, micro, check=check)

    def reference_step(
        self, loss: torch.Tensor, step: int, micro: int = 0, *, check: bool = True
    ) -> float:
        """The reference's forward and backward on the global micro-batch; compares its loss
        with the sharded model's ``loss`` (a collective: keep it out of counted regions)."""
        ref_loss = self.ref(*self.global_(step, micro))
        ref_loss.backward()
        global_loss = mean_over_ranks(loss)
        if check:
            close(f"step {step}.{micro} loss", global_loss, ref_loss.detach())
        return global_loss.item()

    def optim_step(self) -> None:
        if self.optim is None or self.ref_optim is None:
            raise AssertionError("call make_optimizers() after sharding")
        self.optim.step()
        self.ref_optim.step()
        self.optim.zero_grad()
        self.ref_optim.zero_grad()

    def train(self, num_steps: int) -> None:
        """``num_steps`` checked steps (the loss, every gradient), then the parameters."""
        for step in range(num_steps):
            self.forward_backward(step)
            self.check_grads(f"step {step}")
            self.optim_step()
        self.check_params("after training")

    def counted_step(
        self, step: int, counter: Callable[[], AbstractContextManager[T]]
    ) -> tuple[T, T]:
        """One checked step whose forward and whose backward each run under a fresh
        ``counter()`` (`record_collectives`, `CollectiveCounter`); returns the two counts. The
        reference's step (a collective) runs outside both."""
        with counter() as forward:
            loss = self.model(*self.local(step))
        with counter() as backward:
            loss.backward()
        self.reference_step(loss, step)
        self.check_grads(f"step {step}")
        self.optim_step()
        return forward, backward

    # -- checks -----------------------------------------------------------------------------------

    def check_grads(self, what: str, scale: Callable[[str], float] | None = None) -> int:
        """Every gradient equals the reference's (times ``scale(name)``); returns how many."""
        num = compare_grads(self.model, self.ref, what, scale=scale)
        if num == 0:
            raise AssertionError(f"{what}: no gradient to compare")
        return num

    def check_params(self, what: str) -> None:
        for name, p in self.model.named_parameters():
            if not isinstance(p, DTensor):
                raise AssertionError(
                    f"{what} {name}: expected a sharded DTensor, got a plain tensor"
                )
        compare_params(self.model, self.ref, what, SGD_FP32)


@dataclass(kw_only=True)
class SideBySide:
    losses: list[float] = field(default_factory=list)
    """Global loss per step: the mean over data-parallel ranks of the local losses."""
    ref_losses: list[float] = field(default_factory=list)
    records: list[list[CollectiveRecord]] = field(default_factory=list)
    """fsdp2's collectives of each step's forwards and backwards."""


def cast_forward(dtype: torch.dtype, num_slices: int) -> Callable[[nn.Module, Batch], torch.Tensor]:
    """The reference's forward under mixed precision: fp32 master weights, computed in
    ``dtype`` on casts of the weights and floating inputs. With ``num_slices`` > 1 it runs each
    rank's slice of the global batch separately, each on its own casts, so the fp32 gradients
    are sums of per-slice low-precision gradients: the arithmetic of sharded training."""

    def forward(ref: nn.Module, batch: Batch) -> torch.Tensor:
        losses = []
        for piece in zip(*(t.chunk(num_slices) for t in batch), strict=True):
            params = {n: p.to(dtype) for n, p in ref.named_parameters()}
            inputs = tuple(t.to(dtype) if t.is_floating_point() else t for t in piece)
            losses.append(functional_call(ref, params, inputs).float())
        return torch.stack(losses).mean()

    return forward


def train_side_by_side(
    model: nn.Module,
    ref: nn.Module,
    make_batch: MakeBatch,
    *,
    dp_rank: int,
    dp_size: int,
    num_steps: int = 3,
    num_micro: int = 1,
    tol: Tolerance = FP32,
    ref_forward: Callable[[nn.Module, Batch], torch.Tensor] | None = None,
    before_micro: Callable[[int, int], None] | None = None,
    optim: torch.optim.Optimizer | None = None,
    check_grads: bool = True,
) -> SideBySide:
    """Train ``model`` (already sharded) and ``ref`` (its unsharded twin) on the same global
    batches; raise on the first mismatch. Each step runs ``num_micro`` forward/backward passes,
    calling ``before_micro(step, micro)`` before each (to turn knobs), then one optimizer step.
    ``check_grads=False`` compares only losses and parameters (for a reference that computes
    differently on purpose)."""
    ref_forward = ref_forward or (lambda module, batch: module(*batch))
    optim = optim or adamw(model.parameters())
    ref_optim = adamw(ref.parameters())
    out = SideBySide()
    compare_params(model, ref, "before training", SAME_ARITHMETIC)
    for step in range(num_steps):
        loss_sum, ref_loss_sum = torch.zeros(()), torch.zeros(())
        with record_collectives() as records:
            for micro in range(num_micro):
                if before_micro is not None:
                    before_micro(step, micro)
                loss = model(*local_batch(make_batch, step, micro, dp_rank, dp_size))
                loss.backward()
                loss_sum += loss.detach().float()
        out.records.append(list(records))
        for micro in range(num_micro):
            batch = global_batch(make_batch, step, micro, dp_size * LOCAL_BATCH)
            ref_loss = ref_forward(ref, batch)
            ref_loss.backward()
            ref_loss_sum += ref_loss.detach().float()
        global_loss = mean_over_ranks(loss_sum)
        close(f"step {step} loss", global_loss, ref_loss_sum, tol)
        if check_grads:
            compare_grads(model, ref, f"step {step}", tol)
        for opt in (optim, ref_optim):
            opt.step()
            opt.zero_grad()
        out.losses.append(global_loss.item())
        out.ref_losses.append(ref_loss_sum.item())
    compare_params(model, ref, "after training", tol)
    return out


# -- counting collectives -------------------------------------------------------------------------


def kinds(records: Iterable[CollectiveRecord]) -> Counter[tuple[str, int]]:
    """How many collectives of each (kind, world size)."""
    return Counter((r.kind, r.world_size) for r in records)


def count(records: Iterable[CollectiveRecord], kind: str) -> Counter[str]:
    """Collectives of ``kind`` per group label."""
    return Counter(r.label for r in records if r.kind == kind)


def labels(records: Iterable[CollectiveRecord], kind: str) -> list[str]:
    """The group labels of the ``kind`` collectives in ``records``, in issue order."""
    return [r.label for r in records if r.kind == kind]


def backward_counts(t: Lockstep, num_steps: int, kind: str) -> list[int]:
    """Train ``num_steps`` checked lockstep steps; the ``kind`` collectives (`CollectiveCounter`'s
    names) of each backward."""
    counts = [t.counted_step(step, CollectiveCounter)[1].counts[kind] for step in range(num_steps)]
    t.check_params("after training")
    return counts


def same_on_all_ranks(value: Any) -> None:
    """Cross-rank sanity check: ``value`` is identical on every rank."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    if any(v != gathered[0] for v in gathered):
        raise AssertionError(f"expected the same value on every rank, got {gathered}")


class SeamAwareMode(TorchDispatchMode):
    """A dispatch mode over c10d ops that tells fsdp2's reduce-scatter on gloo (issued as an
    in-place all-reduce of its own input) from an all-reduce: fsdp2 records each collective
    just before issuing it, so the c10d op that follows a fresh "reduce_scatter" record is it."""

    def __enter__(self) -> Any:
        self._recording = record_collectives()
        self._records = self._recording.__enter__()
        self._seen = 0
        return super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        try:
            return super().__exit__(*exc)
        finally:
            self._recording.__exit__(None, None, None)

    def _is_fsdp2_reduce_scatter(self) -> bool:
        """Call once per c10d op: whether it is the reduce-scatter fsdp2 just recorded."""
        fresh = len(self._records) > self._seen
        self._seen = len(self._records)
        return fresh and self._records[-1].kind == "reduce_scatter"


class CollectiveCounter(SeamAwareMode):
    """Counts c10d collectives by kind ("allgather", "reducescatter", "allreduce"), whoever
    issues them: fsdp2 or torch's own FSDP2. Unlike ``CommDebugMode`` it tracks no modules:
    torch 2.13's module tracker raises IndexError on models that call a module several times
    per forward (a chunked loss) or tie weights (GPT), with either implementation."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        namespace, _, name = func._schema.name.partition("::")
        if namespace == "c10d":
            name = name.replace("_", "")
            seam_reduce_scatter = self._is_fsdp2_reduce_scatter()
            for kind in ("allgather", "reducescatter", "allreduce"):
                if kind in name:
                    if kind == "allreduce" and seam_reduce_scatter:
                        kind = "reducescatter"  # fsdp2's reduce-scatter on gloo, done in place
                    self.counts[kind] += 1
        return func(*args, **(kwargs or {}))
