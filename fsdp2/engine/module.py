"""``FSDPModule``: the methods every fully-sharded module gains (its setters in
``module_settings.py``), ``UnshardHandle``, and which modules can become one."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, NoReturn

import torch.nn as nn

from fsdp2.engine.changes import take_up_changes
from fsdp2.engine.iteration import IterContext
from fsdp2.engine.module_settings import GroupSettingsMethods
from fsdp2.engine.param_group import FSDPParamGroup, ShardedState
from fsdp2.engine.registry import STATE_ATTR
from fsdp2.engine.state import STATES, FSDPState, in_backward, state_of
from fsdp2.engine.state_dict import check_state_dict, taken_elsewhere
from fsdp2.engine.traced import traced_forward

__all__ = [
    "STATE_ATTR",
    "FSDPModule",
    "GradientReductionHandle",
    "ReplicateModule",
    "UnshardHandle",
    "container_without_forward",
    "state_of",
]


def container_without_forward(module: nn.Module) -> bool:
    """``module`` is an ``nn.ModuleList``/``nn.ModuleDict`` whose class has no ``forward`` of its
    own, so calling it never runs its children and there is no forward to hook. A subclass that
    defines ``forward`` is an ordinary module. The one rule for ``fully_shard``, ``replicate``
    and auto-sharding's blocks; decided from the class alone, the same on every rank."""
    return (
        isinstance(module, (nn.ModuleList, nn.ModuleDict))
        and type(module).forward is nn.Module.forward
    )


class FSDPModule(GroupSettingsMethods):
    """Mixed into every module ``fully_shard`` was applied to (as ``FSDP<OriginalClass>``).

    Its methods control when the module's group gathers and frees its parameters and how its
    gradients are reduced. A method with ``recurse`` applies to every fsdp2 module under this
    one (itself included) by default, or to this module's own group only with
    ``recurse=False``; one without applies to this module's own group.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # Containers build new instances of their own class (e.g. slicing nn.Sequential): those
        # hold no fsdp2 state, so they get the original class.
        plain = next(c for c in cls.__mro__ if not issubclass(c, GroupSettingsMethods))
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
            group.repack()
        return result

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        # nn.Module copies parameter by parameter and reports bad keys or shapes at the end;
        # check everything first so that a bad state dict leaves the model untouched.
        if taken_elsewhere(self._get_fsdp_state()):
            _refuse_mid_step(self._groups(recurse=True))
        check_state_dict(self, state_dict, strict)  # type: ignore[arg-type]
        return super().load_state_dict(state_dict, strict=strict, assign=assign)  # type: ignore[misc]

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        named = super().named_parameters(prefix, recurse, remove_duplicate)  # type: ignore[misc]
        if not taken_elsewhere(self._get_fsdp_state()):
            return named  # type: ignore[no-any-return]
        # Another thread mid-step sees the sharded parameters, never the gathered tensors the
        # training thread is using ([Note: state from any thread] in state_dict.py).
        sharded = {
            id(p.unsharded_param): p.sharded_param
            for group in self._groups(recurse)
            for p in group.fsdp_params
        }
        return ((name, sharded.get(id(param), param)) for name, param in named)

    def _get_fsdp_state(self) -> FSDPState:
        state: FSDPState = self.__dict__[STATE_ATTR]
        return state

    def _groups(self, recurse: bool) -> list[FSDPParamGroup]:
        return [group for s in self._states(recurse) for group in s.groups]

    def _states(self, recurse: bool) -> list[FSDPState]:
        if not recurse:
            return [self._get_fsdp_state()]
        return STATES.under(self)  # type: ignore[arg-type]

    # -- explicit control -------------------------------------------------------------------------

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """Gather this module's parameters now (e.g. ahead of its forward, to overlap).

        Args:
            async_op: ``False`` (default) waits for the all-gather and returns ``None``;
                ``True`` returns an :class:`UnshardHandle` whose ``wait()`` finishes it.
        """
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
        """Free this module's gathered parameters and register the sharded ones. Takes no
        arguments."""
        for group in self._groups(recurse=False):
            group.reshard()
            group.forget_gathered(free=True)

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """Whether the caller ends each backward iteration with :meth:`finalize_backward`
        instead of the end of backward doing it (pipeline schedules, which reduce gradients
        as an action of their own). Call it on the root, before the backward; the mode cannot
        change once a backward started, until that iteration is finalized or reset. It takes
        precedence over :meth:`set_is_last_backward`.

        Args:
            enabled: ``True``: backward leaves the gradients of groups with gradient sync on
                unreduced until :meth:`finalize_backward`; ``False`` (default): automatic.
        """
        state = self._get_fsdp_state()
        ctx = state.ctx
        if ctx is not None:
            if not state.is_root:
                raise RuntimeError(
                    f"set_manual_backward_finalization was called on {type(self).__name__} "
                    f"({state.label}), which is not the root fsdp2 module; call it on the module "
                    "you run forward on"
                )
            if enabled != state.manual_finalization and in_backward():
                raise RuntimeError(
                    "set_manual_backward_finalization cannot change the mode during backward; "
                    "call it before the forward"
                )
            if ctx.manual_active is not None and enabled != ctx.manual_active:
                raise RuntimeError(
                    "set_manual_backward_finalization cannot change the mode after a backward "
                    "started: call finalize_backward() (or reset_iter_state()) first"
                )
        state.set_manual_finalization(enabled)

    def finalize_backward(self, *, async_op: bool = False) -> GradientReductionHandle | None:
        """End the backward iteration (with :meth:`set_manual_backward_finalization`): reduce
        what the backward passes left unreduced, reshard the groups that reshard after
        backward, and wait for the reductions. Call it on the root after the last backward of
        the step, with gradient sync on, before reading the gradients. Before the first
        forward it does nothing.

        Args:
            async_op: ``False`` (default) waits and returns ``None``; ``True`` returns a
                :class:`GradientReductionHandle` whose ``wait()`` finishes (a forward before
                that raises).
        """
        state = self._get_fsdp_state()
        ctx = state.ctx
        if ctx is None:
            return GradientReductionHandle() if async_op else None
        if ctx.pending_reduction is not None:
            raise RuntimeError(
                "finalize_backward: the previous finalize_backward(async_op=True) is still "
                "pending; call wait() on its handle first"
            )
        if not state.is_root:
            raise RuntimeError(
                f"finalize_backward was called on {type(self).__name__} ({state.label}), which is "
                "not the root fsdp2 module; call it on the module you run forward on"
            )
        manual = ctx.manual_active if ctx.manual_active is not None else state.manual_finalization
        if not manual:
            raise RuntimeError(
                "finalize_backward needs manual backward finalization: call "
                "set_manual_backward_finalization(True) on the root before the forward"
            )
        if ctx.callback_queued:
            raise RuntimeError(
                "finalize_backward was called during backward; call it after the backward completed"
            )
        ctx.finalize_backward()
        if not async_op:
            ctx.end_finalization()
            return None
        return GradientReductionHandle(ctx, ctx.await_reduction())

    def reset_iter_state(self) -> None:
        """After forward or backward raised: drop that iteration's collectives, gradients and
        gathered parameters so the next iteration runs cleanly. Call it on the root (the next
        forward does it too). Takes no arguments."""
        state = self._get_fsdp_state()
        if state.ctx is None:
            return  # never ran: nothing to reset
        if not state.is_root:
            raise RuntimeError(
                f"reset_iter_state() was called on {type(self).__name__} ({state.label}), which is "
                "not the root fsdp2 module; call it on the module you run forward on"
            )
        state.reset_iteration()

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Gather these modules' parameters when this module's forward starts (replacing the
        recorded-order prefetch).

        Args:
            modules: ``FSDPModule``s to gather, in this order; ``[]`` prefetches nothing.
        """
        self._get_fsdp_state().set_prefetch(False, _groups_of(modules, "forward"))

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Gather these modules' parameters when this module's backward starts.

        Args:
            modules: ``FSDPModule``s to gather, in this order; ``[]`` prefetches nothing.
        """
        self._get_fsdp_state().set_prefetch(True, _groups_of(modules, "backward"))


def _refuse_mid_step(groups: list[FSDPParamGroup]) -> None:
    """A load from another thread than the training one, while some group is gathered for that
    thread's forward or backward, would change parameters under a step in flight: refused before
    anything is copied ([Note: state from any thread] in state_dict.py)."""
    busy = [g.label for g in groups if g.state is not ShardedState.SHARDED]
    if busy:
        raise RuntimeError(
            f"fsdp2: load_state_dict from another thread than the training one while "
            f"{', '.join(busy)} {'is' if len(busy) == 1 else 'are'} gathered for its forward or "
            "backward; nothing was loaded. Load between steps (after optimizer.step(), before "
            "the next forward), or on the training thread"
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
    """Mixed into every module ``replicate`` was applied to (as ``Replicate<OriginalClass>``),
    with :class:`FSDPModule`'s methods."""


