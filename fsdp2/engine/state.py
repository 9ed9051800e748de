"""``FSDPState``: the per-call runtime that fsdp2 runs around a module's forward and backward.

One ``FSDPState`` exists per ``fully_shard`` call. The first state whose module runs forward
becomes the root: it gathers every state below it into one :class:`IterContext`, which holds what
a training iteration shares (the order groups ran in, the reduce-scatter in flight, the
end-of-backward callback).

Groups are gathered ahead of their own hooks in the order the last forward ran them (see
[Note: prefetch order] in iteration.py).
"""

from __future__ import annotations

from enum import Enum, auto
from functools import partial
from typing import Any

import torch
import torch.nn as nn
from torch._compile import _disable_dynamo
from torch.autograd import Variable

from fsdp2.engine.agreement import check_materialized
from fsdp2.engine.backward_done import InputHooks, hook_output
from fsdp2.engine.changes import take_up_changes
from fsdp2.engine.iteration import IterContext, trace
from fsdp2.engine.param_group import FSDPParamGroup
from fsdp2.engine.policies import MixedPrecisionPolicy, cast_floats
from fsdp2.engine.registry import StateRegistry
from fsdp2.engine.ties import TIES
from fsdp2.engine.tree import map_tensors, tensors_in

__all__ = ["STATES", "FSDPState", "TrainingState", "in_backward", "module_label", "state_of"]

_LABEL_MODULES = 4  # a fully_shard([...]) label names this many modules, then elides


def module_label(names: list[str]) -> str:
    """A group's label: its modules' FQNs, comma-joined ("" for the root); a long list
    (``fully_shard([m1, ..., m256])``) as its first and last, and how many: the modules of one
    call are usually a run of siblings, and the label appears in every error and report."""
    if len(names) <= _LABEL_MODULES:
        return ",".join(names)
    return f"{names[0]} .. {names[-1]} ({len(names)} modules)"


def in_backward() -> bool:
    """Whether the autograd engine is running a backward on this thread (a forward now is a
    reentrant checkpoint recomputing, or a hook's own computation)."""
    return torch._C._current_graph_task_id() != -1


class TrainingState(Enum):
    """Where an ``FSDPState`` is in the iteration; shown in ``repr``, read by the hooks. Not a
    checked state machine: every pair of states is a real edge (a backward inside a forward, a
    checkpoint recomputing a forward in backward, an iteration that raised), so a table of
    legal transitions would allow them all."""

    IDLE = auto()  # at init, after its post-forward, and after the end of backward
    FORWARD = auto()  # between its pre-forward and post-forward: parameters unsharded
    PRE_BACKWARD = auto()  # its outputs' gradients arrived: parameters unsharded for backward
    # Its gradients were handed to the reduce-scatter, resharded, until the end of backward.
    # Read as "not PRE_BACKWARD": a checkpoint recomputing its forward now gathers it again
    # and hooks the outputs; and as "not IDLE": summon_full_params refuses to run.
    POST_BACKWARD = auto()

    # Members are singletons: hash by identity, in C. Enum's own __hash__ is Python code, run
    # at every state change (several times per group and step).
    __hash__ = object.__hash__


def reshard_after_forward_of(requested: bool | None, is_root: bool) -> bool:
    """The one default reshard-after-forward rule (eager hooks, traced mode and the planner):
    unset, the root keeps its parameters gathered into backward, whose start needs them first,
    and every other state reshards."""
    return (not is_root) if requested is None else bool(requested)


