"""Whole matrices at one owner rank: where each sharded matrix is orthogonalised (or
preconditioned), and how its shards get there and back.

[Note: owner per matrix]
A matrix optimizer needs each weight's whole matrix, but FSDP leaves every rank a row-slab
(``Shard(d)``, ``torch.chunk`` sizes: possibly uneven, possibly empty). Each sharded matrix gets
one owner rank of its shard group, chosen greedily by size (largest first, to the least loaded
rank, ties to the lower rank) from global facts only (shapes and the optimizer's parameter order),
so every rank computes the same plan without talking. Per step and per bucket (shard group and
dtype) two ``all_to_all`` calls move the data: every rank's shard of every matrix to its owner
(the owner concatenates them along the shard dim, in rank order: the full matrix, exactly), and
the owner's full update back as shards. That is each shard to its owner and back once, the
minimum for the scheme; the owner's slice of its own matrices does not leave the rank.

HSDP (``(Replicate(), Shard(d))``): each replica runs the exchange inside its own shard group
and repeats the work of the other replicas. Sharing it would need the updates sent across the
replicate axis, usually the slow inter-node link that HSDP keeps to one gradient all-reduce.

Stacked experts (3-D, ``Shard(0)``) need no exchange: a rank holds whole experts, and every expert
is its own matrix. 2-D meshes that shard one tensor twice (FSDP x TP) are refused by name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from fsdp2.engine.collectives import all_to_all

__all__ = ["MatrixLayout", "assign_owners", "exchange", "matrix_layout"]


@dataclass(frozen=True)
class MatrixLayout:
    """How one matrix parameter is spread over ranks (the same object on every rank)."""

    shape: tuple[int, ...]  # the full (global) shape
    group: dist.ProcessGroup | None  # the shard group; None: this rank holds what it needs
    dim: int = 0  # the sharded tensor dim
    rank: int = 0  # this rank's index in ``group``
    owner: int = 0  # the rank of ``group`` that computes the whole-matrix update

    @property
    def world(self) -> int:
        return 1 if self.group is None else self.group.size()

    def rows(self, rank: int) -> tuple[int, int]:
        """Rank ``rank``'s (start, size) along ``dim``: ``torch.chunk``'s cut, as ``Shard`` makes."""
        n = self.shape[self.dim]
        chunk = -(-n // self.world)
        start = min(rank * chunk, n)
        return start, min(chunk, n - start)

    def local_shape(self, rank: int) -> tuple[int, ...]:
        shape = list(self.shape)
        shape[self.dim] = self.rows(rank)[1]
        return tuple(shape)

    def local_numel(self, rank: int) -> int:
        numel = 1
        for s in self.local_shape(rank):
            numel *= s
        return numel


def matrix_layout(param: torch.Tensor, name: str, who: str = "Muon") -> MatrixLayout:
    """The layout of ``param`` (owner still 0), or a ValueError naming ``name`` for a sharding
    the owner exchange does not support (two sharded mesh axes, partial values); ``who`` is the
    optimizer's class name, for the message."""
    shape = tuple(param.shape)
    if not isinstance(param, DTensor):
        return MatrixLayout(shape, None)
    placements = param.placements
    sharded = [(axis, p) for axis, p in enumerate(placements) if not isinstance(p, Replicate)]
    if not sharded:
        return MatrixLayout(shape, None)
    if len(sharded) > 1 or type(sharded[0][1]) is not Shard:
        raise ValueError(
            f"{who}: parameter {name} (shape {list(shape)}) is a DTensor with placements "
            f"{tuple(placements)}; the whole-matrix exchange supports one Shard mesh axis (FSDP, "
            "or HSDP's (Replicate(), Shard(d))), not a tensor sharded twice (FSDP x TP) or "
            "partial. Put it in the AdamW part (Muon(..., adamw_params=[...]) or a param group "
            "with use_muon=False)."
        )
    axis, placement = sharded[0]
    if not isinstance(placement, Shard):  # type(...) is Shard, checked above
        raise AssertionError(f"{who}: expected a Shard placement for {name}, got {placement}")
    dim = placement.dim % len(shape)
    if len(shape) == 3 and dim == 0:  # whole experts on each rank: see [Note: owner per matrix]
        return MatrixLayout(shape, None)
    mesh = param.device_mesh
    layout = MatrixLayout(shape, mesh.get_group(axis), dim, mesh.get_local_rank(axis))
    if tuple(param.to_local().shape) != layout.local_shape(layout.rank):
        raise AssertionError(
            f"{name}: local shard {tuple(param.to_local().shape)} is not torch.chunk's "
            f"{layout.local_shape(layout.rank)} of {list(shape)} on rank {layout.rank}"
        )
    return layout


