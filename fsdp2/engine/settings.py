"""``GroupSettings``: what a user chose for one parameter group, at ``fully_shard`` or later through
``FSDPModule``'s ``set_*`` methods (module.py). Plain data: the group and its gradient reducer read
these fields where they act on them, and nothing here acts itself."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from fsdp2.engine.comm import AllGather, ReduceScatter
from fsdp2.engine.policies import CPUOffloadPolicy, MixedPrecisionPolicy

__all__ = ["GroupSettings"]


@dataclass(slots=True)
class GroupSettings:
    """One group's knobs; every default is what ``fully_shard`` gives without the ``set_*`` call."""

    # -- fully_shard's arguments
    mp_policy: MixedPrecisionPolicy = field(default_factory=MixedPrecisionPolicy)
    offload: CPUOffloadPolicy | None = None  # shards (and reduced gradients) live on the CPU
    # -- when to gather and free
    reshard_after_backward: bool = True
    unshard_in_backward: bool = True
    keep_unsharded_storage: bool = False  # reshard keeps the storage (same data pointers)
    # Gather the next group ahead of need: None decides by device ([Note: prefetch order]).
    guess_prefetch: bool | None = None
    # -- gradient reduction
    requires_gradient_sync: bool = True  # False: accumulate unreduced gradients (no sync)
    requires_all_reduce: bool = True  # HSDP only: False defers the all-reduce over replicas
    divide_factor: float | None = None  # None: average over the shard ranks
    force_sum_reduction: bool = False
    reduce_scatter_unused: bool = False  # give unused parameters zeros so ranks agree
    all_reduce_hook: Callable[[torch.Tensor], None] | None = None
    max_in_flight: int = 1  # reduce-scatters (and their input buffers) alive at once
    # -- the collectives
    custom_all_gather: AllGather | None = None
    custom_reduce_scatter: ReduceScatter | None = None
    reduce_scatter_group: dist.ProcessGroup | None = None  # None: the shard group
