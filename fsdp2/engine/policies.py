"""Policies that tune how fsdp2 stores and moves parameters: small frozen dataclasses."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn as nn

from fsdp2.engine.tree import map_tensors

__all__ = ["CPUOffloadPolicy", "DataParallelMeshDims", "MixedPrecisionPolicy", "OffloadPolicy"]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes used around the sharded parameters; ``None`` everywhere means full precision.

    Sharded parameters and optimizer state always keep the parameters' original dtype.
    """

    param_dtype: torch.dtype | None = None
    """Dtype of the all-gather and of the unsharded parameters used in forward/backward."""
    reduce_dtype: torch.dtype | None = None
    """Dtype of the gradient reduction, and of the sum kept while gradient sync is off. ``None``
    follows the installed torch (engine/releases.py): from 2.15 each parameter's own dtype (an
    fp32 parameter computed in bf16 reduces in fp32), before 2.15 ``param_dtype``."""
    output_dtype: torch.dtype | None = None
    """Dtype that the module's floating-point outputs are cast to; ``None`` leaves them alone."""
    cast_forward_inputs: bool = True
    """Whether floating-point forward inputs are cast to ``param_dtype``."""
    # Not in the repr: a function's repr names its address, which differs between ranks, and
    # the policy's repr is what every rank compares at fully_shard (agreement.py; its answers
    # per parameter are compared instead) and what messages and auto_shard's summary print.
    param_dtype_override_fn: Callable[[nn.Parameter], torch.dtype | None] | None = field(
        default=None, kw_only=True, repr=False
    )
    """Asked once per parameter at ``fully_shard``: ``None`` or ``param_dtype`` gathers it in
    ``param_dtype``, its own dtype keeps it in that dtype (norms in fp32 beside bf16 weights);
    anything else raises. It must answer alike on every rank. Inputs are still cast to
    ``param_dtype``."""

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, torch.dtype):
                raise TypeError(
                    f"MixedPrecisionPolicy.{name} must be a torch.dtype or None, got {value!r}"
                )
        fn = self.param_dtype_override_fn
        if fn is not None and not callable(fn):
            raise TypeError(
                f"MixedPrecisionPolicy.param_dtype_override_fn must be callable or None, got {fn!r}"
            )

    def kept_dtype(self, param: nn.Parameter) -> torch.dtype | None:
        """``param``'s own dtype where ``param_dtype_override_fn`` keeps it in that dtype,
        else ``None`` (it follows ``param_dtype``)."""
        if self.param_dtype_override_fn is None:
            return None
        answer = self.param_dtype_override_fn(param)
        if answer is None or answer == self.param_dtype:
            return None
        if not isinstance(answer, torch.dtype):
            raise ValueError(
                f"param_dtype_override_fn must return a torch.dtype or None, got {answer!r}"
            )
        if answer != param.dtype:
            raise ValueError(
                f"param_dtype_override_fn returned {answer} for a parameter of dtype "
                f"{param.dtype}; it may return only None, param_dtype ({self.param_dtype}) or "
                "the parameter's own dtype"
            )
        return answer

    def _resolve_for_param(self, param: nn.Parameter) -> MixedPrecisionPolicy:
        """torch 2.15's ``fully_shard`` asks this of the policy it is given, ours included:
        the policy of one parameter, its override applied."""
        kept = self.kept_dtype(param)
        return replace(
            self,
            param_dtype=kept if kept is not None else self.param_dtype,
            param_dtype_override_fn=None,
        )

    @property
    def is_default(self) -> bool:
        return self.param_dtype is None and self.reduce_dtype is None and self.output_dtype is None


@dataclass
class OffloadPolicy:
    """No offloading: sharded parameters, gradients and optimizer state stay on the mesh's device."""


@dataclass
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters, gradients and optimizer state on CPU; copy to the device to gather."""

    pin_memory: bool = True
    """Pin the host copies (only where an accelerator exists) for faster, overlappable copies."""


@dataclass
class DataParallelMeshDims:
    """Names the data-parallel dims of a full SPMD mesh whose parameters are already DTensors.

    A tuple of names is flattened into one dim. At least one of the two must be given.
    """

    shard: str | tuple[str, ...] | None = None
    """Mesh dim name(s) that fsdp2 shards parameters over."""
    replicate: str | tuple[str, ...] | None = None
    """Mesh dim name(s) that parameters are replicated over (HSDP, or DDP without ``shard``)."""

    def __post_init__(self) -> None:
        if self.shard is None and self.replicate is None:
            raise ValueError(
                "DataParallelMeshDims needs shard=..., replicate=... or both; got neither"
            )

    @property
    def shard_names(self) -> tuple[str, ...]:
        return _names(self.shard)

    @property
    def replicate_names(self) -> tuple[str, ...]:
        return _names(self.replicate)


def _names(value: str | tuple[str, ...] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    """``tree`` with every floating-point tensor cast to ``dtype`` (others untouched)."""

    def cast(leaf: torch.Tensor) -> torch.Tensor:
        if leaf.is_floating_point() and leaf.dtype != dtype:
            return leaf.to(dtype)
        return leaf

    return map_tensors(cast, tree)