def assign_owners(layouts: Sequence[MatrixLayout]) -> list[MatrixLayout]:
    """Give each sharded matrix an owner: largest first to the least-loaded rank of its group.
    Deterministic from shapes and order, so every rank builds the same plan."""
    loads: dict[str, list[int]] = {}
    owners = [0] * len(layouts)
    order = sorted(range(len(layouts)), key=lambda i: (-_numel(layouts[i].shape), i))
    for i in order:
        layout = layouts[i]
        if layout.group is None:
            continue
        load = loads.setdefault(layout.group.group_name, [0] * layout.world)
        owners[i] = min(range(layout.world), key=lambda r: (load[r], r))
        load[owners[i]] += _numel(layout.shape)
    return [
        MatrixLayout(lay.shape, lay.group, lay.dim, lay.rank, owner)
        for lay, owner in zip(layouts, owners, strict=True)
    ]


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


WholeMatrixFn = Callable[[int, torch.Tensor], torch.Tensor]


def exchange(
    layouts: Sequence[MatrixLayout], shards: Sequence[torch.Tensor], update: WholeMatrixFn
) -> list[torch.Tensor]:
    """For matrices sharing one shard group and dtype: send every shard to its matrix's owner,
    let the owner compute ``update(i, full_matrix_i)`` (a tensor of the full shape), and return
    this rank's shard of each update, in the order given."""
    group, rank, world = layouts[0].group, layouts[0].rank, layouts[0].world
    if group is None:  # the caller exchanges sharded matrices only
        raise AssertionError("exchange: expected matrices sharded over a process group, got None")
    mine = [i for i, lay in enumerate(layouts) if lay.owner == rank]
    by_owner = [[i for i, lay in enumerate(layouts) if lay.owner == r] for r in range(world)]

    # There: rank r's shards of the matrices each rank owns, owner-major.
    in_splits = [sum(layouts[i].local_numel(rank) for i in ids) for ids in by_owner]
    out_splits = [sum(layouts[i].local_numel(src) for i in mine) for src in range(world)]
    sent = _cat([shards[i].reshape(-1) for ids in by_owner for i in ids], shards[0])
    received = sent.new_empty(sum(out_splits))
    all_to_all(received, sent, out_splits, in_splits, group, "matrix shards to owners").wait()
    pieces = iter(
        torch.split(received, [layouts[i].local_numel(s) for s in range(world) for i in mine])
    )
    parts: dict[int, list[torch.Tensor]] = {i: [] for i in mine}
    for src in range(world):
        for i in mine:
            parts[i].append(next(pieces).view(layouts[i].local_shape(src)))
    updates = {i: update(i, torch.cat(parts[i], dim=layouts[i].dim)) for i in mine}

    # Back: the owner's full updates, cut into every rank's shard, destination-major.
    back: list[torch.Tensor] = []
    for dst in range(world):
        for i in mine:
            start, size = layouts[i].rows(dst)
            back.append(updates[i].narrow(layouts[i].dim, start, size).reshape(-1))
    sent_back = _cat([b.to(shards[0].dtype) for b in back], shards[0])
    returned = sent.new_empty(sum(in_splits))
    all_to_all(returned, sent_back, in_splits, out_splits, group, "matrix updates to shards").wait()
    flat = iter(
        torch.split(returned, [layouts[i].local_numel(rank) for ids in by_owner for i in ids])
    )
    result: dict[int, torch.Tensor] = {}
    for ids in by_owner:
        for i in ids:
            result[i] = next(flat).view(layouts[i].local_shape(rank))
    return [result[i] for i in range(len(layouts))]


def _cat(tensors: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    return torch.cat(tensors) if tensors else like.new_empty(0)
