"""Gradient reduction for a parameter group: when its gradients are ready, one reduce-scatter
(and, with replicas, one all-reduce), and handing the reduced shards to the parameters.

[Note: when a group's gradients are ready]
Each unsharded parameter that needs a gradient has a post-accumulate-grad hook. At its first call
in a backward, the group asks the autograd engine how many of its parameters' ``AccumulateGrad``
nodes will run in this graph task; when that many have fired, every gradient the group will get is
in. Parameters outside this backward's graph are not waited for; anything that never fires is
caught by the end-of-backward callback. The group reshards and reduce-scatters them in one
collective once its module's backward is done too ([Note: when a module's backward is done] in
inputs.py): resharding first, so that the collective's buffers never coexist with the
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
from typing import cast

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial

from fsdp2.engine.collectives import Pending, all_reduce, reduce_scatter
from fsdp2.engine.comm import ReduceScatter
from fsdp2.engine.mesh import MeshInfo
from fsdp2.engine.param import FSDPParam

__all__ = [
    "GradientReduction",
    "PendingReduce",
    "Reduced",
    "accumulate_grad",
    "hand_over",
    "local_grad",
]

# A reduced shard for its parameter, and, for a parameter this rank had no gradient for, the
# reduced flag that says whether any rank had one (see [Note: gradients on some ranks only]).
Reduced = tuple[FSDPParam, torch.Tensor, "torch.Tensor | None"]


class PendingReduce:
    """A reduce-scatter in flight; ``finish()`` waits and returns each parameter's reduced shard."""

    __slots__ = ("free_input", "group", "keep_alive", "out", "params", "pending", "use_sum", "used")

    def __init__(
        self,
        group: GradientReduction,
        pending: Pending,
        out: torch.Tensor | None,
        params: list[FSDPParam],
        keep_alive: object,
        use_sum: bool,
        free_input: bool = False,
        used: list[bool] | None = None,
    ) -> None:
        self.group = group
        self.pending = pending
        self.out = out  # 1-D, this rank's reduced chunk of every parameter in ``params``
        self.params = params
        self.keep_alive = keep_alive  # the collective's input must outlive it
        self.use_sum = use_sum  # summed, not averaged: the division is still to do
        # keep_alive is our own input buffer (not a custom collective's, which may reuse it):
        # free it once done, not whenever the backend drops its reference.
        self.free_input = free_input
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
        return self.out is None or not self.group.finish_communicates()

    def finish(self) -> list[Reduced]:
        self.pending.wait()
        if self.out is None:  # one rank, nothing to reduce: the gradients are the shards
            grads, self.keep_alive = self.keep_alive, None
            return self.group.own_shards(self.params, cast("list[torch.Tensor]", grads))
        if self.free_input:
            cast(torch.Tensor, self.keep_alive).untyped_storage().resize_(0)
        self.keep_alive = None
        return self.group.finish_reduce(self.out, self.params, self.use_sum, self.used)


def accumulate_grad(fsdp_param: FSDPParam, local: torch.Tensor) -> None:
    """Hand a reduced shard to the sharded parameter: as its gradient, or added to it; then run
    the parameter's post-accumulate-grad hooks (optimizer-in-backward steps there), once per
    backward, as autograd runs them for a plain parameter."""
    if fsdp_param.frozen():
        return  # frozen after its forward: as in plain PyTorch, it gets no gradient
    param = fsdp_param.sharded_param
    if param.grad is None:
        param.grad = fsdp_param.make_grad(local)
    elif isinstance(param.grad, DTensor):
        param.grad._local_tensor.add_(local)
    else:
        raise RuntimeError(
            f"fsdp2 expected the gradient of {fsdp_param.fqn} to be None or a DTensor, found a "
            f"{type(param.grad).__name__}; assign gradients as DTensors or set them to None"
        )
    for hook in (getattr(param, "_post_accumulate_grad_hooks", None) or {}).values():
        hook(param)


