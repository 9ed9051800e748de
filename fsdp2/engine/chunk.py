"""``Chunk``: which rows of a parameter this rank holds, and how they move between the full
parameter and the group's rank-major buffers.

A parameter is cut along its shard dim into ``W`` chunks of ``ceil(rows / W)`` rows, as
``torch.chunk`` and DTensor's ``Shard(dim)`` cut it (see [Note: flat layout] in layout.py).

[Note: sharding another dim]
With ``Shard(d)``, ``d > 0``, rank ``r``'s rows are a strided slab of the contiguous full
parameter, not a slice of it: seen as ``(A, rows, X)`` (``A``/``X`` the products of the dims
before/after ``d``), rank ``r`` holds ``[:, r*c : r*c + n_r]``. Ranks ``0..k-1`` hold ``c`` rows
each (``k = rows // c``) and rank ``k`` the rest, so two strided copies (``rank_blocks``) move
every rank's chunk between the rank-major buffers and the full parameter.

[Note: a dim split twice]
fsdp2 cuts the piece a rank got from tensor (or expert) parallelism again, ``torch.chunk``-style
over the data-parallel ranks. DTensor must describe that with the parameter's placements (a
``_StridedShard`` on the data-parallel dim when the other split comes after it in the mesh), or
``full_tensor()``, redistribution and checkpoints put rows in the wrong places. With sizes that
divide evenly it always can; with uneven ones only sometimes (``dp_rows_mismatch``). These are
global facts (the global shape, the mesh's shape, the placements): every rank decides them alike.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from fsdp2.engine.mesh import MeshInfo, sharded_layout

__all__ = ["Chunk", "chunk_of", "dp_rows_mismatch", "piece_sizes"]


@dataclass(frozen=True, slots=True)
class Chunk:
    """This rank's chunk of one parameter (its local shape, if tensor parallelism split it),
    fixed once the group's mesh is known, and the sharded DTensor's mesh and placements."""

    dim: int  # the dim fsdp2 splits
    shape: tuple[int, ...]  # the whole parameter's (tensor parallelism's piece)
    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    dp_axes: frozenset[int]  # axes of the parameter's own mesh that are data-parallel
    numel: int  # padded, equal on every rank: what the rank contributes to a collective
    rows: int  # ceil(rows / W): every rank's share of the shard dim
    row_start: int  # this rank's first row
    local_shape: tuple[int, ...]  # this rank's real rows (fewer, or none, on trailing ranks)
    layout_shape: tuple[int, ...]  # the shape with the shard dim first: traced mode's order

    @property
    def local_numel(self) -> int:
        return math.prod(self.local_shape)

    def param_order(self, layout: torch.Tensor) -> torch.Tensor:
        """A view of a tensor in layout order (sharded dim first) in the parameter's order."""
        return layout.movedim(0, self.dim) if self.dim else layout

    def shard_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a full (global) tensor of the parameter's shape."""
        if not self.shape:
            return full
        return full.narrow(self.dim, self.row_start, self.local_shape[self.dim])

    def split_rows(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of ``full`` as ``torch.split`` cuts them (the chunks of the layout)."""
        if not self.shape:
            return full
        if not self.local_shape[self.dim]:  # fewer rows than ranks: none here
            return full.new_zeros(self.local_shape)
        return torch.split(full, self.rows, self.dim)[self.row_start // self.rows]

    def rank_blocks(
        self, full: torch.Tensor, chunks: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Pairs of matching views that copy between ``full`` (the whole parameter, contiguous,
        1-D) and ``chunks`` (``(W, >= chunk)``, rank-major; each rank's rows at the start of its
        row), for ``Shard(dim > 0)``: see [Note: sharding another dim]. Both in elements of the
        parameter, or both in bytes."""
        numel = math.prod(self.shape)
        if numel == 0:
            return []
        scale = full.numel() // numel  # the element size when given bytes, else 1
        rows, c = self.shape[self.dim], self.rows
        a = math.prod(self.shape[: self.dim])
        x = math.prod(self.shape[self.dim + 1 :]) * scale
        whole = full.view(a, rows, x)
        k, rest = divmod(rows, c)
        pairs = []
        if k:
            block = whole[:, : k * c].reshape(a, k, c * x).transpose(0, 1)
            pairs.append((block, chunks[:k, : a * c * x].view(k, a, c * x)))
        if rest:
            pairs.append(
                (whole[:, k * c :].reshape(a, rest * x), chunks[k, : a * rest * x].view(a, -1))
            )
        return pairs

    def rank_major(self, full: torch.Tensor, world: int) -> torch.Tensor:
        """``full`` (a tensor of the parameter's shape, e.g. its gradient) rank-major, for
        ``torch._chunk_cat(..., dim=0, num_chunks=world)``: as is for dim 0 (it pads), a view
        when the shard dim splits evenly, else a zero-padded ``(W, chunk)`` copy."""
        if not self.dim:
            return full
        if math.prod(self.shape) and self.shape[self.dim] == world * self.rows:
            # Even: rank r's rows are [:, r] of (A, W, rest), a strided view, no copy.
            return full.reshape(math.prod(self.shape[: self.dim]), world, -1).transpose(0, 1)
        chunks = full.new_zeros(world, self.numel)
        for whole, chunk in self.rank_blocks(full.reshape(-1), chunks):
            chunk.copy_(whole)
        return chunks


def chunk_of(
    shape: tuple[int, ...],
    global_shape: tuple[int, ...],
    dim: int,
    outer_spec: DTensorSpec | None,
    info: MeshInfo,
    fqn: str,
) -> Chunk:
    """This rank's chunk of a parameter of ``shape`` (``global_shape`` before tensor
    parallelism's split, described by ``outer_spec``), split along ``dim`` over ``info``'s shard
    ranks. Errors are decided from global sizes (every rank alike), never this rank's piece."""
    world, rank = info.shard_size, info.shard_rank
    dp_axes = info.dp_axes_on(outer_spec.mesh) if outer_spec else frozenset()
    if len(shape) == 0:  # a scalar cannot be cut: every rank keeps it (Replicate)
        mesh, placements = sharded_layout(info, outer_spec, Replicate(), fqn)
        return Chunk(dim, shape, mesh, tuple(placements), dp_axes, 1, 0, 0, (), ())
    mesh, placements = sharded_layout(info, outer_spec, Shard(dim), fqn)
    size = global_shape[dim]
    if len(info.shard_axes) > 1 and size % world:  # no other split of dim (sharded_layout)
        raise NotImplementedError(
            f"{fqn}: dim {dim} of size {size} does not split evenly over the {world} "
            "ranks of the flattened data-parallel dims; uneven sizes need one shard dim"
        )
    if (
        outer_spec is not None
        and info.shard_axis is not None
        and dp_rows_mismatch(size, dim, tuple(mesh.shape), tuple(placements), info.shard_axis)
    ):
        pieces = piece_sizes(size, dim, tuple(outer_spec.mesh.shape), tuple(outer_spec.placements))
        raise NotImplementedError(
            f"{fqn}: tensor parallelism splits dim {dim} (size {size}) into pieces of "
            f"{sorted(pieces, reverse=True)} rows and fsdp2 splits each again over {world} "
            f"data-parallel ranks; DTensor's {tuple(placements)} would place these uneven rows "
            f"elsewhere. Make the size divisible by {world} x the tensor-parallel degree, or "
            "shard another dim with shard_placement_fn"
        )
    rows = shape[dim]
    rest = [n for i, n in enumerate(shape) if i != dim]
    chunk_rows = -(-rows // world)
    local_shape = list(shape)
    local_shape[dim] = min(max(rows - rank * chunk_rows, 0), chunk_rows)
    return Chunk(
        dim,
        tuple(shape),
        mesh,
        tuple(placements),
        dp_axes,
        numel=chunk_rows * math.prod(rest),
        rows=chunk_rows,
        row_start=min(rank * chunk_rows, rows),
        local_shape=tuple(local_shape),
        layout_shape=(rows, *rest),
    )


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
