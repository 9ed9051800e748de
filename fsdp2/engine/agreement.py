"""Facts every rank must agree on, checked once so that a mistake raises on every rank.

[Note: errors on every rank]
An error raised on some ranks only is a hang on the others: they go on into the next collective
and wait for a peer that is gone. Most of fsdp2's checks look at facts every rank shares (global
shapes, module structure, arguments). What each rank builds for itself can differ, though: the
model (a rank-dependent config, a checkpoint loaded on one rank), its dtype, which parameters
are frozen, the device a rank put them on (a missing ``set_device``), whether a rank
materialised its meta parameters. A difference there does not raise at all: the collectives
mismatch later, hang, or silently mix up bytes (a parameter frozen on one rank moves the others
in that rank's layout). So:

- ``fully_shard`` exchanges a digest of what it is about to shard (each parameter's name,
  global and local shape, placements, dtype, ``requires_grad``; the policies) over the ranks of
  its mesh, with two flags: "a parameter here is on the wrong device" and "a parameter here is on
  meta". One tiny all-gather per data-parallel process group (two for HSDP), before anything can
  raise from this rank's own data. Only when something differs, a second exchange brings every
  rank's facts, to say which rank differs in what.
- Parameters may legitimately be on meta on some ranks at ``fully_shard`` (accelerate's
  ``cpu_ram_efficient_loading`` keeps the weights on rank 0 only, and materialises the others
  with ``to_empty`` before broadcasting). For a group that was on meta on any rank, the root's
  lazy init (its first forward or ``unshard()``) checks once more, over the same groups, that no
  rank still is, and that the ranks still agree on dtypes and ``requires_grad``. Models that
  never saw meta skip that exchange: nothing is added to any step.
- With several process groups (HSDP's shard and replicate groups), a rank whose own groups agree
  may still sit in a mesh where another group disagreed: the verdict travels with the digest
  (``bad rank``), so after the second group every rank of the mesh knows and raises.

Conditions that can change at any step on one rank only (a gradient assigned by hand, a module
frozen between steps, inputs of another dtype) are not exchanged: that would cost a collective
per step. ``FSDP2_CHECK_COLLECTIVES=1`` reports them (docs/errors-on-every-rank.md).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp2.engine.collectives import agree_ints, agree_objects
from fsdp2.engine.mesh import MeshInfo, device_of

if TYPE_CHECKING:
    from fsdp2.engine.param_group import FSDPParamGroup

__all__ = ["check_fully_shard", "check_materialized"]

Facts = dict[str, str]  # name → what this rank has, worded for the error message
Problems = dict[str, str]  # name → what is wrong with it on this rank
_ARGUMENTS = "arguments of fully_shard"  # the facts' key for them
_MAX_LINES = 8  # differences listed in a message; the first ones are what a user fixes first


class _Report(NamedTuple):
    """What one rank sent in the second exchange."""

    facts: Facts
    problems: Problems


class _Details(NamedTuple):
    """The first of this rank's groups where ranks differ or one has a problem."""

    ranks: list[int]  # the group's global ranks
    reports: list[_Report]  # one per rank, in that order


@dataclass
class _Outcome:
    flags: int  # bitwise OR of every rank's flags over the groups
    details: _Details | None
    bad_rank: int  # a rank whose group disagreed (maybe not one of ours), or -1


def _digest(facts: Facts) -> int:
    """56 bits of a hash of ``facts`` in order (the order of parameters is their layout), the
    same on every rank for the same facts."""
    text = repr(list(facts.items())).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=7).digest(), "little")


def _agree(
    groups: Sequence[dist.ProcessGroup],
    device: torch.device,
    facts: Facts,
    problems: Problems,
    flags: int = 0,
) -> _Outcome:
    """Exchange ``facts`` (by digest), ``problems`` (whether any) and ``flags`` over each of
    ``groups`` in turn; see [Note: errors on every rank]."""
    digest, bad_rank = _digest(facts), -1
    details: _Details | None = None
    for group in groups:
        rows = agree_ints([digest, int(bool(problems)), flags, bad_rank + 1], group, device)
        for _, _, their_flags, their_bad in rows:
            flags |= their_flags
            bad_rank = max(bad_rank, their_bad - 1)
        if any(d != digest or p for d, p, _, _ in rows):  # every rank sees the same rows
            ranks = dist.get_process_group_ranks(group)
            # Sent as a plain tuple: what crosses the wire stays as it was.
            everyone = cast("list[tuple[Facts, Problems]]", agree_objects((facts, problems), group))
            if details is None:
                details = _Details(ranks, [_Report(*each) for each in everyone])
            bad_rank = max(bad_rank, min(ranks))
    return _Outcome(flags, details, bad_rank)


