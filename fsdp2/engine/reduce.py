"""Gradient reduction for a parameter group: when its gradients are ready, one reduce-scatter
(and, with replicas, one all-reduce; hfsdp: two reduce-scatters), and handing the reduced
shards to the parameters.

[Note: when a group's gradients are ready]
Each unsharded parameter that needs a gradient has a post-accumulate-grad hook. At its first call
in a backward, the group asks the autograd engine how many of its parameters' ``AccumulateGrad``
nodes will run in this graph task; when that many have fired, every gradient the group will get is
in. Parameters outside this backward's graph are not waited for; anything that never fires is
caught by the end-of-backward callback. The group reshards and reduce-scatters them in one
collective once its module's backward is done too ([Note: when a module's backward is done] in
backward_done.py): resharding first, so that the collective's buffers never coexist with the
unsharded parameters.

A reentrant activation checkpoint runs each block's backward as a nested graph task, whose
engine sees only the block's nodes. The count starts at the group's pre-backward, in the task
that runs it. If that task will run some of the group's ``AccumulateGrad`` nodes (a parent
holding parameters both outside checkpointed blocks and inside them), the group claims it and
ignores gradients arriving in nested tasks: they accumulate, and the claimed task's count (or the
end of backward) reduces them all at once; reducing inside a nested task would reshard
parameters the rest of its backward still needs. Otherwise (every parameter inside the block:
the block is the module, or a checkpoint wraps all of it) each nested task counts and reduces
as soon as the block is done.

[Note: gradients on some ranks only]
Whether a parameter got a gradient is a fact of this rank's batch: an MoE expert inside a block
may get no tokens on one rank only. A collective's size must never depend on such a fact, so with
more than one rank (or replicas) every trainable parameter of the group is in the reduce-scatter,
zeros where this rank has no gradient: the average is then plain data parallel's, whose ranks
without tokens add zero. A parameter no rank had a gradient for must stay ``None`` all the same
(an optimizer skips it; zeros would still move it under momentum or weight decay), and only the
other ranks know: each rank's chunk ends with one flag per parameter, 1 where it had a
gradient, reduced along with the gradients, so every rank reads the same count of ranks that
had one, without a collective of its own. ``set_reduce_scatter_unused_params(True)`` gives zeros
to those too, and needs no flags. A group with no gradient at all on this rank reduces nothing:
that is a backward for inputs only (``torch.autograd.grad`` of an input, pipelining's shape
inference), which every rank runs alike; a group made only of experts that one rank's tokens all
missed is the one case this leaves rank-dependent (the hang report names it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist

from fsdp2.engine.collectives import Pending, all_reduce, reduce_scatter
from fsdp2.engine.grads import Reduced, cut_shards, local_grad, refuse_grad, whole_shards
from fsdp2.engine.layout import FlatLayout
from fsdp2.engine.mesh import MeshInfo
from fsdp2.engine.modes.hfsdp import reduce_scatter_in_levels
from fsdp2.engine.param import FSDPParam
from fsdp2.engine.settings import GroupSettings

__all__ = ["GradientReducer", "PendingReduce", "ReduceInput", "reduce_op"]


class PendingReduce:
    """A reduce-scatter in flight; ``finish()`` waits and returns each parameter's reduced shard."""

    __slots__ = (
        "free_input",
        "grads",
        "inp",
        "out",
        "params",
        "pending",
        "reducer",
        "use_sum",
        "used",
    )

    def __init__(
        self,
        reducer: GradientReducer,
        pending: Pending,
        out: torch.Tensor | None,
        params: list[FSDPParam],
        inp: torch.Tensor | None,
        use_sum: bool,
        free_input: bool = False,
        used: list[bool] | None = None,
        grads: list[torch.Tensor] | None = None,
    ) -> None:
        self.reducer = reducer
        self.pending = pending
        self.out = out  # 1-D, this rank's reduced chunk of every parameter in ``params``
        self.params = params
        self.inp = inp  # the collective's input, which must outlive it
        self.use_sum = use_sum  # summed, not averaged: the division is still to do
        # inp is our own buffer (not a custom collective's, which may reuse it): free it once
        # done, not whenever the backend drops its reference.
        self.free_input = free_input
        # One rank, no collective (``out`` is None): the gradients, which are the shards.
        self.grads = grads
        # Which of ``params`` had a gradient on this rank, when ``out`` ends with one flag per
        # parameter (see [Note: gradients on some ranks only]); None: no flags.
        self.used = used

    def finished_locally(self) -> bool:
        """Whether ``finish()`` would neither block nor issue a collective: only then may a
        rank finish it at a moment of its own choosing (``IterContext.reap``). HSDP's all-reduce
        over replicas, or a user's all-reduce hook, issued whenever one rank's reduce-scatter
        happens to be done, would pair up with a different collective on its peers."""
        if not self.pending.done():
            return False
        return self.out is None or not self.reducer.finish_communicates()

    def finish(self) -> list[Reduced]:
        self.pending.wait()
        if self.out is None:  # one rank, nothing to reduce: the gradients are the shards
            grads, self.grads = self.grads or [], None
            return self.reducer.own_shards(self.params, grads)
        if self.free_input and self.inp is not None:
            self.inp.untyped_storage().resize_(0)
        self.inp = None
        return self.reducer.finish_reduce(self.out, self.params, self.use_sum, self.used)


