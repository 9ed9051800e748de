"""``FSDPParamGroup``: the parameters of one ``fully_shard`` call, gathered and freed together.

The group is the unshard/reshard state machine. It composes the rest: its ``layout`` (layout.py:
the flat buffers, [Note: flat layout]), its ``settings`` (settings.py: what the user chose) and its
``reducer`` (reduce.py: the gradient side). Every change of ``state`` goes through ``_enter``,
which checks the state it leaves.

What it keeps between uses, and over which groups it gathers, its ``mode`` says (modes/:
zero3, reshard-to-k, zero2, hfsdp); the group asks it and never branches on which mode it is.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from enum import Enum, auto
from typing import NamedTuple, ParamSpec, Protocol, TypeVar

import torch

from fsdp2.engine.collectives import Pending, all_gather
from fsdp2.engine.layout import FlatLayout
from fsdp2.engine.mesh import MeshInfo
from fsdp2.engine.modes import Mode, Zero3
from fsdp2.engine.packing import Packing
from fsdp2.engine.param import FSDPParam
from fsdp2.engine.policies import CPUOffloadPolicy, MixedPrecisionPolicy
from fsdp2.engine.reduce import GradientReducer
from fsdp2.engine.settings import GroupSettings
from fsdp2.engine.steps import watch_optimizer_steps

__all__ = ["FSDPParamGroup", "InFlightGather", "ShardedState", "Shared", "outside_transforms"]

_P = ParamSpec("_P")
_R = TypeVar("_R")
_G = TypeVar("_G")


# Bound once: the wrappers below run several times per group and step.
_inference_mode = torch.is_inference_mode_enabled
_functorch_active = torch._C._are_functorch_transforms_active


def _outside_mode(inference: bool, functorch: bool) -> contextlib.ExitStack:
    """Leave inference mode and functorch transforms, as far as they are on."""
    stack = contextlib.ExitStack()
    if inference:
        stack.enter_context(torch.inference_mode(False))
    if functorch:
        stack.enter_context(torch._C._DisableFuncTorch())
    return stack


def outside_transforms(method: Callable[_P, _R]) -> Callable[_P, _R]:
    """Run ``method`` outside inference mode and functorch transforms, whatever the caller's
    mode: the buffers it allocates outlive the call. An inference tensor could never be saved
    for backward (a job that evaluates before it trains), and a functorch wrapper has no
    storage to resize (the first gather inside ``torch.func.jvp``)."""

    @functools.wraps(method)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        inference, functorch = _inference_mode(), _functorch_active()
        if not inference and not functorch:  # the common case: no context to enter
            return method(*args, **kwargs)
        with _outside_mode(inference, functorch):
            return method(*args, **kwargs)

    return wrapper


def _outside_transforms_method(method: Callable[[_G], None]) -> Callable[[_G], None]:
    """``outside_transforms`` for a method of no arguments: a plain call, not ``*args, **kwargs``
    (a third of the cost, for methods called several times per group and step)."""

    @functools.wraps(method)
    def wrapper(self: _G) -> None:
        inference, functorch = _inference_mode(), _functorch_active()
        if not inference and not functorch:
            return method(self)
        with _outside_mode(inference, functorch):
            return method(self)

    return wrapper


class ShardedState(Enum):
    """Which form of a group's parameters is registered on its modules."""

    SHARDED = auto()  # at init and after reshard(): only this rank's padded shard is allocated
    UNSHARDED = auto()  # after the all-gather is copied out: the full parameters are allocated
    K_SHARDED = auto()  # after forward with reshard_after_forward=k: W/k chunks kept for backward

    # Members are singletons: hash by identity, in C. Enum's own __hash__ is Python code, run
    # at every state change (several times per group and step).
    __hash__ = object.__hash__


# The states each state may be entered from. reshard() is allowed anywhere (a no-op when
# sharded); a k-rank block is cut only from the full parameters.
_ENTERED_FROM = {
    ShardedState.SHARDED: frozenset(ShardedState),
    ShardedState.UNSHARDED: frozenset({ShardedState.SHARDED, ShardedState.K_SHARDED}),
    ShardedState.K_SHARDED: frozenset({ShardedState.UNSHARDED}),
}


class Shared(Protocol):
    """What a group does with a coalesced gather's shared output (``coalesce.SharedOutput``)."""

    def check(self) -> None: ...  # once the gather finished: did every rank send the same?

    def release(self) -> None: ...  # this group is done with it


