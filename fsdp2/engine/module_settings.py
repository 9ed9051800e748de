"""``GroupSettingsMethods``: the ``set_*`` methods of a sharded module that choose when its
groups free their parameters, how their gradients are reduced, and which collectives they use.
Each writes the groups' ``GroupSettings`` (or the root's iteration); :class:`FSDPModule` gains
them as its base."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Literal

import torch
import torch.distributed as dist

from fsdp2.engine.comm import (
    AllGather,
    GroupAllocAllGather,
    GroupAllocReduceScatter,
    ReduceScatter,
    SymmMemAllGather,
    SymmMemReduceScatter,
)
from fsdp2.engine.param_group import FSDPParamGroup
from fsdp2.engine.state import FSDPState

__all__ = ["GroupSettingsMethods"]


class GroupSettingsMethods:
    """The setters of :class:`FSDPModule` (see its docstring for ``recurse``)."""

    def _get_fsdp_state(self) -> FSDPState:
        raise NotImplementedError  # FSDPModule's

    def _groups(self, recurse: bool) -> list[FSDPParamGroup]:
        raise NotImplementedError  # FSDPModule's

    def _states(self, recurse: bool) -> list[FSDPState]:
        raise NotImplementedError  # FSDPModule's

    # -- when to free -----------------------------------------------------------------------------

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Whether to free gathered parameters after forward (see ``fully_shard``).

        Args:
            reshard_after_forward: ``True`` frees them (backward gathers again), ``False``
                keeps them gathered until backward.
            recurse: every fsdp2 module under this one (default), or this one only.
        """
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(
                f"set_reshard_after_forward expects a bool, got {reshard_after_forward!r}"
            )
        for state in self._states(recurse):
            state.set_reshard_after_forward(reshard_after_forward)
            for group in state.groups:
                group.reshard_fully()  # a bool replaces reshard_after_forward=k

    def set_keep_unsharded_storage(self, keep: bool, *, recurse: bool = True) -> None:
        """Whether resharding keeps the unsharded parameters' storage (their data pointers
        stay the same across reshard and unshard, as CUDA graph capture needs) instead of
        freeing it; keeping costs the unsharded bytes between uses.

        Args:
            keep: ``True`` keeps the storage; ``False`` (default) frees it at every reshard.
            recurse: every fsdp2 module under this one (default), or this one only.
        """
        for group in self._groups(recurse):
            group.settings.keep_unsharded_storage = keep

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """Whether this module's backward gathers its parameters.

        Args:
            unshard_in_backward: ``False`` for modules whose backward needs none of their
                parameters (saves the all-gather); default ``True``.
        """
        for group in self._groups(recurse=False):
            group.settings.unshard_in_backward = unshard_in_backward

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        """Whether to free gathered parameters after backward.

        Args:
            reshard_after_backward: ``True`` (default) frees them; ``False`` keeps them gathered
                across gradient-accumulation micro-steps.
            recurse: every fsdp2 module under this one (default), or this one only.
        """
        for group in self._groups(recurse):
            group.settings.reshard_after_backward = reshard_after_backward

    # -- gradient reduction -----------------------------------------------------------------------

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """Whether backward reduces gradients across ranks.

        Args:
            requires_gradient_sync: ``False``: backward accumulates local, unreduced gradients
                (no communication) until a backward with ``True`` (default) reduces their sum
                once.
            recurse: every fsdp2 module under this one (default), or this one only.
        """
        for group in self._groups(recurse):
            group.settings.requires_gradient_sync = requires_gradient_sync

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Whether the next backward is the last before the optimizer step.

        Args:
            is_last_backward: ``False``: the next backward does not wait for its last
                reduce-scatters at its end (pipelining's micro-batches); default ``True``.
        """
        state = self._get_fsdp_state()
        if state.ctx is None:
            state._lazy_init()
        state.require_ctx().set_last_backward(is_last_backward)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """Whether HSDP all-reduces gradients across replicas after the reduce-scatter.

        Args:
            requires_all_reduce: ``False`` defers the all-reduce over the replicate axis
                (accumulate within each replica); default ``True``. With a 1-D mesh there is
                no all-reduce to skip.
            recurse: every fsdp2 module under this one (default), or this one only.
        """
        for group in self._groups(recurse):
            group.settings.requires_all_reduce = requires_all_reduce

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide summed gradients by ``factor`` instead of averaging over the ranks.

        Args:
            factor: a positive number (e.g. the global number of tokens, for a sum-reduced
                loss); the world size gives the default average.
        """
        if not factor > 0:
            raise ValueError(f"set_gradient_divide_factor expects a positive factor, got {factor}")
        for group in self._groups(recurse=False):
            group.settings.divide_factor = float(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated name of :meth:`set_gradient_divide_factor` (warns).

        Args:
            factor: as for :meth:`set_gradient_divide_factor`.
        """
        warnings.warn(
            "set_reduce_scatter_divide_factor is deprecated; use set_gradient_divide_factor",
            FutureWarning,
            stacklevel=2,
        )
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Reduce with SUM only and divide afterwards (for backends without AVG).

        Args:
            enable: ``True`` for SUM reductions; ``False`` (default) lets the backend average.
        """
        for group in self._groups(recurse=False):
            group.settings.force_sum_reduction = enable

    def set_reduce_scatter_unused_params(
        self, reduce_scatter_unused_params: bool, *, recurse: bool = True
    ) -> None:
        """Whether parameters without a gradient are reduce-scattered too (as zeros).

        Args:
            reduce_scatter_unused_params: ``True`` reduces zeros for parameters that got no
                gradient (MoE experts routed no tokens), also for a group no backward reached,
                and sends no per-parameter "used" flags. ``False`` (default): fsdp2 still
                issues the same reduce-scatter on every rank, with the flags, so that a
                parameter no rank used keeps ``grad=None``.
            recurse: every fsdp2 module under this one (default), or this one only.
        """
        for group in self._groups(recurse):
            group.settings.reduce_scatter_unused = reduce_scatter_unused_params

    def set_reduce_scatter_max_input_buffers(
        self, max_input_buffers: int, *, recurse: bool = True
    ) -> None:
        """How many reduce-scatters (with their input buffers) may be in flight at once.

        Args:
            max_input_buffers: an int >= 1; more overlaps more and holds more memory.
            recurse: every fsdp2 module under this one (default), or this one only.
        """
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(
                f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}"
            )
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be at least 1, got {max_input_buffers}")
        for group in self._groups(recurse):
            group.settings.max_in_flight = max_input_buffers

    def set_all_reduce_hook(
        self, hook: Callable[[torch.Tensor], None], *, stream: torch.Stream | None = None
    ) -> None:
        """Run a hook on each reduced gradient shard before the gradients are handed out.

        Args:
            hook: called as ``hook(reduced_shard)``; modifies the tensor in place (e.g. a
                custom all-reduce over another mesh dim).
            stream: accepted for torch's API; fsdp2 runs no side streams, so the hook runs
                where the reduction is waited on.
        """
        del stream  # fsdp2 runs no side streams: the hook runs where the reduction is waited on
        for group in self._groups(recurse=False):
            group.settings.all_reduce_hook = hook

    def set_post_optim_event(self, event: torch.Event) -> None:
        """Make the next forward's first gather wait for ``event`` (then discard it).

        Args:
            event: recorded after the optimizer step (e.g. ``torch.cuda.current_stream()
                .record_event()``), so that gathers do not overwrite what it still reads.
        """
        state = self._get_fsdp_state()
        if state.ctx is None:
            state._lazy_init()
        state.require_ctx().set_post_optim_event(event)

    def set_custom_all_gather(self, comm: AllGather) -> None:
        """Run this module's all-gather through ``comm``.

        Args:
            comm: an :class:`~fsdp2.AllGather`; its ``allocate`` makes the output buffer and
                its ``__call__`` replaces the all-gather.
        """
        for group in self._groups(recurse=False):
            group.settings.custom_all_gather = comm

    def set_custom_reduce_scatter(self, comm: ReduceScatter) -> None:
        """Run this module's reduce-scatter through ``comm``.

        Args:
            comm: a :class:`~fsdp2.ReduceScatter` (e.g. :class:`~fsdp2.LowPrecisionReduceScatter`);
                its ``allocate`` makes both buffers and its ``__call__`` replaces the
                reduce-scatter.
        """
        for group in self._groups(recurse=False):
            group.settings.custom_reduce_scatter = comm

    def set_separate_reduce_scatter_group(
        self, enable: bool = True, *, recurse: bool = True
    ) -> None:
        """Reduce-scatter gradients on a process group of their own over the same ranks (one
        per set of ranks), so that a backend running one collective at a time per group can
        overlap them with all-gathers. Creates groups: every rank must call it alike. (Traced
        mode does not support it.)

        Args:
            enable: ``True`` (default) for a separate group; ``False``: back to the shard group.
            recurse: every fsdp2 module under this one (default), or this one only.
        """
        made: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for group in self._groups(recurse):
            settings, shard_group = group.settings, group.info.shard_group
            if not enable or shard_group is None or group.shard_size == 1:  # nothing to scatter
                settings.reduce_scatter_group = None
            else:
                ranks = tuple(dist.get_process_group_ranks(shard_group))
                if ranks not in made:
                    made[ranks] = settings.reduce_scatter_group or dist.new_group(
                        list(ranks), use_local_synchronization=True, group_desc="fsdp2_rs"
                    )
                settings.reduce_scatter_group = made[ranks]
            comm = settings.custom_reduce_scatter
            if isinstance(comm, GroupAllocReduceScatter):  # allocate from the group it runs on
                rs_group = settings.reduce_scatter_group or shard_group
                settings.custom_reduce_scatter = type(comm)(rs_group)  # type: ignore[arg-type]

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Allocate this module's all-gather and reduce-scatter buffers with the process group's
        own allocator, where its backend has one (NCCL: registered memory for zero-copy
        transfers); gloo has none, so on CPU this changes nothing. Not combinable with
        ``set_custom_all_gather``/``set_custom_reduce_scatter``.

        Args:
            enable: ``True`` for the process group's allocator, ``False`` for the default.
        """
        groups = [g for g in self._groups(recurse=False) if g.info.shard_group is not None]
        _check_no_user_comms(groups, "set_allocate_memory_from_process_group_for_comm")
        for group in groups:
            shard_group = group.info.shard_group
            rs_group = group.settings.reduce_scatter_group or shard_group
            if shard_group is None or rs_group is None:
                raise AssertionError(
                    f"set_allocate_memory_from_process_group_for_comm: expected '{group.label}' "
                    "to have a shard group (groups without one were filtered out), found None"
                )
            group.settings.custom_all_gather = GroupAllocAllGather(shard_group) if enable else None
            group.settings.custom_reduce_scatter = (
                GroupAllocReduceScatter(rs_group) if enable else None
            )

    def set_symm_mem_for_comm(self, backend: Literal["NCCL"] = "NCCL") -> None:
        """All-gather into symmetric memory (CUDA + NCCL only), so that NCCL may use its
        copy-engine or symmetric-kernel all-gather; the reduce-scatter too if
        ``set_force_sum_reduction_for_comms(True)`` was set (NCCL's only sums). Raises on other
        devices and backends. Not combinable with custom collectives.

        Args:
            backend: ``"NCCL"``, the only one supported.
        """
        if backend != "NCCL":
            raise ValueError(f"set_symm_mem_for_comm supports backend='NCCL' only, got {backend!r}")
        groups = [g for g in self._groups(recurse=False) if g.info.shard_group is not None]
        _check_no_user_comms(groups, "set_symm_mem_for_comm")
        for group in groups:
            pg_backend = str(dist.get_backend(group.info.shard_group))
            device = group.device
            if device.type != "cuda" or "nccl" not in pg_backend:
                raise RuntimeError(
                    f"set_symm_mem_for_comm: '{group.label}' communicates on {device.type} "
                    f"through {pg_backend}, but symmetric memory needs CUDA devices and an NCCL "
                    "process group. Call it only when training on CUDA with NCCL"
                )
        for group in groups:
            shard_group = group.info.shard_group
            rs_group = group.settings.reduce_scatter_group or shard_group
            if shard_group is None or rs_group is None:
                raise AssertionError(
                    f"set_symm_mem_for_comm: expected '{group.label}' to have a shard group "
                    "(groups without one were filtered out), found None"
                )
            group.settings.custom_all_gather = SymmMemAllGather(shard_group, backend)
            if group.settings.force_sum_reduction:
                group.settings.custom_reduce_scatter = SymmMemReduceScatter(rs_group, backend)


def _check_no_user_comms(groups: list[FSDPParamGroup], method: str) -> None:
    """``method`` installs fsdp2's own collectives: refuse to replace the user's."""
    for group in groups:
        for comm in (group.settings.custom_all_gather, group.settings.custom_reduce_scatter):
            if comm is not None and not isinstance(
                comm, (GroupAllocAllGather, GroupAllocReduceScatter)
            ):
                raise RuntimeError(
                    f"{method}: '{group.label}' uses a custom collective "
                    f"({type(comm).__name__}, from set_custom_all_gather or "
                    "set_custom_reduce_scatter), which allocates its own buffers; "
                    "use one or the other"
                )
