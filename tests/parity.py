"""Parity: a sharded model trains exactly like a plain copy trained on the whole global batch.

`run_parity` runs on every rank of a gloo group (through the harness, or under ``torchrun`` via
``python -m torch.distributed.run ... tests/parity.py``). Each rank builds the model from one seed,
shards it (``fully_shard`` on each unit, then the root), and also trains an unsharded reference
in-process on the concatenation of all ranks' local batches. Every rank regenerates every rank's
batch from per-rank seeds, so no data is exchanged. Each step compares the loss, every gradient
(before the optimizer step) and finally every parameter, and checks the sharded layout: a
``(Shard(0),)`` DTensor whose local part is rank r's ``torch.chunk`` (no padding visible;
fsdp2 replicates 0-d parameters instead).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

if __package__ in (None, ""):  # run as a script by torchrun: make `tests` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.harness import fsdp_api
from tests.models import MODELS, Batch, build_model, make_batch
from tests.tolerance import FP32_ATOL, FP32_RTOL, PARAM_ATOL

MODEL_SEED = 1234
LR, WEIGHT_DECAY = 1e-2, 0.1
# Adam's update lr * g / (|g| + eps) (one step, m = g, sqrt(v) = |g|) moves by at most lr / eps
# per unit change of g, near g = 0. The sharded run's gradients differ from the reference's by
# rounding (W partial sums against one matmul: ~1e-8, FP32_ATOL = 1e-6 at worst), so each step
# moves the two runs' parameters apart by up to lr / eps times that, and later steps compute
# their gradients at those parameters. With eps = 1e-5 that was 1000x: on AVX2 kernels the
# GPT's step-1 gradients then differed by 1.7e-6, past FP32_ATOL. eps = 1e-3 makes it 10x, and
# PARAM_ATOL = (lr / eps) * FP32_ATOL. Every gradient is compared before its step at the fp32
# tolerance, so a gradient off by a factor (which Adam's normalisation would hide) still fails.
ADAM_EPS = 1e-3
GLOBAL_BATCH = 8  # train_global_batches' rows per step: divisible by every world size tested


@dataclass(frozen=True, kw_only=True)
class ParityConfig:
    model: str
    impl: str
    num_steps: int = 5
    local_batch_size: int = 4
    reshard_after_forward: bool | None = None
    """Passed to every `fully_shard` call, the root's included; None keeps the default."""
    num_microbatches: int = 1
    """Forwards per backward: the local batch is split and the mean of the losses backpropagated."""
    set_to_none: bool = True
    """`model.zero_grad(set_to_none=...)` before each step."""
    eval_before_step: int | None = None
    """In this step, between zero_grad and the training forward, also compare a forward under
    `torch.no_grad()` on a held-out batch."""
    corrupt: Literal["grad", "param"] | None = None
    """Self-test of this check: add 1e-3 to one element of the last rank's shard of the first
    gradient (before the comparison) or of the last parameter (after the last step)."""
    rtol: float = FP32_RTOL
    atol: float = FP32_ATOL
    """Tolerance for losses and gradients (see tests/tolerance.py)."""
    param_atol: float = PARAM_ATOL
    """Parameters after training: 1e-3 of one lr step of slack for the noise Adam amplifies."""


@dataclass(kw_only=True)
class ParityResult:
    losses: list[float] = field(default_factory=list)
    """The sharded run's global loss per step (mean over ranks of the local losses)."""
    ref_losses: list[float] = field(default_factory=list)
    num_grads_compared: int = 0
    max_grad_diff: float = 0.0
    max_param_diff: float = 0.0
    max_tol_used: float = 0.0
    """max |actual - expected| / (atol + rtol |expected|) over every comparison: the margin."""


def batch_seed(step: int, rank: int) -> int:
    return 10_000 + 100 * step + rank


