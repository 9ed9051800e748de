"""Which tensors ``iter_full_weights`` hands out, in which order, and in which buckets.

The plan is made from facts every rank shares (the ``state_dict()`` keys, global shapes, dtypes,
meshes), never from a rank's own shard, so that every rank cuts the same buckets and issues the
same collectives in the same order, and a refusal raises on every rank alike.

[Note: a bucket's gather]
A bucket is a run of consecutive tensors whose full size, in the dtype handed out, adds up to at
most ``bucket_bytes`` (a tensor larger than that is a bucket of its own). The parameters fsdp2
shards over the same process group are gathered together, into one buffer laid out tensor by
tensor: a segment of headers (16 bytes per rank: a status code and the rank, see [Note: ending
together] in full_weights.py), then one segment per parameter, each at a 16-byte aligned offset
so that it can be viewed in any dtype, holding every rank's chunk in rank order (cast to the
dtype handed out, padded to ``chunk.numel``, the same on every rank). Each rank writes its own
chunks into the buffer and one coalesced all-gather fills in the rest, segment by segment, in
place. A parameter cut along dim 0 is then the start of its segment as it stands, and is handed
out as a view of it: nothing is copied, and the buffer is the only memory a bucket takes (a
single flat all-gather would land rank by rank, and cutting the tensors out of it would hold
the bucket twice). Parameters fsdp2 does not split (one rank, ``replicate()``), buffers and
tensors fsdp2 does not manage need no gather and ride along in whichever bucket they fall in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp2.debug.waiting import is_gloo
from fsdp2.engine.buckets import cut
from fsdp2.engine.mesh import device_of
from fsdp2.engine.param import FSDPParam
from fsdp2.engine.param_group import FSDPParamGroup
from fsdp2.engine.state import STATES, TrainingState

__all__ = [
    "GLOO_BUCKET_BYTES",
    "HEADER_BYTES",
    "NCCL_BUCKET_BYTES",
    "Bucket",
    "WeightItem",
    "agreement_groups",
    "plan_buckets",
]

# The default bucket, per backend of the gathers. NCCL (and any backend but gloo): large enough
# that each all-gather is bandwidth-bound (NCCL reaches its peak well below this), small enough
# to sit beside a training job's free memory. gloo: W in-place broadcasts per parameter
# (collectives.all_gather_in_place) run slower the larger the bucket, well past where the
# per-bucket costs stop mattering (benchmarks/README.md, "Full weights out", issue 40).
NCCL_BUCKET_BYTES = 256 * 2**20
GLOO_BUCKET_BYTES = 16 * 2**20

HEADER_BYTES = 16  # two int64: the rank's status code and its global rank
_ALIGN = 16  # every chunk starts at a multiple of this many bytes of the block


@dataclass(slots=True)
class WeightItem:
    """One tensor handed out: a parameter (once, under its first key) or a buffer."""

    name: str  # its key in the unsharded module's ``state_dict()``
    source: torch.Tensor  # what the module holds: the sharded DTensor parameter, or a buffer
    fsdp_param: FSDPParam | None  # fsdp2's view of it, if fsdp2 shards it
    group: FSDPParamGroup | None  # the group that holds it
    dtype: torch.dtype  # handed out in this dtype
    nbytes: int  # the full tensor's bytes in that dtype
    offset: int = -1  # its segment's byte offset in the bucket's gathered buffer; -1: none

    @property
    def chunk_bytes(self) -> int:
        """What each rank contributes to the gather: its padded chunk, in the dtype handed out."""
        return self.fsdp_param.chunk.numel * self.dtype.itemsize if self.fsdp_param else 0

    @property
    def gathered(self) -> bool:
        """Whether the bucket's all-gather brings it (fsdp2 splits it over several ranks)."""
        return self.group is not None and self.group.shard_size > 1

    @property
    def outer(self) -> bool:
        """Whether mesh dims other than fsdp2's split it (tensor or expert parallel), so that
        its full tensor takes one more collective of its own (DTensor's ``full_tensor()``)."""
        if self.fsdp_param is not None:
            return self.fsdp_param.outer_spec is not None
        return isinstance(self.source, DTensor)


