"""`run_parity`: the standard parity run of a model of `tests.models.MODELS`.

It runs on every rank of a gloo group (through the harness, or under ``torchrun`` via
``tests/parity/__main__.py``). Each rank builds the pair (`twins`), shards the model
(`shard_model`), and trains both with AdamW on the same global batches. Each step compares the
loss and every gradient (before the optimizer step), finally every parameter and buffer, and
checks the sharded layout.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from tests.models import MODELS, Batch
from tests.parity.build import LOCAL_BATCH, adamw, global_batch, rank_rows, shard_model, twins
from tests.parity.compare import (
    Margin,
    close,
    compare_buffers,
    compare_grads,
    compare_params,
    mean_over_ranks,
)
from tests.tolerance import FP32, SAME_ARITHMETIC, Tolerance

HELD_OUT = 50
"""The micro-batch index of a step's held-out batch: never a training batch."""


@dataclass(frozen=True, kw_only=True)
class ParityConfig:
    model: str
    impl: str
    num_steps: int = 5
    local_batch_size: int = LOCAL_BATCH
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
    tol: Tolerance = FP32


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


def _forward_backward(model: nn.Module, batch: Batch, num_microbatches: int) -> torch.Tensor:
    micro = zip(*(t.chunk(num_microbatches) for t in batch), strict=True)
    loss = torch.stack([model(*mb) for mb in micro]).mean()
    loss.backward()
    return loss.detach()


def _corrupt_last_rank(tensor: torch.Tensor) -> None:
    if not isinstance(tensor, DTensor):
        raise AssertionError(f"expected a DTensor, got {type(tensor).__name__}")
    if dist.get_rank() == dist.get_world_size() - 1:
        with torch.no_grad():
            tensor.to_local().view(-1)[0] += 1e-3


def _sharded_twins(cfg: ParityConfig) -> tuple[nn.Module, nn.Module]:
    """The pair, the model sharded; checks that sharding kept the names and the values."""
    model, ref = twins(cfg.model)
    names = [n for n, _ in model.named_parameters()]
    kwargs = {}
    if cfg.reshard_after_forward is not None:
        kwargs["reshard_after_forward"] = cfg.reshard_after_forward
    shard_model(model, cfg.model, cfg.impl, **kwargs)
    if [n for n, _ in model.named_parameters()] != names:
        raise AssertionError(f"fully_shard changed parameter names: {names}")
    # Sharding copies the values: bitwise.
    compare_params(model, ref, "after fully_shard", SAME_ARITHMETIC, check_layout=True)
    compare_buffers(model, ref, "after fully_shard")
    return model, ref


def run_parity(cfg: ParityConfig) -> dict[str, Any]:
    """Train the sharded model and the reference side by side; raise on any mismatch."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    spec = MODELS[cfg.model]
    if cfg.local_batch_size % cfg.num_microbatches:
        raise ValueError(f"local_batch_size must divide by num_microbatches: {cfg}")
    model, ref = _sharded_twins(cfg)
    init_params = [p.detach().clone() for p in ref.parameters()]
    grad_margin, param_margin = Margin(), Margin()

    def batches(step: int, micro: int = 0) -> tuple[Batch, Batch]:
        """This rank's batch and the reference's."""
        batch = global_batch(cfg.model, step, micro, world_size * cfg.local_batch_size)
        return rank_rows(batch, rank, world_size), batch

    optim, ref_optim = adamw(model.parameters()), adamw(ref.parameters())
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
            held_out, ref_held_out = batches(step, HELD_OUT)
            with torch.no_grad():
                eval_loss = mean_over_ranks(model(*held_out))
                ref_eval_loss = ref(*ref_held_out)
            close(f"step {step} eval loss", eval_loss, ref_eval_loss, cfg.tol, grad_margin)
        local, ref_batch = batches(step)
        loss = mean_over_ranks(_forward_backward(model, local, cfg.num_microbatches))
        ref_loss = _forward_backward(ref, ref_batch, cfg.num_microbatches)
        close(f"step {step} loss", loss, ref_loss, cfg.tol, grad_margin)
        if cfg.corrupt == "grad":
            _corrupt_last_rank(next(p.grad for p in model.parameters() if p.grad is not None))
        result.num_grads_compared += compare_grads(
            model, ref, f"step {step}", cfg.tol, check_layout=True, margin=grad_margin
        )
        optim.step()
        ref_optim.step()
        result.losses.append(loss.item())
        result.ref_losses.append(ref_loss.item())

    if cfg.corrupt == "param":
        _corrupt_last_rank(list(model.parameters())[-1])
    compare_params(model, ref, "after training", cfg.tol, check_layout=True, margin=param_margin)
    compare_buffers(model, ref, "after training")
    # Guard against a vacuous pass: training must have moved the parameters.
    if all(
        torch.equal(p0, p.detach()) for p0, p in zip(init_params, ref.parameters(), strict=True)
    ):
        raise AssertionError("no parameter changed during training")
    result.max_grad_diff = grad_margin.max_diff
    result.max_param_diff = param_margin.max_diff
    result.max_tol_used = max(grad_margin.max_tol_used, param_margin.max_tol_used)
    return asdict(result)


def main() -> None:
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
