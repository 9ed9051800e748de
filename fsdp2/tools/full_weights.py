"""``iter_full_weights``: a sharded model's full weights, bucket by bucket, in bounded memory.

What torch offers gathers differently: ``get_model_state_dict(full_state_dict=True)`` holds the
whole model at once (on rank 0 with ``cpu_offload``), and ``full_tensor()`` per parameter is one
collective per parameter. Here each bucket of at most ``bucket_bytes`` is one all-gather over
every parameter in it, whatever ``fully_shard`` group holds it ([Note: a bucket's gather] in
weight_plan.py), and its buffers are freed before the next bucket is gathered.

[Note: ending together]
A consumer may raise on one rank only (a failed push to an inference engine, a full disk). That
rank's generator is closed (a ``for`` loop drops it as the exception unwinds), and its peers
would wait in the next bucket's all-gather for a rank that is gone. So a closed generator, or
one whose own work raised, does not simply stop: it keeps taking part in every remaining
collective, in the same order as its peers, with a stop code in its block's header, handing out
nothing more. Every rank that reads a stop code in a bucket's headers does the same. Peers
in other shard groups (HSDP's other replicas) read no header of that rank; so the iteration ends
with one small exchange of every rank's status, passed along each dim of each mesh in turn,
after which every rank knows: the ranks whose consumer stopped return (their own exception goes
on), the ranks whose own work raised raise it, and every other rank raises a ``RuntimeError``
naming the rank that stopped and the bucket. A collective that itself fails or times out is
raised at once (the hang report covers it): nothing more is issued on a broken group.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate

from fsdp2.engine.collectives import agree_ints, all_gather_in_place, redistribute
from fsdp2.tools.weight_plan import Bucket, WeightItem, agreement_groups, plan_buckets

__all__ = ["iter_full_weights", "walk"]

_LABEL = "iter_full_weights"

_OK, _CLOSED, _FAILED = 0, 1, 2  # a rank's status code, in its headers and the closing exchange

Named = list[tuple[str, torch.Tensor]]


def iter_full_weights(
    module: nn.Module,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    bucket_bytes: int | None = None,
    rank: int | None = None,
    buffers: bool = True,
) -> Iterator[Named]:
    """The full weights of a sharded ``module``, one bucket at a time: an iterator of lists of
    ``(name, tensor)``. Call it on every rank and run it to the end on every rank.

    Names are the keys of the unsharded module's ``state_dict()``, in its order; a tied weight
    comes once, under its first key (as ``named_parameters()`` gives it). Each bucket holds at
    most ``bucket_bytes`` of full tensors (a larger tensor comes alone) and is gathered in one
    all-gather, across ``fully_shard`` groups; HSDP gathers within each replica, tensor and
    expert parallel dims follow with one ``full_tensor()`` per such parameter. Each tensor is
    contiguous, equal bit for bit to ``full_tensor().to(dtype)``, and this bucket's own: the
    parameters of one bucket are views of the one buffer they were gathered into (a
    ``Shard(d > 0)`` parameter is copied out of it), so memory above the sharded model is the
    bucket you hold and nothing more: the gather runs in place, on NCCL and on gloo alike
    (engine/collectives.py: ``all_gather_in_place``). The buffer lives as long as any of its
    tensors: ``clone()`` what you keep beyond the bucket if you keep only some.
    Tensor subclasses (torchao's float8, NF4) are refused by name.

    A consumer that raises (or stops early) on one rank makes every rank end with an error
    instead of a hang (see [Note: ending together]): the others raise a ``RuntimeError`` naming
    that rank. Keep the iterator in the ``for`` statement, or close it
    (``contextlib.closing``) when you stop early, so that its peers learn it stopped.

    Args:
        module: a module holding fsdp2 modules (a plain module works too: nothing to gather).
        dtype: floating-point tensors are handed out in this dtype (cast before the gather, so
            fewer bytes move); ``None`` keeps each tensor's own. Other dtypes are kept.
        device: where the tensors are handed out (``"cpu"`` to offload); ``None``: the device
            their mesh gathers on, buffers and unmanaged tensors where they are.
        bucket_bytes: the most bytes of full tensors (in ``dtype``) per bucket. ``None`` (the
            default): 16 MiB where gloo gathers (its in-place broadcasts slow down with the
            bucket: 8-32 MiB took 0.4-0.6x the time of torch's ``get_model_state_dict``, 256 MiB
            0.7-0.9x, and up to 2.1x in an earlier run), 256 MiB on NCCL and other backends
            (bandwidth-bound well below it).
        rank: only this (global) rank receives the buckets; the others yield nothing but take
            part in every collective. ``None``: every rank receives every bucket.
        buffers: also hand out the persistent buffers that ``state_dict()`` holds.
    """
    if bucket_bytes is not None and bucket_bytes < 1:
        raise ValueError(f"iter_full_weights expects bucket_bytes >= 1, got {bucket_bytes}")
    world = dist.get_world_size() if dist.is_initialized() else 1
    if rank is not None and not 0 <= rank < world:
        raise ValueError(
            f"iter_full_weights expects rank in [0, {world}) or None (every rank), got {rank}"
        )
    me = dist.get_rank() if dist.is_initialized() else 0
    buckets = plan_buckets(module, dtype, bucket_bytes, buffers)
    out_device = torch.device(device) if device is not None else None
    return walk(buckets, out_device, lambda _item: rank is None or rank == me)


def walk(
    buckets: list[Bucket], device: torch.device | None, receives: Callable[[WeightItem], bool]
) -> Iterator[Named]:
    """Gather ``buckets`` in order, yielding what this rank ``receives`` (non-empty lists only),
    then agree with every rank on how it ended (see [Note: ending together])."""
    status = _Status(dist.get_rank() if dist.is_initialized() else 0)
    for bucket in buckets:
        named = _Bucket(bucket, device, receives, status).run()
        if status.stopping or not named:
            continue
        try:
            yield named
        except GeneratorExit:  # the consumer stopped: keep taking part, quietly
            status.stop(_CLOSED, bucket.index, None)
        del named  # not held while the next bucket is gathered
    status.agree(agreement_groups(buckets))


@dataclass(slots=True)
class _Status:
    """How this rank's iteration goes, and the first stop it heard of from any rank."""

    rank: int
    own: int = _OK  # this rank's code
    error: BaseException | None = None  # this rank's own work raised this
    stopped: tuple[int, int, int] | None = None  # (bucket, rank, code) of the first stop known

    @property
    def stopping(self) -> bool:
        return self.stopped is not None

    def stop(self, code: int, bucket: int, error: BaseException | None) -> None:
        if self.own == _OK:
            self.own, self.error = code, error
        self.heard(bucket, self.rank, code)

    def heard(self, bucket: int, rank: int, code: int) -> None:
        if self.stopped is None or (bucket, rank) < self.stopped[:2]:
            self.stopped = (bucket, rank, code)

    def agree(self, groups: list[tuple[dist.ProcessGroup, torch.device]]) -> None:
        """The closing exchange, then end as [Note: ending together] says."""
        for group, device in groups:
            mine = list(self.stopped) if self.stopped is not None else [-1, -1, _OK]
            for bucket, rank, code in agree_ints(mine, group, device):
                if code != _OK:
                    self.heard(bucket, rank, code)
        if self.error is not None:
            raise self.error
        if self.stopped is None or self.own != _OK:
            return
        bucket, rank, code = self.stopped
        what = "its consumer raised or stopped early" if code == _CLOSED else "it raised"
        raise RuntimeError(
            f"iter_full_weights stopped on every rank: rank {rank} stopped at bucket {bucket} "
            f"({what}); see that rank's error"
        )


class _Bucket:
    """One bucket's gather and cut-out on this rank (see [Note: a bucket's gather])."""

    def __init__(
        self,
        bucket: Bucket,
        device: torch.device | None,
        receives: Callable[[WeightItem], bool],
        status: _Status,
    ) -> None:
        self.bucket = bucket
        self.device = device
        self.receives = receives
        self.status = status

    def run(self) -> Named:
        """Every collective of the bucket, in the order every rank issues them; this rank's own
        errors are caught and turn it to stopping, collective failures raise."""
        out = self._gather() if self.bucket.group is not None else None
        named: Named = []
        for item in self.bucket.items:
            keep = self.receives(item) and not self.status.stopping
            if not keep and not item.outer:
                continue  # no collective to take part in, nothing to hand out
            value = self._full(item, out, keep)
            if keep and value is not None:
                named.append((item.name, value))
        if self.status.stopping:
            named = []
        if out is not None and not any(_shares(value, out) for _, value in named):
            out.untyped_storage().resize_(0)  # not left to the collective's own reference
        return named

    def _gather(self) -> torch.Tensor:
        bucket, status = self.bucket, self.status
        if bucket.group is None or bucket.device is None:
            raise AssertionError(f"bucket {bucket.index}: expected a group to gather over")
        world, me = bucket.group.size(), bucket.group.rank()
        out = torch.empty(bucket.gathered_bytes, dtype=torch.uint8, device=bucket.device)
        headers, *chunks = bucket.segments(out)
        try:  # also when stopping: tensor-parallel peers may still cut correct tensors from it
            self._pack(chunks, me)
        except Exception as error:  # this rank's own failure: stop, but keep taking part
            status.stop(_FAILED, bucket.index, error)
        header = torch.tensor([status.own, status.rank], dtype=torch.int64)
        headers.view(world, -1)[me].view(torch.int64).copy_(header)
        all_gather_in_place([headers, *chunks], bucket.group, _LABEL).wait()
        for code, rank in headers.view(world, -1).view(torch.int64).tolist():
            if code != _OK:
                status.heard(bucket.index, rank, code)
        return out

    def _pack(self, chunks: list[torch.Tensor], me: int) -> None:
        """This rank's chunk of each gathered item, cast, into its place in the segment."""
        items = [item for item in self.bucket.items if item.offset >= 0]
        for item, segment in zip(items, chunks, strict=True):
            local = item.source._local_tensor  # type: ignore[attr-defined]
            mine = segment.view(-1, item.chunk_bytes)[me].view(item.dtype)
            mine[: local.numel()].copy_(local.reshape(-1))

    def _full(self, item: WeightItem, out: torch.Tensor | None, keep: bool) -> torch.Tensor | None:
        """``item``'s full tensor (``None`` where this rank's own work failed). An item split
        by other mesh dims takes part in their ``full_tensor()`` whatever happened before."""
        try:
            local = self._local_full(item, out)
        except Exception as error:
            self.status.stop(_FAILED, self.bucket.index, error)
            local = None
        if item.outer:
            local = self._outer_full(item, local)
        if local is None or not keep:
            return None
        try:  # ``local`` is this bucket's own already: moved or cast if asked, never copied
            return local.to(self.device or local.device, item.dtype)
        except Exception as error:
            self.status.stop(_FAILED, self.bucket.index, error)
            return None

    def _local_full(self, item: WeightItem, out: torch.Tensor | None) -> torch.Tensor:
        """The tensor before other mesh dims split it, in ``item.dtype``: a view of its segment
        of the gathered buffer (cut along dim 0) or a copy out of it (another dim), or (not
        gathered) a copy of the local tensor."""
        fsdp_param = item.fsdp_param
        if not item.gathered or fsdp_param is None or out is None:
            local = item.source.detach()
            local = local._local_tensor if isinstance(local, DTensor) else local
            # On the mesh's device where its full_tensor() runs, else where it is handed out.
            device = _mesh_device(item) if item.outer else self.device or local.device
            return local.to(device, item.dtype, copy=True)
        group = self.bucket.group
        world = group.size() if group is not None else 1
        segment = out[item.offset : item.offset + world * item.chunk_bytes].view(item.dtype)
        if fsdp_param.chunk.dim == 0:  # the full tensor is the segment's start: a view of it
            return segment[: math.prod(fsdp_param.shape)].view(fsdp_param.shape)
        on_device = self.device if self.device is not None and not item.outer else out.device
        full = torch.empty(fsdp_param.shape, dtype=item.dtype, device=on_device)
        for whole, chunk in fsdp_param.chunk.rank_blocks(full.view(-1), segment.view(world, -1)):
            whole.copy_(chunk)  # [Note: sharding another dim] in engine/param.py
        return full

    def _outer_full(self, item: WeightItem, local: torch.Tensor | None) -> torch.Tensor:
        """The full tensor over the other mesh dims: DTensor's ``full_tensor()``, on every rank
        of those dims (an empty stand-in where this rank failed, so that none waits for it)."""
        fsdp_param, source = item.fsdp_param, item.source
        spec = fsdp_param.outer_spec if fsdp_param is not None else source._spec  # type: ignore[attr-defined]
        if spec is None:
            raise AssertionError(f"{item.name}: expected a DTensor spec for its outer mesh dims")
        if local is None:
            shape = fsdp_param.shape if fsdp_param is not None else _local_shape(source)
            local = torch.empty(shape, dtype=item.dtype, device=_mesh_device(item))
        dtensor = DTensor.from_local(
            local, spec.mesh, spec.placements, run_check=False, shape=spec.shape, stride=spec.stride
        )
        everywhere = [Replicate()] * spec.mesh.ndim
        return redistribute(dtensor, everywhere, item.name, dtensor.full_tensor)


def _shares(value: torch.Tensor, out: torch.Tensor) -> bool:
    return value.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()


def _local_shape(source: torch.Tensor) -> torch.Size:
    return source._local_tensor.shape  # type: ignore[attr-defined,no-any-return]


def _mesh_device(item: WeightItem) -> torch.device:
    if item.group is not None:
        return item.group.device
    return item.source._local_tensor.device  # type: ignore[attr-defined,no-any-return]