def _dp_groups(info: MeshInfo) -> list[dist.ProcessGroup]:
    """The data-parallel groups whose ranks must agree (of more than one rank)."""
    groups = (info.shard_group, info.replicate_group)
    return [g for g in groups if g is not None and g.size() > 1]


# -- fully_shard --------------------------------------------------------------------------------


def _describe(param: nn.Parameter) -> str:
    shape = tuple(param.shape)
    parts = [f"shape {shape}", str(param.dtype).removeprefix("torch.")]
    if isinstance(param, DTensor):
        parts.append(f"local {tuple(param._local_tensor.shape)} as {list(param.placements)}")
    local = param._local_tensor if isinstance(param, DTensor) else param
    if type(local) not in (torch.Tensor, nn.Parameter):
        parts.append(type(local).__name__)
    parts.append("requires_grad" if param.requires_grad else "frozen")
    return ", ".join(parts)


def check_fully_shard(
    who: str,
    params: dict[nn.Parameter, str],
    info: MeshInfo,
    device: torch.device,
    arguments: str,
) -> bool:
    """Raise on every rank of ``info``'s mesh unless they all shard the same parameters
    (``params``: each with its FQN) with the same ``arguments``, each on CPU, meta or
    ``device``. Returns whether any rank has a parameter on meta."""
    facts: Facts = {_ARGUMENTS: arguments}
    facts.update((fqn, _describe(p)) for p, fqn in params.items())
    problems: Problems = {
        fqn: str(p.device)
        for p, fqn in params.items()
        if p.device != device and p.device.type not in ("cpu", "meta")
    }
    meta = int(any(p.device.type == "meta" for p in params))
    outcome = _agree(_dp_groups(info), device, facts, problems, meta)
    if outcome.details is not None:
        ranks, reports = outcome.details
        if any(r.problems for r in reports):
            raise ValueError(_device_message(who, device, ranks, [r.problems for r in reports]))
        raise ValueError(_mismatch_message(who, ranks, [r.facts for r in reports]))
    if outcome.bad_rank >= 0:
        raise ValueError(_elsewhere_message(who, outcome.bad_rank))
    if problems:  # no peers to exchange with: this rank alone
        raise ValueError(_device_message(who, device, None, [problems]))
    return bool(outcome.flags)


def _device_message(
    who: str, device: torch.device, ranks: list[int] | None, problems: list[Problems]
) -> str:
    """``ranks=None``: this rank alone, with no peers to name."""
    bad = [i for i, here in enumerate(problems) if here]
    fqn, found = next(iter(problems[bad[0]].items()))
    where = "" if ranks is None else f" on rank {ranks[bad[0]]}"
    text = (
        f"{fqn} of {who} is on {found}{where}, but the mesh's device is {device}. Move the "
        f"module to {device} (or keep it on CPU: fully_shard moves it) before calling "
        "fully_shard, or pass a mesh on the parameters' device"
    )
    if ranks is not None and len(bad) < len(ranks):
        text += (
            f". Only on {_rank_word([ranks[i] for i in bad])}: did every rank call "
            "torch.accelerator.set_device_index(local_rank) before building its model?"
        )
    return text


def _mismatch_message(who: str, ranks: list[int], facts: list[Facts]) -> str:
    names = list(dict.fromkeys(name for f in facts for name in f))
    lines = []
    for name in names:
        by_value: dict[str, list[int]] = {}
        for rank, f in zip(ranks, facts, strict=True):
            by_value.setdefault(f.get(name, "absent"), []).append(rank)
        if len(by_value) > 1:
            found = "; ".join(f"{v} on {_rank_word(r)}" for v, r in by_value.items())
            lines.append(f"  {name}: {found}")
    if not lines:  # the same parameters, registered in another order: another layout
        orders: dict[str, list[int]] = {}
        for rank, f in zip(ranks, facts, strict=True):
            orders.setdefault(", ".join(k for k in f if k != _ARGUMENTS), []).append(rank)
        found = "; ".join(f"{v} on {_rank_word(r)}" for v, r in orders.items())
        lines.append(f"  order: {found}")
    return (
        f"fully_shard({who}): the ranks of the mesh differ in what they shard, so its "
        f"collectives would not match (a hang, or mixed-up values):\n"
        + "\n".join(_cap(lines))
        + "\nEvery rank must build the same model (shapes, dtypes, frozen parameters) and call "
        "fully_shard with the same arguments"
    )


