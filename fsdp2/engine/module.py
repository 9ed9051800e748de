"""``FSDPModule``: the methods every fully-sharded module gains, and ``UnshardHandle``."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any, Literal, NoReturn

import torch
import torch.distributed as dist

from fsdp2.engine.changes import take_up_changes
from fsdp2.engine.collectives import (
    AllGather,
    GroupAllocAllGather,
    GroupAllocReduceScatter,
    ReduceScatter,
    SymmMemAllGather,
    SymmMemReduceScatter,
)
from fsdp2.engine.param_group import FSDPParamGroup
from fsdp2.engine.registry import STATE_ATTR
from fsdp2.engine.state import FSDPState, state_of
from fsdp2.engine.state_dict import check_state_dict
from fsdp2.engine.traced import traced_forward

__all__ = ["STATE_ATTR", "FSDPModule", "ReplicateModule", "UnshardHandle", "state_of"]


class FSDPModule:
    """Mixed into every module ``fully_shard`` was applied to (as ``FSDP<OriginalClass>``)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # Containers build new instances of their own class (e.g. slicing nn.Sequential): those
        # hold no fsdp2 state, so they get the original class.
        plain = next(c for c in cls.__mro__ if not issubclass(c, FSDPModule))
        obj = plain.__new__(plain)
        type(obj).__init__(obj, *args, **kwargs)  # what obj.__init__(...) calls
        return obj

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        state: FSDPState = self.__dict__[STATE_ATTR]
        if state.traced:
            return traced_forward(state, super().__call__, args, kwargs)  # type: ignore[misc]
        args, kwargs = state.pre_forward(args, kwargs)
        return state.post_forward(super().__call__(*args, **kwargs), self)  # type: ignore[misc]

    def __deepcopy__(self, memo: dict[int, Any]) -> NoReturn:
        raise RuntimeError(
            f"cannot deepcopy {type(self).__name__}: its parameters are shards of a model spread "
            "over ranks. Deepcopy the model before calling fully_shard, or build a new one"
        )

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> Any:
        # .to(), .float(), .to_empty() and friends may replace the sharded parameters' tensors:
        # free any gathered copy first, then re-pack what they became into the group's buffers.
        groups = self._groups(recurse=False)
        for group in groups:
            group.reshard()
        result = super()._apply(fn, recurse)  # type: ignore[misc]
        for group in groups:
            group.rebuild()
        return result

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        # nn.Module copies parameter by parameter and reports bad keys or shapes at the end;
        # check everything first so that a bad state dict leaves the model untouched.
        check_state_dict(self, state_dict, strict)  # type: ignore[arg-type]
        return super().load_state_dict(state_dict, strict=strict, assign=assign)  # type: ignore[misc]

    def _get_fsdp_state(self) -> FSDPState:
        state: FSDPState = self.__dict__[STATE_ATTR]
        return state

    def _groups(self, recurse: bool) -> list[FSDPParamGroup]:
        return [group for s in self._states(recurse) for group in s.groups]

    def _states(self, recurse: bool) -> list[FSDPState]:
        if not recurse:
            return [self._get_fsdp_state()]
        found: list[FSDPState] = []
        for sub in self.modules():  # type: ignore[attr-defined]
            state = state_of(sub)
            if state is not None and state not in found:
                found.append(state)
        return found

    # -- explicit control -------------------------------------------------------------------------

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """Gather this module's parameters now; with ``async_op`` return a handle to wait on."""
        state = self._get_fsdp_state()
        if state.ctx is None:
            state._lazy_init()
        for group in state.groups:
            take_up_changes(group)
            group.unshard()
        handle = UnshardHandle(state.groups)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free this module's gathered parameters and register the sharded ones."""
        for group in self._groups(recurse=False):
            group.reshard()

    def reset_iter_state(self) -> None:
        """After forward or backward raised: drop that iteration's collectives, gradients and
        gathered parameters so the next iteration runs cleanly. Call it on the root."""
        state = self._get_fsdp_state()
        if state.ctx is None:
            return  # never ran: nothing to reset
        if not state.is_root:
            raise RuntimeError(
                f"reset_iter_state() was called on {type(self).__name__} ({state.fqn}), which is "
                "not the root fsdp2 module; call it on the module you run forward on"
            )
        state.ctx.reset()

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Gather these modules' parameters when this module's forward starts (replacing the
        recorded-order prefetch)."""
        self._get_fsdp_state().forward_prefetch = _groups_of(modules, "forward")

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Gather these modules' parameters when this module's backward starts."""
        self._get_fsdp_state().backward_prefetch = _groups_of(modules, "backward")

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """``False`` for modules whose backward needs none of their parameters."""
        for group in self._groups(recurse=False):
            group.unshard_in_backward = unshard_in_backward

    # -- when to free -----------------------------------------------------------------------------

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Whether to free gathered parameters after forward."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(
                f"set_reshard_after_forward expects a bool, got {reshard_after_forward!r}"
            )
        for state in self._states(recurse):
            state.requested_reshard_after_forward = reshard_after_forward
            state.reshard_after_forward = reshard_after_forward
            for group in state.groups:
                group.partial_group = None  # a bool replaces reshard_after_forward=k

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        """Whether to free gathered parameters after backward (``False`` keeps them gathered
        across gradient-accumulation micro-steps)."""
        for group in self._groups(recurse):
            group.reshard_after_backward = reshard_after_backward

    # -- gradient reduction -----------------------------------------------------------------------

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """``False``: backward accumulates local, unreduced gradients (no communication) until
        a backward with ``True`` reduces their sum once."""
        for group in self._groups(recurse):
            group.reduce_grads_enabled = requires_gradient_sync

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """``False``: the next backward does not wait for its last reduce-scatters at its end."""
        state = self._get_fsdp_state()
        if state.ctx is None:
            state._lazy_init()
        state.require_ctx().is_last_backward = is_last_backward

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """For HSDP's replicate axis; with a 1-D mesh there is no all-reduce to skip."""
        for group in self._groups(recurse):
            group.requires_all_reduce = requires_all_reduce

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide summed gradients by ``factor`` instead of averaging over the ranks."""
        if not factor > 0:
            raise ValueError(f"set_gradient_divide_factor expects a positive factor, got {factor}")
        for group in self._groups(recurse=False):
            group.divide_factor = float(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated name of :meth:`set_gradient_divide_factor`."""
        warnings.warn(
            "set_reduce_scatter_divide_factor is deprecated; use set_gradient_divide_factor",
            FutureWarning,
            stacklevel=2,
        )
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Reduce with SUM only and divide afterwards (for backends without AVG)."""
        for group in self._groups(recurse=False):
            group.force_sum_reduction = enable

    def set_reduce_scatter_unused_params(
        self, reduce_scatter_unused_params: bool, *, recurse: bool = True
    ) -> None:
        """Reduce zeros for parameters that got no gradient on this rank, so ranks whose
        control flow differs (MoE routing, optional branches) still issue matching collectives."""
        for group in self._groups(recurse):
            group.reduce_scatter_unused = reduce_scatter_unused_params

    def set_reduce_scatter_max_input_buffers(
        self, max_input_buffers: int, *, recurse: bool = True
    ) -> None:
        """How many reduce-scatters (with their input buffers) may be in flight at once."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(
                f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}"
            )
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be at least 1, got {max_input_buffers}")
        for group in self._groups(recurse):
            group.max_in_flight = max_input_buffers

    def set_all_reduce_hook(
        self, hook: Callable[[torch.Tensor], None], *, stream: torch.Stream | None = None
    ) -> None:
        """Call ``hook(reduced_shard)`` on each reduced gradient shard, in place, before the
        gradients are handed out (e.g. a custom all-reduce over another mesh dim)."""
        del stream  # fsdp2 runs no side streams: the hook runs where the reduction is waited on
        for group in self._groups(recurse=False):
            group.all_reduce_hook = hook

    def set_post_optim_event(self, event: torch.Event) -> None:
        """An event the next forward's first gather waits on (then discarded)."""
        state = self._get_fsdp_state()
        if state.ctx is None:
            state._lazy_init()
        state.require_ctx().post_optim_event = event

    def set_custom_all_gather(self, comm: AllGather) -> None:
        """Use ``comm`` (its ``allocate`` for the output buffer) for this module's all-gather."""
        for group in self._groups(recurse=False):
            group.custom_all_gather = comm

    def set_custom_reduce_scatter(self, comm: ReduceScatter) -> None:
        """Use ``comm`` (its ``allocate`` for both buffers) for this module's reduce-scatter."""
        for group in self._groups(recurse=False):
            group.custom_reduce_scatter = comm

    def set_separate_reduce_scatter_group(
        self, enable: bool = True, *, recurse: bool = True
    ) -> None:
        """Reduce-scatter gradients on a process group of their own over the same ranks (one
        per set of ranks), so that a backend running one collective at a time per group can
        overlap them with all-gathers. Creates groups: every rank must call it alike.
        ``False``: back to the shard group. (Traced mode does not support it.)"""
        made: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for group in self._groups(recurse):
            shard_group = group.info.shard_group
            if not enable or shard_group is None or group.world == 1:  # nothing to scatter
                group.reduce_scatter_group = None
            else:
                ranks = tuple(dist.get_process_group_ranks(shard_group))
                if ranks not in made:
                    made[ranks] = group.reduce_scatter_group or dist.new_group(
                        list(ranks), use_local_synchronization=True, group_desc="fsdp2_rs"
                    )
                group.reduce_scatter_group = made[ranks]
            comm = group.custom_reduce_scatter
            if isinstance(comm, GroupAllocReduceScatter):  # allocate from the group it runs on
                group.custom_reduce_scatter = type(comm)(group.reduce_scatter_group or shard_group)  # type: ignore[arg-type]

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Allocate this module's all-gather and reduce-scatter buffers with the process group's
        own allocator, where its backend has one (NCCL: registered memory for zero-copy
        transfers); gloo has none, so on CPU this changes nothing. Not combinable with
        ``set_custom_all_gather``/``set_custom_reduce_scatter``."""
        groups = [g for g in self._groups(recurse=False) if g.info.shard_group is not None]
        _check_no_user_comms(groups, "set_allocate_memory_from_process_group_for_comm")
        for group in groups:
            shard_group = group.info.shard_group
            rs_group = group.reduce_scatter_group or shard_group
            assert shard_group is not None and rs_group is not None  # filtered above
            group.custom_all_gather = GroupAllocAllGather(shard_group) if enable else None
            group.custom_reduce_scatter = GroupAllocReduceScatter(rs_group) if enable else None

    def set_symm_mem_for_comm(self, backend: Literal["NCCL"] = "NCCL") -> None:
        """All-gather into symmetric memory (CUDA + NCCL only), so that NCCL may use its
        copy-engine or symmetric-kernel all-gather; the reduce-scatter too if
        ``set_force_sum_reduction_for_comms(True)`` was set (NCCL's only sums). Raises on other
        devices and backends. Not combinable with custom collectives."""
        if backend != "NCCL":
            raise ValueError(f"set_symm_mem_for_comm supports backend='NCCL' only, got {backend!r}")
        groups = [g for g in self._groups(recurse=False) if g.info.shard_group is not None]
        _check_no_user_comms(groups, "set_symm_mem_for_comm")
        for group in groups:
            pg_backend = str(dist.get_backend(group.info.shard_group))
            if group.device.type != "cuda" or "nccl" not in pg_backend:
                raise RuntimeError(
                    f"set_symm_mem_for_comm: '{group.label}' communicates on {group.device.type} "
                    f"through {pg_backend}, but symmetric memory needs CUDA devices and an NCCL "
                    "process group. Call it only when training on CUDA with NCCL"
                )
        for group in groups:
            shard_group = group.info.shard_group
            rs_group = group.reduce_scatter_group or shard_group
            assert shard_group is not None and rs_group is not None  # filtered above
            group.custom_all_gather = SymmMemAllGather(shard_group, backend)
            if group.force_sum_reduction:
                group.custom_reduce_scatter = SymmMemReduceScatter(rs_group, backend)


def _check_no_user_comms(groups: list[FSDPParamGroup], method: str) -> None:
    """``method`` installs fsdp2's own collectives: refuse to replace the user's."""
    for group in groups:
        for comm in (group.custom_all_gather, group.custom_reduce_scatter):
            if comm is not None and not isinstance(
                comm, (GroupAllocAllGather, GroupAllocReduceScatter)
            ):
                raise RuntimeError(
                    f"{method}: '{group.label}' uses a custom collective "
                    f"({type(comm).__name__}, from set_custom_all_gather or "
                    "set_custom_reduce_scatter), which allocates its own buffers; "
                    "use one or the other"
                )


def _groups_of(modules: list[FSDPModule], direction: str) -> list[FSDPParamGroup]:
    groups = []
    for mod in modules:
        if not isinstance(mod, FSDPModule):
            raise ValueError(
                f"set_modules_to_{direction}_prefetch expects FSDPModules (modules fully_shard "
                f"was applied to), got {type(mod).__name__}; apply fully_shard to it first"
            )
        groups.extend(mod._get_fsdp_state().groups)
    return groups


class ReplicateModule(FSDPModule):
    """Mixed into every module ``replicate`` was applied to (as ``Replicate<OriginalClass>``)."""


class UnshardHandle:
    """Returned by ``FSDPModule.unshard(async_op=True)``: ``wait()`` finishes the all-gather."""

    def __init__(self, groups: list[FSDPParamGroup] | None = None) -> None:
        self._groups = groups or []

    def wait(self) -> None:
        for group in self._groups:
            group.wait_for_unshard()
        self._groups = []
