"""Parity on any data-parallel layout: a sharded model and a plain reference, trained side by side.

`tests/parity.py` checks plain FSDP on a 1-D mesh over every rank. The mesh, tensor-parallel,
mixed-precision and offload tests need the same check where the data-parallel ranks are not the
world (tensor-parallel ranks of one data-parallel group feed the same batch), where the reference
computes differently (bf16 casts of its fp32 weights), and with knobs turned between micro-steps.
`train_side_by_side` runs on every rank: each data-parallel rank trains on its own slice, the
reference (in-process, unsharded) on the concatenation of every slice, with AdamW on both; it
compares losses and every ``grad.full_tensor()`` each step, then every ``full_tensor()``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.func import functional_call

from fsdp2.engine.collectives import CollectiveRecord, record_collectives
from tests.models import Batch
from tests.parity import adamw
from tests.tolerance import FP32_ATOL, FP32_RTOL, PARAM_ATOL

MakeBatch = Callable[[torch.Generator, int], Batch]
LOCAL_BATCH = 4
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True, kw_only=True)
class Tolerance:
    rtol: float = FP32_RTOL
    atol: float = FP32_ATOL
    """For losses and gradients (see tests/tolerance.py)."""
    param_atol: float = PARAM_ATOL
    """For parameters after training: Adam turns gradient rounding noise into update noise."""
    normwise: bool = False
    """Compare ``|actual - expected| <= atol + rtol |expected|`` over whole tensors (2-norms)
    rather than per element: low-precision sums with cancellation have large per-element
    relative errors that say nothing about the computation as a whole."""


FP32 = Tolerance()
# bf16 keeps 8 significant bits: per-rank partial sums rounded to bf16 differ from one sum over
# the global batch by a few bf16 ulps, and sums with cancellation (a LayerNorm weight's gradient)
# have large per-element relative errors: compare whole tensors.
BF16_TOL = Tolerance(rtol=2e-2, atol=1e-6, param_atol=1e-6, normwise=True)
# A reference that does the very same arithmetic (see cast_forward) must match exactly. Only
# with 2 data-parallel ranks: a sum of two gradients is the same in either order, and halving
# (the mean) is exact in binary; with more ranks the collective's summation order is its own.
SAME_ARITHMETIC = Tolerance(rtol=0, atol=0, param_atol=0)


@dataclass(kw_only=True)
class SideBySide:
    losses: list[float] = field(default_factory=list)
    """Global loss per step: the mean over data-parallel ranks of the local losses."""
    ref_losses: list[float] = field(default_factory=list)
    records: list[list[CollectiveRecord]] = field(default_factory=list)
    """fsdp2's collectives of each step's forwards and backwards."""


def batch_seed(step: int, micro: int, dp_rank: int) -> int:
    return 70_000 + 1_000 * step + 10 * micro + dp_rank


def local_batch(make_batch: MakeBatch, step: int, micro: int, dp_rank: int) -> Batch:
    return make_batch(torch.Generator().manual_seed(batch_seed(step, micro, dp_rank)), LOCAL_BATCH)


def global_batch(make_batch: MakeBatch, step: int, micro: int, dp_size: int) -> Batch:
    parts = [local_batch(make_batch, step, micro, r) for r in range(dp_size)]
    return tuple(torch.cat(ts) for ts in zip(*parts, strict=True))


def full(t: torch.Tensor) -> torch.Tensor:
    if not isinstance(t, DTensor):
        return t
    if t.dtype in FP8_DTYPES:  # gloo moves no fp8: gather the bytes
        local = t.to_local().view(torch.uint8)
        as_bytes = DTensor.from_local(
            local, t.device_mesh, t.placements, shape=t.shape, stride=t.stride()
        )
        return as_bytes.full_tensor().view(t.dtype)
    return t.full_tensor()


def close(
    what: str,
    actual: torch.Tensor,
    expected: torch.Tensor,
    rtol: float,
    atol: float,
    normwise: bool = False,
) -> None:
    if actual.dtype in FP8_DTYPES:  # assert_close compares fp8 only bitwise: upcast (exact)
        actual, expected = actual.float(), expected.float()
    if normwise:
        error, scale = (actual - expected).norm().item(), expected.norm().item()
        if not error <= atol + rtol * scale:
            raise AssertionError(
                f"rank {dist.get_rank()} {what}: |actual - expected| = {error:.3g} exceeds "
                f"{atol} + {rtol} * |expected| = {atol + rtol * scale:.3g}"
            )
        return
    torch.testing.assert_close(
        actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"rank {dist.get_rank()} {what}: {m}"
    )


def mean_over_ranks(t: torch.Tensor) -> torch.Tensor:
    """Over every rank: tensor-parallel peers hold equal losses, so this is the data-parallel mean."""
    total = t.detach().float().clone()
    dist.all_reduce(total)  # SUM: gloo has no AVG all-reduce
    return total / dist.get_world_size()


def compare_grads(model: nn.Module, ref: nn.Module, what: str, tol: Tolerance) -> None:
    for (name, p), ref_p in zip(model.named_parameters(), ref.parameters(), strict=True):
        if (p.grad is None) != (ref_p.grad is None):
            raise AssertionError(f"{what} {name}: grad is {p.grad!r}, reference's {ref_p.grad!r}")
        if ref_p.grad is not None:
            close(f"{what} grad {name}", full(p.grad), ref_p.grad, tol.rtol, tol.atol, tol.normwise)


def compare_params(
    model: nn.Module, ref: nn.Module, what: str, rtol: float, atol: float, normwise: bool = False
) -> None:
    for (name, p), ref_p in zip(model.named_parameters(), ref.parameters(), strict=True):
        close(f"{what} param {name}", full(p).detach(), ref_p.detach(), rtol, atol, normwise)


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
    compare_params(model, ref, "before training", 0.0, 0.0)
    for step in range(num_steps):
        loss_sum, ref_loss_sum = torch.zeros(()), torch.zeros(())
        with record_collectives() as records:
            for micro in range(num_micro):
                if before_micro is not None:
                    before_micro(step, micro)
                loss = model(*local_batch(make_batch, step, micro, dp_rank))
                loss.backward()
                loss_sum += loss.detach().float()
        out.records.append(list(records))
        for micro in range(num_micro):
            ref_loss = ref_forward(ref, global_batch(make_batch, step, micro, dp_size))
            ref_loss.backward()
            ref_loss_sum += ref_loss.detach().float()
        global_loss = mean_over_ranks(loss_sum)
        close(f"step {step} loss", global_loss, ref_loss_sum, tol.rtol, tol.atol, tol.normwise)
        if check_grads:
            compare_grads(model, ref, f"step {step}", tol)
        for opt in (optim, ref_optim):
            opt.step()
            opt.zero_grad()
        out.losses.append(global_loss.item())
        out.ref_losses.append(ref_loss_sum.item())
    compare_params(model, ref, "after training", tol.rtol, tol.param_atol, tol.normwise)
    return out


def kinds(records: Iterable[CollectiveRecord]) -> Counter[tuple[str, int]]:
    """How many collectives of each (kind, world size)."""
    return Counter((r.kind, r.world_size) for r in records)


def count(records: Iterable[CollectiveRecord], kind: str) -> Counter[str]:
    """Collectives of ``kind`` per group label."""
    return Counter(r.label for r in records if r.kind == kind)


def same_on_all_ranks(value: Any) -> None:
    """Cross-rank sanity check: ``value`` is identical on every rank."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    if any(v != gathered[0] for v in gathered):
        raise AssertionError(f"expected the same value on every rank, got {gathered}")
