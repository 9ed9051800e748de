"""Comparing a sharded model with its reference: losses, gradients, parameters, buffers, layout.

Every comparison goes through `close`, with a `tests.tolerance.Tolerance`; a `Margin` passed
along records how much of the tolerance the comparisons used.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from tests.tolerance import FP32, Tolerance

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(kw_only=True)
class Margin:
    """The largest differences `close` saw, absolute and as a fraction of the tolerance."""

    max_diff: float = 0.0
    max_tol_used: float = 0.0
    """max |actual - expected| / (atol + rtol |expected|) over every comparison."""

    def record(self, actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance) -> None:
        if actual.numel():
            diff = (actual - expected).abs()
            tol_used = diff / (tol.atol + tol.rtol * expected.abs())
            self.max_diff = max(self.max_diff, diff.max().item())
            self.max_tol_used = max(self.max_tol_used, tol_used.max().item())


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank (a collective for a DTensor)."""
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
    tol: Tolerance = FP32,
    margin: Margin | None = None,
) -> None:
    """Raise unless ``actual`` is within ``tol`` of ``expected``."""
    if actual.dtype in FP8_DTYPES:  # assert_close compares fp8 only bitwise: upcast (exact)
        actual, expected = actual.float(), expected.float()
    if tol.normwise:
        error, scale = (actual - expected).norm().item(), expected.norm().item()
        if not error <= tol.atol + tol.rtol * scale:
            raise AssertionError(
                f"rank {dist.get_rank()} {what}: |actual - expected| = {error:.3g} exceeds "
                f"{tol.atol} + {tol.rtol} * |expected| = {tol.atol + tol.rtol * scale:.3g}"
            )
        return
    torch.testing.assert_close(
        actual,
        expected,
        rtol=tol.rtol,
        atol=tol.atol,
        msg=lambda m: f"rank {dist.get_rank()} {what}: {m}",
    )
    if margin is not None:
        margin.record(actual, expected, tol)


def mean_over_ranks(t: torch.Tensor) -> torch.Tensor:
    """Mean over every rank of a local loss (tensor-parallel peers hold equal losses, so this is
    the data-parallel mean); in at least fp32."""
    total = t.detach().to(torch.promote_types(t.dtype, torch.float32)).clone()
    dist.all_reduce(total)  # SUM: gloo has no AVG all-reduce
    return total / dist.get_world_size()


def compare_grads(
    model: nn.Module,
    ref: nn.Module,
    what: str,
    tol: Tolerance = FP32,
    *,
    scale: Callable[[str], float] | None = None,
    check_layout: bool = False,
    margin: Margin | None = None,
) -> int:
    """Every gradient equals the reference's (times ``scale(name)``); a gradient on one side
    only fails. ``check_layout``: also check each is laid out as FSDP promises. Returns how many
    gradients were compared."""
    num_compared = 0
    for (name, p), ref_p in zip(model.named_parameters(), ref.parameters(), strict=True):
        if ref_p.grad is None:
            if p.grad is not None:
                raise AssertionError(f"{what} {name}: reference grad is None, sharded is not")
            continue
        if p.grad is None:
            raise AssertionError(f"{what} {name}: sharded grad is None, reference is not")
        if check_layout:
            check_sharded_layout(f"{what} {name}.grad", p.grad, ref_p.shape)
        expected = ref_p.grad if scale is None else ref_p.grad * scale(name)
        close(f"{what} grad {name}", full(p.grad), expected, tol, margin)
        num_compared += 1
    return num_compared


def compare_params(
    model: nn.Module,
    ref: nn.Module,
    what: str,
    tol: Tolerance = FP32,
    *,
    check_layout: bool = False,
    margin: Margin | None = None,
) -> None:
    """Every parameter equals the reference's, within ``tol.for_params()``."""
    for (name, p), ref_p in zip(model.named_parameters(), ref.parameters(), strict=True):
        if check_layout:
            check_sharded_layout(f"{what} {name}", p, ref_p.shape)
        close(f"{what} param {name}", full(p).detach(), ref_p.detach(), tol.for_params(), margin)


def compare_buffers(model: nn.Module, ref: nn.Module, what: str) -> None:
    """Buffers stay whole, plain tensors on every rank, bitwise equal to the reference's (the
    same values, never reduced)."""
    for (name, b), ref_b in zip(model.named_buffers(), ref.buffers(), strict=True):
        if isinstance(b, DTensor):
            raise AssertionError(f"{what}: buffer {name} became a DTensor")
        torch.testing.assert_close(b, ref_b, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")


def padded_shard_numel(shape: torch.Size, world_size: int) -> int:
    """Elements of one rank's shard once dim 0 is padded to a multiple of the world size (a 0-d
    parameter counts as one element)."""
    if len(shape) == 0:
        return 1
    return math.ceil(shape[0] / world_size) * math.prod(shape[1:])


def expected_local_shape(full_shape: torch.Size, rank: int, world_size: int) -> torch.Size:
    """Rank r's `torch.chunk` of dim 0; empty on ranks past the last chunk."""
    if len(full_shape) == 0:
        return full_shape
    chunks = torch.empty(full_shape).chunk(world_size, dim=0)
    if rank < len(chunks):
        return chunks[rank].shape
    return torch.Size([0, *full_shape[1:]])


def check_sharded_layout(name: str, p: torch.Tensor, full_shape: torch.Size) -> None:
    """``p`` (a parameter or its gradient) is a ``(Shard(0),)`` DTensor whose local part is this
    rank's ``torch.chunk`` (no padding visible); fsdp2 replicates 0-d parameters instead."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if not isinstance(p, DTensor):
        raise AssertionError(f"{name}: expected a DTensor, got {type(p).__name__}")
    expected_placements = (Replicate(),) if len(full_shape) == 0 else (Shard(0),)
    if tuple(p.placements) != expected_placements:
        raise AssertionError(f"{name}: placements {p.placements}, expected {expected_placements}")
    if p.shape != full_shape:
        raise AssertionError(f"{name}: global shape {tuple(p.shape)}, expected {full_shape}")
    local_shape = p.to_local().shape
    if local_shape != expected_local_shape(full_shape, rank, world_size):
        raise AssertionError(
            f"{name}: rank {rank} local shape {tuple(local_shape)}, expected "
            f"{tuple(expected_local_shape(full_shape, rank, world_size))} (torch.chunk)"
        )


def step_both(
    model: nn.Module,
    ref: nn.Module,
    optim: torch.optim.Optimizer,
    ref_optim: torch.optim.Optimizer,
) -> None:
    """Compare every gradient with the reference's at the fp32 tolerance, then step and zero
    both optimizers (a hand-written lockstep loop's end of step)."""
    for (name, p), r in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(
            full(p.grad), r.grad, rtol=FP32.rtol, atol=FP32.atol, msg=f"grad of {name}"
        )
    for each in (optim, ref_optim):
        each.step()
        each.zero_grad()


def params_close_after_adamw(model: nn.Module, ref: nn.Module) -> None:
    """Parameters after AdamW steps: PARAM_ATOL, Adam's slack (tests.tolerance)."""
    from tests.tolerance import PARAM_ATOL

    for (name, p), r in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(full(p), r, rtol=FP32.rtol, atol=PARAM_ATOL, msg=name)
