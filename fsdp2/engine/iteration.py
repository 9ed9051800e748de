"""``IterContext``: one root's training iteration, where every collective of it is decided.

The root's lazy init (``FSDPState._lazy_init``) gives the groups of every state below it one
context: the order groups ran in (see [Note: prefetch order] below), the gathers and their
coalescing, the reduce-scatters in flight (and those held to be coalesced: [Note: coalesced
reduce-scatters]), the reduced shards waiting for the end of backward, and the end of backward,
which finishes what the per-module hooks left. The states' hooks (``state.py``) say when
something happens (a forward starts, a module's backward is done, backward ends); the context
decides what runs then; a group knows how (gather, free, reduce its own parameters).

[Note: manual backward finalization]
By default the end of each backward reduces what the hooks left and, unless
``set_is_last_backward(False)``, waits for every reduction. With
``set_manual_backward_finalization(True)`` on the root (torch 2.15's API; its pipeline stages turn
it on) the caller owns that end: a backward's end only stashes the gradients of groups without
sync, and ``finalize_backward()`` later reduces what is left, group by group in backward's order,
then waits (or returns a handle whose ``wait()`` does). The mode is fixed when a backward begins
and holds until the iteration is finalized or reset. Until an asynchronous finalization is
waited for, a forward raises; a reset makes its handle raise.

[Note: prefetch order]
While forward runs, each group appends itself to the context's recording the first time it runs
in that iteration; when the root's forward ends the recording becomes ``forward_order``. In
backward a group prefetches the group before it (the root prefetches the last one, whose
gradients arrive first), so that gather overlaps its backward compute. A wrong guess costs
memory, never correctness: anything gathered and unused is freed at the end of backward.
On accelerators forward guesses too: each group, once gathered, starts the gather of the group
that followed it in the last forward, before its own kernels are queued. An asynchronous NCCL
collective waits for everything already queued on the compute stream when it is issued, so a
gather issued at the next module's own pre-forward could only start once this module's compute
is done: every forward gather would be exposed (torch hides it with side streams; we need none,
see docs/accelerators.md). On CPU meshes neither direction guesses: compute and gloo share the
same cores, so a prefetched gather overlaps nothing (forward: 784 vs 958 ms per step, GPT at 2
ranks; backward: 49.1 vs 48.9 ms) while its buffer raised peak memory by 2 MiB of 19 (the same
model). ``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch`` replace the
guess everywhere; ``GroupSettings.guess_prefetch`` overrides the choice by device.
With coalescing on, a guessed prefetch is a coalesced gather like any other: the group guessed
takes along the small groups after it (backward: before it). Gathered alone it would leave the
next group's own hook nothing to coalesce, and from there on every group would be prefetched
alone, one collective each (measured on one H100, 96 tiny blocks on an 8-rank fake group: 179
all-gathers per step instead of 14).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch

from fsdp2.engine.changes import take_up_changes
from fsdp2.engine.coalesce import Gathers, coalesce_bytes
from fsdp2.engine.coalesce_reduce import UNBOUNDED, Reductions
from fsdp2.engine.collectives import forget_deferred_checks, run_deferred_checks
from fsdp2.engine.param_group import FSDPParamGroup

__all__ = ["IterContext", "backward_prefetch", "trace"]

logger = logging.getLogger("fsdp2")


def trace(label: str, fqn: str) -> None:
    """One event per hook, for the profiler and the ``fsdp2`` logger; near free when both are off."""
    if torch._C._autograd._profiler_enabled():
        with torch.profiler.record_function(f"fsdp2::{label} {fqn}"):
            pass
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("fsdp2::%s %s", label, fqn)


def backward_prefetch(n: int, index: int, by_root: bool, root: Callable[[int], bool]) -> int:
    """The group a pre-backward prefetches, by index in the forward order of ``n`` groups
    (``index``: the one whose pre-backward runs; ``-1``: none). The root's state (``by_root``)
    prefetches the last group, whose gradients come first; any other group the one before it,
    but never one of the root's (``root(i)``): the root's pre-backward ran first and gathered
    those. The engine's rule, and the planner's (tools/planner/estimate.py)."""
    if by_root:
        return n - 1 if n - 1 != index else -1
    return index - 1 if index > 0 and not root(index - 1) else -1


class IterContext:
    """What the groups under one root share during a training iteration. It knows groups, not
    the states that own them: the states' hooks say *when* (``state.py``), this decides *what*."""

    def __init__(self, groups: list[FSDPParamGroup], root_groups: list[FSDPParamGroup]) -> None:
        self.groups = groups  # every state's, pre-order: the root's first
        self.root_groups = root_groups
        self.forward_order: list[FSDPParamGroup] = []  # last completed forward's group order
        self.recording: list[FSDPParamGroup] = []
        self.iteration = 0
        self.gathers = Gathers(self.groups)  # see [Note: coalesced gathers]
        self.reductions = Reductions(self.groups)  # held, in flight, reduced
        self.callback_queued = False
        self.num_backwards = 0  # ends of backward so far: with the iteration, names a round
        self.num_forwards = 0  # sharded forward calls so far: which ran inside which
        # The root's forward is running with grad enabled: a nested forward under no_grad is then
        # part of a training step (a reentrant checkpoint's first pass), not an evaluation.
        self.training_forward = False
        self.is_last_backward = True
        # See [Note: manual backward finalization]: the mode fixed when the current backward
        # began (None between iterations), and the reduction an asynchronous finalize_backward
        # started, until its handle's wait().
        self.manual_active: bool | None = None
        self.pending_reduction: object | None = None
        self.post_optim_event: torch.Event | None = None
        # No state has explicit prefetch targets (set at each start_forward): gathers may be
        # coalesced, if coalescing is on ([Note: coalesced gathers]).
        self.coalesce_ok = False
        # The threads training this iteration: the one that started the forward, and any the
        # backward ran on (autograd runs a CUDA backward on a thread of its own). State taken
        # from any other is read without resharding or swapping what they use ([Note: state
        # from any thread]).
        self.threads: set[int] = set()

    def off_thread(self) -> bool:
        """Whether the caller is a thread other than those training this iteration."""
        return bool(self.threads) and threading.get_ident() not in self.threads

    def record(self, group: FSDPParamGroup) -> None:
        """Note that ``group`` runs now (its first call this iteration fixes its position)."""
        if group.seen_in != self.iteration:
            group.ran_in(self.iteration, len(self.recording))
            self.recording.append(group)

    def may_coalesce(self) -> bool:
        """Whether coalescing is on and no state has explicit prefetch targets: the user's
        order then rules ([Note: coalesced gathers])."""
        return self.coalesce_ok and bool(coalesce_bytes())

    def gather(self, group: FSDPParamGroup, coalesce: bool, backward: bool) -> None:
        """Start gathering ``group`` (a no-op if it is gathered or under way): with the small
        groups next to it in the recorded order if ``coalesce``, else alone."""
        if not (
            coalesce and self.gathers.gather(group, self.forward_order, self.iteration, backward)
        ):
            group.unshard()

    def prefetch_after(self, group: FSDPParamGroup, coalesce: bool) -> None:
        """At ``group``'s pre-forward, on accelerators: start gathering the group that ran after
        it in the last forward, unless that one ran already in this iteration. ``coalesce``:
        with the small groups after it, as its own pre-forward would."""
        if not group.guesses_prefetch():
            return
        order, index = self.forward_order, group.order_index
        if index + 1 < len(order) and order[index] is group:
            following = order[index + 1]
            if following.seen_in != self.iteration:  # not run yet in this forward
                take_up_changes(following)  # what its own pre-forward would do first
                self.gather(following, coalesce, backward=False)

    def prefetch_before(self, group: FSDPParamGroup, coalesce: bool, is_root: bool) -> None:
        """At ``group``'s pre-backward, on accelerators: start gathering the group whose backward
        comes next, the one before it in the last forward; ``coalesce``: with the small groups
        before that one."""
        if not group.guesses_prefetch():
            return
        order = self.forward_order
        if group.seen_in == self.iteration and order and order[group.order_index] is group:
            target = backward_prefetch(
                len(order), group.order_index, is_root, lambda i: order[i] in self.root_groups
            )
            if target >= 0 and order[target].settings.unshard_in_backward:
                self.gather(order[target], coalesce, backward=True)

    def start_forward(self, explicit_prefetch: bool) -> bool:
        """The root's forward starts a new iteration. ``explicit_prefetch``: some state has
        explicit prefetch targets (no coalescing this iteration). Returns whether the last
        backward never reached its end (it raised) and was reset here: the states then forget
        it too."""
        if self.pending_reduction is not None:
            raise RuntimeError(
                "fsdp2: forward started while the gradient reduction of "
                "finalize_backward(async_op=True) is pending; call wait() on its handle first"
            )
        recovered = self.callback_queued
        if recovered:
            self.reset()
        if self.post_optim_event is not None:
            self.post_optim_event.wait()
            self.post_optim_event = None
        self.iteration += 1
        self.threads = {threading.get_ident()}
        self.recording = []
        self.training_forward = torch.is_grad_enabled()
        self.coalesce_ok = not explicit_prefetch
        return recovered

    def end_forward(self) -> None:
        run_deferred_checks()  # a coalesced gather's headers, on accelerators
        self.forward_order = self.recording
        self.training_forward = False

    def begin_backward(self, manual: bool) -> bool:
        """A hook of this backward ran; ``manual``: the root's manual finalization. Returns
        whether this is the first: the caller then queues the end of backward."""
        if self.callback_queued:
            return False
        self.callback_queued = True
        self.threads.add(threading.get_ident())  # autograd's thread for this backward
        if self.manual_active is None:
            self.manual_active = manual
        return True

    def end_of_backward(self) -> None:
        """Reduce whatever was not reduced yet, wait for it all, and reshard every group.
        After a backward with ``create_graph=True`` (grad mode is on in its hooks) the groups
        stay gathered: the graph it built (a gradient penalty's) uses the unsharded parameters
        in the next backward, which reshards them."""
        trace("end_of_backward", "")
        run_deferred_checks()  # before stashing gradients that no collective will reduce
        keep_gathered = torch.is_grad_enabled()
        manual = bool(self.manual_active)
        for group in self.groups:
            # Every group, including those whose hooks finished them (the reshard is then a
            # no-op): without sync, a group whose module's backward did not finish in this
            # backward (a list group where only one module ran: torchtitan's chunked loss on
            # [norm, lm_head]) has not stashed yet; left in .grad, the next micro-step would sum
            # in param_dtype. With sync in manual mode, finalize_backward reduces it.
            hold = manual and group.settings.requires_gradient_sync
            self.finish_group(group, UNBOUNDED, keep_gathered=keep_gathered, hold=hold)
        if self.is_last_backward and not manual:
            self.wait_for_reductions()
        else:
            self.reductions.flush(UNBOUNDED)  # before anything waits for a reduction
        self.reductions.hand_over()
        for group in self.groups:
            group.reducer.end_backward()
        self.callback_queued = False
        self.num_backwards += 1

    def finish_group(
        self,
        group: FSDPParamGroup,
        max_in_flight: int,
        *,
        keep_gathered: bool = False,
        always: bool = False,
        hold: bool = False,
    ) -> None:
        """The one place a group is finished with a backward: reshard it (if it reshards after
        backward, and unless ``keep_gathered``: a ``create_graph`` backward's hooks), first,
        since the reduction needs only the gradients; then reduce its gradients, or, without
        gradient sync, fold them into the unreduced sum. ``always``: reduce even what holds no
        gradient on this rank (a module's backward is done: every rank reduces there, maybe
        zeros for a coalesced bucket); otherwise only what is left (summed over micro-batches
        without sync, or ``set_reduce_scatter_unused_params``'s zeros); ``hold``: only the
        reshard. Called when a module's backward is done (``FSDPState``), at the end of
        backward, by ``finalize_backward`` and pipelining's ``post_backward()``."""
        if group.settings.reshard_after_backward and not keep_gathered:
            group.reshard()
        if hold:
            return
        if not group.settings.requires_gradient_sync:
            group.reducer.stash_grads()
        elif always or group.reducer.reduces_at_end():
            self.reductions.reduce(group.reducer, max_in_flight)

    def finalize_backward(self) -> None:
        """The first half of ``FSDPModule.finalize_backward``: every group finished, last group
        first (backward's order), and the reductions issued, not waited for."""
        for group in reversed(self.groups):
            self.finish_group(group, group.settings.max_in_flight)
        self.reductions.flush(UNBOUNDED)

    def wait_for_reductions(self) -> None:
        """Wait for every reduction; the backward iteration is over. The reduced shards are
        handed to the parameters by the caller (``Reductions.hand_over``)."""
        self.reductions.wait_all()
        self.manual_active = None

    def count_forward(self) -> int:
        """One more sharded forward call began; returns how many so far."""
        self.num_forwards += 1
        return self.num_forwards

    def set_last_backward(self, is_last_backward: bool) -> None:
        """Whether the next backward is the step's last (``set_is_last_backward``)."""
        self.is_last_backward = is_last_backward

    def set_post_optim_event(self, event: torch.Event) -> None:
        """The next gathers wait for ``event`` (``set_post_optim_event``)."""
        self.post_optim_event = event

    def await_reduction(self) -> object:
        """``finalize_backward(async_op=True)``: a reduction is pending until its handle's
        ``wait()``; returns the token that handle holds."""
        token = self.pending_reduction = object()
        return token

    def end_finalization(self) -> None:
        """The second half of ``finalize_backward`` (or its handle's ``wait()``): wait for the
        reductions and hand the reduced shards to the parameters."""
        self.wait_for_reductions()
        self.reductions.hand_over()
        self.pending_reduction = None

    def reset(self) -> None:
        """Forget a failed iteration: its collectives, its gradients, its unsharded parameters."""
        forget_deferred_checks()
        self.reductions.drop()
        for group in self.groups:
            group.reducer.drop_unreduced_grads()
            group.reducer.end_backward()
            group.reshard()
        self.callback_queued = False
        self.training_forward = False
        self.manual_active = None
        self.pending_reduction = None  # its handle's wait() now raises
