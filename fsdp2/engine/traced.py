"""Traced mode: fsdp2's all-gathers and reduce-scatters as ops inside the compiled graph.

fsdp2's default runtime gathers and reduces from eager hooks around each module's forward and
backward, which dynamo does not trace, so the collectives stay outside any compiled graph (see
docs/compile.md). ``set_traced(model)`` switches every fsdp2 module under ``model`` to a pure
function of its sharded parameters instead: before the module's own forward, its group's shards
are gathered with one functional all-gather (``_c10d_functional.all_gather_into_tensor``), the
gathered parameters are registered for the duration of that forward, and autograd turns the
gather into a reduce-scatter in backward. Dynamo and AOTAutograd trace both, so a whole model's
forward compiles with ``fullgraph=True`` and its backward graph holds the reduce-scatters, where
the compiler is free to reorder and overlap them.

[Note: traced gather]
One collective per group, as in eager mode: every parameter's local shard (real rows only, the
sharded dim first) is padded to its chunk and concatenated into this rank's flat shard, the flat
shards are gathered rank-major, and each parameter is cut back out of its column of chunks. The
gradients arrive through the same views, so autograd builds the padded, rank-major reduce-scatter
input by itself; :class:`_GatherShards` reduce-scatters it and divides, and the gradient of the
sharded ``DTensor`` parameter is its local part, as the optimizer expects.

[Note: traced resharding]
Autograd keeps whatever backward needs. Left alone it would keep the gathered parameters from
forward to backward, i.e. ``reshard_after_forward=False``. For groups that reshard after forward,
the gather runs under selective activation checkpointing that marks every op of it
``MUST_RECOMPUTE``: backward gathers again (eager recompute, or an all-gather in the compiled
backward graph) and forward frees the gathered parameters as soon as their last use is done.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from fsdp2.engine.changes import take_up_changes
from fsdp2.engine.policies import cast_floats
from fsdp2.engine.state import STATES, FSDPState, module_label

if TYPE_CHECKING:
    from fsdp2.engine.param import FSDPParam
    from fsdp2.engine.param_group import FSDPParamGroup

__all__ = ["set_traced", "traced_forward"]

_c10d = torch.ops._c10d_functional


def set_traced(module: nn.Module, traced: bool = True) -> None:
    """Run every fsdp2 module under ``module`` (itself included) in traced mode, or back.

    Call it on the root after the last ``fully_shard``, then ``torch.compile`` the model. In
    traced mode no hook runs: each forward gathers its group with a functional all-gather and
    its backward reduce-scatters the gradients. ``module`` counts as the root for the default
    ``reshard_after_forward`` (the root keeps its parameters until backward, others reshard).
    See docs/compile.md.

    Args:
        module: a module ``fully_shard`` was applied to, or one holding such modules.
        traced: ``True`` (default) for traced mode; ``False`` returns to the eager hooks.

    Raises:
        ValueError: ``module`` holds no fsdp2 module.
        NotImplementedError: a setting traced mode does not support (named, with the module).
    """
    states = STATES.under(module)
    if not states:
        raise ValueError(
            f"set_traced expects a module that fully_shard was applied to (or one holding such "
            f"modules), got a {type(module).__name__} with none; call fully_shard first"
        )
    fqns = {id(m): fqn or "<root>" for fqn, m in module.named_modules()}
    for state in states:
        unsupported = _unsupported(state) if traced else []
        if unsupported:
            where = ", ".join(f"{fqns[id(m)]} ({type(m).__name__})" for m in state.modules)
            raise NotImplementedError(
                f"fsdp2 traced mode does not support {', '.join(unsupported)}, found in the "
                f"fully_shard call on {where}; keep the eager hooks for this model and "
                "compile each block instead (see docs/compile.md)"
            )
    for state in states:
        if traced and state.group is not None:
            state.group.reshard()  # gathered tensors of an eager step would go stale
            state.group.rename(module_label([fqns[id(m)] for m in state.modules]))  # as lazy init
        if traced:
            state.decide_reshard_after_forward(any(m is module for m in state.modules))
        state.set_traced(traced)


def traced_forward(
    state: FSDPState, call: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``call(*args, **kwargs)`` (the module's forward) with its group's parameters gathered."""
    group = state.group
    if group is None:
        return call(*args, **kwargs)
    unsupported = _unsupported(state)  # again: set_* methods may have changed knobs since
    if unsupported:
        raise NotImplementedError(
            f"fsdp2 traced mode does not support {', '.join(unsupported)}, set on {group.label} "
            "after set_traced; undo that, or call set_traced(model, False) for the eager hooks"
        )
    if state.input_dtype is not None:
        args, kwargs = cast_floats((args, kwargs), state.input_dtype)
    if torch.compiler.is_compiling():
        # Adopting repacks buffers, which a graph cannot do: gather from whatever parameter the
        # module holds now (a replaced one recompiles on dynamo's identity guard), so an
        # assigned parameter is trained, never the stale one. Eager adoption catches up later.
        shards = [_held(fsdp_param) for fsdp_param in group.fsdp_params]
    else:
        take_up_changes(group)  # as the hooks do: assigned parameters, requires_grad_
        shards = [p.sharded_param for p in group.fsdp_params]
    if state.reshard_after_forward and torch.is_grad_enabled():
        context = functools.partial(create_selective_checkpoint_contexts, _recompute_everything)
        fulls = checkpoint(_gather, group, *shards, use_reentrant=False, context_fn=context)
    else:
        fulls = _gather(group, *shards)
    for fsdp_param, full in zip(group.fsdp_params, fulls, strict=True):
        for params, name in fsdp_param.slots:
            params[name] = full
    try:
        output = call(*args, **kwargs)
        if state.output_dtype is not None:
            output = cast_floats(output, state.output_dtype)
        return output
    finally:
        for fsdp_param, shard in zip(group.fsdp_params, shards, strict=True):
            for params, name in fsdp_param.slots:
                params[name] = shard