class FSDPState:
    """Hooks and per-iteration state for the modules of one ``fully_shard`` call."""

    def __init__(
        self,
        modules: tuple[nn.Module, ...],
        groups: list[FSDPParamGroup],
        reshard_after_forward: bool | None,
        mp_policy: MixedPrecisionPolicy,
    ) -> None:
        self.modules = modules
        # One group per mesh: usually one; shard_placement_fn may put parameters on others.
        self.groups = groups
        self.label = ""  # set at lazy init, when the root's module tree names it
        # Floating inputs are cast to this dtype, outputs to output_dtype (None: leave alone).
        self.input_dtype = mp_policy.param_dtype if mp_policy.cast_forward_inputs else None
        self.output_dtype = mp_policy.output_dtype
        # None: decided at lazy init (the root keeps its parameters, others reshard).
        self.requested_reshard_after_forward = reshard_after_forward
        self.reshard_after_forward = bool(reshard_after_forward)
        self.ctx: IterContext | None = None
        self.is_root = False
        self.root = self  # the state whose forward runs first (set at lazy init)
        self.members: list[FSDPState] = []  # the root's: every state under it, pre-order
        # set_manual_backward_finalization: read from the root only ([Note: manual backward
        # finalization] in iteration.py).
        self.manual_finalization = False
        self.training_state = TrainingState.IDLE
        # Explicit prefetch targets (set_modules_to_*_prefetch); None: use the recorded order.
        self.forward_prefetch: list[FSDPParamGroup] | None = None
        self.backward_prefetch: list[FSDPParamGroup] | None = None
        self.traced = False  # True: no hooks; forward gathers inside the graph (traced.py)
        # fully_shard([a, b]): the modules not yet run since the group was gathered for forward.
        self._yet_to_run: set[int] = set()
        self._yet_to_run_in = -1  # the iteration that set was started in
        self.inputs = InputHooks(self._inputs_done)  # see [Note: when a module's backward is done]
        self._call_start = 0  # ctx.num_forwards when this state's current forward call began
        self._call_unhooked = False  # that call runs with grad, but no input requires it
        self._call_inputs: list[torch.Tensor] = []  # that call's inputs that require grad
        for group in groups:
            group.on_grads_ready(partial(self._post_backward, group))

    def set_reshard_after_forward(self, reshard_after_forward: bool) -> None:
        """A bool from ``set_reshard_after_forward``: what was asked, and what is done."""
        self.requested_reshard_after_forward = reshard_after_forward
        self.reshard_after_forward = reshard_after_forward

    def decide_reshard_after_forward(self, is_root: bool) -> None:
        """Apply the default rule once the root is known (lazy init, traced mode)."""
        self.reshard_after_forward = reshard_after_forward_of(
            self.requested_reshard_after_forward, is_root
        )

    def set_traced(self, traced: bool) -> None:
        """Run the forward as one traced graph (traced.py) or through the eager hooks."""
        self.traced = traced

    def drop_group(self, group: FSDPParamGroup) -> None:
        """Forget ``group`` (emptied: its last parameter, a tie, moved to another call)."""
        if group in self.groups:
            self.groups.remove(group)

    def set_manual_finalization(self, enabled: bool) -> None:
        """``set_manual_backward_finalization``: read from the root at its next backward."""
        self.manual_finalization = enabled

    def set_prefetch(self, backward: bool, groups: list[FSDPParamGroup]) -> None:
        """Explicit prefetch targets for this state's forward (or backward)."""
        if backward:
            self.backward_prefetch = groups
        else:
            self.forward_prefetch = groups

    @property
    def group(self) -> FSDPParamGroup | None:
        """The group on the call's own mesh (the only one, unless parameters chose others)."""
        return self.groups[0] if self.groups else None

    # -- lazy init --------------------------------------------------------------------------------

    def _lazy_init(self) -> None:
        """Make this state the root of every fsdp2 state in its modules' subtrees."""
        states = STATES.under(*self.modules)
        unresolved = TIES.unresolved(self.modules)
        if unresolved:
            raise ValueError(
                f"fsdp2: weights tied across fully_shard calls, and no call on a module holding "
                f"every place they sit: {'; '.join(unresolved)}. Call fully_shard on their "
                "common ancestor too (the root, last), or shard the modules that share them in "
                "one call, e.g. fully_shard([embedding, lm_head])"
            )
        not_root = next((s for s in states if s is not self and s.manual_finalization), None)
        if not_root is not None:
            raise RuntimeError(
                f"set_manual_backward_finalization(True) was called on "
                f"{type(not_root.modules[0]).__name__}, but the module whose forward runs first "
                f"is {type(self.modules[0]).__name__}, the root; call it on the root"
            )
        ctx = IterContext([g for s in states for g in s.groups], self.groups)
        self.members = states
        names = {id(m): n for top in self.modules for n, m in top.named_modules()}
        for state in states:
            state.label = module_label([names.get(id(m), "") for m in state.modules])
            for group in state.groups:
                group.rename(state.label)
                for fsdp_param in group.fsdp_params:
                    # Named under the root from now on: at fully_shard, names were relative to
                    # the block ("fc.weight" of which of 96?), and errors from here on quote them.
                    module, name = fsdp_param.slot_modules[0]
                    if id(module) in names:
                        fsdp_param.rename(f"{names[id(module)]}.{name}".lstrip("."))
            state.ctx = ctx
            state.is_root = state is self
            state.root = self
            state.decide_reshard_after_forward(state.is_root)
        trace("lazy_init", self.label)
        try:
            check_materialized(ctx.groups)  # once, only for groups that were on meta somewhere
        except BaseException:
            for state in states:  # not initialised: the next forward checks again
                state.ctx = None
            raise

    @property
    def _comm_ctx(self) -> FSDPState:
        """torch 2.15's pipeline schedules compare their stages' communication contexts by
        identity (``defer_reduce_grad_wait`` refuses shared ones). fsdp2 shares none between
        roots (``share_comm_ctx`` only checks its input): each state is its own."""
        return self

    def require_ctx(self) -> IterContext:
        """The iteration context, which lazy init gives every state before any hook runs."""
        if self.ctx is None:
            raise AssertionError(
                f"fsdp2 state '{self.label}': expected an iteration context (set at lazy init), "
                "found None"
            )
        return self.ctx

    # -- forward ----------------------------------------------------------------------------------

    # Dynamo never traces the hooks: their collectives, storage resizing and autograd hooks
    # run eagerly, and a compiled region breaks its graph around them (docs/compile.md).
    @_disable_dynamo
    def pre_forward(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if self.ctx is None:
            self._lazy_init()
        if self.input_dtype is not None:
            args, kwargs = cast_floats((args, kwargs), self.input_dtype)
        recompute = in_backward()  # activation checkpointing recomputing the forward
        if self.training_state is TrainingState.PRE_BACKWARD and recompute:
            return args, kwargs
        # PRE_BACKWARD outside backward: left by a backward that raised; the root's
        # start_forward recovers from it.
        ctx = self.require_ctx()
        if self.is_root and not recompute:
            explicit = any(
                s.forward_prefetch is not None or s.backward_prefetch is not None
                for s in self.members
            )
            if ctx.start_forward(explicit):
                self._forget_states()
        if not self.groups:
            return args, kwargs
        trace("pre_forward", self.label)
        self.training_state = TrainingState.FORWARD
        coalesce = not recompute and ctx.may_coalesce()
        for group in self.groups:  # issue every gather before waiting for any
            take_up_changes(group)
            ctx.gather(group, coalesce, backward=False)
        for group in self.groups:
            group.wait_for_unshard()
            ctx.record(group)
        self._call_start = ctx.count_forward()
        self._call_inputs = (
            self.inputs.hook((args, kwargs), (ctx.iteration, ctx.num_backwards))
            if torch.is_grad_enabled()
            else []
        )
        self._call_unhooked = torch.is_grad_enabled() and not self._call_inputs
        if self.forward_prefetch is not None:
            for target in self.forward_prefetch:
                target.unshard()
        elif not recompute:  # a checkpoint's recompute runs in backward's order, not forward's
            for group in self.groups:
                ctx.prefetch_after(group, coalesce)
        return args, kwargs

    @_disable_dynamo
    def post_forward(self, output: Any, module: object = None) -> Any:
        if self.output_dtype is not None:
            output = cast_floats(output, self.output_dtype)
        if self.training_state is TrainingState.PRE_BACKWARD:
            return output
        grad_enabled = torch.is_grad_enabled()
        if in_backward():
            # Recomputed by a reentrant checkpoint, whose backward comes right after: keep the
            # parameters gathered for it (the group reshards once its gradients are reduced).
            self.training_state = TrainingState.IDLE
            if grad_enabled:
                output = self._hook_outputs(output)
            return output
        if self.groups:
            trace("post_forward", self.label)
            if self._call_unhooked and self.require_ctx().num_forwards != self._call_start:
                # Inputs without gradients, but sharded modules ran inside: nodes of this call
                # (a frozen parameter scaling their outputs) lead to their parameters, not ours,
                # so nothing here says when they are done; wait for the end of backward.
                self.inputs.hold()
            every_member_ran = self._member_ran(module)
            # Under no_grad inside a training forward (a reentrant checkpoint, whose backward
            # recomputes this forward), reshard as in any training forward: torch keeps
            # reshard_after_forward=False groups gathered there, and their recompute gathers
            # nothing. Outside one, this forward is an evaluation: free every group.
            evaluating = not grad_enabled and not self.require_ctx().training_forward
            for group in self.groups:
                if evaluating:
                    group.reshard()
                elif self.reshard_after_forward and every_member_ran:
                    group.reshard_to_k()
            self.training_state = TrainingState.IDLE
        if self.is_root:
            self.require_ctx().end_forward()
            self._free_unused(everything=not grad_enabled)
        if grad_enabled:
            output = self._hook_outputs(output)
        return output

    def _member_ran(self, module: object) -> bool:
        """Note that ``module`` finished a forward; whether every module of this call has run
        since the group was last gathered for forward. One ``fully_shard([a, b])`` group is
        gathered once for all its modules (as in torch): resharding after ``a`` would gather it
        again for ``b``. A module called again after that (a chunked loss calling the head per
        chunk) starts a new round, which holds the gathered group into backward, where it is
        needed first."""
        if len(self.modules) == 1 or module is None:
            return True
        iteration = self.require_ctx().iteration
        if self._yet_to_run_in != iteration:
            self._yet_to_run_in = iteration
            self._yet_to_run = {id(m) for m in self.modules}
        self._yet_to_run.discard(id(module))
        if self._yet_to_run:
            return False
        self._yet_to_run = {id(m) for m in self.modules}
        return True

    def _free_unused(self, everything: bool) -> None:
        """At the root's post-forward: free gathers nobody used (all of them under no_grad)."""
        ctx = self.require_ctx()
        for group in ctx.groups:
            if everything or (group.seen_in != ctx.iteration and group.unshard_pending):
                group.reshard()

    def _hook_outputs(self, output: Any) -> Any:
        """Hook the outputs that require grad. An input handed back as it came (T5's blocks
        pass ``position_bias`` on) is returned as an alias: the input's own gradient is complete
        only after this module's backward, so hooked it would gather the group a second time,
        and, as every later block's input, it would hold all of them gathered until the first
        one's backward (torch's outputs are likewise new tensors, made by its input hooks)."""
        passed_in, self._call_inputs = self._call_inputs, []
        tensors = tensors_in(output)
        if passed_in and any(t is p for t in tensors for p in passed_in):
            ids = {id(t) for t in passed_in}
            output = map_tensors(lambda t: t.view_as(t) if id(t) in ids else t, output)
            tensors = tensors_in(output)
        for tensor in tensors:
            if tensor.requires_grad:
                hook_output(tensor, self._pre_backward)
        return output

    # -- backward ---------------------------------------------------------------------------------

    def _pre_backward(self, grad: torch.Tensor) -> None:
        ctx = self.require_ctx()
        self._begin_backward()
        ctx.reductions.reap()
        if not self.groups or self.training_state is TrainingState.PRE_BACKWARD:
            return
        trace("pre_backward", self.label)
        self.training_state = TrainingState.PRE_BACKWARD
        coalesce = ctx.may_coalesce()
        for group in self.groups:
            group.reducer.begin_backward()
            if group.settings.unshard_in_backward:
                ctx.gather(group, coalesce, backward=True)
        for group in self.groups:
            if group.settings.unshard_in_backward:
                group.wait_for_unshard()
        if self.backward_prefetch is not None:
            for target in self.backward_prefetch:
                target.unshard()
            return
        for group in self.groups:
            ctx.prefetch_before(group, coalesce, self.is_root)

    def _begin_backward(self) -> None:
        """Any hook of a backward: at the first, queue the end of backward with autograd."""
        root = self.root
        if self.require_ctx().begin_backward(root.manual_finalization):
            Variable._execution_engine.queue_callback(root.end_of_backward)

    def _post_backward(self, group: FSDPParamGroup) -> None:
        """Every gradient of ``group`` is in; finish it if its modules' backward is done too."""
        self._begin_backward()
        self._finish_if_done(group)

    def _inputs_done(self) -> None:
        """A forward call's input gradients are in (maybe the last call's)."""
        for group in self.groups:
            self._finish_if_done(group)

    def _finish_if_done(self, group: FSDPParamGroup) -> None:
        """Reshard and reduce-scatter ``group`` once autograd is done with it: its gradients
        are in and its modules' backward is done (see [Note: when a module's backward is done])."""
        if not group.reducer.grads_ready or not self.inputs.done():
            return
        group.reducer.mark_taken()
        trace("post_backward", self.label)
        self.require_ctx().finish_group(
            group, group.settings.max_in_flight, keep_gathered=torch.is_grad_enabled(), always=True
        )
        self.training_state = TrainingState.POST_BACKWARD

    # -- end of the iteration (the root's) -----------------------------------------------------------

    def end_of_backward(self) -> None:
        """Autograd's callback at the end of a backward (queued by the first hook): the
        iteration finishes every group (``IterContext.end_of_backward``), every state is idle."""
        self.require_ctx().end_of_backward()
        for state in self.members:
            state.training_state = TrainingState.IDLE

    def reset_iteration(self) -> None:
        """Forget a failed iteration (``reset_iter_state``): its collectives, gradients and
        gathered parameters (``IterContext.reset``), and what each state's hooks held."""
        self.require_ctx().reset()
        self._forget_states()

    def _forget_states(self) -> None:
        for state in self.members:
            state.training_state = TrainingState.IDLE
            state._call_inputs = []

    def __repr__(self) -> str:
        sharded = ",".join(g.state.name for g in self.groups) or "no params"
        role = "root" if self.is_root else "child"
        return f"FSDPState({self.label or '<root>'}, {role}, {self.training_state.name}, {sharded})"


# The registry of "the fsdp2 states of a module tree" (registry.py), bound to FSDPState.
STATES: StateRegistry[FSDPState] = StateRegistry()
state_of = STATES.of
