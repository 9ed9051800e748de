"""``FlatLayout``: where a group's parameters live, as one flat shard per rank and one unsharded
buffer, and how a gather's output is copied between them.

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

import functools

import torch

from fsdp2.engine import packing
from fsdp2.engine.mesh import MeshInfo
from fsdp2.engine.packing import Packing
from fsdp2.engine.param import FSDPParam, typed
from fsdp2.engine.policies import CPUOffloadPolicy, MixedPrecisionPolicy

__all__ = ["FlatLayout"]


class FlatLayout:
    """A group's flat buffers and each parameter's place in them ([Note: flat layout])."""

    def __init__(
        self,
        params: list[FSDPParam],
        info: MeshInfo,
        device: torch.device,
        label: str,
        mp_policy: MixedPrecisionPolicy,
        offload: CPUOffloadPolicy | None,
    ) -> None:
        self.info = info
        self.shard_size = info.shard_size
        self.label = label  # named in errors
        self.mp_policy = mp_policy
        self.offload = offload
        self.device = device  # where gathers, compute and reductions run
        # Plain parameters first (trainable, then frozen), extension parameters last: the plain
        # prefix of the flat shard is what a byte-packed gather sends as is.
        self.order = sorted(
            range(len(params)), key=lambda i: (params[i].extension, not params[i].requires_grad)
        )
        self.params = [params[i] for i in self.order]
        self.trainable = [p for p in self.params if p.requires_grad]
        self.plain_params = [p for p in self.params if not p.extension]
        self.ext_params = [p for p in self.params if p.extension]
        for fsdp_param in self.params:
            fsdp_param.set_chunk(info)
        self.set_dtypes()
        self._check_even_extensions()
        self.stale = False  # some parameters replaced, not yet re-packed (see repack)

    def rename(self, label: str) -> None:
        self.label = label

    def _check_even_extensions(self) -> None:
        # Decided from shapes, not this rank's shard, so that every rank raises alike.
        # Uneven dim 0 is padded (packing.pack); other dims and tensor-parallel pieces are not.
        uneven = [
            p.fqn
            for p in self.ext_params
            if (p.dim or p.outer_spec is not None)
            and any(n % self.shard_size for n in p.piece_sizes())
        ]
        if uneven:
            raise NotImplementedError(
                f"{', '.join(uneven)}: all-gather extension parameters sharded on a dim other "
                f"than 0, or tensor parallel, must split evenly over the {self.shard_size} shard "
                "ranks (every rank's inputs the same size); make that size divisible, or "
                "shard dim 0"
            )

    def shard(self, full_tensors: list[torch.Tensor]) -> None:
        """Allocate the flat shard and fill it with this rank's rows of ``full_tensors`` (in the
        order the parameters were given)."""
        fulls = [full_tensors[i] for i in self.order]
        if any(full.device.type == "meta" for full in fulls):
            storage = torch.device("meta")  # materialised later by to_empty(); see repack()
        else:
            storage = torch.device("cpu") if self.offload else self.device
        self._build(storage, fulls)

    def _build(self, storage_device: torch.device, fulls: list[torch.Tensor] | None) -> None:
        """Allocate the flat buffers on ``storage_device`` and point every parameter into them.
        ``fulls`` are the full parameters to shard; ``None`` re-packs the current sharded
        parameters (after ``module.to(...)`` or ``to_empty`` replaced them)."""
        shard_size = self.shard_size
        pin = self.offload is not None and self.offload.pin_memory and self.device.type != "cpu"
        # 1-D, this rank's padded chunk of every parameter; zeros so padding is deterministic.
        flat = torch.zeros(self.shard_numel, dtype=self.dtype, device=storage_device)
        self.sharded_flat = flat.pin_memory() if pin else flat
        for i, fsdp_param in enumerate(self.params):
            full = fulls[i] if fulls is not None else None
            fsdp_param.init_sharded(self.sharded_flat, self.info, full)
        # With one rank and nothing to cast or move, the shard is the whole parameter: the
        # unsharded parameters view the sharded buffer and "gathering" costs nothing.
        self.alias = (
            shard_size == 1
            and self.param_dtype == self.dtype
            and not self._cast_each
            and storage_device == self.device
            and not self.ext_params
        )
        # Unsharded parameters are views, and a view needs its storage allocated when it is made:
        # they are made at the first gather, so that sharding (or re-packing after to_empty) a
        # model never allocates its unsharded size. Until then, empty stand-ins.
        for fsdp_param in self.params:
            fsdp_param.reset_unsharded()
            packing.forget(fsdp_param)  # extension parameters: built by their post hook
        # 1-D, param-major, every plain parameter padded to shard_size * chunk (or the shard).
        self.unsharded_flat: torch.Tensor | None = self.sharded_flat if self.alias else None
        # Per plain parameter, its (shard_size, units) region of unsharded_flat.
        self.copy_out_views: list[torch.Tensor] = []
        if self.alias:
            self.make_unsharded_views()

    def make_unsharded_views(self) -> None:
        """Allocate the unsharded buffer and make the plain parameters' unsharded views of it."""
        shard_size = self.shard_size
        if self.unsharded_flat is None:
            self.unsharded_flat = torch.empty(
                shard_size * self.plain_numel, dtype=self.param_dtype, device=self.device
            )
        self.copy_out_views = []
        for p in self.plain_params:
            start, units = shard_size * p.place.gather_offset, p.place.gather_units
            region = self.unsharded_flat[start : start + shard_size * units]
            self.copy_out_views.append(region.view(shard_size, units))
        for fsdp_param in self.plain_params:
            fsdp_param.init_unsharded(self.unsharded_flat, shard_size)

    @property
    def send_bytes(self) -> int:
        """What this rank sends in a gather of the group (a mixed group gathers bytes)."""
        return self.plain_numel * self.param_dtype.itemsize

    def set_dtypes(self) -> None:
        """Each parameter's gather dtype, the group's buffer and reduce dtypes, and the chunks'
        offsets in those buffers (elements of the one dtype, or bytes: [Note: mixed dtypes])."""
        mp = self.mp_policy
        for p in self.params:
            p.set_dtypes(mp.param_dtype, mp.reduce_dtype)
        dtypes = {p.dtype for p in self.params}
        # Several dtypes stored, or gathered (param_dtype_override_fn): byte-packed buffers.
        self.mixed = len(dtypes) > 1 or len({p.param_dtype for p in self.params}) > 1
        # Sharded gradients not all in the group's one dtype (a mixed group, or a grad_dtype
        # set on some parameter): cast shard by shard, from the promoted reduce dtype.
        self.cast_each_grad = self.mixed or any(p.grad_dtype is not None for p in self.params)
        if self.mixed:
            self.dtype = self.param_dtype = torch.uint8
        else:
            self.dtype = dtypes.pop() if dtypes else torch.float32
            floating = self.dtype.is_floating_point
            self.param_dtype = (mp.param_dtype if floating else None) or self.dtype
        reduce_dtypes = {p.reduce_dtype for p in self.trainable}
        if not self.cast_each_grad:  # one dtype: every parameter's, trainable or not
            self.reduce_dtype = self.params[0].reduce_dtype if self.params else torch.float32
        elif reduce_dtypes:
            self.reduce_dtype = functools.reduce(torch.promote_types, reduce_dtypes)
        else:
            self.reduce_dtype = torch.float32
        if self.mixed:  # widest first: every chunk's offset is a multiple of its element size
            self.plain_params.sort(key=lambda p: -p.param_dtype.itemsize)
        # A mixed group casting some chunks gathers a packed copy, not its shard's bytes.
        self._cast_each = self.mixed and any(p.param_dtype != p.dtype for p in self.plain_params)
        offset = 0
        for p in self.plain_params:
            units = self._units(p.chunk.numel, p.param_dtype)
            p.place.gather_offset, p.place.gather_units = offset, units
            offset += units
        self.plain_numel = offset
        self._chunk_sizes = [p.place.gather_units for p in self.plain_params]
        # The shard's plain prefix is what a gather without casts sends: the same layout. Chunks
        # not sent as they are may start anywhere: at 16 bytes, aligned for any dtype.
        offset = 0
        for p in self.plain_params + [p for p in self.ext_params if not p.wrapper]:
            if self.mixed and (self._cast_each or p.extension):
                offset = -(-offset // 16) * 16
            p.place.offset = offset
            offset += self._units(p.chunk.numel, p.dtype)
        self.shard_numel = offset
        # Shard(dim > 0) chunks are strided slabs of the full parameter: no single split-copy.
        self._split_copy = all(not p.dim for p in self.plain_params)

    def _units(self, numel: int, dtype: torch.dtype) -> int:
        """Buffer units for ``numel`` elements of ``dtype``: elements, or bytes if mixed."""
        return numel * dtype.itemsize if self.mixed else numel

    def follow_requires_grad(self) -> None:
        """After parameters were frozen or unfrozen: the trainable ones again, and (a mixed group
        reduces in the widest of their dtypes) the reduce dtype. The layout it also recomputes
        depends on dtypes only: unchanged."""
        self.trainable = [p for p in self.params if p.requires_grad]
        if self.cast_each_grad:
            self.set_dtypes()

    # -- re-packing ------------------------------------------------------------------------------

    def needs_repack(self, force: bool) -> bool:
        """Whether to re-pack now (see ``FSDPParamGroup.repack``): once every parameter was
        replaced, or ``force``; a partial replacement marks the layout ``stale`` and waits."""
        replaced = [not p.in_buffer() for p in self.params]
        if not force:
            if not any(replaced):
                self.stale = False
                return False
            self.stale = True
            if not all(replaced):
                return False
        return True

    def repack(self) -> None:
        """Re-pack the (resharded) sharded parameters into fresh buffers, adopting their new
        device and dtype."""
        for fsdp_param in self.params:
            fsdp_param.follow_dtype()
        self.set_dtypes()
        devices = [_local_device(p) for p in self.params]
        # Some still on meta (only others were replaced): nothing to keep until to_empty().
        metas = [d for d in devices if d.type == "meta"]
        storage = metas[0] if metas else devices[0]
        if self.offload is None:
            self.device = storage
        self._build(storage, None)
        self.stale = False

    def check_repackable(self) -> None:
        """Before a gather finishes a deferred re-pack by force: parameters left in the old buffer
        are still good when they share the replaced ones' device (``.to()`` hands back the same
        tensor where there is nothing to convert: a bias under ``memory_format=``, a parameter
        already of the target dtype). On meta, or on another device, they cannot be gathered
        with the rest."""
        devices = {_local_device(p) for p in self.params}
        if len(devices) == 1 and next(iter(devices)).type != "meta":
            return
        done = [p for p in self.params if not p.in_buffer()]
        left = [p for p in self.params if p.in_buffer()]

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

    # -- gathering -------------------------------------------------------------------------------

    def check_materialized(self) -> None:
        if self.sharded_flat.device.type == "meta":
            names = ", ".join(p.fqn for p in self.params)
            raise RuntimeError(
                f"fsdp2 module {self.label or '<root>'!r} has parameters on the meta device "
                f"({names}). "
                "Materialise them before forward: module.to_empty(device=...) and then "
                "module.reset_parameters() (or your own init)"
            )

    def gather_source(self) -> tuple[torch.Tensor, Packing | None]:
        """This rank's send buffer for a full gather, and the extension packing if any: one
        cast/copy of the plain shard (to param_dtype, and to the device if offloaded)."""
        if self._cast_each:
            source = self._cast_plain()
        else:
            plain = self.sharded_flat[: self.plain_numel]
            source = plain.to(self.device, self.param_dtype, non_blocking=True)
        if not self.ext_params:
            return source, None
        return packing.pack(self.ext_params, source, self.info, self.device, self.mp_policy)

    def _cast_plain(self) -> torch.Tensor:
        """A mixed group's send buffer when mixed precision casts some chunks: every plain chunk
        in its gather dtype, at its gather offset (alignment gaps are never read)."""
        send = torch.empty(self.plain_numel, dtype=torch.uint8, device=self.device)
        flat = self.sharded_flat
        dst = [
            typed(send, p.place.gather_offset, p.chunk.numel, p.param_dtype)
            for p in self.plain_params
        ]
        src = [typed(flat, p.place.offset, p.chunk.numel, p.dtype) for p in self.plain_params]
        torch._foreach_copy_(dst, src, non_blocking=True)
        return send

    def copy_out(self, out: torch.Tensor, packed: Packing | None, replicas: int = 1) -> None:
        """Regrow the unsharded buffer and copy a finished gather's rank-major ``out`` into it
        (and into the extension parameters, through their post hooks). ``replicas`` > 1: ``out``
        comes shard-rank-major over that many replicas ([Note: two-level gathers], modes/hfsdp.py)."""
        flat = self.unsharded_flat
        if flat is None:
            raise AssertionError(
                f"wait_for_unshard '{self.label}': expected the unsharded buffer made by "
                "unshard(), found None"
            )
        packing.regrow(flat.untyped_storage(), flat.numel() * flat.element_size())
        # The copy-out writes the storage of tensors autograd saved in forward; their data
        # ends up as it was then (see [Note: freeing unsharded storage]).
        with torch.autograd._unsafe_preserve_version_counter(flat):  # type: ignore[attr-defined]
            if packed is not None:
                plain_bytes = self.plain_numel * flat.element_size()
                rows = packing.unpack(
                    self.ext_params, out, packed, plain_bytes, self.shard_size, self.device
                )
                sizes = [c * flat.element_size() for c in self._chunk_sizes]
                targets = [view.view(torch.uint8) for view in self.copy_out_views]
            elif replicas > 1:  # [Note: two-level gathers]
                rows = out.view(-1, replicas, self.plain_numel).transpose(0, 1)
                rows = rows.reshape(self.shard_size, self.plain_numel)
                sizes, targets = self._chunk_sizes, self.copy_out_views
            else:
                rows = out.view(self.shard_size, self.plain_numel)
                sizes, targets = self._chunk_sizes, self.copy_out_views
            if out is not flat and targets:
                self._copy_rows(rows, sizes, targets)

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
            for whole, chunk in p.chunk.rank_blocks(target.reshape(-1)[: p.numel * scale], piece):
                dst.append(whole)
                src.append(chunk)
        torch._foreach_copy_(dst, src)

    def k_block(self, lo: int, hi: int) -> torch.Tensor:
        """From the unsharded buffer, rows ``lo:hi`` of the rank-major layout a full gather
        would land in: what the ranks ``lo..hi-1`` contribute (``reshard_after_forward=k``)."""
        parts = []
        for p, view in zip(self.plain_params, self.copy_out_views, strict=True):
            if p.dim:  # the full parameter, not rank-major chunks: cut them out
                scale = p.param_dtype.itemsize if view.dtype != p.param_dtype else 1
                full, view = view.reshape(-1)[: p.numel * scale], view.new_zeros(view.shape)
                for whole, chunk in p.chunk.rank_blocks(full, view):
                    chunk.copy_(whole)
            parts.append(view[lo:hi])
        return torch.cat(parts, dim=1).view(-1)

    def free_unsharded(self) -> None:
        """Shrink the unsharded storage to nothing ([Note: freeing unsharded storage])."""
        flat = self.unsharded_flat
        if not self.alias and flat is not None and flat.device.type != "meta":
            flat.untyped_storage().resize_(0)
        for fsdp_param in self.ext_params:
            packing.free(fsdp_param)

    def unsharded_nbytes(self) -> int:
        """Bytes held by unsharded parameters now (0 when resharded; shared with the shard at W=1)."""
        flat = self.unsharded_flat
        return 0 if self.alias or flat is None else flat.untyped_storage().nbytes()


def _local_device(fsdp_param: FSDPParam) -> torch.device:
    device: torch.device = fsdp_param.sharded_param._local_tensor.device  # type: ignore[attr-defined]
    return device
