"""Splitting a dim that tensor (or expert) parallelism already split: which rows each rank holds.

fsdp2 cuts the piece a rank got from tensor parallelism again, ``torch.chunk``-style over the
data-parallel ranks. DTensor must describe that with the parameter's placements (a
``_StridedShard`` on the data-parallel dim when the other split comes after it in the mesh), or
``full_tensor()``, redistribution and checkpoints put rows in the wrong places. With sizes that
divide evenly it always can; with uneven ones only sometimes. These are global facts (the global
shape, the mesh's shape, the placements): every rank decides them alike.
"""

from __future__ import annotations

import functools
import itertools
import math

from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

__all__ = ["dp_rows_mismatch", "piece_sizes"]


def _splits(placement: Placement, dim: int) -> bool:
    return isinstance(placement, (Shard, _StridedShard)) and placement.dim == dim


def _on_dim0(placement: Placement) -> Placement:
    if isinstance(placement, _StridedShard):
        return _StridedShard(0, split_factor=placement.split_factor)
    return Shard(0) if isinstance(placement, Shard) else Replicate()


def _rows(
    size: int, shape: tuple[int, ...], coord: tuple[int, ...], placements: tuple[Placement, ...]
) -> tuple[int, int]:
    """(number of rows, first row) of a 1-D tensor of ``size`` rows at mesh ``coord``."""
    local, offset = _compute_local_shape_and_global_offset((size,), shape, list(coord), placements)
    return local[0], offset[0]


def piece_sizes(
    size: int, dim: int, shape: tuple[int, ...], placements: tuple[Placement, ...]
) -> frozenset[int]:
    """The sizes of ``dim`` (global size ``size``) across all ranks of a mesh of ``shape``
    under ``placements``: what each rank's local tensor has, before fsdp2 splits it."""
    axes = [a for a, p in enumerate(placements) if _splits(p, dim)]
    return _piece_sizes(
        size, tuple(shape[a] for a in axes), tuple(_on_dim0(placements[a]) for a in axes)
    )


@functools.lru_cache(maxsize=256)
def _piece_sizes(
    size: int, shape: tuple[int, ...], placements: tuple[Placement, ...]
) -> frozenset[int]:
    coords = itertools.product(*(range(n) for n in shape))
    return frozenset(_rows(size, shape, c, placements)[0] for c in coords)


def dp_rows_mismatch(
    size: int, dim: int, shape: tuple[int, ...], placements: tuple[Placement, ...], dp_axis: int
) -> bool:
    """Whether ``placements`` (on a mesh of ``shape``, ``dp_axis`` being fsdp2's split of
    ``dim``) describe other rows than fsdp2 holds: each rank's tensor-parallel piece cut in
    ``ceil(rows / dp)`` chunks, the ``i``-th on data-parallel rank ``i``."""
    axes = [a for a, p in enumerate(placements) if a == dp_axis or _splits(p, dim)]
    sizes = tuple(shape[a] for a in axes)
    if size % math.prod(sizes) == 0:
        return False  # even at every level: DTensor's order and fsdp2's agree
    reduced = tuple(_on_dim0(placements[a]) for a in axes)
    return _mismatch(size, sizes, reduced, axes.index(dp_axis))


@functools.lru_cache(maxsize=256)
def _mismatch(
    size: int, shape: tuple[int, ...], placements: tuple[Placement, ...], dp: int
) -> bool:
    outer = tuple(Replicate() if a == dp else p for a, p in enumerate(placements))
    for coord in itertools.product(*(range(n) for n in shape)):
        rows, start = _rows(size, shape, coord, outer)
        chunk = -(-rows // shape[dp])
        i = coord[dp]
        ours = min(max(rows - i * chunk, 0), chunk), start + min(i * chunk, rows)
        theirs = _rows(size, shape, coord, placements)
        if ours[0] != theirs[0] or (ours[0] and ours[1] != theirs[1]):
            return True
    return False