def _held(fsdp_param: FSDPParam) -> nn.Parameter:
    """The parameter the module holds in ``fsdp_param``'s place now."""
    params, name = fsdp_param.slots[0]
    return cast(nn.Parameter, params[name])


def _gather(group: FSDPParamGroup, *shards: torch.Tensor) -> list[torch.Tensor]:
    """Every parameter of ``group`` in full, from the sharded ``DTensor`` parameters ``shards``
    (see [Note: traced gather])."""
    pieces = []
    for fsdp_param, shard in zip(group.fsdp_params, shards, strict=True):
        local = cast(DTensor, shard).to_local()
        if fsdp_param.dim:
            local = local.movedim(fsdp_param.dim, 0)
        local = local.reshape(-1)
        padding = fsdp_param.chunk.numel - local.numel()
        pieces.append(F.pad(local, (0, padding)) if padding else local)
    flat = torch.cat(pieces)  # 1-D, this rank's padded shard of every parameter
    shard_group = group.info.shard_group
    if shard_group is None:
        raise AssertionError(f"traced gather of '{group.label}' needs a shard group")
    replicate_group = group.info.replicate_group  # HSDP: all-reduce over replicas after
    replicas = replicate_group.group_name if replicate_group is not None else None
    factor = group.settings.divide_factor or float(group.shard_size * group.info.replicate_size)
    gathered = _GatherShards.apply(  # type: ignore[no-untyped-call]
        flat,
        group.shard_size,
        shard_group.group_name,
        replicas,
        factor,
        group.layout.param_dtype,
        group.layout.reduce_dtype,
    )
    chunks = [p.chunk.numel for p in group.fsdp_params]
    columns = gathered.view(group.shard_size, group.layout.shard_numel).split(chunks, dim=1)
    fulls = []
    for fsdp_param, column in zip(group.fsdp_params, columns, strict=True):
        if not fsdp_param.shape:  # replicated: every rank sent the same value
            fulls.append(_OneOfReplicas.apply(column.reshape(-1)))  # type: ignore[no-untyped-call]
            continue
        full = fsdp_param.chunk.param_order(
            column.reshape(-1)[: fsdp_param.numel].view(fsdp_param.chunk.layout_shape)
        )
        spec = fsdp_param.outer_spec
        if spec is not None:  # tensor parallel: the gathered tensor is this rank's TP piece
            full = DTensor.from_local(
                full,
                spec.mesh,
                spec.placements,
                run_check=False,
                shape=spec.shape,
                stride=spec.stride,
                # On data-parallel dims (dp_mesh_dims), a Partial gradient is this rank's
                # contribution: the reduce-scatter sums it, as eager mode does (reduce.
                # local_grad); normalising it to Replicate here would all-reduce it first.
                # (A Replicate gradient there is split evenly, DTensor's rule.)
                grad_placements=tuple(
                    Partial() if axis in fsdp_param.chunk.dp_axes else p
                    for axis, p in enumerate(spec.placements)
                ),
            )
        fulls.append(full)
    return fulls


