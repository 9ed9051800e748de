"""A parameter's gradient on its way into a reduction (``local_grad``; ``refuse_grad`` for one no
reduction can take) and, reduced, back to the sharded parameter (``cut_shards``,
``whole_shards``, ``accumulate_grad``, ``hand_over``)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial
from torch.distributed.tensor.placement_types import Placement

from fsdp2.engine.collectives import all_reduce, redistribute
from fsdp2.engine.param import FSDPParam

__all__ = [
    "Reduced",
    "accumulate_grad",
    "cut_shards",
    "hand_over",
    "local_grad",
    "refuse_grad",
    "whole_shards",
]

# A reduced shard for its parameter, and, for a parameter this rank had no gradient for, the
# reduced flag that says whether any rank had one ([Note: gradients on some ranks only], reduce.py).
Reduced = tuple[FSDPParam, torch.Tensor, "torch.Tensor | None"]


def cut_shards(
    out: torch.Tensor,
    flags: torch.Tensor | None,
    params: list[FSDPParam],
    used: list[bool] | None,
    device: torch.device,
    dtype: torch.dtype,
    each: bool,
) -> list[Reduced]:
    """A finished reduction's ``out`` (this rank's chunk of every parameter in ``params``) cut
    into their shards, on the shards' ``device`` in ``dtype``, or with ``each``, each in its
    own gradient dtype (mixed dtypes, a grad_dtype); ``flags``: the reduced flag of each
    parameter ``used`` says this rank had no gradient for."""
    out = out.to(device, out.dtype if each else dtype)  # no-op without mp or offload
    shards: list[Reduced] = []
    start = 0
    for i, fsdp_param in enumerate(params):
        shard = fsdp_param.local_view(out, start)
        flag = None if flags is None or used is None or used[i] else flags[i]
        shards.append(
            (fsdp_param, shard.to(fsdp_param.sharded_grad_dtype) if each else shard, flag)
        )
        start += fsdp_param.chunk.numel
    return shards


def whole_shards(
    params: list[FSDPParam], grads: list[torch.Tensor], device: torch.device
) -> list[Reduced]:
    """One rank and no replicas: each whole gradient is its parameter's shard."""
    shards: list[Reduced] = []
    for p, g in zip(params, grads, strict=True):
        # Usually already the shard's shape, dtype and device: skip the calls (per step, per
        # parameter, they were the largest single cost of a one-rank backward).
        if g.shape != p.chunk.local_shape:
            g = g.reshape(p.chunk.local_shape)
        if g.dtype != p.sharded_grad_dtype or g.device != device:
            g = g.to(device, p.sharded_grad_dtype)
        shards.append((p, g, None))
    return shards


def accumulate_grad(fsdp_param: FSDPParam, local: torch.Tensor) -> None:
    """Hand a reduced shard to the sharded parameter: as its gradient, or added to it; then run
    the parameter's post-accumulate-grad hooks (optimizer-in-backward steps there), once per
    backward, as autograd runs them for a plain parameter."""
    param = fsdp_param.sharded_param
    if not (param.requires_grad and fsdp_param.unsharded_param.requires_grad):
        # Frozen, by requires_grad_ on either parameter, maybe since its forward: as in plain
        # PyTorch, it gets no gradient.
        return
    if param.grad is None:
        param.grad = fsdp_param.make_grad(local)
    elif isinstance(param.grad, DTensor):
        param.grad._local_tensor.add_(local)
    else:
        raise RuntimeError(
            f"fsdp2 expected the gradient of {fsdp_param.fqn} to be None or a DTensor, found a "
            f"{type(param.grad).__name__}; assign gradients as DTensors or set them to None"
        )
    hooks = param._post_accumulate_grad_hooks  # None until one is registered
    if hooks:
        for hook in hooks.values():
            hook(param)


def hand_over(reduced: list[Reduced]) -> None:
    """At the end of backward: give each parameter its reduced shard, but not one that no rank
    had a gradient for, which stays ``None`` as in plain data parallel. Reading those flags
    waits for their reduce-scatters: only a rank that lacked some gradient pays for it."""
    flags = [flag for _, _, flag in reduced if flag is not None]
    anywhere = iter(torch.stack(flags).gt(0).tolist() if flags else [])
    for fsdp_param, shard, flag in reduced:
        if flag is None or next(anywhere):
            accumulate_grad(fsdp_param, shard)


