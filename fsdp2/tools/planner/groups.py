"""What the planner reads off a sharded (meta) model: one ``GroupFacts`` per parameter group,
with the byte counts fsdp2's buffers will have on rank 0 (the rank with the most real rows)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from fsdp2.engine.coalesce import ag_joinable
from fsdp2.engine.coalesce_reduce import rs_joinable
from fsdp2.engine.modes.base import Planned
from fsdp2.engine.param import FSDPParam
from fsdp2.engine.param_group import FSDPParamGroup
from fsdp2.engine.state import STATES, FSDPState, module_label, reshard_after_forward_of

__all__ = ["GroupFacts", "collect_groups"]


@dataclass(frozen=True)
class GroupFacts:
    """One ``fully_shard`` call's group, as sizes (all bytes are per rank)."""

    label: str  # the modules' FQNs, comma-joined (module_label): what the recorder labels it
    modules: tuple[str, ...]
    is_root: bool
    num_params: int  # elements of its parameters (unsharded)
    num_trainable: int
    shard_world: int
    replicate_world: int  # 0: no replicate dim (plain FSDP); else HSDP's replicas (even 1)
    param_dtype: str
    reduce_dtype: str
    reshard_after_forward: bool
    sharded_bytes: int  # the flat shard buffer, padding included
    param_bytes: int  # the real rows of the sharded parameters in it (rank 0: the most)
    param_last_bytes: int  # the same on the last rank, which holds the fewest real rows
    unsharded_bytes: int  # the all-gathered parameters in param_dtype (0: aliases the shard)
    gather_in_bytes: int  # what this rank sends in an all-gather
    grad_bytes: int  # the reduced gradient shard held until the next zero_grad
    # The reduce-scatter's "used" flags ([Note: gradients on some ranks only]) held beside it,
    # in the buffer its gradients view: memory, but not what .grad holds.
    grad_flag_bytes: int
    grad_real_bytes: int  # its real rows (without padding), rank 0
    grad_last_bytes: int  # its real rows on the last rank
    unsharded_grad_bytes: int  # autograd's unsharded gradients in param_dtype, before reduction
    reduce_in_bytes: int  # the reduce-scatter's input buffer, in reduce_dtype
    reduce_out_bytes: int
    trainable_local_numel: int  # real elements of trainable parameters on this rank
    trainable_local_bytes: int  # the same in the parameters' dtypes (sizes optimizer state)
    # Whether backward reaches the group's modules: it has trainable parameters, or a module
    # before it (pre-order, taken as forward's order) has some, so gradients flow through it.
    # A frozen first block is not reached: no pre-backward, no gather in backward.
    backward_reached: bool = True
    # What coalescing ([Note: coalesced gathers], RULES of issue 24) asks of a group, besides
    # its place and state in the step: may its gather / its reduce-scatter join a bucket, and
    # with whom (groups with equal keys share a process group; the reduce op is "sum"/"avg").
    gather_joinable: bool = False
    reduce_joinable: bool = False
    gather_key: int = 0
    reduce_key: int = 0
    reduce_op: str = "avg"
    unshard_in_backward: bool = True
    # memory_mode="zero2": the unsharded buffer stays allocated between steps (held, not
    # transient), and the steady-state step is the first micro-batch after an optimizer step.
    stay_gathered: bool = False
    # memory_mode="hfsdp": the replicas its first-level gather spans (0: one-level gathers); the
    # copy of that level kept between steps, and the transposed copy-out's buffer.
    replica_world: int = 0
    copy_extra_bytes: int = 0
    # Bytes kept between steps: zero2's unsharded copy, or hfsdp's 1/S, and beside either the
    # snapshot of this rank's shard it is checked against (engine/kept.py).
    kept_bytes: int = 0
    # The mode's collectives (``Mode.plan``): one unshard's in forward, and in backward after a
    # reshard (reshard_after_forward=k: over k ranks); the sizes of its reduce-scatter's levels.
    forward_gathers: tuple[Planned, ...] = ()
    backward_gathers: tuple[Planned, ...] = ()
    reduce_worlds: tuple[int, ...] = ()
    note: str = ""  # the mode's note on them
    mode: str = "zero3"  # its name (``MODES``)


def collect_groups(model: nn.Module) -> list[GroupFacts]:
    """Every group under ``model``, in pre-order (the order forward first reaches them)."""
    names = {id(m): n for n, m in model.named_modules()}
    states = STATES.under(model)
    reached = _reached_in_backward(model, states)
    keys: dict[int, int] = {}  # process groups, numbered as first met (ids don't survive a fork)
    facts = []
    for i, state in enumerate(states):
        fqns = [names.get(id(m), "") for m in state.modules]
        label = module_label(fqns)
        reshard = reshard_after_forward_of(state.requested_reshard_after_forward, i == 0)
        for group in state.groups:
            fact = _facts(group, label, i == 0, reshard)
            reached_i = i == 0 or reached[i]
            facts.append(
                dataclasses.replace(
                    fact,
                    modules=tuple(fqns),
                    backward_reached=reached_i,
                    **_coalescing(group, keys),
                )
            )
    return facts