class _OneOfReplicas(torch.autograd.Function):
    """A 0-d parameter is replicated, so its gathered column holds the same value from every
    rank. Forward: that value. Backward: its gradient in every rank's chunk, so that the
    reduce-scatter hands each rank the reduced gradient (as eager mode does)."""

    @staticmethod
    def forward(ctx: Any, column: torch.Tensor) -> torch.Tensor:
        ctx.size = column.numel()
        return column[0].clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.reshape(1).expand(ctx.size).contiguous()


class _GatherShards(torch.autograd.Function):
    """Forward: cast every rank's flat shard to ``param_dtype`` and all-gather them over the
    shard group, rank-major (``world * shard_numel``). Backward: reduce-scatter (sum) the
    gradient of that in ``reduce_dtype``, all-reduce (sum) it over ``replicas`` (HSDP), divide by
    ``factor``, and hand it back in the shard's own dtype. The casts live here, not as separate
    autograd nodes, so that the reduced gradient goes straight from ``reduce_dtype`` to the
    parameter's dtype, as in eager mode."""

    @staticmethod
    def forward(
        ctx: Any,
        flat: torch.Tensor,
        world: int,
        group_name: str,
        replicas: str | None,
        factor: float,
        param_dtype: torch.dtype,
        reduce_dtype: torch.dtype,
    ) -> torch.Tensor:
        ctx.world, ctx.group_name, ctx.replicas, ctx.factor = world, group_name, replicas, factor
        ctx.dtype, ctx.reduce_dtype = flat.dtype, reduce_dtype
        gathered: torch.Tensor = _c10d.all_gather_into_tensor(
            flat.to(param_dtype), world, group_name
        )
        return _c10d.wait_tensor(gathered)  # type: ignore[no-any-return]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad = grad.to(ctx.reduce_dtype).contiguous()
        reduced = _c10d.wait_tensor(
            _c10d.reduce_scatter_tensor(grad, "sum", ctx.world, ctx.group_name)
        )
        if ctx.replicas is not None:
            reduced = _c10d.wait_tensor(_c10d.all_reduce(reduced, "sum", ctx.replicas))
        return (reduced / ctx.factor).to(ctx.dtype), None, None, None, None, None, None


def _recompute_everything(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_RECOMPUTE


def _unsupported(state: FSDPState) -> list[str]:
    """The features of ``state`` that traced mode does not implement."""
    group = state.group
    if group is None:
        return []
    found = []
    if len(state.groups) > 1:
        found.append("parameters on several meshes (shard_placement_fn)")
    info = group.info
    if info.shard_group is None:
        found.append("replicate-only meshes")
    if info.replicate_group is not None and not group.settings.requires_all_reduce:
        found.append("set_requires_all_reduce(False)")
    if group.layout.mixed:
        found.append("parameters of several dtypes in one group")
    if any(p.extension for p in group.fsdp_params):
        found.append("all-gather extensions (fsdp_pre_all_gather)")
    if group.settings.offload is not None:
        found.append("CPU offload")
    # A graph gathers at every forward: it can keep no copy between steps, nor gather in levels.
    if group.mode.traced_refusal is not None:
        found.append(group.mode.traced_refusal)
    if (
        group.settings.custom_all_gather is not None
        or group.settings.custom_reduce_scatter is not None
    ):
        found.append("custom collectives")
    if group.settings.reduce_scatter_group is not None:
        found.append("set_separate_reduce_scatter_group")
    if group.settings.all_reduce_hook is not None:
        found.append("an all-reduce hook")
    if not group.settings.requires_gradient_sync:
        found.append("set_requires_gradient_sync(False)")
    return found