def hand_over(reduced: list[Reduced]) -> None:
    """At the end of backward: give each parameter its reduced shard, but not one that no rank
    had a gradient for, which stays ``None`` as in plain data parallel. Reading those flags
    waits for their reduce-scatters: only a rank that lacked some gradient pays for it."""
    flags = [flag for _, _, flag in reduced if flag is not None]
    anywhere = iter(torch.stack(flags).gt(0).tolist() if flags else [])
    for fsdp_param, shard, flag in reduced:
        if flag is None or next(anywhere):
            accumulate_grad(fsdp_param, shard)


def local_grad(fsdp_param: FSDPParam, grad: torch.Tensor) -> torch.Tensor:
    """The plain tensor to reduce for an unsharded gradient. A DTensor gradient (tensor
    parallel) is first laid out as its parameter on the model-parallel dims (e.g. ``Partial``
    after a row-wise layer is summed over tp), but a ``Partial`` on a data-parallel dim is left
    alone: its local tensor is this rank's contribution, which the reduce-scatter sums (or
    averages) over those very ranks. Summing it there first would count it once per rank."""
    if not isinstance(grad, DTensor):
        return grad
    spec = fsdp_param.outer_spec
    if spec is None:
        raise AssertionError(
            f"{fsdp_param.fqn}: expected a DTensor gradient only for a DTensor parameter, "
            "found one for a plain parameter"
        )
    dp_axes = fsdp_param.dp_axes
    target = tuple(
        have if axis in dp_axes and isinstance(have, Partial) else want
        for axis, (have, want) in enumerate(zip(grad.placements, spec.placements, strict=True))
    )
    if grad.placements != target:
        grad = grad.redistribute(spec.mesh, target)
    return grad._local_tensor