def _coalescing(group: FSDPParamGroup, keys: dict[int, int]) -> dict[str, Any]:
    """The static half of the engine's joinability, asked of the engine itself
    (``coalesce.ag_joinable``, ``coalesce_reduce.rs_joinable``); the rest, a group's state in
    the step, the planner's schedule follows."""
    settings = group.settings
    shard_group = group.info.shard_group
    reduce_group = settings.reduce_scatter_group or shard_group
    return {
        "gather_joinable": ag_joinable(group),
        "reduce_joinable": rs_joinable(group.reducer),
        "gather_key": keys.setdefault(id(shard_group), len(keys)),
        "reduce_key": keys.setdefault(id(reduce_group), len(keys)),
        "reduce_op": "sum" if group.reducer.sums() else "avg",
        "unshard_in_backward": settings.unshard_in_backward,
        "stay_gathered": group.mode.keeps_gathered,
        "mode": group.mode.name,
        **group.mode.plan(group.layout, group.shard_size)._asdict(),
    }


def _reached_in_backward(model: nn.Module, states: list[FSDPState]) -> list[bool]:
    """Per state: a trainable parameter in one of its modules or in a module before its first
    one in pre-order (the forward order the planner assumes; the model's inputs are taken not
    to need gradients)."""
    first = {id(s.modules[0]): i for i, s in enumerate(states) if s.modules}
    reached = [False] * len(states)
    seen_trainable = False
    for module in model.modules():
        i = first.get(id(module))
        if i is not None:
            reached[i] = seen_trainable or any(g.layout.trainable for g in states[i].groups)
        seen_trainable |= any(p.requires_grad for p in module.parameters(recurse=False))
    return reached


def _facts(group: FSDPParamGroup, label: str, is_root: bool, reshard: bool) -> GroupFacts:
    world = group.shard_size
    replicas = group.info.replicate_size if group.info.replicate_group is not None else 0
    unit = group.layout.sharded_flat.element_size()  # 1 for a mixed-dtype group's byte buffers
    reduce_unit = group.layout.reduce_dtype.itemsize
    trainable = group.layout.trainable
    row, flags = group.reducer.row_numel(), group.reducer.flags()  # the engine's own rule
    flag_bytes = 0
    if group.layout.cast_each_grad:  # each reduced shard cast to its own dtype: real rows only
        grad_bytes = sum(p.chunk.local_numel * p.sharded_grad_dtype.itemsize for p in trainable)
    else:  # the reduce-scatter's output (one buffer, padding included) in the parameters' dtype
        grad_bytes = (row - flags) * group.layout.dtype.itemsize
        # Its flags stay allocated with it (the gradients view that buffer), unless a cast or a
        # copy to the shards' device leaves them behind: held, but no gradient's.
        kept = group.layout.reduce_dtype == group.layout.dtype and group.settings.offload is None
        flag_bytes = flags * group.layout.dtype.itemsize if kept else 0
    return GroupFacts(
        label=label,
        modules=tuple(label.split(",")),
        is_root=is_root,
        num_params=sum(p.numel for p in group.fsdp_params),
        num_trainable=sum(p.numel for p in trainable),
        shard_world=world,
        replicate_world=replicas,
        param_dtype=str(group.layout.param_dtype).removeprefix("torch."),
        reduce_dtype=str(group.layout.reduce_dtype).removeprefix("torch."),
        reshard_after_forward=reshard,
        sharded_bytes=group.layout.shard_numel * unit,
        param_bytes=sum(p.chunk.local_numel * p.dtype.itemsize for p in group.fsdp_params),
        param_last_bytes=sum(_last_rank_bytes(p, world, p.dtype) for p in group.fsdp_params),
        unsharded_bytes=0 if group.layout.alias else world * group.layout.send_bytes,
        gather_in_bytes=group.layout.send_bytes,
        grad_bytes=grad_bytes,
        grad_flag_bytes=flag_bytes,
        grad_real_bytes=sum(p.chunk.local_numel * p.sharded_grad_dtype.itemsize for p in trainable),
        grad_last_bytes=sum(_last_rank_bytes(p, world, p.sharded_grad_dtype) for p in trainable),
        unsharded_grad_bytes=sum(p.numel * p.param_dtype.itemsize for p in trainable),
        reduce_in_bytes=world * row * reduce_unit if world > 1 else 0,
        reduce_out_bytes=row * reduce_unit if world > 1 or replicas else 0,
        trainable_local_numel=sum(p.chunk.local_numel for p in trainable),
        trainable_local_bytes=sum(p.chunk.local_numel * p.dtype.itemsize for p in trainable),
    )


def _last_rank_bytes(p: FSDPParam, world: int, dtype: torch.dtype) -> int:
    """Bytes in ``dtype`` of the real rows the last of ``world`` ranks holds (a scalar: all)."""
    if not p.shape:
        return dtype.itemsize
    rows = p.shape[p.dim]
    last_rows = min(max(rows - (world - 1) * p.chunk.rows, 0), p.chunk.rows)
    return last_rows * (p.numel // rows if rows else 0) * dtype.itemsize