def _elsewhere_message(who: str, bad_rank: int) -> str:
    return (
        f"fully_shard({who}): ranks of the mesh differ in what they shard; this rank's own "
        f"groups agree, and rank {bad_rank}'s error says what differs. Every rank must build the "
        "same model and call fully_shard with the same arguments"
    )


def _rank_word(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _cap(lines: list[str]) -> list[str]:
    if len(lines) <= _MAX_LINES:
        return lines
    return [*lines[:_MAX_LINES], f"  ... and {len(lines) - _MAX_LINES} more"]


# -- lazy init ----------------------------------------------------------------------------------


def _still_meta(group: FSDPParamGroup) -> list[str]:
    """Names within the group's module: the report names the module first."""
    prefix = f"{group.label}." if group.label else ""
    return [
        p.fqn.removeprefix(prefix)
        for p in group.fsdp_params
        if p.sharded_param._local_tensor.device.type == "meta"  # type: ignore[attr-defined]
    ]


def check_materialized(groups: list[FSDPParamGroup]) -> None:
    """At lazy init: raise on every rank if the ranks differ in which groups are still on meta
    (of those on meta on some rank at ``fully_shard``), or in dtypes or frozen parameters.
    One exchange per process group, only for such groups; see [Note: errors on every rank].
    Meta on every rank alike is left to the first gather, which then raises on every rank."""
    by_groups: dict[tuple[int, ...], list[FSDPParamGroup]] = {}
    for group in groups:  # in module order: the same on every rank
        if group.meta_on_some_rank:
            key = tuple(id(pg) for pg in _dp_groups(group.info))
            by_groups.setdefault(key, []).append(group)
    for members in by_groups.values():
        facts: Facts = {}
        for group in members:
            for p in group.fsdp_params:
                param = p.sharded_param
                facts[p.fqn] = (  # named under the root by lazy init
                    f"{str(param.dtype).removeprefix('torch.')}, "
                    + ("requires_grad" if param.requires_grad else "frozen")
                )
            meta = _still_meta(group)
            if meta:
                facts[_META + (group.label or "<root>")] = ", ".join(meta)
        info = members[0].info
        # The mesh's device: a group half converted by to_empty may sit on meta.
        outcome = _agree(_dp_groups(info), device_of(info.mesh), facts, {})
        if outcome.details is not None:
            ranks, reports = outcome.details
            each = [r.facts for r in reports]
            if any(k.startswith(_META) for f in each for k in f):
                raise RuntimeError(_meta_message(ranks, each))
            raise RuntimeError(_changed_message(ranks, each))
        if outcome.bad_rank >= 0:
            raise RuntimeError(
                f"fsdp2: at the first forward, ranks differ in their parameters; rank "
                f"{outcome.bad_rank}'s error says what differs"
            )
        for group in members:
            group.materialized_everywhere()


_META = "on meta: "  # the facts' key prefix for a group still on meta


def _meta_message(ranks: list[int], facts: list[Facts]) -> str:
    lines = [
        f"  {_rank_word([rank])}: fsdp2 module {key.removeprefix(_META)!r} ({names})"
        for rank, here in zip(ranks, facts, strict=True)
        for key, names in here.items()
        if key.startswith(_META)
    ]
    return (
        "fsdp2: parameters are still on the meta device at the first forward on some ranks:\n"
        + "\n".join(_cap(lines))
        + "\nMaterialise them on every rank before forward: module.to_empty(device=...), then "
        "module.reset_parameters() (or your own init, or load a checkpoint)"
    )


def _changed_message(ranks: list[int], facts: list[Facts]) -> str:
    text = _mismatch_message("...", ranks, facts)
    body = text.split("\n", 1)[1].rsplit("\n", 1)[0]
    return (
        "fsdp2: at the first forward, the ranks differ in their parameters' dtypes or "
        f"requires_grad (changed on some ranks after fully_shard):\n{body}\nChange them alike "
        "on every rank"
    )
