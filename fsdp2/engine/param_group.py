"""``FSDPParamGroup``: the parameters of one ``fully_shard`` call, moved together.

[Note: flat layout]
Each rank keeps one 1-D ``sharded_flat`` buffer: the padded chunk of every parameter, trainable
parameters first, back to back. The sharded ``DTensor`` parameters are views into it, so the
optimizer writes straight into the all-gather input: gathering needs no copy-in. The gather lands
rank-major (``[rank 0's chunks | rank 1's chunks | ...]``) and one ``split_with_sizes_copy``
turns it param-major into ``unsharded_flat``, which the unsharded parameters view.

[Note: mixed dtypes]
A group whose parameters have several dtypes (a frozen bf16 or fp8 base weight beside fp32
adapters) keeps both flat buffers as bytes, each chunk viewed as its parameter's dtype, and the
gather moves bytes: still one collective, and no copy-in unless mixed precision casts some chunk.
Chunks go widest dtype first, so that every one starts at a multiple of its element size, in a
rank's shard and in the param-major unsharded buffer alike. Mixed precision applies per parameter, floating ones only. Gradients
are reduce-scattered together too, in the widest of the trainable parameters' reduce dtypes
(bf16 beside fp32 reduces in fp32, rounded once on the way back): one collective, and no
parameter's gradient is summed at less than its own precision.

[Note: freeing unsharded storage]
Autograd saves the unsharded parameters it needs for backward. Rather than dropping the tensors,
resharding shrinks the storage under ``unsharded_flat`` to zero bytes, and unsharding grows it back
and refills it, so the very tensors autograd saved see valid data again in backward. The refill
would bump their version counter and trip autograd's in-place check, so it runs under
``_unsafe_preserve_version_counter``: the data is, by construction, what forward used.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp2.engine import extension
from fsdp2.engine.collectives import Pending, all_gather
from fsdp2.engine.comm import AllGather, ReduceScatter
from fsdp2.engine.extension import Packing
from fsdp2.engine.mesh import MeshInfo
from fsdp2.engine.param import FSDPParam, ShardedState, typed
from fsdp2.engine.policies import CPUOffloadPolicy, MixedPrecisionPolicy
from fsdp2.engine.reduce import GradientReduction

__all__ = ["FSDPParamGroup"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _plain_tensors(method: Callable[_P, _R]) -> Callable[_P, _R]:
    """Run ``method`` outside inference mode and functorch transforms, whatever the caller's
    mode: the buffers it allocates outlive the call. An inference tensor could never be saved
    for backward (a job that evaluates before it trains), and a functorch wrapper has no
    storage to resize (the first gather inside ``torch.func.jvp``)."""

    @functools.wraps(method)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        inference = torch.is_inference_mode_enabled()
        functorch = torch._C._are_functorch_transforms_active()
        if not inference and not functorch:  # the common case: no context to enter
            return method(*args, **kwargs)
        with contextlib.ExitStack() as stack:
            if inference:
                stack.enter_context(torch.inference_mode(False))
            if functorch:
                stack.enter_context(torch._C._DisableFuncTorch())
            return method(*args, **kwargs)

    return wrapper


class FSDPParamGroup(GradientReduction):
    """All-gathers, frees and reduce-scatters the parameters of one ``fully_shard`` call."""

    def __init__(
        self,
        params: list[FSDPParam],
        full_tensors: list[torch.Tensor],
        info: MeshInfo,
        device: torch.device,
        label: str,
        mp_policy: MixedPrecisionPolicy | None = None,
        offload: CPUOffloadPolicy | None = None,
    ) -> None:
        self.info = info
        self.label = label
        self.world = info.shard_size
        self.state = ShardedState.SHARDED
        # Plain parameters first (trainable, then frozen), extension parameters last: the plain
        # prefix of the flat shard is what a byte-packed gather sends as is.
        order = sorted(
            range(len(params)), key=lambda i: (params[i].extension, not params[i].requires_grad)
        )
        self.fsdp_params = [params[i] for i in order]
        self.trainable = [p for p in self.fsdp_params if p.requires_grad]
        self.plain_params = [p for p in self.fsdp_params if not p.extension]
        self.ext_params = [p for p in self.fsdp_params if p.extension]
        for fsdp_param in self.fsdp_params:
            fsdp_param.on_grad_ready = self._on_grad_ready
        self.mp_policy = mp_policy or MixedPrecisionPolicy()
        self.device = device  # where gathers, compute and reductions run
        self.offload = offload
        for fsdp_param in self.fsdp_params:
            fsdp_param.plan(info)
        self._set_dtypes()
        # Decided from shapes, not this rank's shard, so that every rank raises alike.
        # Uneven dim 0 is padded (extension.pack); other dims and tensor-parallel pieces are not.
        uneven = [
            p.fqn
            for p in self.ext_params
            if (p.dim or p.outer_spec is not None) and any(n % self.world for n in p.piece_sizes())
        ]
        if uneven:
            raise NotImplementedError(
                f"{', '.join(uneven)}: all-gather extension parameters sharded on a dim other "
                f"than 0, or tensor parallel, must split evenly over the {self.world} shard "
                "ranks (every rank's inputs the same size); make that size divisible, or "
                "shard dim 0"
            )
        fulls = [full_tensors[i] for i in order]
        if any(full.device.type == "meta" for full in fulls):
            storage = torch.device("meta")  # materialised later by to_empty(); see rebuild()
        else:
            storage = torch.device("cpu") if offload else device
        self._build(storage, fulls)
        # An issued gather: its handle, its output, the extension packing, and whether the
        # output is ours to free (not a custom collective's buffer, not the shard itself).
        self._gather: tuple[Pending, torch.Tensor, Packing | None, bool] | None = None
        # reshard_after_forward=k: the k-rank group that gathers in backward, which of the k
        # blocks of W/k consecutive ranks' chunks this rank keeps, and (in PARTIAL) that block.
        self.partial_group: dist.ProcessGroup | None = None
        self.partial_rows = (0, 0)
        self._partial: torch.Tensor | None = None
        self._task = -1  # graph task whose gradients are being counted
        self.backward_task = -1  # graph task its pre-backward ran in (-1: none this backward)
        self._ready = 0
        self._expected = 0
        self.on_grads_ready: Callable[[], None] = lambda: None  # set by the owning FSDPState
        self.grads_ready = False  # every gradient in, not yet reduced (see reduce.py's note)
        self.seen_in = -1  # the last iteration whose forward ran this group
        self.order_index = 0  # its position in that forward's order
        self.reduced_in_backward = False  # reduce-scattered since the last end of backward
        # Knobs set through FSDPModule's set_* methods.
        self.reduce_grads_enabled = True  # False: accumulate unreduced gradients (no sync)
        self.reshard_after_backward = True
        self.unshard_in_backward = True
        self.divide_factor: float | None = None  # None: average over the shard ranks
        self.force_sum_reduction = False
        self.reduce_scatter_unused = False  # give unused parameters zeros so ranks agree
        self.all_reduce_hook: Callable[[torch.Tensor], None] | None = None
        self.custom_all_gather: AllGather | None = None
        self.custom_reduce_scatter: ReduceScatter | None = None
        self.reduce_scatter_group: dist.ProcessGroup | None = None  # None: the shard group
        self.max_in_flight = 1  # reduce-scatters (and their input buffers) alive at once
        # Gather the next group ahead of need: None decides by device ([Note: prefetch order]).
        self.guess_prefetch: bool | None = None
        self.requires_all_reduce = True  # only meaningful with a replicate axis (HSDP)
        self.stale = False  # some parameters replaced, not yet re-packed (see rebuild)
        # Some rank had parameters on meta at fully_shard: lazy init checks (agreement.py).
        self.meta_on_some_rank = False
        self._replica_partial: torch.Tensor | None = None  # reduced, not yet all-reduced

    def _build(self, storage_device: torch.device, fulls: list[torch.Tensor] | None) -> None:
        """Allocate the flat buffers on ``storage_device`` and point every parameter into them.
        ``fulls`` are the full parameters to shard; ``None`` re-packs the current sharded
        parameters (after ``module.to(...)`` or ``to_empty`` replaced them)."""
        world = self.world
        pin = self.offload is not None and self.offload.pin_memory and self.device.type != "cpu"
        # 1-D, this rank's padded chunk of every parameter; zeros so padding is deterministic.
        flat = torch.zeros(self.shard_numel, dtype=self.dtype, device=storage_device)
        self.sharded_flat = flat.pin_memory() if pin else flat
        for i, fsdp_param in enumerate(self.fsdp_params):
            full = fulls[i] if fulls is not None else None
            fsdp_param.init_sharded(self.sharded_flat, self.info, full)
            fsdp_param.group = self
        # With one rank and nothing to cast or move, the shard is the whole parameter: the
        # unsharded parameters view the sharded buffer and "gathering" costs nothing.
        self.alias = (
            world == 1
            and self.param_dtype == self.dtype
            and not self._cast_each
            and storage_device == self.device
            and not self.ext_params
        )
        # Unsharded parameters are views, and a view needs its storage allocated when it is made:
        # they are made at the first gather, so that sharding (or re-packing after to_empty) a
        # model never allocates its unsharded size. Until then, empty stand-ins.
        for fsdp_param in self.fsdp_params:
            fsdp_param.unsharded_param = nn.Parameter(
                torch.empty(0), requires_grad=fsdp_param.requires_grad
            )
            fsdp_param.ext_inner = None  # extension parameters: built by their post hook
            fsdp_param.ext_outputs = None
        self.unsharded_flat = self.sharded_flat if self.alias else None
        self._copy_out: list[torch.Tensor] = []
        if self.alias:
            self._make_unsharded_views()

    def _make_unsharded_views(self) -> None:
        """Allocate the unsharded buffer and make the plain parameters' unsharded views of it."""
        world = self.world
        if self.unsharded_flat is None:
            # 1-D, param-major, every plain parameter padded to world * chunk.
            self.unsharded_flat = torch.empty(
                world * self.plain_numel, dtype=self.param_dtype, device=self.device
            )
        self._copy_out = [
            self.unsharded_flat[
                world * p.gather_offset : world * (p.gather_offset + p.gather_units)
            ].view(world, p.gather_units)
            for p in self.plain_params
        ]
        for fsdp_param in self.plain_params:
            fsdp_param.init_unsharded(self.unsharded_flat, world)

    def _set_dtypes(self) -> None:
        """Each parameter's gather dtype, the group's buffer and reduce dtypes, and the chunks'
        offsets in those buffers (elements of the one dtype, or bytes: [Note: mixed dtypes])."""
        mp = self.mp_policy
        for p in self.fsdp_params:  # mixed precision leaves non-floating dtypes alone
            p.param_dtype = (mp.param_dtype if p.dtype.is_floating_point else None) or p.dtype
        dtypes = {p.dtype for p in self.fsdp_params}
        self.mixed = len(dtypes) > 1
        if self.mixed:
            self.dtype = self.param_dtype = torch.uint8
            reduce_dtypes = [mp.reduce_dtype or p.param_dtype for p in self.trainable]
            self.reduce_dtype = (
                functools.reduce(torch.promote_types, reduce_dtypes)
                if reduce_dtypes
                else torch.float32
            )
        else:
            self.dtype = dtypes.pop() if dtypes else torch.float32
            floating = self.dtype.is_floating_point
            self.param_dtype = (mp.param_dtype if floating else None) or self.dtype
            self.reduce_dtype = (mp.reduce_dtype if floating else None) or self.param_dtype
        if self.mixed:  # widest first: every chunk's offset is a multiple of its element size
            self.plain_params.sort(key=lambda p: -p.param_dtype.itemsize)
        # A mixed group casting some chunks gathers a packed copy, not its shard's bytes.
        self._cast_each = self.mixed and any(p.param_dtype != p.dtype for p in self.plain_params)
        offset = 0
        for p in self.plain_params:
            p.gather_offset, p.gather_units = offset, self._units(p.chunk_numel, p.param_dtype)
            offset += p.gather_units
        self.plain_numel = offset
        self._chunk_sizes = [p.gather_units for p in self.plain_params]
        # The shard's plain prefix is what a gather without casts sends: the same layout. Chunks
        # not sent as they are may start anywhere: at 16 bytes, aligned for any dtype.
        offset = 0
        for p in self.plain_params + [p for p in self.ext_params if not p.wrapper]:
            if self.mixed and (self._cast_each or p.extension):
                offset = -(-offset // 16) * 16
            p.offset = offset
            offset += self._units(p.chunk_numel, p.dtype)
        self.shard_numel = offset
        # Shard(dim > 0) chunks are strided slabs of the full parameter: no single split-copy.
        self._split_copy = all(not p.dim for p in self.plain_params)

    def _units(self, numel: int, dtype: torch.dtype) -> int:
        """Buffer units for ``numel`` elements of ``dtype``: elements, or bytes if mixed."""
        return numel * dtype.itemsize if self.mixed else numel

    def rebuild(self, force: bool = False) -> None:
        """Re-pack the sharded parameters into fresh buffers once something (``module.to(...)``,
        ``to_empty``, ``load_state_dict(assign=True)``) replaced their tensors, adopting their new
        device and dtype. A group spanning several modules is converted one module at a time:
        until every parameter is replaced, the rest still live in the old (maybe meta) buffer,
        so the re-pack waits (``stale``) for the last module, or for the next gather. ``force``:
        re-pack now, whatever was replaced (parameters a user assigned: see changes.py)."""
        replaced = [not self._packed(p) for p in self.fsdp_params]
        if not force:
            if not any(replaced):
                self.stale = False
                return
            self.stale = True
            if not all(replaced):
                return
        self.reshard()
        for fsdp_param in self.fsdp_params:
            fsdp_param.dtype = fsdp_param.sharded_param.dtype
        self._set_dtypes()
        devices = [_local_device(p) for p in self.fsdp_params]
        # Some still on meta (only others were replaced): nothing to keep until to_empty().
        metas = [d for d in devices if d.type == "meta"]
        storage = metas[0] if metas else devices[0]
        if self.offload is None:
            self.device = storage
        self._build(storage, None)
        self.stale = False

    def _packed(self, fsdp_param: FSDPParam) -> bool:
        """Whether the sharded parameter still lives in this group's flat shard."""
        return fsdp_param.in_buffer()

    def _repack_if_stale(self) -> None:
        """Before a gather: finish a deferred re-pack. Parameters left in the old buffer are
        still good when they share the replaced ones' device: ``.to()`` hands back the same
        tensor where there is nothing to convert (a bias under ``memory_format=``, a parameter
        already of the target dtype). On meta, or on another device, they cannot be gathered
        with the rest."""
        if not self.stale:
            return
        self.rebuild()
        if self.stale:
            self._repack_partly_replaced()

    def _repack_partly_replaced(self) -> None:
        devices = {_local_device(p) for p in self.fsdp_params}
        if len(devices) == 1 and next(iter(devices)).type != "meta":
            self.rebuild(force=True)
            return
        done = [p for p in self.fsdp_params if not self._packed(p)]
        left = [p for p in self.fsdp_params if self._packed(p)]

        def names(params: list[FSDPParam]) -> str:
            return ", ".join(p.fqn for p in params)

        def where(params: list[FSDPParam]) -> str:
            return " and ".join(sorted({str(_local_device(p)) for p in params}))

        raise RuntimeError(
            f"fsdp2 group {self.label or '<root>'!r}: the parameters {names(done)} were "
            f"replaced (by .to(), to_empty() or load_state_dict(assign=True)) and are on "
            f"{where(done)}, but {names(left)} were not and are on {where(left)}; the modules "
            "of one fully_shard call are gathered together, so convert all of them (e.g. call "
            ".to()/to_empty() on their parent)"
        )

    # -- unshard / reshard -----------------------------------------------------------------------

    @_plain_tensors
    def unshard(self) -> None:
        """Start gathering the full parameters (no-op if unsharded or already under way)."""
        if self.state is ShardedState.UNSHARDED or self._gather is not None:
            return
        self._repack_if_stale()
        if self.alias:
            return
        if self.sharded_flat.device.type == "meta":
            names = ", ".join(p.fqn for p in self.fsdp_params)
            raise RuntimeError(
                f"fsdp2 module {self.label or '<root>'!r} has parameters on the meta device "
                f"({names}). "
                "Materialise them before forward: module.to_empty(device=...) and then "
                "module.reset_parameters() (or your own init)"
            )
        if self.unsharded_flat is None:
            self._make_unsharded_views()  # the first gather: allocated at full size
        if self.unsharded_flat is None:
            raise AssertionError(
                f"unshard '{self.label}': expected the unsharded buffer to be allocated, found None"
            )
        packing = None
        if self._partial is not None:
            source, group = self._partial, self.partial_group
        else:
            # One cast/copy of the plain shard: to param_dtype, and to the device if offloaded.
            if self._cast_each:
                source = self._cast_plain()
            else:
                plain = self.sharded_flat[: self.plain_numel]
                source = plain.to(self.device, self.param_dtype, non_blocking=True)
            group = self.info.shard_group
            if self.ext_params:
                source, packing = extension.pack(self, source)
        if self.world == 1:  # nothing to gather, only the cast, copy or packing above
            self._gather = (Pending(None), source, packing, False)
            return
        if group is None:
            raise AssertionError(
                f"unshard '{self.label}': expected a process group to gather over, found None"
            )
        # group.size(), not self.world: a k-rank gather (reshard_after_forward=k) sends W/k
        # chunks per rank, and the output still holds all W chunks once.
        out_numel = group.size() * source.numel()
        comm = self.custom_all_gather
        if comm is not None:
            out = comm.allocate((out_numel,), dtype=source.dtype, device=source.device)
        else:
            # Never the unsharded buffer itself, even where the layouts agree (one parameter):
            # a collective may mark its output written when it completes, on its own thread,
            # which would trip autograd's check on the very tensors it saved in forward.
            out = source.new_empty(out_numel)
        pending = all_gather(out, source, group, self.label, comm)
        self._gather = (pending, out, packing, comm is None)

    @_plain_tensors
    def wait_for_unshard(self) -> None:
        """Finish the gather, if any, and register the unsharded parameters on the modules."""
        if self.state is ShardedState.UNSHARDED:
            return
        self.unshard()
        if self._gather is not None:
            pending, out, packing, owned = self._gather
            self._gather = None
            self._partial = None
            pending.wait()
            # Allocated only now, not when the gather was issued: a prefetch holds just the
            # gather's output until the group is needed.
            flat = self.unsharded_flat
            if flat is None:
                raise AssertionError(
                    f"wait_for_unshard '{self.label}': expected the unsharded buffer made by "
                    "unshard(), found None"
                )
            flat.untyped_storage().resize_(flat.numel() * flat.element_size())
            # The copy-out writes the storage of tensors autograd saved in forward; their data
            # ends up as it was then (see [Note: freeing unsharded storage]).
            flat = self.unsharded_flat
            if flat is None:
                raise AssertionError(
                    f"wait_for_unshard '{self.label}': expected the unsharded buffer, found None"
                )
            with torch.autograd._unsafe_preserve_version_counter(flat):  # type: ignore[attr-defined]
                if packing is not None:
                    rows = extension.unpack(self, out, packing)
                    sizes = [c * flat.element_size() for c in self._chunk_sizes]
                    targets = [view.view(torch.uint8) for view in self._copy_out]
                else:
                    rows = out.view(self.world, self.plain_numel)
                    sizes, targets = self._chunk_sizes, self._copy_out
                if out is not self.unsharded_flat and targets:
                    self._copy_rows(rows, sizes, targets)
            if owned:
                # Free it now: the finished collective may keep a reference to it for a while
                # (gloo drops its own on a worker thread), and a block-sized buffer must not
                # outlive the copy-out by chance.
                out.untyped_storage().resize_(0)
        for fsdp_param in self.fsdp_params:
            fsdp_param.register(fsdp_param.unsharded_param, replacing=fsdp_param.sharded_param)
        self.state = ShardedState.UNSHARDED

    def _cast_plain(self) -> torch.Tensor:
        """A mixed group's send buffer when mixed precision casts some chunks: every plain chunk
        in its gather dtype, at its gather offset (alignment gaps are never read)."""
        send = torch.empty(self.plain_numel, dtype=torch.uint8, device=self.device)
        flat = self.sharded_flat
        dst = [
            typed(send, p.gather_offset, p.chunk_numel, p.param_dtype) for p in self.plain_params
        ]
        src = [typed(flat, p.offset, p.chunk_numel, p.dtype) for p in self.plain_params]
        torch._foreach_copy_(dst, src, non_blocking=True)
        return send

    def _copy_rows(self, rows: torch.Tensor, sizes: list[int], targets: list[torch.Tensor]) -> None:
        """Copy the gathered ``(W, units)`` rows param-major into the unsharded buffer."""
        if self._split_copy:
            torch.split_with_sizes_copy(rows, sizes, dim=1, out=targets)
            return
        dst, src = [], []
        for p, piece, target in zip(
            self.plain_params, torch.split(rows, sizes, dim=1), targets, strict=True
        ):
            if not p.dim:
                dst.append(target)
                src.append(piece)
                continue
            scale = p.param_dtype.itemsize if target.dtype != p.param_dtype else 1
            for whole, chunk in p.rank_blocks(target.reshape(-1)[: p.numel * scale], piece):
                dst.append(whole)
                src.append(chunk)
        torch._foreach_copy_(dst, src)

    @_plain_tensors
    def reshard(self) -> None:
        """Register the sharded parameters again and free the unsharded storage."""
        if self._gather is not None:  # a prefetch nobody used: let it land before freeing
            self._gather[0].wait()
            self._gather = None
        if self.state is ShardedState.UNSHARDED:
            for fsdp_param in self.fsdp_params:
                fsdp_param.register(fsdp_param.sharded_param, replacing=fsdp_param.unsharded_param)
        self.state = ShardedState.SHARDED
        self._partial = None
        self._free_unsharded()

    @_plain_tensors
    def reshard_partial(self) -> None:
        """Reshard, but keep this rank's block of W/k ranks' chunks so that backward gathers
        within a k-rank group (``reshard_after_forward=k``)."""
        if (
            self.state is not ShardedState.UNSHARDED
            or self.partial_group is None
            or self.ext_params
        ):
            self.reshard()
            return
        lo, hi = self.partial_rows
        # Param-major → the rank-major layout those W/k ranks would contribute to a full gather.
        parts = []
        for p, view in zip(self.plain_params, self._copy_out, strict=True):
            if p.dim:  # the full parameter, not rank-major chunks: cut them out
                scale = p.param_dtype.itemsize if view.dtype != p.param_dtype else 1
                full, view = view.reshape(-1)[: p.numel * scale], view.new_zeros(view.shape)
                for whole, chunk in p.rank_blocks(full, view):
                    chunk.copy_(whole)
            parts.append(view[lo:hi])
        partial = torch.cat(parts, dim=1).view(-1)
        self.reshard()
        self._partial = partial
        self.state = ShardedState.PARTIAL

    def _free_unsharded(self) -> None:
        flat = self.unsharded_flat
        if not self.alias and flat is not None and flat.device.type != "meta":
            flat.untyped_storage().resize_(0)
        for fsdp_param in self.ext_params:
            extension.free(fsdp_param)

    def guesses_prefetch(self) -> bool:
        """Whether hooks gather this group ahead of need from the recorded order: only where
        collectives run beside compute (an accelerator's streams), unless told otherwise."""
        if self.guess_prefetch is None:
            return self.device.type != "cpu"
        return self.guess_prefetch

    @property
    def unshard_pending(self) -> bool:
        return self._gather is not None

    def unsharded_nbytes(self) -> int:
        """Bytes held by unsharded parameters now (0 when resharded; shared with the shard at W=1)."""
        flat = self.unsharded_flat
        return 0 if self.alias or flat is None else flat.untyped_storage().nbytes()

    def __repr__(self) -> str:
        return f"FSDPParamGroup({self.label!r}, {self.state.name}, {len(self.fsdp_params)} params)"


def _local_device(fsdp_param: FSDPParam) -> torch.device:
    device: torch.device = fsdp_param.sharded_param._local_tensor.device  # type: ignore[attr-defined]
    return device
