"""``FSDPParam``: one parameter, seen as its slice of its group's flat buffers.

Layout (see [Note: flat layout] in layout.py): a parameter is cut along its shard dim into
``W`` chunks of ``ceil(rows / W)`` rows, as ``torch.chunk`` and DTensor's ``Shard(dim)`` cut it.
Each rank's chunk holds its rows as one contiguous tensor of their true shape, followed by padding
that exists only inside fsdp2's buffers, never in a tensor a user sees. A 0-d parameter cannot be
cut: every rank keeps the whole scalar (``Replicate()``) and contributes it as a one-element chunk,
so it still rides in the group's single collective.

Which rows each rank holds, and how they move between a full tensor and the rank-major
buffers, is ``chunk.py``'s (``FSDPParam.chunk``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor, Replicate, _dtensor_spec
from torch.utils import dlpack
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from fsdp2.engine.chunk import Chunk, chunk_of, piece_sizes
from fsdp2.engine.collectives import redistribute
from fsdp2.engine.extension import (
    ExtensionState,
    contiguous_strides,
    has_extension,
    releases_outputs,
)
from fsdp2.engine.mesh import MeshInfo
from fsdp2.engine.releases import CLEAR_NATIVE_DTENSOR_CACHE, RULES, explicit_grad_dtype

if TYPE_CHECKING:
    pass

__all__ = ["BufferPlace", "FSDPParam", "typed"]


def typed(flat: torch.Tensor, start: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """``numel`` elements of ``dtype`` at ``start`` of ``flat``: counted in elements if ``flat`` has
    that dtype, else in bytes (a mixed-dtype group's byte buffers)."""
    if flat.dtype == dtype:
        return flat[start : start + numel]
    return flat[start : start + numel * dtype.itemsize].view(dtype)


@dataclass(slots=True)
class BufferPlace:
    """Where the group's layout put one parameter's chunk (written by layout.py alone): its start
    in a rank's flat shard, and its start and length in a rank's part of the gathered buffer, in
    the buffers' units (the dtype's elements, or bytes in a mixed-dtype group)."""

    offset: int = 0
    gather_offset: int = 0
    gather_units: int = 0


class FSDPParam:
    """One managed parameter: its sharded ``DTensor`` parameter and its unsharded stand-in."""

    def __init__(
        self,
        param: nn.Parameter,
        slots: list[tuple[nn.Module, str]],
        fqn: str,
        owner: str,
        kept_dtype: torch.dtype | None = None,
        dim: int = 0,
    ) -> None:
        self.fqn = fqn
        # Gathered in this dtype whatever the mixed precision policy says (its
        # param_dtype_override_fn kept the parameter in its own dtype at fully_shard).
        self.kept_dtype = kept_dtype
        self.owner = owner  # the fully_shard call's modules, named in errors about tied weights
        # Every (module, name) the parameter is registered under: tied weights have several.
        self.slots = [(module._parameters, name) for module, name in slots]
        self.slot_modules = list(slots)
        # An incoming DTensor (tensor parallel) is sharded again through its local tensor: the
        # layout below works on that local shape, and the unsharded parameter is rebuilt as a
        # DTensor with this spec, which is what the tensor-parallel modules compute with.
        self.outer_spec: _dtensor_spec.DTensorSpec | None = (
            param._spec if isinstance(param, DTensor) else None
        )
        self.shape = param._local_tensor.shape if isinstance(param, DTensor) else param.shape
        self.global_shape = param.shape
        # Shards are stored contiguously whatever the parameter's layout (channels_last included),
        # so the sharded DTensor reports the contiguous strides of the full shape.
        self.stride = contiguous_strides(param.shape)
        self.dtype = param.dtype
        # The grad_dtype the user set (None: the default): the sharded gradient's dtype, and the
        # dtype its micro-batches are summed and reduced in (see set_dtypes).
        self.grad_dtype = explicit_grad_dtype(param)
        self.requires_grad = param.requires_grad
        self.numel = math.prod(self.shape)
        self.dim = dim  # the dim fsdp2 splits (shard_placement_fn may pick another)
        # All-gather extension (see extension.py): the subclass the shard is viewed as.
        local = param._local_tensor if isinstance(param, DTensor) else param
        self.subclass = type(local) if has_extension(local) else None
        self.extension = self.subclass is not None
        # A wrapper subclass (its data in inner tensors, as torchao's float8 and NF4 weights) has
        # no storage of its own to view the flat buffer through: its shard lives outside it.
        self.wrapper = self.extension and is_traceable_wrapper_subclass(local)
        # What packing.py keeps across gathers.
        self.ext = ExtensionState(release_outputs=releases_outputs(local))
        self.module = slots[0][0]  # handed to fsdp_pre_all_gather
        self.on_grad_ready: Callable[[torch.Tensor], None] | None = None
        # Set by the group's layout once it is fixed (layout.py).
        self.place = BufferPlace()  # where its chunk is in the group's buffers
        self.param_dtype = self.dtype  # what it is gathered and computed in (mixed precision)
        self.reduce_dtype = self.dtype  # what its gradients are summed in (set_dtypes)
        self.sharded_param: nn.Parameter  # DTensor; the optimizer's parameter
        self.unsharded_param: nn.Parameter  # plain tensor viewing the unsharded buffer
        self.grad_node: torch.autograd.graph.Node | None = None  # AccumulateGrad, kept alive
        self._hooked: nn.Parameter | None = None  # the unsharded parameter given on_grad_ready
        self.chunk: Chunk  # this rank's rows, fixed by set_chunk (the layout's first step)
        # The shard as a tensor (a view of the flat shard; a wrapper's own tensor) and, but for
        # a wrapper, that view's storage: set by init_sharded.
        self.local_tensor: torch.Tensor
        self.local_storage: torch.UntypedStorage

    def set_chunk(self, info: MeshInfo) -> None:
        """Fix this rank's chunk over ``info``'s shard ranks (``chunk.py``)."""
        self.chunk = chunk_of(
            self.shape, self.global_shape, self.dim, self.outer_spec, info, self.fqn
        )

    def piece_sizes(self) -> frozenset[int]:
        """The size of the sharded dim of every rank's local piece (tensor parallelism may
        leave pieces of different sizes): a global fact, the same on every rank."""
        if not self.shape:
            return frozenset()  # a scalar is not split
        size, spec = self.global_shape[self.dim], self.outer_spec
        if spec is None:
            return frozenset({size})
        return piece_sizes(size, self.dim, tuple(spec.mesh.shape), tuple(spec.placements))

    def init_sharded(self, flat: torch.Tensor, info: MeshInfo, full: torch.Tensor | None) -> None:
        """Make the sharded parameter view its chunk of ``flat``, filled with this rank's rows of
        ``full``, or (``full=None``) with the current sharded parameter's values. A wrapper
        subclass's shard is a tensor of its own instead (``_wrapper_shard``)."""
        if self.wrapper:
            local = self._wrapper_shard(flat.device, full)
        else:
            local = own_storage(typed(flat, self.place.offset, self.chunk.local_numel, self.dtype))
            self.local_storage = local.untyped_storage()  # what in_buffer() recognises
            local = local.view(self.chunk.local_shape)
            if self.subclass is not None:
                local = local.as_subclass(self.subclass)  # same storage, the user's subclass
        self.local_tensor = local
        if full is None:
            owner = getattr(self.sharded_param, "_fsdp2_owner", None) or self.owner
            current = self.sharded_param._local_tensor  # type: ignore[attr-defined]
            if local is not current:
                with torch.no_grad():
                    local.copy_(current)
            # Keep the Parameter object (optimizers and users hold it); swap what it wraps.
            if self.sharded_param.stride() != self.stride:
                # .to(memory_format=...) made it channels_last: its strides must be the
                # contiguous ones of the buffer it now lives in.
                new = self._new_sharded_param(local, self.sharded_param.requires_grad)
                torch.utils.swap_tensors(self.sharded_param, new)  # type: ignore[no-untyped-call]
            self.sharded_param._local_tensor = local  # type: ignore[attr-defined]
            self.sharded_param._fsdp2_owner = owner  # type: ignore[attr-defined]
            self._keep_grad_dtype()
            return
        if full.device.type != "meta" and not self.wrapper:
            with torch.no_grad():
                local.copy_(self.chunk.shard_of(full))
        self.sharded_param = self._new_sharded_param(local, self.requires_grad)
        self.sharded_param._fsdp2_owner = self.owner  # type: ignore[attr-defined]
        self.local_tensor = self.sharded_param._local_tensor  # type: ignore[attr-defined]
        self._keep_grad_dtype()

    def _keep_grad_dtype(self) -> None:
        """Give the sharded parameter the user's ``grad_dtype`` (a new parameter object, or one
        ``.to()`` converted, lost it): its reduced gradient comes in that dtype. A gradient it
        holds (``.to()`` converted that too) is cast back to it."""
        param, dtype = self.sharded_param, self.grad_dtype
        if dtype is None or param.grad_dtype == dtype:
            return
        grad, param.grad = param.grad, None
        param.grad_dtype = dtype
        if grad is not None:
            param.grad = grad.to(dtype)

    def _new_sharded_param(self, local: torch.Tensor, requires_grad: bool) -> nn.Parameter:
        """``local`` wrapped as the sharded DTensor parameter, as it is: ``DTensor.from_local``
        would wrap a ``view_as`` of it, which some subclasses reject (torchao <= 0.13's NF4)."""
        meta = _dtensor_spec.TensorMeta(self.global_shape, self.stride, local.dtype)
        spec = _dtensor_spec.DTensorSpec(
            self.chunk.mesh, tuple(self.chunk.placements), tensor_meta=meta
        )
        return parameter(DTensor.__new__(DTensor, local, spec, requires_grad=False), requires_grad)

    def _wrapper_shard(self, device: torch.device, full: torch.Tensor | None) -> torch.Tensor:
        """A wrapper subclass's shard: this rank's rows of ``full`` cut through the subclass (so
        its inner tensors are cut alike) and copied, so that it owns exactly its bytes; or, on
        a re-pack, the current shard as it is.

        Only ops that such subclasses implement for sharding: ``torch.split`` to cut (torchao's
        NF4 implements ``aten.slice``, what ``narrow`` runs, only for the whole tensor), and
        ``new_zeros`` + ``copy_`` to copy (NF4 refuses ``.to(copy=True)``)."""
        if full is None:
            local: torch.Tensor = self.sharded_param._local_tensor  # type: ignore[attr-defined]
            return local
        with torch.no_grad():
            rows = self.chunk.split_rows(full)
            if rows.device != device:
                rows = rows.to(device)
            shard = rows.new_zeros(rows.shape)
            shard.copy_(rows)
            return shard

    def init_unsharded(self, unsharded_flat: torch.Tensor, world: int) -> None:
        """View this parameter's (padded) region of the group's param-major unsharded buffer: its
        start, as a contiguous tensor of the full shape."""
        start = world * self.place.gather_offset
        view = typed(unsharded_flat, start, self.numel, self.param_dtype).view(self.shape)
        if self.outer_spec is not None:
            view = DTensor(view, self.outer_spec, requires_grad=False)  # type: ignore[no-untyped-call]
        self.adopt_unsharded(parameter(view, self.requires_grad))

    def reset_unsharded(self) -> None:
        """An empty stand-in for the unsharded parameter, until the first gather makes the view
        (a view needs its storage allocated when it is made)."""
        self.unsharded_param = nn.Parameter(torch.empty(0), requires_grad=self.requires_grad)

    def set_dtypes(
        self, mp_param_dtype: torch.dtype | None, mp_reduce_dtype: torch.dtype | None
    ) -> None:
        """What the parameter is gathered and computed in: the policy's ``param_dtype`` for a
        floating parameter, unless its override kept its own; its stored dtype otherwise (mixed
        precision leaves non-floating dtypes alone). And what its gradients are summed in: the
        policy's ``reduce_dtype``; else its explicit ``grad_dtype``; else the installed torch's
        default (``RULES.reduce_dtype_follows_grad_dtype``: its own dtype, or ``param_dtype``)."""
        floating = self.dtype.is_floating_point
        self.param_dtype = self.kept_dtype or (mp_param_dtype if floating else None) or self.dtype
        if not floating:
            self.reduce_dtype = self.param_dtype
        elif mp_reduce_dtype is not None:
            self.reduce_dtype = mp_reduce_dtype
        elif self.grad_dtype is not None:
            self.reduce_dtype = self.grad_dtype
        else:
            follows = RULES.reduce_dtype_follows_grad_dtype
            self.reduce_dtype = self.dtype if follows else self.param_dtype

    @property
    def sharded_grad_dtype(self) -> torch.dtype:
        """The dtype of the sharded parameter's ``.grad``: its ``grad_dtype``, else its own."""
        return self.grad_dtype or self.dtype

    def adopt(self, new: nn.Parameter) -> None:
        """Make ``new`` (a parameter assigned on the modules, or loaded with ``assign=True``)
        the sharded parameter, owned by this call; the group re-packs it next. A ``grad_dtype``
        set on ``new`` replaces ours; without one, ours carries over (as torch 2.15 does)."""
        new._fsdp2_owner = self.owner  # type: ignore[attr-defined]
        self.grad_dtype = explicit_grad_dtype(new) or self.grad_dtype
        self.sharded_param = new

    def follow_dtype(self) -> None:
        """Store what the sharded parameter now holds (``.to(dtype)``, an adopted parameter):
        read by the re-pack that follows."""
        self.dtype = self.sharded_param.dtype

    def rename(self, fqn: str) -> None:
        """Name the parameter under the root (at lazy init): at ``fully_shard`` names were
        relative to the call's module ("fc.weight" of which of 96 blocks?)."""
        self.fqn = fqn

    def connect(self, on_grad_ready: Callable[[torch.Tensor], None]) -> None:
        """Call ``on_grad_ready`` (the group's reducer) once autograd accumulated the unsharded
        parameter's gradient; set before the unsharded parameters are made."""
        self.on_grad_ready = on_grad_ready

    def adopt_unsharded(self, param: nn.Parameter) -> None:
        """Make ``param`` the unsharded parameter, hooked for gradient readiness, taking its
        gradient in the dtype ``RULES.unsharded_grad_as_computed`` says."""
        self.unsharded_param = param
        if (
            RULES.unsharded_grad_as_computed
            and self.requires_grad
            and self.param_dtype.is_floating_point
            and self.reduce_dtype.itemsize > self.param_dtype.itemsize
        ):
            param.grad_dtype = self.reduce_dtype if self._summed_outside_dp() else None
        self._hook()

    def _summed_outside_dp(self) -> bool:
        """Whether the gradient may be ``Partial`` on a model-parallel axis (the parameter is
        replicated there: a SequenceParallel norm's weight), summed there by ``local_grad``."""
        spec = self.outer_spec
        return spec is not None and any(
            isinstance(p, Replicate)
            for axis, p in enumerate(spec.placements)
            if axis not in self.chunk.dp_axes
        )

    def _hook(self) -> None:
        param = self.unsharded_param
        if not self.requires_grad or self.on_grad_ready is None:
            return
        if self._hooked is not param:  # once per tensor, however often requires_grad flips
            param.register_post_accumulate_grad_hook(self.on_grad_ready)  # type: ignore[no-untyped-call]
            self._hooked = param
        # Holding the AccumulateGrad node keeps it unique, so the engine can be asked
        # whether it will run in a given backward (see GradientReducer.on_grad_ready).
        # Grad mode on: the first gather may run under no_grad (evaluation first, or the
        # forward of a reentrant checkpoint), where the view would have no grad_fn.
        with torch.enable_grad():
            self.grad_node = param.view_as(param).grad_fn
        if self.grad_node is not None:
            self.grad_node = self.grad_node.next_functions[0][0]

    def follow_requires_grad(self, gathered: bool) -> bool:
        """Take up ``requires_grad_`` called since the last forward on the registered parameter
        (the unsharded one if ``gathered``: what ``model.parameters()`` yields then); whether
        it changed."""
        wanted = (self.unsharded_param if gathered else self.sharded_param).requires_grad
        if wanted == self.requires_grad:
            return False
        self.requires_grad = wanted
        self.sharded_param.requires_grad_(wanted)
        self.unsharded_param.requires_grad_(wanted)
        self._hook()
        return True

    def register(self, param: nn.Parameter, replacing: nn.Parameter | None = None) -> None:
        """Put ``param`` in every slot. With ``replacing``, first check that each slot still
        holds it (a parameter the user assigned meanwhile must not vanish silently), and carry
        over its ``requires_grad``: the user may have changed it on the one they could see."""
        slots = self.slots
        if replacing is not None:
            # check_slots, inlined: four times per parameter and step
            for params, name in slots:
                if params.get(name) is not replacing:
                    self.check_slots(replacing)
            wanted = replacing.requires_grad
            if param.requires_grad is not wanted:
                param.requires_grad_(wanted)
        for params, name in slots:
            params[name] = param

    def check_slots(self, expected: nn.Parameter) -> None:
        """Raise unless every slot still holds ``expected``, what fsdp2 registered there."""
        for params, name in self.slots:
            if params.get(name) is not expected:
                raise RuntimeError(
                    f"{self.fqn} was replaced (or removed) on its module in the middle of an "
                    "iteration (after its forward began, or while unshard() kept it gathered); "
                    "fsdp2 adopts a new parameter only when a forward starts with the module "
                    "resharded. Assign parameters between iterations"
                )

    def local_view(self, flat: torch.Tensor, start: int) -> torch.Tensor:
        """This rank's real rows inside a rank-local buffer where the chunk begins at ``start``,
        as a tensor with a storage of its own (see ``own_storage``)."""
        return own_storage(flat[start : start + self.chunk.local_numel]).view(
            self.chunk.local_shape
        )

    def current_piece(self) -> torch.Tensor:
        """The parameter's current values in the shape its layout works on: under tensor
        parallelism this rank's piece (what ``fully_shard`` reads from a DTensor parameter),
        not the whole tensor. Every rank of the shard group calls it (a collective)."""
        sharded = cast(DTensor, self.sharded_param.detach())
        if sharded.device.type == "meta":
            return torch.empty(self.shape, dtype=self.dtype, device="meta")
        replicated = [Replicate()] * sharded.device_mesh.ndim
        full = redistribute(sharded, replicated, self.fqn, sharded.full_tensor)
        spec = self.outer_spec
        if spec is None:
            return full
        # Replicate to the parameter's own placements: a local cut, no collective.
        whole = DTensor.from_local(full, spec.mesh, [Replicate()] * spec.mesh.ndim, run_check=False)
        piece: torch.Tensor = whole.redistribute(spec.mesh, spec.placements).to_local()
        return piece

    def in_buffer(self) -> bool:
        """Whether the sharded parameter's local tensor is still the one ``init_sharded`` made
        (and not one ``module.to(...)``, ``to_empty`` or ``load_state_dict(assign=True)`` put in
        its place): by storage identity, as data pointers are 0 on meta and for empty shards;
        a wrapper subclass's shard (outside the buffer) by tensor identity."""
        local = self.sharded_param._local_tensor  # type: ignore[attr-defined]
        if self.wrapper:
            return bool(local is self.local_tensor and local.dtype == self.dtype)
        return bool(
            local.untyped_storage()._cdata == self.local_storage._cdata
            and local.dtype == self.dtype
        )

    def make_grad(self, local: torch.Tensor) -> DTensor:
        """A gradient with the sharded parameter's placement, wrapping ``local`` without a copy.
        (A new wrapper each time, about 2 us: keeping one to reuse would keep the previous
        step's gradient alive after ``zero_grad`` dropped it.)"""
        spec = self.sharded_param._spec  # type: ignore[attr-defined]
        # __new__ alone: DTensor.__init__ does nothing in eager, behind a dynamo-disable and
        # an export wrapper that cost more than the wrapping itself (once per parameter, step).
        return DTensor.__new__(DTensor, local, spec, requires_grad=False)

    def __repr__(self) -> str:
        return f"FSDPParam({self.fqn}, shape={tuple(self.shape)}, dim={self.dim})"


def parameter(tensor: torch.Tensor, requires_grad: bool) -> nn.Parameter:
    """``nn.Parameter(tensor)``; a DTensor keeps its own mesh object.

    nn.Parameter detaches a DTensor through sharding propagation, whose caches compare meshes by
    ranks and dim names, not by process group. The parameter can come back on an equal mesh of
    an earlier group, destroyed since (a notebook that re-initialises, a job that rebuilds its
    groups over the same ranks): every DTensor op on it or on what is computed from it
    (``full_tensor``, ``state_dict``, gradient clipping) would then fail to resolve that group.
    Where that happens, the caches are cleared, so that what follows is computed on this mesh."""
    param = nn.Parameter(tensor, requires_grad=requires_grad)
    if isinstance(tensor, DTensor) and param._spec.mesh is not tensor._spec.mesh:  # type: ignore[attr-defined]
        _clear_dtensor_caches()
        param._spec = tensor._spec  # type: ignore[attr-defined]
    return param


def _clear_dtensor_caches() -> None:
    """Forget every op's cached sharding: Python's cache and the C++ dispatch fast path's."""
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()  # type: ignore[no-untyped-call]
    if CLEAR_NATIVE_DTENSOR_CACHE is not None:  # releases without the C++ fast path lack it
        CLEAR_NATIVE_DTENSOR_CACHE()


def own_storage(piece: torch.Tensor) -> torch.Tensor:
    """``piece`` (a 1-D slice of a flat buffer) as a tensor whose storage is exactly its bytes of
    the buffer's memory, and which keeps the buffer alive.

    The shards and gradients users hold must not look like views of the group's buffer. What
    walks storages would see all of it: ``torch.save`` and pickle of one tensor write every
    parameter of the group, and libraries that find tied weights by storage (transformers'
    ``id_tensor_storage``) would take every parameter for a copy of every other. And a DTensor
    takes its ``storage_offset`` from its local tensor, so one wrapping a slice at a nonzero
    offset has a nonzero ``data_ptr()`` on its data-less storage; torch's pickling and
    ``deepcopy`` then read that storage as real ("invalid python storage"). A DLPack round
    trip makes the storage without a copy. Meta and fake tensors have no memory to share.
    """
    if piece.device.type == "meta" or is_fake(piece):
        return piece
    raw = dlpack.from_dlpack(dlpack.to_dlpack(piece.view(torch.uint8)))  # type: ignore[attr-defined]
    return raw.view(piece.dtype)
