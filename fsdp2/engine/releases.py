"""What depends on the installed torch's release: every such rule is decided here, once.

fsdp2 is a drop-in for the torch it is installed beside (2.11 to 2.15). Where torch changed the
meaning of its API between releases, fsdp2 follows the installed one; the rest of the code asks
:data:`RULES` and never compares versions itself. Additions of a newer release that need none of
its internals (``finalize_backward``, ``set_keep_unsharded_storage``,
``MixedPrecisionPolicy.param_dtype_override_fn``) exist on every release.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

__all__ = [
    "CLEAR_NATIVE_DTENSOR_CACHE",
    "RULES",
    "TORCH_RELEASE",
    "ReleaseRules",
    "explicit_grad_dtype",
    "rules_for",
]


def parse_release(version: str) -> tuple[int, int]:
    """``"2.15.0+cu132"`` -> ``(2, 15)``; a nightly ``"2.16.0.dev20261101"`` -> ``(2, 16)``."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None:
        raise ValueError(f"fsdp2: cannot read torch's release from its version {version!r}")
    return int(found[1]), int(found[2])


@dataclass(frozen=True)
class ReleaseRules:
    """The behaviours that differ between torch releases, as the installed one has them."""

    release: tuple[int, int]
    reduce_dtype_follows_grad_dtype: bool
    """``MixedPrecisionPolicy(reduce_dtype=None)``: 2.15 reduces (and accumulates without sync)
    in each parameter's ``grad_dtype``, its own dtype unless set; earlier releases in
    ``param_dtype``. A bf16-computed gradient of an fp32 parameter is summed in fp32 from 2.15."""
    single_collectives: bool
    """``dist.all_gather_single`` / ``dist.reduce_scatter_single`` (2.13 renamed them); before,
    only ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` (engine/collectives.py)."""
    unsharded_grad_as_computed: bool
    """A parameter computed in a narrower dtype than its gradients are summed in (bf16 compute,
    fp32 reduce): from 2.15 its unsharded parameter takes the gradient in the dtype autograd
    computes it in (``grad_dtype=None``), so an op whose backward yields fp32 (a norm's weight)
    is reduced from fp32; earlier releases round every gradient to ``param_dtype`` first. One
    whose gradient may be summed over model-parallel ranks first (a DTensor replicated on a
    non-data-parallel axis) takes it in the reduce dtype instead, so that sum is exact too."""
    stage_finalizes_backward: bool
    """``torch.distributed.pipelining``'s stage ends the microbatches' backward through the
    public ``set_manual_backward_finalization`` / ``finalize_backward`` from 2.15; earlier
    releases reach into ``fully_shard.state(module)`` (engine/torch_state.py serves both)."""


def rules_for(release: tuple[int, int]) -> ReleaseRules:
    """The rules of ``release`` (any release, so tests can check each one's)."""
    from_2_15 = release >= (2, 15)
    return ReleaseRules(
        release=release,
        reduce_dtype_follows_grad_dtype=from_2_15,
        single_collectives=release >= (2, 13),
        unsharded_grad_as_computed=from_2_15,
        stage_finalizes_backward=from_2_15,
    )


TORCH_RELEASE = parse_release(torch.__version__)
RULES = rules_for(TORCH_RELEASE)


def explicit_grad_dtype(param: torch.Tensor) -> torch.dtype | None:
    """The ``grad_dtype`` a user set on ``param``, or ``None`` if it has the default (its own
    dtype). torch 2.15 records whether one was set (``_has_grad_dtype_override``), so one set to
    the parameter's own dtype counts and survives a later ``.to()``; earlier releases (which have
    ``grad_dtype`` but not the record) show it only where it differs from the dtype."""
    dtype = getattr(param, "grad_dtype", None)
    overridden = getattr(param, "_has_grad_dtype_override", None)
    if overridden is not None:
        return dtype if overridden else None
    return dtype if dtype is not None and dtype != param.dtype else None


# DTensor's C++ dispatch fast path keeps a sharding cache of its own in the releases that have
# that path; the function that clears it, or None (engine/param.py clears both caches).
CLEAR_NATIVE_DTENSOR_CACHE = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