class GradientReduction:
    """The gradient half of ``FSDPParamGroup`` (which sets every attribute declared here)."""

    info: MeshInfo
    label: str
    world: int
    fsdp_params: list[FSDPParam]
    trainable: list[FSDPParam]
    sharded_flat: torch.Tensor
    dtype: torch.dtype
    mixed: bool  # parameters of several dtypes (see [Note: mixed dtypes] in param_group.py)
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    device: torch.device
    on_grads_ready: Callable[[], None]
    grads_ready: bool
    reduced_in_backward: bool
    divide_factor: float | None
    force_sum_reduction: bool
    reduce_scatter_unused: bool
    all_reduce_hook: Callable[[torch.Tensor], None] | None
    custom_reduce_scatter: ReduceScatter | None
    reduce_scatter_group: dist.ProcessGroup | None  # set_separate_reduce_scatter_group
    requires_all_reduce: bool
    _replica_partial: torch.Tensor | None
    _task: int
    backward_task: int
    _ready: int
    _expected: int

    def _on_grad_ready(self, param: torch.Tensor) -> None:
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

    def _count_expected(self) -> int:
        try:
            return sum(
                torch._C._will_engine_execute_node(p.grad_node)
                for p in self.trainable
                if p.grad_node is not None
            )
        except RuntimeError:
            # torch.autograd.grad() asked for an unsharded parameter's gradient: the engine
            # refuses the question, and runs no AccumulateGrad node for such an input.
            return 0

    def _refuse_grad(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """Raise for a gradient no reduce-scatter can take: one with a graph, or a sparse one."""
        fqn = next((p.fqn for p in self.trainable if p.unsharded_param is param), "?")
        if not grad.requires_grad:
            raise RuntimeError(
                f"fsdp2: {fqn} got a gradient of layout {grad.layout}, but sharded gradients are "
                "reduce-scattered as dense tensors. A sparse gradient comes from "
                "nn.Embedding(..., sparse=True) or nn.EmbeddingBag(..., sparse=True): build the "
                "module with sparse=False (the default), or set module.sparse = False; sharding "
                "already spreads the embedding's memory over the ranks"
            )
        raise RuntimeError(
            f"fsdp2: backward(create_graph=True) gave {fqn} a gradient that requires grad, but "
            "the reduce-scatter that shards it is not differentiable, so its higher-order terms "
            "would be lost. Take higher-order gradients with respect to tensors that are not "
            "sharded parameters (torch.autograd.grad(loss, inputs, create_graph=True), as in a "
            "gradient penalty), or compute them on an unsharded copy of the model"
        )

    def has_unreduced_grads(self) -> bool:
        return any(map(self._has_grad, self.trainable))

    def reduces_at_end(self) -> bool:
        """Whether the end of backward (or pipelining's ``post_backward``) still has to reduce
        this group: gradients its own hooks did not reduce, or the zeros asked for by
        ``set_reduce_scatter_unused_params`` where no backward reached it."""
        return self.has_unreduced_grads() or (
            self.reduce_scatter_unused and not self.reduced_in_backward and bool(self.trainable)
        )

    def drop_unreduced_grads(self) -> None:
        self._replica_partial = None
        for fsdp_param in self.trainable:
            fsdp_param.unsharded_param.grad = None
            fsdp_param.unreduced = None

    def reduce_grads(self) -> PendingReduce | None:
        """Take the unsharded gradients and start their reduce-scatter; ``None`` if there are none."""
        self._task = -1
        self.reduced_in_backward = True
        replicated = self.info.replicate_group is not None
        has = [self._has_grad(p) for p in self.trainable]  # on this rank
        used = None  # per parameter, when the chunk carries flags
        if self.world > 1 or replicated:  # see [Note: gradients on some ranks only]
            params = self.trainable
            deferring = replicated and (
                not self.requires_all_reduce or self._replica_partial is not None
            )
            if not (self.reduce_scatter_unused or deferring or any(has)):
                # No gradient at all on this rank: a backward for inputs only (autograd.grad,
                # pipelining's shape inference), which every rank runs alike. torch reduces
                # nothing there either.
                return None
            if not self.reduce_scatter_unused:
                used = has
        else:
            params = [p for p, h in zip(self.trainable, has, strict=True) if h]
        if not params:
            return None
        grads = [self._take_grad(p) for p in params]
        use_sum = self.divide_factor is not None or self.force_sum_reduction
        if self.world == 1 and self.info.replicate_group is None and not use_sum:
            if self.all_reduce_hook is None:
                return PendingReduce(self, Pending(None), None, params, grads, use_sum)
        if self.mixed or any(g.dtype != grads[0].dtype for g in grads):
            # _chunk_cat takes one dtype (and casts it to reduce_dtype): a mixed-dtype group's,
            # or running sums without sync next to this backward's gradients or zeros
            grads = [g.to(self.reduce_dtype) for g in grads]
        if used is not None:  # one flag per parameter at the end of every rank's chunk
            one, zero = grads[0].new_ones(1), grads[0].new_zeros(1)
            grads.extend((one if u else zero).expand(self.world) for u in used)
        if self.world == 1:
            out = torch.cat([g.reshape(-1) for g in grads]) if len(grads) > 1 else grads[0]
            out = out.reshape(-1).to(self.reduce_dtype)
            return PendingReduce(self, Pending(None), out, params, None, use_sum, used=used)
        numel = sum(p.chunk_numel for p in params) + (len(used) if used is not None else 0)
        comm = self.custom_reduce_scatter
        size, dtype, device = (self.world, numel), self.reduce_dtype, self.device
        if comm is not None:
            inp = comm.allocate(size, dtype=dtype, device=device)
            out = comm.allocate((numel,), dtype=dtype, device=device)
        else:
            inp = torch.empty(size, dtype=dtype, device=device)
            out = inp.new_empty(numel)
        torch._chunk_cat(grads, dim=0, num_chunks=self.world, out=inp)  # casts to reduce_dtype
        grads.clear()  # copied: free them before the collective allocates its own buffers
        op = dist.ReduceOp.SUM if use_sum else dist.ReduceOp.AVG
        group = self.reduce_scatter_group or self.info.shard_group
        if group is None:
            raise AssertionError(
                f"reduce_grads '{self.label}': expected a shard group to reduce over, found None"
            )
        pending = reduce_scatter(out, inp.view(-1), group, self.label, op, comm)
        return PendingReduce(
            self, pending, out, params, inp, use_sum, free_input=comm is None, used=used
        )

    @staticmethod
    def _has_grad(fsdp_param: FSDPParam) -> bool:
        return fsdp_param.unsharded_param.grad is not None or fsdp_param.unreduced is not None

    def stash_grads(self) -> None:
        """Without gradient sync: move this backward's gradients onto the running unreduced sum,
        kept in ``reduce_dtype`` so low-precision micro-steps don't lose bits."""
        if self.reduce_dtype == self.param_dtype:
            return  # autograd keeps accumulating into the unsharded .grad, already the dtype
        for fsdp_param in self.trainable:
            unsharded = fsdp_param.unsharded_param
            if unsharded.grad is None:
                continue
            grad = unsharded.grad
            unsharded.grad = None
            grad = local_grad(fsdp_param, grad).to(self.reduce_dtype)
            if fsdp_param.unreduced is None:
                fsdp_param.unreduced = grad
            else:
                fsdp_param.unreduced += grad

    def _take_grad(self, fsdp_param: FSDPParam) -> torch.Tensor:
        unsharded = fsdp_param.unsharded_param
        grad = unsharded.grad
        unsharded.grad = None
        if grad is not None:
            grad = local_grad(fsdp_param, grad)
        if fsdp_param.unreduced is not None:  # the sum of earlier micro-steps without sync
            grad = fsdp_param.unreduced if grad is None else fsdp_param.unreduced.add_(grad)
            fsdp_param.unreduced = None
        if grad is None:  # unused here, but other ranks may have used it
            grad = torch.zeros(fsdp_param.shape, dtype=self.param_dtype, device=self.device)
        # A scalar is replicated: every rank's chunk carries it, so each gets the reduced value.
        if grad.dim() == 0:
            return grad.reshape(1).expand(self.world)
        return fsdp_param.rank_major(grad, self.world)

    def finish_communicates(self) -> bool:
        """Whether ``finish_reduce`` may issue collectives (HSDP's all-reduce, the user's hook)."""
        replicated = self.info.replicate_group is not None and self.requires_all_reduce
        return replicated or self.all_reduce_hook is not None

    def finish_reduce(
        self, out: torch.Tensor, params: list[FSDPParam], use_sum: bool, used: list[bool] | None
    ) -> list[Reduced]:
        """After the reduce-scatter: all-reduce over replicas (HSDP), divide, run the user's
        hook, cast to the parameters' dtype and device, and cut ``out`` into their shards
        (``used``: ``out`` ends with a flag per parameter, see [Note: gradients on some ranks
        only])."""
        info = self.info
        if info.replicate_group is not None:
            if self._replica_partial is not None:  # micro-steps whose all-reduce was deferred
                out = out.add_(self._replica_partial)
                self._replica_partial = None
            if not self.requires_all_reduce:
                self._replica_partial = out
                return []
            op = dist.ReduceOp.SUM if use_sum else dist.ReduceOp.AVG
            all_reduce(out, info.replicate_group, self.label, op).wait()
        if use_sum:
            factor = self.divide_factor or float(info.shard_size * info.replicate_size)
            if factor != 1.0:
                out.div_(factor)
        flags = None
        if used is not None:
            flags, out = out[out.numel() - len(used) :], out[: out.numel() - len(used)]
        if self.all_reduce_hook is not None:
            self.all_reduce_hook(out)
        # No-op without mp or offload. A mixed-dtype group casts each shard to its own dtype.
        out = out.to(self.sharded_flat.device, out.dtype if self.mixed else self.dtype)
        shards: list[Reduced] = []
        start = 0
        for i, fsdp_param in enumerate(params):
            shard = fsdp_param.local_view(out, start)
            flag = None if flags is None or used is None or used[i] else flags[i]
            shards.append((fsdp_param, shard.to(fsdp_param.dtype) if self.mixed else shard, flag))
            start += fsdp_param.chunk_numel
        return shards

    def own_shards(self, params: list[FSDPParam], grads: list[torch.Tensor]) -> list[Reduced]:
        """With one rank and no replicas, each whole gradient is the shard: no copy, no cut."""
        device = self.sharded_flat.device
        shards: list[Reduced] = []
        for p, g in zip(params, grads, strict=True):
            # Usually already the shard's shape, dtype and device: skip the calls (per step,
            # per parameter, they were the largest single cost of a one-rank backward).
            if g.shape != p.local_shape:
                g = g.reshape(p.local_shape)
            if g.dtype != p.dtype or g.device != device:
                g = g.to(device, p.dtype)
            shards.append((p, g, None))
        return shards