class InFlightGather(NamedTuple):
    """An issued all-gather, not yet copied out."""

    pending: Pending
    out: torch.Tensor  # rank-major: every rank's send buffer (1-D, or (W, n) when coalesced)
    packing: Packing | None  # the extension parameters' metadata, if any
    owned: bool  # ``out`` is ours to free: not a custom collective's buffer, not the shard itself
    shared: Shared | None = None  # a coalesced gather's output, ``out`` a slice of it
    replicas: int = 1  # >1: ``out`` comes shard-rank-major over replicas (modes.GatherInput)


class FSDPParamGroup:
    """All-gathers, frees and reduce-scatters the parameters of one ``fully_shard`` call."""

    # The collective seam (collectives.py); a test may give one group its own to observe its
    # gathers (tests/engine/test_memory.py).
    all_gather = staticmethod(all_gather)

    def __init__(
        self,
        params: list[FSDPParam],
        full_tensors: list[torch.Tensor],
        info: MeshInfo,
        device: torch.device,
        label: str,
        mp_policy: MixedPrecisionPolicy | None = None,
        offload: CPUOffloadPolicy | None = None,
        mode: Mode | None = None,
        meta_on_some_rank: bool = False,
    ) -> None:
        watch_optimizer_steps()  # the steps' count and holds know every step from now on
        self.info = info
        self.mode: Mode = mode or Zero3()
        self.shard_size = info.shard_size
        self.state = ShardedState.SHARDED
        self.settings = GroupSettings(
            mp_policy=mp_policy or MixedPrecisionPolicy(), offload=offload
        )
        mp_policy = self.settings.mp_policy
        self.layout = FlatLayout(params, info, device, label, mp_policy, offload)
        self.fsdp_params = self.layout.params  # in layout order
        self.reducer = GradientReducer(
            label, info, self.layout, self.settings, self.mode.reduce_levels()
        )
        self._on_grads_ready: Callable[[], None] = self.reducer.on_grads_ready
        for fsdp_param in self.fsdp_params:  # before the unsharded parameters are made
            fsdp_param.connect(self.reducer.on_grad_ready)
        self.layout.shard(full_tensors)
        self._gather: InFlightGather | None = None
        # Reshards so far: an UnshardHandle whose group was resharded since its unshard() has
        # nothing left to wait for (module.py).
        self.num_reshards = 0
        self.seen_in = -1  # the last iteration whose forward ran this group
        self.order_index = 0  # its position in that forward's order
        # Some rank had parameters on meta at fully_shard: lazy init checks (agreement.py).
        self.meta_on_some_rank = meta_on_some_rank

    def on_grads_ready(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once every gradient of the group is in (the owning state's
        post-backward), also on a reducer a re-pack makes later (``remove``)."""
        self._on_grads_ready = callback
        self.reducer.call_when_ready(callback)

    def set_mode(self, mode: Mode) -> None:
        """Run ``mode`` from now on (``reshard_after_forward=k`` at ``fully_shard``, a bool
        replacing it later): what the old one kept is dropped."""
        self.mode.forget()
        self.mode.drop_block()
        self.mode = mode

    def reshard_fully(self) -> None:
        """``set_reshard_after_forward(bool)``: no k-rank block after forward from now on (any
        other mode, and what it keeps, stays as it is)."""
        mode = self.mode.fully_resharding()
        if mode is not self.mode:
            self.set_mode(mode)

    def still_gathered(self) -> bool:
        """Whether the kept gathered copy is current: unsharding needs no collective."""
        mode = self.mode
        return mode.keeps_gathered and mode.reuses_gathered(
            self.layout, self.info, self.num_reshards
        )

    def kept_nbytes(self) -> int:
        """Bytes the memory modes keep between steps: zero2's unsharded copy, hfsdp's copy of
        the first level (0 for zero3), and the shard snapshot each is checked against."""
        return self.mode.kept_nbytes(self.layout)

    def forget_gathered(self, free: bool) -> None:
        """Stop trusting the kept copies: the next unshard gathers. ``free``: give their memory
        back too (``FSDPModule.reshard()``, the user's explicit request for it)."""
        self.mode.forget()
        if free and self.state is not ShardedState.UNSHARDED:
            if not self.settings.keep_unsharded_storage:
                self.layout.free_unsharded()

    @property
    def device(self) -> torch.device:
        """Where its gathers, compute and reductions run (its shards too, unless offloaded)."""
        return self.layout.device

    @property
    def label(self) -> str:
        """The group's modules' FQNs, comma-joined ("" for the root): set at lazy init."""
        return self.layout.label

    def rename(self, label: str) -> None:
        """Name the group under the root (lazy init, traced mode)."""
        self.layout.rename(label)
        self.reducer.rename(label)

    def ran_in(self, iteration: int, index: int) -> None:
        """This group's forward ran in ``iteration``, ``index``-th of its root's groups."""
        self.seen_in = iteration
        self.order_index = index

    def materialized_everywhere(self) -> None:
        """Every rank's parameters are off meta now (agreement.py checked them)."""
        self.meta_on_some_rank = False

    def _enter(self, state: ShardedState) -> None:
        """The one place ``state`` changes: raise if ``state`` may not follow the current one."""
        if self.state not in _ENTERED_FROM[state]:
            allowed = ", ".join(sorted(s.name for s in _ENTERED_FROM[state]))
            raise AssertionError(
                f"fsdp2 group {self.label!r}: illegal transition {self.state.name} -> "
                f"{state.name}; expected to leave one of {allowed}"
            )
        self.state = state

    def repack(self, force: bool = False) -> None:
        """Re-pack the sharded parameters into fresh buffers once something (``module.to(...)``,
        ``to_empty``, ``load_state_dict(assign=True)``) replaced their tensors, adopting their new
        device and dtype. A group spanning several modules is converted one module at a time:
        until every parameter is replaced, the rest still live in the old (maybe meta) buffer,
        so the re-pack waits (``layout.stale``) for the last module, or for the next gather.
        ``force``: re-pack now, whatever was replaced (parameters a user assigned: changes.py)."""
        if not self.layout.needs_repack(force):
            return
        self.reshard()
        self.mode.forget()  # the buffers it holds are replaced
        self.layout.repack()

    def remove(self, fsdp_param: FSDPParam) -> torch.Tensor:
        """Take ``fsdp_param`` out of this group (a tied weight that a later ``fully_shard``
        call met: its common ancestor's group manages it, api.py) and re-pack the others into
        fresh buffers. Returns its current values (``FSDPParam.current_piece``), for the group that
        takes it: every rank of the group calls this at the same ``fully_shard`` call (the
        gather is a collective)."""
        if self.state is not ShardedState.SHARDED or self.reducer.has_unreduced_grads():
            raise AssertionError(
                f"remove from group {self.label!r}: expected a sharded group with no gradient "
                f"pending, found {self.state.name}"
            )
        full = fsdp_param.current_piece()
        rest = [p for p in self.fsdp_params if p is not fsdp_param]
        layout = FlatLayout(
            rest,
            self.info,
            self.layout.device,
            self.label,
            self.settings.mp_policy,
            self.settings.offload,
        )
        self.layout = layout
        self.fsdp_params = layout.params
        self.reducer = GradientReducer(
            self.label, self.info, layout, self.settings, self.mode.reduce_levels()
        )
        self.reducer.call_when_ready(self._on_grads_ready)  # still the state's post-backward
        for other in self.fsdp_params:
            other.connect(self.reducer.on_grad_ready)
        if rest:
            layout.repack()  # the others' current shards, in buffers of their own
        else:
            layout.shard([])  # empty buffers: the group is dropped from its state (api.py)
        self.mode.forget()
        return full

    def _repack_stale(self) -> None:
        """Before a gather: finish a deferred re-pack (see ``FlatLayout.check_repackable``)."""
        if not self.layout.stale:
            return
        self.repack()
        if self.layout.stale:
            self.layout.check_repackable()
            self.repack(force=True)

    # -- unshard / reshard -----------------------------------------------------------------------

    @_outside_transforms_method
    def unshard(self) -> None:
        """Start gathering the full parameters (no-op if unsharded or already under way)."""
        if self.state is ShardedState.UNSHARDED or self._gather is not None:
            return
        self._repack_stale()
        layout = self.layout
        if layout.alias or self.still_gathered():
            return
        layout.check_materialized()
        if layout.unsharded_flat is None:
            layout.make_unsharded_views()  # the first gather: allocated at full size
        if layout.unsharded_flat is None:
            raise AssertionError(
                f"unshard '{self.label}': expected the unsharded buffer to be allocated, found None"
            )
        source, packing, group, replicas = self.mode.gather_input(
            layout, self.info, self.num_reshards, self.all_gather
        )
        if self.shard_size == 1:  # nothing to gather, only the cast, copy or packing above
            self._gather = InFlightGather(Pending(None), source, packing, False, replicas=replicas)
            return
        if group is None:
            raise AssertionError(
                f"unshard '{self.label}': expected a process group to gather over, found None"
            )
        # group.size(), not self.shard_size: a k-rank gather (reshard_after_forward=k) sends W/k
        # chunks per rank, and the output still holds all W chunks once.
        out_numel = group.size() * source.numel()
        comm = self.settings.custom_all_gather
        if comm is not None:
            out = comm.allocate((out_numel,), dtype=source.dtype, device=source.device)
        else:
            # Never the unsharded buffer itself, even where the layouts agree (one parameter):
            # a collective may mark its output written when it completes, on its own thread,
            # which would trip autograd's check on the very tensors it saved in forward.
            out = source.new_empty(out_numel)
        pending = self.all_gather(out, source, group, layout.label, comm)
        self._gather = InFlightGather(pending, out, packing, comm is None, replicas=replicas)

    def start_shared_gather(self, gather: InFlightGather) -> None:
        """Take this group's part of a coalesced gather (coalesce.py) as its gather under way."""
        if self.state is not ShardedState.SHARDED or self._gather is not None:
            raise AssertionError(
                f"coalesced gather '{self.label}': expected a sharded group with no gather under "
                f"way, found {self.state.name} with {self._gather is not None}"
            )
        self._gather = gather

    @_outside_transforms_method
    def wait_for_unshard(self) -> None:
        """Finish the gather, if any, and register the unsharded parameters on the modules."""
        if self.state is ShardedState.UNSHARDED:
            return
        self.unshard()
        if self._gather is not None:
            pending, out, packing, owned, shared, replicas = self._gather
            self._gather = None
            if self.mode.cuts_blocks:
                self.mode.drop_block()
            pending.wait()
            if shared is not None:
                shared.check()
            # The unsharded storage is regrown only now, not when the gather was issued: a
            # prefetch holds just the gather's output until the group is needed.
            self.layout.copy_out(out, packing, replicas)
            if owned:
                # Free it now: the finished collective may keep a reference to it for a while
                # (gloo drops its own on a worker thread), and a block-sized buffer must not
                # outlive the copy-out by chance.
                out.untyped_storage().resize_(0)
            if shared is not None:
                shared.release()
            if self.mode.keeps_gathered:
                self.mode.gathered(self.layout)
        for fsdp_param in self.fsdp_params:
            fsdp_param.register(fsdp_param.unsharded_param, replacing=fsdp_param.sharded_param)
        self._enter(ShardedState.UNSHARDED)

    @_outside_transforms_method
    def reshard(self) -> None:
        """Register the sharded parameters again and free the unsharded storage."""
        self._release(ShardedState.SHARDED)
        if self.mode.cuts_blocks:
            self.mode.drop_block()

    @_outside_transforms_method
    def reshard_to_k(self) -> None:
        """Reshard, but keep this rank's block of W/k ranks' chunks so that backward gathers
        within a k-rank group (``reshard_after_forward=k``)."""
        mode = self.mode
        if (
            self.state is not ShardedState.UNSHARDED
            or not mode.cuts_blocks
            or not mode.cut_block(self.layout)
        ):
            # reshard(), without its wrapper again: a call per group and forward
            self._release(ShardedState.SHARDED)
            if mode.cuts_blocks:
                mode.drop_block()
            return
        self._release(ShardedState.K_SHARDED)

    def _release(self, state: ShardedState) -> None:
        """Register the sharded parameters, enter ``state`` and free the unsharded storage."""
        if self._gather is not None:  # a prefetch nobody used: let it land before freeing
            self._gather.pending.wait()
            if self._gather.shared is not None:
                self._gather.shared.release()
            self._gather = None
        if self.state is ShardedState.UNSHARDED:
            for fsdp_param in self.fsdp_params:
                fsdp_param.register(fsdp_param.sharded_param, replacing=fsdp_param.unsharded_param)
        self._enter(state)
        self.num_reshards += 1
        mode = self.mode
        if (
            not (mode.keeps_gathered and mode.holds_unsharded())
            and not self.settings.keep_unsharded_storage
        ):
            self.layout.free_unsharded()

    def guesses_prefetch(self) -> bool:
        """Whether hooks gather this group ahead of need from the recorded order: only where
        collectives run beside compute (an accelerator's streams), unless told otherwise."""
        if self.settings.guess_prefetch is None:
            return self.layout.device.type != "cpu"
        return self.settings.guess_prefetch

    @property
    def unshard_pending(self) -> bool:
        return self._gather is not None

    def __repr__(self) -> str:
        return f"FSDPParamGroup({self.label!r}, {self.state.name}, {len(self.fsdp_params)} params)"