class ReduceInput(NamedTuple):
    """A group's reduce-scatter input, built (its gradients copied in and freed), not issued yet:
    ``inp`` is rank-major, ``(shard ranks, numel)``, one row per rank's chunk."""

    inp: torch.Tensor
    params: list[FSDPParam]
    use_sum: bool  # as PendingReduce's
    used: list[bool] | None


def reduce_op(use_sum: bool) -> dist.ReduceOp.RedOpType:
    return dist.ReduceOp.SUM if use_sum else dist.ReduceOp.AVG


class GradientReducer:
    """The gradient side of one ``FSDPParamGroup``: counts its gradients in, reduces them in one
    reduce-scatter (and, with replicas, one all-reduce) and cuts the result into shards. It reads
    the group's buffers and dtypes from its ``layout`` and the user's choices from ``settings``,
    both shared with the group."""

    # The collective seam (collectives.py); a test may give one reducer its own to observe the
    # moment its reduce-scatter is issued.
    reduce_scatter = staticmethod(reduce_scatter)

    def __init__(
        self,
        label: str,
        info: MeshInfo,
        layout: FlatLayout,
        settings: GroupSettings,
        levels: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None,
    ) -> None:
        self.label = label
        self.info = info
        self.levels = levels  # hfsdp's (replicate, shard): two-level reduce-scatters (modes/)
        self.shard_size = info.shard_size
        self.layout = layout
        self.settings = settings
        self.on_grads_ready: Callable[[], None] = lambda: None  # the owning state's, via its group
        self.grads_ready = False  # every gradient in, not yet reduced (see the note above)
        self.reduced_in_backward = False  # reduce-scattered since the last end of backward
        self._task = -1  # graph task whose gradients are being counted
        self.backward_task = -1  # graph task its pre-backward ran in (-1: none this backward)
        self._ready = 0
        self._expected = 0
        # HSDP with set_requires_all_reduce(False): reduced over the shard ranks, summed over
        # micro-steps, not yet all-reduced over the replicas.
        self.deferred_replica_sum: torch.Tensor | None = None
        # Without gradient sync: each trainable parameter's running gradient sum, in
        # reduce_dtype, until a backward with sync reduces it (stash_grads).
        self.unreduced: dict[FSDPParam, torch.Tensor] = {}

    def rename(self, label: str) -> None:
        self.label = label

    def call_when_ready(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once every gradient of the group is in."""
        self.on_grads_ready = callback

    def on_grad_ready(self, param: torch.Tensor) -> None:
        grad = param.grad
        if grad is not None and (grad.requires_grad or grad.layout is not torch.strided):
            self._refuse_grad(param, grad)
        task = torch._C._current_graph_task_id()
        if self.backward_task not in (-1, task):
            return  # a nested graph task inside this group's backward: see the note above
        if task != self._task:
            self._task, self._ready, self._expected = task, 0, self._count_expected()
        self._ready += 1
        if self._ready == self._expected:
            self.grads_ready = True
            self.on_grads_ready()

    def begin_backward(self) -> None:
        """At the group's pre-backward: count the gradients this graph task will bring, and
        claim the task if it brings any (see the note above)."""
        task = torch._C._current_graph_task_id()
        self._task, self._ready, self._expected = task, 0, self._count_expected()
        self.backward_task = task if self._expected else -1
        self.grads_ready = not self._expected  # none to wait for: only the module's backward

    def mark_taken(self) -> None:
        """The ready gradients are going to a reduction: not ready again until counted in."""
        self.grads_ready = False

    def end_backward(self) -> None:
        """The end of a backward (or a reset): nothing counted, claimed or reduced in it."""
        self.reduced_in_backward = False
        self.grads_ready = False
        self.backward_task = -1

    def _count_expected(self) -> int:
        try:
            return sum(
                torch._C._will_engine_execute_node(p.grad_node)
                for p in self.layout.trainable
                if p.grad_node is not None
            )
        except RuntimeError:
            # torch.autograd.grad() asked for an unsharded parameter's gradient: the engine
            # refuses the question, and runs no AccumulateGrad node for such an input.
            return 0

    def _refuse_grad(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        fqn = next((p.fqn for p in self.layout.trainable if p.unsharded_param is param), "?")
        refuse_grad(fqn, grad)

    def has_unreduced_grads(self) -> bool:
        if self.unreduced:
            return True
        for fsdp_param in self.layout.trainable:  # a loop, not any(): per group and step
            if fsdp_param.unsharded_param.grad is not None:
                return True
        return False

    def reduces_at_end(self) -> bool:
        """Whether the end of backward (or pipelining's ``post_backward``) still has to reduce
        this group: gradients its own hooks did not reduce, or the zeros asked for by
        ``set_reduce_scatter_unused_params`` where no backward reached it."""
        return self.has_unreduced_grads() or (
            self.settings.reduce_scatter_unused
            and not self.reduced_in_backward
            and bool(self.layout.trainable)
        )

    def drop_unreduced_grads(self) -> None:
        self.deferred_replica_sum = None
        self.unreduced.clear()
        for fsdp_param in self.layout.trainable:
            fsdp_param.unsharded_param.grad = None

    def drop_grad(self, fsdp_param: FSDPParam) -> None:
        """Forget ``fsdp_param``'s gradient, and its sum over micro-steps without sync (it was
        frozen: it must never get a gradient summed before)."""
        fsdp_param.unsharded_param.grad = None
        self.unreduced.pop(fsdp_param, None)

    def reduce_grads(self) -> PendingReduce | None:
        """Take the unsharded gradients and start their reduce-scatter; ``None`` if there are none."""
        built = self.build_input()
        return self.issue(built) if isinstance(built, ReduceInput) else built

    def build_input(self, always: bool = False) -> ReduceInput | PendingReduce | None:
        """Take the unsharded gradients into the reduce-scatter's rank-major input, freeing
        them; the collective is not issued (``issue``, or a coalesced bucket, does that). With
        one rank no collective is needed: the finished ``PendingReduce``. ``None``: nothing to
        reduce; ``always`` builds zeros (and flags) instead where this rank had no gradient at
        all (see [Note: coalesced reduce-scatters] in coalesce_reduce.py)."""
        self._task = -1
        self.reduced_in_backward = True
        replicated = self.info.replicate_group is not None
        has = [self._has_grad(p) for p in self.layout.trainable]  # on this rank
        used = None  # per parameter, when the chunk carries flags
        if self.shard_size > 1 or replicated:  # see [Note: gradients on some ranks only]
            params = self.layout.trainable
            deferring = replicated and (
                not self.settings.requires_all_reduce or self.deferred_replica_sum is not None
            )
            if not (self.settings.reduce_scatter_unused or deferring or always or any(has)):
                # No gradient at all on this rank: a backward for inputs only (autograd.grad,
                # pipelining's shape inference), which every rank runs alike. torch reduces
                # nothing there either.
                return None
            if self.flags():
                used = has
        else:
            params = [p for p, h in zip(self.layout.trainable, has, strict=True) if h]
        if not params:
            return None
        grads = [self._take_grad(p) for p in params]
        use_sum = self.sums()
        if self.shard_size == 1 and self.info.replicate_group is None and not use_sum:
            if self.settings.all_reduce_hook is None:
                return PendingReduce(self, Pending(None), None, params, None, use_sum, grads=grads)
        if self.layout.mixed or any(g.dtype != grads[0].dtype for g in grads):
            # _chunk_cat takes one dtype (and casts it to reduce_dtype): a mixed-dtype group's,
            # or running sums without sync next to this backward's gradients or zeros
            grads = [g.to(self.layout.reduce_dtype) for g in grads]
        if used is not None:  # one flag per parameter at the end of every rank's chunk
            one, zero = grads[0].new_ones(1), grads[0].new_zeros(1)
            grads.extend((one if u else zero).expand(self.shard_size) for u in used)
        if self.shard_size == 1:
            out = torch.cat([g.reshape(-1) for g in grads]) if len(grads) > 1 else grads[0]
            out = out.reshape(-1).to(self.layout.reduce_dtype)
            return PendingReduce(self, Pending(None), out, params, None, use_sum, used=used)
        comm, size = self.settings.custom_reduce_scatter, (self.shard_size, self.row_numel())
        dtype, device = self.layout.reduce_dtype, self.layout.device
        if comm is not None:
            inp = comm.allocate(size, dtype=dtype, device=device)
        else:
            inp = torch.empty(size, dtype=dtype, device=device)
        torch._chunk_cat(grads, dim=0, num_chunks=self.shard_size, out=inp)  # casts to reduce_dtype
        grads.clear()  # copied: free them before the collective allocates its own buffers
        return ReduceInput(inp, params, use_sum, used)

    def flags(self) -> int:
        """Flags at the end of each rank's chunk of the input: one per trainable parameter where
        ranks may differ in which got a gradient ([Note: gradients on some ranks only]); none
        where unused ones get zeros anyway, or one rank reduces alone."""
        flagged = self.shard_size > 1 or self.info.replicate_group is not None
        flagged = flagged and not self.settings.reduce_scatter_unused
        return len(self.layout.trainable) if flagged else 0

    def row_numel(self) -> int:
        """Elements of each rank's row of the input, every trainable parameter's chunk and the
        flags: the one rule for its size (the coalesced bucket and the planner read it too)."""
        return sum(p.chunk.numel for p in self.layout.trainable) + self.flags()

    def sums(self) -> bool:
        """Whether this group's reduction sums (and divides afterwards) instead of averaging."""
        return self.settings.divide_factor is not None or self.settings.force_sum_reduction

    def reduce_group(self) -> dist.ProcessGroup:
        """The process group this group's reduce-scatter runs on."""
        group = self.settings.reduce_scatter_group or self.info.shard_group
        if group is None:
            raise AssertionError(
                f"reduce_grads '{self.label}': expected a shard group to reduce over, found None"
            )
        return group

    def issue(self, built: ReduceInput) -> PendingReduce:
        """Start the reduce-scatter of ``built`` (this group's alone)."""
        comm, (inp, params, use_sum, used) = self.settings.custom_reduce_scatter, built
        if comm is not None:
            out = comm.allocate((inp.shape[1],), dtype=inp.dtype, device=inp.device)
        else:
            out = inp.new_empty(inp.shape[1])
        group, op = self.reduce_group(), reduce_op(use_sum)
        levels = self.levels
        if (
            levels is not None
            and min(levels[0].size(), levels[1].size()) > 1
            and comm is None
            and self.settings.reduce_scatter_group is None
        ):
            inp, pending = reduce_scatter_in_levels(
                out, inp, op, levels, self.label, self.reduce_scatter
            )
        else:
            pending = self.reduce_scatter(out, inp.view(-1), group, self.label, op, comm)
        return PendingReduce(self, pending, out, params, inp, use_sum, comm is None, used)

    def _has_grad(self, fsdp_param: FSDPParam) -> bool:
        return fsdp_param.unsharded_param.grad is not None or fsdp_param in self.unreduced

    def stash_grads(self) -> None:
        """Without gradient sync: move this backward's gradients onto the running unreduced sum,
        kept in ``reduce_dtype`` so low-precision micro-steps don't lose bits: each
        parameter's own (a ``grad_dtype`` set on it), or a mixed-dtype group's one."""
        layout = self.layout
        if layout.reduce_dtype == layout.param_dtype:
            return  # autograd keeps accumulating into the unsharded .grad, already the dtype
        for fsdp_param in layout.trainable:
            unsharded = fsdp_param.unsharded_param
            if unsharded.grad is None:
                continue
            grad = unsharded.grad
            unsharded.grad = None
            dtype = layout.reduce_dtype if layout.mixed else fsdp_param.reduce_dtype
            grad = local_grad(fsdp_param, grad, self.label).to(dtype)
            summed = self.unreduced.get(fsdp_param)
            if summed is None:
                self.unreduced[fsdp_param] = grad
            else:
                summed += grad

    def _take_grad(self, fsdp_param: FSDPParam) -> torch.Tensor:
        unsharded = fsdp_param.unsharded_param
        grad = unsharded.grad
        unsharded.grad = None
        if grad is not None:
            grad = local_grad(fsdp_param, grad, self.label)
        summed = self.unreduced.pop(fsdp_param, None)
        if summed is not None:  # the sum of earlier micro-steps without sync
            grad = summed if grad is None else summed.add_(grad)
        if grad is None:  # unused here, but other ranks may have used it
            grad = torch.zeros(
                fsdp_param.shape, dtype=self.layout.param_dtype, device=self.layout.device
            )
        # A scalar is replicated: every rank's chunk carries it, so each gets the reduced value.
        if grad.dim() == 0:
            return grad.reshape(1).expand(self.shard_size)
        return fsdp_param.chunk.rank_major(grad, self.shard_size)

    def finish_communicates(self) -> bool:
        """Whether ``finish_reduce`` may issue collectives (HSDP's all-reduce, the user's hook)."""
        replicated = self.info.replicate_group is not None and self.settings.requires_all_reduce
        return replicated or self.settings.all_reduce_hook is not None

    def finish_reduce(
        self, out: torch.Tensor, params: list[FSDPParam], use_sum: bool, used: list[bool] | None
    ) -> list[Reduced]:
        """After the reduce-scatter: all-reduce over replicas (HSDP), divide, run the user's
        hook, cast to the parameters' dtype and device, and cut ``out`` into their shards
        (``used``: ``out`` ends with a flag per parameter, see [Note: gradients on some ranks
        only])."""
        info = self.info
        if info.replicate_group is not None:
            if self.deferred_replica_sum is not None:  # micro-steps whose all-reduce was deferred
                out = out.add_(self.deferred_replica_sum)
                self.deferred_replica_sum = None
            if not self.settings.requires_all_reduce:
                self.deferred_replica_sum = out
                return []
            all_reduce(out, info.replicate_group, self.label, reduce_op(use_sum)).wait()
        if use_sum:
            factor = self.settings.divide_factor or float(info.shard_size * info.replicate_size)
            if factor != 1.0:
                out.div_(factor)
        flags = None
        if used is not None:
            flags, out = out[out.numel() - len(used) :], out[: out.numel() - len(used)]
        if self.settings.all_reduce_hook is not None:
            self.settings.all_reduce_hook(out)
        layout = self.layout
        return cut_shards(
            out,
            flags,
            params,
            used,
            layout.sharded_flat.device,
            layout.dtype,
            layout.cast_each_grad,
        )

    def own_shards(self, params: list[FSDPParam], grads: list[torch.Tensor]) -> list[Reduced]:
        """With one rank and no replicas, each whole gradient is the shard: no copy, no cut."""
        return whole_shards(params, grads, self.layout.sharded_flat.device)
