"""Activation memory of one training step, estimated on fake tensors: the model is built and run
forward and backward under ``FakeTensorMode`` (shapes and dtypes only, no data, no memory), with
torch's ``MemTracker`` counting what would be live.

What this cannot see: the batch is per rank and unsharded parameters stand in for the gathered
ones (FSDP's own buffers are the planner's transient model); kernels' internal workspaces;
allocator fragmentation; data-dependent shapes (fake tensors take the batch's shapes as given).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_leaves, tree_map

__all__ = ["activation_bytes", "default_loss"]


def default_loss(output: Any) -> torch.Tensor:
    """The step's loss: the last 0-d tensor in ``output`` (e.g. ``(logits, loss)``), else the
    sum of its first tensor."""
    tensors = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor)]
    scalars = [t for t in tensors if t.dim() == 0 and t.requires_grad]
    if scalars:
        return scalars[-1]
    if not tensors:
        raise ValueError("the model's output holds no tensor to take a loss of; pass loss_fn=")
    return tensors[0].float().sum()


def activation_bytes(
    build: Callable[[], nn.Module],
    batch: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None,
    compute_dtype: torch.dtype | None,
) -> int:
    """Peak bytes of activations and temporaries over one forward + backward on ``batch``
    (a tuple of tensors or shapes' stand-ins, or a function returning one)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        model = _build_in(build, compute_dtype)  # mixed precision computes in param_dtype
        args = batch() if callable(batch) else batch
        if not isinstance(args, tuple | list):
            args = (args,)
        args = tree_map(lambda t: _fake(mode, t, compute_dtype), tuple(args))
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker:
            loss = (loss_fn or default_loss)(model(*args))
            loss.backward()  # type: ignore[no-untyped-call]
        peak = tracker.get_tracker_snapshot("peak")
    total = 0
    for per_device in peak.values():
        for kind, nbytes in per_device.items():
            if str(kind).endswith(("ACT", "TEMP")):
                total += nbytes
    return total


def _build_in(build: Callable[[], nn.Module], dtype: torch.dtype | None) -> nn.Module:
    """``build()`` with floating parameters made in ``dtype`` (fake parameters cannot be
    converted by ``module.to`` afterwards: it swaps tensors, which fake ones refuse)."""
    if dtype is None:
        return build()
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return build()
    finally:
        torch.set_default_dtype(default)


def _fake(mode: FakeTensorMode, value: Any, dtype: torch.dtype | None) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    fake: torch.Tensor
    if mode.is_our_fake(value):
        fake = value
    elif value.device.type == "meta":  # a shape stand-in: made fake on the default device
        fake = torch.empty(value.shape, dtype=value.dtype)
    else:
        fake = mode.from_tensor(value)
    if dtype is not None and fake.is_floating_point():
        fake = fake.to(dtype)
    return fake
