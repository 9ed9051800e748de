"""The pair and its data: one seed for the model, one formula for every batch, one way to shard.

`twins` builds the model from `MODEL_SEED` and its reference as a copy. Every batch is
`global_batch(make_batch, step, micro, num_rows)`, seeded by `batch_seed(step, micro)` alone;
rank r of W trains on `rank_rows` r of it, the reference on all of it, so both see the same
rows whatever the world size, and every rank regenerates every batch (no data is exchanged).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from tests.harness import fsdp_api
from tests.models import MODELS, Batch

MODEL_SEED = 1234
LOCAL_BATCH = 4  # rows per rank in a step (or micro-step)
GLOBAL_BATCH = 8  # train_global_batches' rows per step: divisible by every world size tested

# AdamW. Adam's update lr * g / (|g| + eps) (one step, m = g, sqrt(v) = |g|) moves by at most
# lr / eps per unit change of g, near g = 0. The sharded run's gradients differ from the
# reference's by rounding (W partial sums against one matmul: ~1e-8, FP32_ATOL = 1e-6 at worst),
# so each step moves the two runs' parameters apart by up to lr / eps times that, and later steps
# compute their gradients at those parameters. With eps = 1e-5 that was 1000x: on AVX2 kernels
# the GPT's step-1 gradients then differed by 1.7e-6, past FP32_ATOL. eps = 1e-3 makes it 10x,
# and PARAM_ATOL = (lr / eps) * FP32_ATOL. Every gradient is compared before its step at the fp32
# tolerance, so a gradient off by a factor (which Adam's normalisation would hide) still fails.
LR, WEIGHT_DECAY, ADAM_EPS = 1e-2, 0.1, 1e-3
SGD_LR = 0.1  # SGD: exact arithmetic per element, so parameters compare as tightly as gradients

MakeBatch = Callable[[torch.Generator, int], Batch]


def adamw(params: Iterable[nn.Parameter]) -> torch.optim.AdamW:
    """The suite's optimizer: AdamW with the constants above."""
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, eps=ADAM_EPS)


def sgd(params: Iterable[nn.Parameter]) -> torch.optim.SGD:
    return torch.optim.SGD(params, lr=SGD_LR)


def twins(build: Callable[[], nn.Module] | str) -> tuple[nn.Module, nn.Module]:
    """The model to shard and its unsharded reference: equal values, built from `MODEL_SEED`
    (``build`` may name a model of `tests.models.MODELS`)."""
    if isinstance(build, str):
        build = MODELS[build].build
    torch.manual_seed(MODEL_SEED)
    model = build()
    return model, copy.deepcopy(model)


# -- data -----------------------------------------------------------------------------------------


def batch_seed(step: int, micro: int = 0) -> int:
    """The seed of the global batch of ``(step, micro)``; ``micro`` < 100."""
    return 10_000 + 100 * step + micro


def _batch_fn(make_batch: MakeBatch | str) -> MakeBatch:
    return MODELS[make_batch].make_batch if isinstance(make_batch, str) else make_batch


def global_batch(make_batch: MakeBatch | str, step: int, micro: int, num_rows: int) -> Batch:
    """The reference's batch of ``(step, micro)``: ``num_rows`` rows (``make_batch`` may name a
    model of `tests.models.MODELS`)."""
    gen = torch.Generator().manual_seed(batch_seed(step, micro))
    return _batch_fn(make_batch)(gen, num_rows)


def rank_rows(batch: Batch, rank: int, world_size: int) -> Batch:
    """Rank ``rank``'s contiguous share of the rows of ``batch``."""
    rows = batch[0].shape[0] // world_size
    return tuple(t[rank * rows : (rank + 1) * rows] for t in batch)


def local_batch(
    make_batch: MakeBatch | str,
    step: int,
    micro: int,
    rank: int,
    world_size: int,
    rows_per_rank: int = LOCAL_BATCH,
) -> Batch:
    """Rank ``rank``'s rows of the global batch of ``world_size * rows_per_rank`` rows."""
    batch = global_batch(make_batch, step, micro, world_size * rows_per_rank)
    return rank_rows(batch, rank, world_size)


def train_global_batches(
    name: str,
    model: nn.Module,
    optim: torch.optim.Optimizer,
    steps: Iterable[int],
    *,
    sharded: bool,
    input_dtype: torch.dtype | None = None,
) -> list[float]:
    """Train on the global batch of ``GLOBAL_BATCH`` rows of each of ``steps``; return each
    step's global loss. A sharded model takes its rank's rows and averages its loss over ranks;
    a plain one takes every row, so both see the same data. ``input_dtype``: cast floating-point
    inputs to it (e.g. for a float64 model)."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if sharded else (0, 1)
    losses = []
    for step in steps:
        local = rank_rows(global_batch(name, step, 0, GLOBAL_BATCH), rank, world)
        if input_dtype is not None:
            local = tuple(t.to(input_dtype) if t.is_floating_point() else t for t in local)
        loss = model(*local)
        loss.backward()
        optim.step()
        optim.zero_grad()
        loss = loss.detach().clone()
        if sharded:
            dist.all_reduce(loss)
        losses.append(loss.item() / world)
    return losses


# -- sharding -------------------------------------------------------------------------------------


def shard_model(model: nn.Module, name: str, impl: str = "fsdp2", **kwargs: Any) -> None:
    """``fully_shard`` (of ``impl``) each of the shard units of `MODELS` ``name``, then the
    root, with ``kwargs`` on every call. For an `MLPStack`: groups "blocks.i" and ""."""
    fully_shard = fsdp_api(impl).fully_shard
    for unit in MODELS[name].shard_units(model):
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)


def fsdp_modules(model: nn.Module, impl: str = "fsdp2") -> list[Any]:
    """Every module ``fully_shard`` (of ``impl``) was applied to, in ``modules()`` order."""
    return [m for m in model.modules() if isinstance(m, fsdp_api(impl).FSDPModule)]


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