def global_batch(cfg: ParityConfig, seed_of_rank: Callable[[int], int], world_size: int) -> Batch:
    """All ranks' local batches, concatenated in rank order: the reference's batch."""
    parts = [
        make_batch(cfg.model, seed_of_rank(r), cfg.local_batch_size) for r in range(world_size)
    ]
    return tuple(torch.cat(ts) for ts in zip(*parts, strict=True))


def shard_model(model: nn.Module, cfg: ParityConfig) -> None:
    fully_shard = fsdp_api(cfg.impl).fully_shard
    kwargs: dict[str, Any] = {}
    if cfg.reshard_after_forward is not None:
        kwargs["reshard_after_forward"] = cfg.reshard_after_forward
    for unit in MODELS[cfg.model].shard_units(model):
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)


def adamw(params: Iterable[nn.Parameter]) -> torch.optim.AdamW:
    """The suite's optimizer: AdamW with the constants above."""
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, eps=ADAM_EPS)


def train_global_batches(
    name: str,
    model: nn.Module,
    optim: torch.optim.Optimizer,
    steps: Iterable[int],
    *,
    seed: int,
    sharded: bool,
    input_dtype: torch.dtype | None = None,
) -> list[float]:
    """Train on the global batch ``make_batch(name, seed + step, GLOBAL_BATCH)`` of each of
    ``steps``; return each step's global loss. A sharded model takes its rank's rows of each
    batch and averages its loss over ranks; a plain one takes every row, so both see the same
    data. ``input_dtype``: cast floating-point inputs to it (e.g. for a float64 model)."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if sharded else (0, 1)
    rows = GLOBAL_BATCH // world
    losses = []
    for step in steps:
        batch = make_batch(name, seed + step, GLOBAL_BATCH)
        local = [t[rank * rows : (rank + 1) * rows] for t in batch]
        if input_dtype is not None:
            local = [t.to(input_dtype) if t.is_floating_point() else t for t in local]
        loss = model(*local)
        loss.backward()
        optim.step()
        optim.zero_grad()
        loss = loss.detach().clone()
        if sharded:
            dist.all_reduce(loss)
        losses.append(loss.item() / world)
    return losses


@dataclass(frozen=True)
class PlannedGroup:
    """What one `fully_shard` call in `shard_model` should manage, computed without FSDP."""

    label: str
    """The module's FQN in the root ("" for the root): fsdp2's collective label."""
    module: nn.Module
    params: dict[str, nn.Parameter]
    """FQN -> parameter, for the parameters no earlier call claimed (shared ones count once)."""


def plan_groups(model: nn.Module, model_name: str) -> list[PlannedGroup]:
    """The groups `shard_model` creates on the unsharded ``model``, in call order (units
    bottom-up, then the root)."""
    fqn_of = {id(m): fqn for fqn, m in model.named_modules()}
    param_fqn = {id(p): fqn for fqn, p in model.named_parameters()}  # first FQN of a tied one
    claimed: set[int] = set()
    groups = []
    for module in [*MODELS[model_name].shard_units(model), model]:
        params = {}
        for p in module.parameters():
            if id(p) not in claimed:
                claimed.add(id(p))
                params[param_fqn[id(p)]] = p
        groups.append(PlannedGroup(fqn_of[id(module)], module, params))
    return groups


def padded_shard_numel(shape: torch.Size, world_size: int) -> int:
    """Elements of one rank's shard once dim 0 is padded to a multiple of the world size (a 0-d
    parameter counts as one element)."""
    if len(shape) == 0:
        return 1
    return math.ceil(shape[0] / world_size) * math.prod(shape[1:])


def expected_local_shape(full: torch.Size, rank: int, world_size: int) -> torch.Size:
    """Rank r's `torch.chunk` of dim 0; empty on ranks past the last chunk."""
    if len(full) == 0:
        return full
    chunks = torch.empty(full).chunk(world_size, dim=0)
    if rank < len(chunks):
        return chunks[rank].shape
    return torch.Size([0, *full[1:]])


