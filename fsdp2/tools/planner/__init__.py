"""``fsdp2.plan``: what a sharded training run will hold and move per rank, before launching it.

The model is built on the meta device, sharded by the user's own function over a fake process
group of the requested size (so fsdp2 lays out exactly the buffers a real rank would have, at
their real sizes, with no memory behind them), and the groups it made are read back and added up.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn

from fsdp2.engine.coalesce import coalesce_bytes
from fsdp2.engine.modes import MODES
from fsdp2.tools.auto import auto_shard
from fsdp2.tools.planner.activations import activation_bytes
from fsdp2.tools.planner.estimate import collectives, transient
from fsdp2.tools.planner.groups import GroupFacts, collect_groups
from fsdp2.tools.planner.report import Comparison, Plan
from fsdp2.tools.planner.world import (
    PlanError,
    beside_live_group,
    build_on_meta,
    call_shard,
    fake_mesh,
    mesh_shape_of,
)

__all__ = ["Comparison", "Plan", "PlanError", "default_shard", "plan"]

# Optimizer state per trainable element, in units of the parameter's own element size.
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 1, "none": 0}


def plan(
    build: Callable[[], nn.Module],
    shard: Callable[..., Any] | None = None,
    *,
    world_size: int | Sequence[int] = 8,
    optimizer: str | float = "adamw",
    batch: Any = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    device: str = "cuda",
    **fully_shard_kwargs: Any,
) -> Plan:
    """Plan one rank of a run: its memory and collectives per step, before launching it.

    The model is built on the meta device and sharded over a fake process group of the size
    asked; nothing is allocated. ``print`` the result, or ``compare`` world sizes.

    Args:
        build: makes the model (called under the meta device).
        shard: ``shard(model)`` or ``shard(model, mesh)`` applies ``fully_shard`` as the
            training script does; default: ``fsdp2.auto_shard`` with ``fully_shard_kwargs``.
        world_size: ranks (FSDP) or ``(replicate, shard)`` (HSDP); ``Plan.compare`` plans
            other sizes.
        optimizer: ``"adamw"``, ``"adam"``, ``"sgd"`` (with momentum), ``"none"``, or state
            bytes per trainable parameter element.
        batch: one rank's example inputs (tensors, or a function returning them), to estimate
            activations; ``None`` leaves them out.
        loss_fn: turns the model's output into the loss for that estimate (default: the
            last 0-d tensor of the output that requires grad, else the sum of its first
            tensor).
        device: the target's device type, which decides backward prefetch (fsdp2 does not
            prefetch on CPU meshes).
        **fully_shard_kwargs: for the default shard function only.

    Returns:
        A :class:`Plan`.

    Raises:
        PlanError: a mistake in the arguments or in what ``build``/``shard`` do.
    """
    if shard is not None and fully_shard_kwargs:
        raise PlanError(
            f"fully_shard options {sorted(fully_shard_kwargs)} apply only without a shard "
            "function; pass them in your shard function's fully_shard calls instead"
        )
    if isinstance(optimizer, str | int | float) and not isinstance(optimizer, str):
        if not optimizer >= 0:
            raise PlanError(f"optimizer state bytes per element must be >= 0, got {optimizer}")
    elif not isinstance(optimizer, str) or optimizer.lower() not in OPTIMIZER_STATES:
        raise PlanError(
            f"optimizer must be one of {sorted(OPTIMIZER_STATES)} or bytes per parameter "
            f"element (a number), got {optimizer!r}"
        )
    return _plan_one(
        build,
        shard,
        world_size,
        optimizer=optimizer,
        device=device,
        fully_shard_kwargs=fully_shard_kwargs,
        activations=_lazy_activations(build, batch, loss_fn, fully_shard_kwargs),
    )


def _lazy_activations(
    build: Callable[[], nn.Module], batch: Any, loss_fn: Any, kwargs: dict[str, Any]
) -> Callable[[torch.dtype | None], int | None]:
    """Activations do not depend on the world size: computed once, on first use."""
    cache: dict[torch.dtype | None, int | None] = {}

    def get(dtype: torch.dtype | None) -> int | None:
        if batch is None:
            return None
        if dtype not in cache:
            cache[dtype] = activation_bytes(build, batch, loss_fn, dtype)
        return cache[dtype]

    return get


def _plan_one(
    build: Callable[[], nn.Module],
    shard: Callable[..., Any] | None,
    world_size: int | Sequence[int],
    *,
    optimizer: str | float,
    device: str,
    fully_shard_kwargs: dict[str, Any],
    activations: Callable[[torch.dtype | None], int | None],
) -> Plan:
    shape = mesh_shape_of(world_size)
    groups, notes, buffers = beside_live_group(
        functools.partial(_shard_on_fake_mesh, build, shard, shape, fully_shard_kwargs)
    )
    dtypes = {g.param_dtype for g in groups}
    compute = getattr(torch, dtypes.pop()) if len(dtypes) == 1 else None
    act = activations(compute if compute is not None and compute != torch.float32 else None)
    if act is not None:
        notes.append(
            "activations: one forward+backward under FakeTensorMode on the batch given (per "
            "rank); misses kernels' workspaces and allocator fragmentation"
        )
    budget = coalesce_bytes()  # the switch as it stands now: the run will read it too
    if budget:
        notes.append(
            f"collectives and transients of a steady-state step (every step after the first) "
            f"with coalescing at {budget:,} B: the first step gathers each group alone in "
            "forward, having no recorded order yet"
        )
    noted = {g.note: list(MODES).index(g.mode) for g in groups if g.note}
    notes.extend(sorted(noted, key=noted.__getitem__))  # the modes' notes, in MODES' order
    moves = transient(groups, prefetch=device != "cpu", budget=budget, gloo=device == "cpu")
    return Plan(
        world_size=shape,
        num_params=sum(g.num_params for g in groups),
        optimizer=str(optimizer),
        param_bytes=sum(g.sharded_bytes for g in groups),
        param_padding_bytes=sum(g.sharded_bytes - g.param_last_bytes for g in groups),
        grad_bytes=sum(g.grad_bytes for g in groups),
        grad_padding_bytes=sum(g.grad_bytes - g.grad_last_bytes for g in groups),
        grad_flag_bytes=sum(g.grad_flag_bytes for g in groups),
        optim_bytes=_optimizer_bytes(groups, optimizer),
        buffer_bytes=buffers,
        kept_gathered_bytes=sum(g.kept_bytes for g in groups),
        forward_transient_bytes=moves.forward_bytes,
        forward_transient_at=moves.forward_at,
        backward_transient_bytes=moves.backward_bytes,
        backward_transient_at=moves.backward_at,
        backward_start_bytes=moves.backward_start_bytes,
        activation_bytes=act,
        collectives=collectives(groups, prefetch=device != "cpu", budget=budget),
        coalesce_bytes=budget,
        groups=groups,
        notes=notes,
        _replan=functools.partial(
            _plan_one,
            build,
            shard,
            optimizer=optimizer,
            device=device,
            fully_shard_kwargs=fully_shard_kwargs,
            activations=activations,
        ),
    )


def _shard_on_fake_mesh(
    build: Callable[[], nn.Module],
    shard: Callable[..., Any] | None,
    shape: tuple[int, ...],
    fully_shard_kwargs: dict[str, Any],
) -> tuple[list[GroupFacts], list[str], int]:
    """The model built on meta and sharded by ``shard`` (or the default) over a fake mesh: its
    groups, notes, and buffer bytes (plain values, to come back from a forked process)."""
    notes = []
    model = build_on_meta(build)
    with fake_mesh(shape) as mesh:
        if shard is None:
            shard, how = default_shard(fully_shard_kwargs)
            notes.append(f"no shard function given: {how}")
        try:
            call_shard(shard, model, mesh)
        except PlanError:
            raise
        except (ValueError, NotImplementedError) as e:
            raise PlanError(f"sharding at world size {shape} failed: {e}") from e
        groups = collect_groups(model)
    if not groups:
        raise PlanError(
            "the shard function did not call fully_shard on the model (no fsdp2 parameter "
            "group was found). It must apply fsdp2.fully_shard (or fsdp2.auto_shard) to the "
            "model it is given, e.g. its blocks and then the model itself"
        )
    unmanaged = [n for n, p in model.named_parameters() if not _is_sharded(p)]
    if unmanaged:
        notes.append(f"{len(unmanaged)} parameters not sharded (e.g. {unmanaged[0]}): not counted")
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return groups, notes, buffers


def _optimizer_bytes(groups: list[GroupFacts], optimizer: str | float) -> int:
    """State per trainable element: in units of its own dtype for a named optimizer (torch
    keeps moments in the parameter's dtype), or the bytes given."""
    if isinstance(optimizer, str):
        factor = OPTIMIZER_STATES[optimizer.lower()]
        return sum(g.trainable_local_bytes * factor for g in groups)
    return sum(round(g.trainable_local_numel * float(optimizer)) for g in groups)


def _is_sharded(param: nn.Parameter) -> bool:
    return hasattr(param, "_fsdp2_owner")


def default_shard(kwargs: dict[str, Any]) -> tuple[Callable[..., Any], str]:
    """The shard function used without one: :func:`~fsdp2.tools.auto.auto_shard` with
    ``kwargs``, and the note that says so."""
    return functools.partial(auto_shard, **kwargs), "used fsdp2.auto_shard"
