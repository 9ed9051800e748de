"""A parameter's gradient on its way into a reduction (``local_grad``) and, reduced, back to the
sharded parameter (``accumulate_grad``, ``hand_over``)."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial

from fsdp2.engine.param import FSDPParam

__all__ = ["Reduced", "accumulate_grad", "hand_over", "local_grad"]

# A reduced shard for its parameter, and, for a parameter this rank had no gradient for, the
# reduced flag that says whether any rank had one ([Note: gradients on some ranks only], reduce.py).
Reduced = tuple[FSDPParam, torch.Tensor, "torch.Tensor | None"]


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


def local_grad(fsdp_param: FSDPParam, grad: torch.Tensor) -> torch.Tensor:
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
    if grad.placements != target:
        grad = grad.redistribute(spec.mesh, target)
    return grad._local_tensor