def check_sharded_layout(name: str, p: torch.Tensor, full_shape: torch.Size) -> None:
    """``p`` (a parameter or its gradient) is a DTensor laid out as FSDP promises."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if not isinstance(p, DTensor):
        raise AssertionError(f"{name}: expected a DTensor, got {type(p).__name__}")
    # 0-d tensors cannot be sharded on dim 0; fsdp2 replicates them.
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


def _forward_backward(model: nn.Module, batch: Batch, num_microbatches: int) -> torch.Tensor:
    micro = zip(*(t.chunk(num_microbatches) for t in batch), strict=True)
    loss = torch.stack([model(*mb) for mb in micro]).mean()
    loss.backward()
    return loss.detach()


def _global_mean(loss: torch.Tensor) -> torch.Tensor:
    """Mean over ranks of the local mean losses: the global-batch mean for equal local batches."""
    loss = loss.detach().clone()
    dist.all_reduce(loss)
    return loss / dist.get_world_size()


class _Comparer:
    """assert_close that also records how much of the tolerance each comparison used."""

    def __init__(self, rtol: float, atol: float) -> None:
        self.rtol, self.atol = rtol, atol
        self.max_diff = 0.0
        self.max_tol_used = 0.0

    def __call__(self, what: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
        torch.testing.assert_close(
            actual, expected, rtol=self.rtol, atol=self.atol, msg=lambda m: f"{what}: {m}"
        )
        if actual.numel():
            diff = (actual - expected).abs()
            tol_used = diff / (self.atol + self.rtol * expected.abs())
            self.max_diff = max(self.max_diff, diff.max().item())
            self.max_tol_used = max(self.max_tol_used, tol_used.max().item())


def compare_grads(model: nn.Module, ref: nn.Module, step: int, close: _Comparer) -> int:
    """Compare every gradient; returns how many were not None."""
    num_compared = 0
    for (name, p), (_, ref_p) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        if ref_p.grad is None:
            if p.grad is not None:
                raise AssertionError(f"step {step} {name}: reference grad is None, sharded is not")
            continue
        if p.grad is None:
            raise AssertionError(f"step {step} {name}: sharded grad is None, reference is not")
        check_sharded_layout(f"step {step} {name}.grad", p.grad, ref_p.shape)
        close(f"step {step} grad {name}", p.grad.full_tensor(), ref_p.grad)
        num_compared += 1
    return num_compared


def compare_params_and_buffers(
    model: nn.Module, ref: nn.Module, when: str, close: _Comparer
) -> None:
    for (name, p), (_, ref_p) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        check_sharded_layout(f"{when} {name}", p, ref_p.shape)
        close(f"{when} param {name}", p.full_tensor(), ref_p.detach())
    for (name, b), (_, ref_b) in zip(model.named_buffers(), ref.named_buffers(), strict=True):
        # Buffers stay whole, plain tensors on every rank.
        if isinstance(b, DTensor):
            raise AssertionError(f"{when}: buffer {name} became a DTensor")
        torch.testing.assert_close(b, ref_b, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")


def _corrupt_last_rank(tensor: torch.Tensor) -> None:
    if not isinstance(tensor, DTensor):
        raise AssertionError(f"expected a DTensor, got {type(tensor).__name__}")
    if dist.get_rank() == dist.get_world_size() - 1:
        with torch.no_grad():
            tensor.to_local().view(-1)[0] += 1e-3


def run_parity(cfg: ParityConfig) -> dict[str, Any]:
    """Train the sharded model and the reference side by side; raise on any mismatch."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    spec = MODELS[cfg.model]
    if cfg.local_batch_size % cfg.num_microbatches:
        raise ValueError(f"local_batch_size must divide by num_microbatches: {cfg}")
    model = build_model(cfg.model, MODEL_SEED)
    ref = build_model(cfg.model, MODEL_SEED)
    init_params = [p.detach().clone() for p in ref.parameters()]
    names = [n for n, _ in model.named_parameters()]
    shard_model(model, cfg)
    if [n for n, _ in model.named_parameters()] != names:
        raise AssertionError(f"fully_shard changed parameter names: {names}")
    close = _Comparer(cfg.rtol, cfg.atol)
    close_params = _Comparer(cfg.rtol, cfg.param_atol)
    compare_params_and_buffers(model, ref, "after fully_shard", close)

    optim = adamw(model.parameters())
    ref_optim = adamw(ref.parameters())
    result = ParityResult()
    for step in range(cfg.num_steps):
        for m in (model, ref):
            m.zero_grad(set_to_none=cfg.set_to_none)
            if spec.prepare_step is not None:
                spec.prepare_step(m, step)
        if step == cfg.eval_before_step:
            # After zero_grad, not before: in torch's FSDP2 a no_grad forward with
            # reshard_after_forward=False leaves the unsharded parameters registered, so a
            # following `model.zero_grad()` misses the sharded gradients (fsdp2 reshards instead).
            # The held-out batch comes from another seed space: never a training batch.
            held_out = make_batch(cfg.model, batch_seed(step, rank) + 50, cfg.local_batch_size)
            ref_held_out = global_batch(cfg, lambda r, s=step: batch_seed(s, r) + 50, world_size)
            with torch.no_grad():
                eval_loss = _global_mean(model(*held_out))
                ref_eval_loss = ref(*ref_held_out)
            close(f"step {step} eval loss", eval_loss, ref_eval_loss)
        local = make_batch(cfg.model, batch_seed(step, rank), cfg.local_batch_size)
        loss = _global_mean(_forward_backward(model, local, cfg.num_microbatches))
        ref_batch = global_batch(cfg, lambda r, s=step: batch_seed(s, r), world_size)
        ref_loss = _forward_backward(ref, ref_batch, cfg.num_microbatches)
        close(f"step {step} loss", loss, ref_loss)
        if cfg.corrupt == "grad":
            _corrupt_last_rank(next(p.grad for p in model.parameters() if p.grad is not None))
        result.num_grads_compared += compare_grads(model, ref, step, close)
        optim.step()
        ref_optim.step()
        result.losses.append(loss.item())
        result.ref_losses.append(ref_loss.item())

    if cfg.corrupt == "param":
        _corrupt_last_rank(list(model.parameters())[-1])
    compare_params_and_buffers(model, ref, "after training", close_params)
    # Guard against a vacuous pass: training must have moved the parameters.
    if all(
        torch.equal(p0, p.detach()) for p0, p in zip(init_params, ref.parameters(), strict=True)
    ):
        raise AssertionError("no parameter changed during training")
    result.max_grad_diff = close.max_diff
    result.max_param_diff = close_params.max_diff
    result.max_tol_used = max(close.max_tol_used, close_params.max_tol_used)
    return asdict(result)