def refuse_grad(fqn: str, grad: torch.Tensor) -> None:
    """Raise for a gradient no reduce-scatter can take: one with a graph, or a sparse one."""
    if not grad.requires_grad:
        raise RuntimeError(
            f"fsdp2: {fqn} got a gradient of layout {grad.layout}, but sharded gradients are "
            "reduce-scattered as dense tensors. A sparse gradient comes from "
            "nn.Embedding(..., sparse=True) or nn.EmbeddingBag(..., sparse=True): build the "
            "module with sparse=False (the default), or set module.sparse = False; sharding "
            "already spreads the embedding's memory over the ranks"
        )
    raise RuntimeError(
        f"fsdp2: backward(create_graph=True) gave {fqn} a gradient that requires grad, but "
        "the reduce-scatter that shards it is not differentiable, so its higher-order terms "
        "would be lost. Take higher-order gradients with respect to tensors that are not "
        "sharded parameters (torch.autograd.grad(loss, inputs, create_graph=True), as in a "
        "gradient penalty), or compute them on an unsharded copy of the model"
    )


def local_grad(fsdp_param: FSDPParam, grad: torch.Tensor, label: str) -> torch.Tensor:
    """The plain tensor to reduce for an unsharded gradient. A DTensor gradient (tensor
    parallel) is first laid out as its parameter on the model-parallel dims (e.g. ``Partial``
    after a row-wise layer is summed over tp), but a ``Partial`` on a data-parallel dim is left
    alone: its local tensor is this rank's contribution, which the reduce-scatter sums (or
    averages) over those very ranks. Summing it there first would count it once per rank.
    A sum over model-parallel ranks runs in the gradient's dtype: from torch 2.15 the reduce
    dtype, which such a parameter takes its gradient in (``RULES.unsharded_grad_as_computed``),
    before it the compute dtype, as torch's ``fully_shard`` sums it."""
    if not isinstance(grad, DTensor):
        return grad
    spec = fsdp_param.outer_spec
    if spec is None:
        raise AssertionError(
            f"{fsdp_param.fqn}: expected a DTensor gradient only for a DTensor parameter, "
            "found one for a plain parameter"
        )
    dp_axes = fsdp_param.chunk.dp_axes
    target = tuple(
        have if axis in dp_axes and isinstance(have, Partial) else want
        for axis, (have, want) in enumerate(zip(grad.placements, spec.placements, strict=True))
    )
    if grad.placements == target:
        return grad._local_tensor
    summed = _summed_through_seam(grad, target, label)
    if summed is not None:
        return summed
    return _laid_out_by_dtensor(grad, spec.mesh, target, label)


def _laid_out_by_dtensor(
    grad: DTensor, mesh: DeviceMesh, target: tuple[Placement, ...], label: str
) -> torch.Tensor:
    """Any other change of layout (a Partial to a Shard, several dims at once): DTensor's to
    plan and issue, the seam's to note. (Its own function: a closure in ``local_grad`` would
    turn that function's locals into cells, a cost on every gradient.)"""
    return redistribute(grad, target, label, lambda: grad.redistribute(mesh, target)._local_tensor)


def _summed_through_seam(
    grad: DTensor, target: tuple[Placement, ...], label: str
) -> torch.Tensor | None:
    """The common change, a ``Partial("sum")`` to ``Replicate()`` on one model-parallel dim
    (a SequenceParallel norm's weight, a row-wise layer's bias), as the seam's all-reduce over
    that dim's group: what DTensor's redistribution issues (the same collective on the same
    group, so the same sums), but recorded and seen by the hang report. ``None`` for any other
    change."""
    changed = [
        i
        for i, (have, want) in enumerate(zip(grad.placements, target, strict=True))
        if have != want
    ]
    if len(changed) != 1:
        return None
    axis = changed[0]
    have, want = grad.placements[axis], target[axis]
    if not (isinstance(have, Partial) and have.reduce_op == "sum" and want.is_replicate()):
        return None
    out = grad._local_tensor.clone()  # out of place, as DTensor's collective is
    all_reduce(out, grad.device_mesh.get_group(axis), label, dist.ReduceOp.SUM).wait()
    return out