class GradientReductionHandle:
    """Returned by ``FSDPModule.finalize_backward(async_op=True)``: ``wait()`` finishes the
    gradient reduction and hands the reduced shards to the parameters.

    Args:
        ctx: the iteration whose reduction it waits for (fsdp2 builds it; users only
            ``wait()``); ``None``: nothing to wait for.
        token: that reduction, as the iteration knows it: a reset since makes ``wait()`` raise.
    """

    def __init__(self, ctx: IterContext | None = None, token: object = None) -> None:
        self._ctx = ctx
        self._token = token

    def wait(self) -> None:
        ctx, self._ctx = self._ctx, None
        if ctx is None:
            return
        if ctx.pending_reduction is not self._token:
            raise RuntimeError(
                "GradientReductionHandle.wait(): this gradient reduction was dropped by "
                "reset_iter_state() (or a forward's recovery from a failed step)"
            )
        ctx.end_finalization()


class UnshardHandle:
    """Returned by ``FSDPModule.unshard(async_op=True)``: ``wait()`` finishes the all-gather
    and registers the unsharded parameters. A group resharded since the ``unshard()`` (its
    forward used the gather and freed it) has nothing left to wait for: ``wait()`` leaves it
    alone, as torch does, so a late ``wait()`` never brings back parameters that the optimizer
    has since updated.

    Args:
        groups: the parameter groups being gathered (fsdp2 builds it; users only ``wait()``).
    """

    def __init__(self, groups: list[FSDPParamGroup] | None = None) -> None:
        self._groups = [(group, group.num_reshards) for group in groups or []]

    def wait(self) -> None:
        for group, reshards in self._groups:
            if group.num_reshards == reshards:
                group.wait_for_unshard()
        self._groups = []