@dataclass(slots=True)
class Bucket:
    """Consecutive items handed out together; their gathered part in one all-gather."""

    index: int
    items: list[WeightItem] = field(default_factory=list)
    nbytes: int = 0  # the full tensors' bytes
    group: dist.ProcessGroup | None = None  # the shard group of its gathered items
    device: torch.device | None = None  # where they are gathered
    gathered_bytes: int = 0  # the gathered buffer: the headers' segment, then each item's

    def add(self, item: WeightItem) -> None:
        if item.gathered and item.fsdp_param is not None and item.group is not None:
            group = item.group.info.shard_group
            if group is None:
                raise AssertionError(f"{item.name}: gathered, but its group has no shard group")
            world = group.size()
            if self.group is None:
                self.group, self.device = group, item.group.device
                self.gathered_bytes = world * HEADER_BYTES
            item.offset = self.gathered_bytes
            self.gathered_bytes += _aligned(world * item.chunk_bytes)
        self.items.append(item)
        self.nbytes += item.nbytes

    def segments(self, gathered: torch.Tensor) -> list[torch.Tensor]:
        """The gathered buffer's segments, in order: the headers', then each gathered item's."""
        if self.group is None:
            raise AssertionError(f"bucket {self.index}: expected a group to gather over")
        world = self.group.size()
        found = [gathered[: world * HEADER_BYTES]]
        for item in self.items:
            if item.offset >= 0:
                found.append(gathered[item.offset : item.offset + world * item.chunk_bytes])
        return found


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def plan_buckets(
    module: nn.Module, dtype: torch.dtype | None, bucket_bytes: int | None, buffers: bool
) -> list[Bucket]:
    """The buckets of ``module``'s full weights, in ``state_dict()`` order; ``bucket_bytes``
    ``None``: the default of the backend that gathers them."""
    items = _items(module, dtype, buffers)
    if bucket_bytes is None:
        bucket_bytes = _default_bucket_bytes(items)
    buckets = []
    for index, run in enumerate(cut(items, lambda i: i.nbytes, bucket_bytes, _gathered_over)):
        bucket = Bucket(index)
        for item in run:
            bucket.add(item)
        buckets.append(bucket)
    return buckets


def _gathered_over(item: WeightItem) -> object:
    """What the gathered items of one bucket share: a shard group and device (``None``: an item
    not gathered rides along in any bucket)."""
    if not item.gathered or item.group is None:
        return None
    return (id(item.group.info.shard_group), item.group.device)


def _items(module: nn.Module, dtype: torch.dtype | None, buffers: bool) -> list[WeightItem]:
    states = STATES.under(module)
    for state in states:
        if state.training_state is not TrainingState.IDLE:
            raise RuntimeError(
                f"iter_full_weights cannot run inside forward or backward: fsdp2 module "
                f"{state.label or type(state.modules[0]).__name__} is in "
                f"{state.training_state.name}. Call it before forward or after backward"
            )
    managed = {
        id(fsdp_param.sharded_param): (fsdp_param, group)
        for state in states
        for group in state.groups
        for fsdp_param in group.fsdp_params
    }
    param_ids = {id(p) for p in module.parameters()}
    # keep_vars: the registered objects themselves (state_dict's pre-hooks reshard each group
    # first), so that tied parameters show as one object under several keys.
    seen: set[int] = set()
    items = []
    for name, value in module.state_dict(keep_vars=True).items():
        if not isinstance(value, torch.Tensor) or id(value) in seen:
            continue  # extra state, or a tied parameter's second key
        seen.add(id(value))
        if id(value) not in param_ids and not buffers:
            continue
        fsdp_param, group = managed.get(id(value), (None, None))
        out_dtype = dtype if dtype is not None and value.dtype.is_floating_point else value.dtype
        numel = value.numel()  # a DTensor's global numel
        items.append(
            WeightItem(name, value, fsdp_param, group, out_dtype, numel * out_dtype.itemsize)
        )
    _refuse_extensions(items)
    return items


def _default_bucket_bytes(items: list[WeightItem]) -> int:
    """gloo's default where gloo runs any of the gathers, else NCCL's: decided from the groups'
    backends, the same on every rank, so every rank cuts the same buckets."""
    for item in items:
        if item.gathered and item.group is not None:
            group = item.group.info.shard_group
            if group is not None and is_gloo(group, item.group.device):
                return GLOO_BUCKET_BYTES
    return NCCL_BUCKET_BYTES


def _refuse_extensions(items: list[WeightItem]) -> None:
    """Tensor subclasses (torchao's float8 and NF4 weights, the all-gather extension) have no
    plain bytes to gather and cast: refused by name, on every rank alike (types are the same
    on every rank: ``fully_shard`` checked them)."""
    names = [
        item.name
        for item in items
        if (item.fsdp_param is not None and item.fsdp_param.extension)
        or type(_local(item.source)) not in (torch.Tensor, nn.Parameter)
    ]
    if names:
        raise NotImplementedError(
            f"iter_full_weights hands out plain tensors; {', '.join(names)} "
            f"{'is a tensor subclass' if len(names) == 1 else 'are tensor subclasses'} "
            "(quantized or all-gather extension weights). Convert them to plain tensors first "
            "(e.g. dequantize), or gather them yourself with DTensor's full_tensor()"
        )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def agreement_groups(buckets: list[Bucket]) -> list[tuple[dist.ProcessGroup, torch.device]]:
    """The process groups the closing agreement runs over, in an order every rank shares: each
    dim of each mesh the items live on, so that a status passed along each in turn reaches
    every rank of those meshes (see [Note: ending together] in full_weights.py)."""
    found: list[tuple[dist.ProcessGroup, torch.device]] = []
    for bucket in buckets:
        for item in bucket.items:
            if item.fsdp_param is not None:
                mesh = item.fsdp_param.chunk.mesh
            elif isinstance(item.source, DTensor):
                mesh = item.source.device_mesh
            else:
                continue
            for axis in range(mesh.ndim):
                group = mesh.get_group(axis)
                if group.size() > 1 and all(group is not g for g, _ in found):
                    found.append((group, device_of(mesh)))
    return found
