"""Lockstep training: a sharded model and its unsharded reference, stepped side by side.

The control-surface tests (`test_accumulation.py`, `test_control.py`, `test_recovery.py`) drive
the sharded model through unusual schedules (micro-steps without sync, explicit unshard, a
failed step), so unlike `tests/parity.py` they need to step both copies by hand. `Lockstep`
holds the pair and does the bookkeeping: the same initial parameters, each rank's local batch
and the reference's global batch (the concatenation of every rank's local batch, regenerated
from per-rank seeds), SGD on both, and tight fp32 comparisons.

Every model here returns the mean loss over its batch, so the mean over ranks of the local
losses is the reference's loss, and averaged gradients are the reference's gradients.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp2.engine import collectives
from tests.harness import fsdp_api
from tests.models import MODELS, Batch
from tests.tolerance import FP32_ATOL, FP32_RTOL

SEED = 1234
LR = 0.1
RTOL, ATOL = FP32_RTOL, FP32_ATOL  # see tests/tolerance.py
LOCAL_BATCH = 4

MakeBatch = Callable[[torch.Generator, int], Batch]


def batch_seed(step: int, micro: int, rank: int) -> int:
    return 50_000 + 1_000 * step + 10 * micro + rank


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
            spec = MODELS[build]
            build, make_batch = spec.build, spec.make_batch
        if make_batch is None:
            raise ValueError("Lockstep needs make_batch unless build names a model in MODELS")
        torch.manual_seed(SEED)
        self.model = build()
        self.ref = copy.deepcopy(self.model)
        self.make_batch = make_batch
        self.local_batch = local_batch
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.optim: torch.optim.Optimizer | None = None
        self.ref_optim: torch.optim.Optimizer | None = None

    # -- data -------------------------------------------------------------------------------------

    def batch_for(self, step: int, micro: int, rank: int) -> Batch:
        """Rank ``rank``'s local micro-batch; override to make batches depend on the rank."""
        gen = torch.Generator().manual_seed(batch_seed(step, micro, rank))
        return self.make_batch(gen, self.local_batch)

    def local(self, step: int, micro: int = 0) -> Batch:
        return self.batch_for(step, micro, self.rank)

    def global_(self, step: int, micro: int = 0) -> Batch:
        parts = [self.batch_for(step, micro, r) for r in range(self.world_size)]
        return tuple(torch.cat(ts) for ts in zip(*parts, strict=True))

    # -- training ---------------------------------------------------------------------------------

    def make_optimizers(self) -> None:
        """SGD: exact arithmetic per element, so parameters compare as tightly as gradients.
        Call after sharding: the sharded model's parameters are new objects."""
        self.optim = torch.optim.SGD(self.model.parameters(), lr=LR)
        self.ref_optim = torch.optim.SGD(self.ref.parameters(), lr=LR)

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

    # -- checks -----------------------------------------------------------------------------------

    def check_grads(self, what: str, scale: Callable[[str], float] = lambda name: 1.0) -> int:
        """Every gradient equals the reference's (times ``scale(name)``); returns how many."""
        num = 0
        for (name, p), ref_p in zip(
            self.model.named_parameters(), self.ref.parameters(), strict=True
        ):
            if ref_p.grad is None:
                if p.grad is not None:
                    raise AssertionError(f"{what} {name}: reference grad is None, sharded is not")
                continue
            if p.grad is None:
                raise AssertionError(f"{what} {name}: sharded grad is None, reference is not")
            close(f"{what} grad {name}", full(p.grad), ref_p.grad * scale(name))
            num += 1
        if num == 0:
            raise AssertionError(f"{what}: no gradient to compare")
        return num

    def check_params(self, what: str) -> None:
        for (name, p), ref_p in zip(
            self.model.named_parameters(), self.ref.parameters(), strict=True
        ):
            if not isinstance(p, DTensor):
                raise AssertionError(
                    f"{what} {name}: expected a sharded DTensor, got a plain tensor"
                )
            close(f"{what} param {name}", full(p), ref_p.detach())


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def close(what: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(
        actual, expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"rank {dist.get_rank()} {what}: {m}"
    )


def mean_over_ranks(t: torch.Tensor) -> torch.Tensor:
    total = t.detach().clone()
    dist.all_reduce(total)  # SUM: gloo has no AVG all-reduce
    return total / dist.get_world_size()


def fsdp_modules(model: nn.Module, impl: str = "fsdp2") -> list[Any]:
    """Every module ``fully_shard`` (of ``impl``) was applied to, in ``modules()`` order."""
    return [m for m in model.modules() if isinstance(m, fsdp_api(impl).FSDPModule)]


def shard_mlp(model: nn.Module, impl: str = "fsdp2", **kwargs: Any) -> None:
    """``fully_shard`` each block of an `MLPStack`, then the root (groups "blocks.i" and "")."""
    fully_shard = fsdp_api(impl).fully_shard
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)


def count(records: Iterable[Any], kind: str) -> Counter[str]:
    """Collectives of ``kind`` per group label, from `fsdp2.engine.collectives.record_collectives`."""
    return Counter(r.label for r in records if r.kind == kind)


class SeamAwareMode(TorchDispatchMode):
    """A dispatch mode over c10d ops that tells fsdp2's reduce-scatter on gloo (issued as an
    in-place all-reduce of its own input) from an all-reduce: fsdp2 records each collective
    just before issuing it, so the c10d op that follows a fresh "reduce_scatter" record is it."""

    def __enter__(self) -> Any:
        self._recording = collectives.record_collectives()
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