def _main() -> None:
    """Entry point under torchrun: prints one ``PARITY OK ...`` line per rank on success."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="mlp", choices=sorted(MODELS))
    parser.add_argument("--impl", default=os.environ.get("FSDP2_TEST_IMPL", "fsdp2"))
    parser.add_argument("--num-steps", type=int, default=5)
    parser.add_argument("--corrupt", choices=["grad", "param"], default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        cfg = ParityConfig(
            model=args.model, impl=args.impl, num_steps=args.num_steps, corrupt=args.corrupt
        )
        result = run_parity(cfg)
        line = (
            f"PARITY OK rank={dist.get_rank()} world_size={dist.get_world_size()} "
            f"model={cfg.model} impl={cfg.impl} losses={result['losses']} "
            f"max_grad_diff={result['max_grad_diff']:.3g} "
            f"max_param_diff={result['max_param_diff']:.3g}\n"
        )
        # One write (under PIPE_BUF): ranks share torchrun's stdout, and print() writes the text
        # and the newline separately, so two ranks' lines could interleave.
        sys.stdout.write(line)
        sys.stdout.flush()
    finally:
        dist.destroy_process_group()
    # Success is decided; skip interpreter teardown, where gloo sometimes aborts (which torchrun
    # would report as this rank failing).
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    _main()
