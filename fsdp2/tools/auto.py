"""auto_shard: find a model's repeated blocks and ``fully_shard`` them, then the root.

FSDP2 has no auto-wrap policy: every training stack writes the same loop by hand (each
transformer block, then the root). `auto_shard` writes it from the module structure alone, so it
decides the same on every rank and works on the meta device. It returns the calls it made as an
`AutoShardResult`, which prints as a table and replays onto a fresh copy of the model.

How the blocks are chosen, and grouped, is ``blocks.py``'s.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

from fsdp2.api import fully_shard as fsdp2_fully_shard
from fsdp2.engine.modes import MODES
from fsdp2.engine.state import state_of
from fsdp2.tools.blocks import (
    blocks_of_types,
    claimed,
    gather_dtype_of,
    gathered_bytes,
    grouped,
    repeated_blocks,
    submodule,
    untied,
)

# Below this many bytes an all-gather's time is its latency (gloo at 2 ranks: 0.19 ms at 64 B,
# 0.22 ms at 256 KiB, 0.74 ms at 1 MiB; NCCL's knee is higher, ~1 MiB): see docs/performance.md.
DEFAULT_MIN_GROUP_BYTES = 256 * 1024
BlockTypes = Sequence[type[nn.Module] | str] | set[type[nn.Module] | str]


@dataclass(frozen=True)
class ShardCall:
    """One ``fully_shard(model.getsubmodule(fqn), **kwargs)`` call, or for several modules one
    ``fully_shard([model.getsubmodule(f) for f in fqns], **kwargs)`` call (one group)."""

    fqns: tuple[str, ...]
    """The modules' names in the model ("" for the root): one, or a group's, in order."""
    kwargs: dict[str, Any]
    """Every keyword argument of the call, the common ones included."""
    numel: int
    """Parameter elements this call claims: its group's unsharded size."""
    nbytes: tuple[int, ...]
    """Bytes each module of ``fqns`` brings to the call's all-gather (what grouping compares):
    in the ``mp_policy``'s ``param_dtype`` where it sets one."""

    @property
    def target(self) -> str | list[str]:
        """What ``fully_shard`` is given, by name: the fqn, or a list of them for a group."""
        return self.fqns[0] if len(self.fqns) == 1 else list(self.fqns)

    @property
    def name(self) -> str:
        """How the printout names the call."""
        if len(self.fqns) == 1:
            return self.fqns[0] or "<root>"
        return f"[{self.fqns[0]} .. {self.fqns[-1]}] ({len(self.fqns)})"


@dataclass(frozen=True)
class AutoShardResult:
    """What `auto_shard` did: the ``fully_shard`` calls in order (bottom-up, root last)."""

    calls: tuple[ShardCall, ...]
    common: dict[str, Any]
    """The keyword arguments every call got (``mesh`` and the caller's ``fully_shard_kwargs``)."""
    skipped: tuple[tuple[str, str], ...] = field(default=())
    """(fqn, why) for each block that was not sharded on its own."""
    min_group_bytes: int | None = None
    """The grouping threshold used (``None``: grouping was off), in bytes gathered."""

    def __iter__(self) -> Iterator[tuple[str | list[str], dict[str, Any]]]:
        """(target, kwargs) per call, the target an fqn or, for a group, a list of fqns:
        ``fully_shard(m.getsubmodule(t) if isinstance(t, str) else [m.getsubmodule(f) for f
        in t], **kw)``."""
        return iter([(c.target, dict(c.kwargs)) for c in self.calls])

    def apply(self, model: nn.Module, fully_shard: Callable[..., Any] | None = None) -> None:
        """Make the same calls on ``model`` (a fresh copy of the same structure). ``fully_shard``:
        whose implementation to call (e.g. torch's, to compare); fsdp2's by default."""
        shard = fsdp2_fully_shard if fully_shard is None else fully_shard
        # All found before any call.
        targets = [[submodule(model, fqn) for fqn in c.fqns] for c in self.calls]
        for modules, call in zip(targets, self.calls, strict=True):
            shard(modules[0] if len(modules) == 1 else modules, **call.kwargs)

    def __str__(self) -> str:
        rows = [("module", "params", "options")]
        for c in self.calls:
            own = {k: v for k, v in c.kwargs.items() if k not in self.common}
            options = ", ".join(f"{k}={v!r}" for k, v in own.items()) or "-"
            rows.append((c.name, f"{c.numel:,}", options))
        widths = [max(len(r[i]) for r in rows) for i in range(2)]
        plural = "s" if len(self.calls) > 1 else ""
        lines = [f"auto_shard: {len(self.calls)} fully_shard call{plural}, bottom-up"]
        for name, numel, options in rows:
            lines.append(f"  {name:<{widths[0]}}  {numel:>{widths[1]}}  {options}")
        if self.common:
            common = ", ".join(f"{k}={v!r}" for k, v in self.common.items())
            lines.append(f"every call also gets: {common}")
        lines += [f"not sharded on its own: {fqn} ({why})" for fqn, why in self.skipped]
        lines += self._grouping_lines()
        if len(self.calls) == 1 and not self.skipped:
            lines.append("no repeated blocks found: the root holds every parameter")
        return "\n".join(lines)

    def _grouping_lines(self) -> list[str]:
        """Why blocks share a call: the threshold, the grouped blocks' sizes."""
        groups = [c for c in self.calls if len(c.fqns) > 1]
        if not groups:
            return []
        sizes = [b for c in groups for b in c.nbytes]
        plural = "s" if len(groups) > 1 else ""
        dtype = gather_dtype_of(self.common)
        unit = "bytes gathered" + (f" in {str(dtype).removeprefix('torch.')}" if dtype else "")
        return [
            f"grouped: {len(sizes)} blocks under min_group_bytes={self.min_group_bytes:,} "
            f"({min(sizes):,} to {max(sizes):,} {unit} each) in {len(groups)} "
            f"fully_shard([...]) call{plural}, consecutive blocks of a run until a call holds "
            "min_group_bytes: below that, a collective costs the backend's latency whatever its "
            "size (min_group_bytes=None: one call per block)"
        ]


def auto_shard(
    model: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    block_types: BlockTypes | None = None,
    min_group_bytes: int | None = DEFAULT_MIN_GROUP_BYTES,
    **fully_shard_kwargs: Any,
) -> AutoShardResult:
    """``fully_shard`` each repeated block of ``model`` (bottom-up), small consecutive ones
    together, then ``model``; return the calls made.

    Without an explicit ``reshard_after_forward``, blocks reshard after forward except the last
    call's, whose parameters backward needs first (the root keeps fully_shard's default). Tied
    weights stay in their common ancestor's group.

    Args:
        model: the model to shard (the root).
        mesh: passed to every ``fully_shard`` call (default: fully_shard's).
        block_types: classes (or class names) whose instances are the blocks; by default the
            largest runs of same-class children of a ``ModuleList``/``Sequential``/
            ``ModuleDict`` (see the module docstring).
        min_group_bytes: blocks whose all-gather moves fewer bytes than this (their parameters
            in ``mp_policy.param_dtype`` when ``fully_shard_kwargs`` sets one) share one
            ``fully_shard([...])`` call with the next blocks of their run until the call holds
            this many (default 256 KiB: below it a collective costs its latency, see the
            module docstring); blocks this large are sharded alone. ``None`` (or 0): one call
            per block.
        **fully_shard_kwargs: passed to every ``fully_shard`` call (``mp_policy``, ...).

    Returns:
        An :class:`AutoShardResult`: the calls made (``print`` it, iterate ``(fqn, kwargs)``
        pairs, or ``apply`` them to a fresh model).
    """
    result = plan_auto_shard(
        model,
        mesh=mesh,
        block_types=block_types,
        min_group_bytes=min_group_bytes,
        **fully_shard_kwargs,
    )
    result.apply(model)
    return result


def plan_auto_shard(
    model: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    block_types: BlockTypes | None = None,
    min_group_bytes: int | None = DEFAULT_MIN_GROUP_BYTES,
    **fully_shard_kwargs: Any,
) -> AutoShardResult:
    """What `auto_shard` would call, without calling it (nothing is modified)."""
    _check_model(model)
    _check_min_group_bytes(min_group_bytes)
    common = dict(fully_shard_kwargs)
    if mesh is not None:
        common = {"mesh": mesh, **common}
    if block_types is None:
        candidates = repeated_blocks(model)
    else:
        candidates = blocks_of_types(model, _check_block_types(block_types))
    blocks, skipped = untied(model, candidates)
    dtype = gather_dtype_of(common)
    targets = [*grouped(model, blocks, min_group_bytes or 0, dtype), ("",)]
    calls_kwargs = [dict(common) for _ in targets]
    # A mode that keeps every group gathered (zero2): no reshard_after_forward to choose.
    mode = MODES.get(common.get("memory_mode", "zero3"))
    keeps = mode is not None and mode.keeps_gathered
    if "reshard_after_forward" not in common and len(targets) > 1 and not keeps:
        for kwargs in calls_kwargs[:-1]:
            kwargs["reshard_after_forward"] = True
        # The last block's backward runs first: resharding it would gather it right back.
        calls_kwargs[-2]["reshard_after_forward"] = False
    claims = claimed(model, [fqn for target in targets for fqn in target])
    calls = []
    for fqns, kwargs in zip(targets, calls_kwargs, strict=True):
        nbytes = tuple(gathered_bytes(claims[fqn], dtype) for fqn in fqns)
        calls.append(
            ShardCall(fqns, kwargs, sum(p.numel() for f in fqns for p in claims[f]), nbytes)
        )
    return AutoShardResult(
        calls=tuple(calls),
        common=common,
        skipped=tuple(skipped),
        min_group_bytes=min_group_bytes or None,
    )


# ---------------------------------------------------------------------------------------------
# Checks (from the module structure, which every rank shares)
# ---------------------------------------------------------------------------------------------


def _check_model(model: nn.Module) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"auto_shard expects an nn.Module, got {type(model).__name__}")
    for fqn, module in model.named_modules():
        if state_of(module) is not None or isinstance(module, TorchFSDPModule):
            raise ValueError(
                f"auto_shard: module {fqn or '<root>'!r} ({type(module).__name__}) is already "
                "sharded; auto_shard makes every fully_shard call itself: give it a model that "
                "fully_shard was not applied to, or shard this one by hand"
            )
    if next(model.parameters(), None) is None:
        raise ValueError(
            f"auto_shard: {type(model).__name__} has no parameters, so there is nothing to "
            "shard; build the model before sharding it"
        )


def _check_min_group_bytes(min_group_bytes: object) -> None:
    if min_group_bytes is None:
        return
    if not isinstance(min_group_bytes, int) or isinstance(min_group_bytes, bool):
        raise TypeError(
            "auto_shard: min_group_bytes must be an int (bytes gathered) or None, got "
            f"{min_group_bytes!r}; e.g. min_group_bytes=1 << 20, or None to shard each block "
            "alone"
        )
    if min_group_bytes < 0:
        raise ValueError(
            f"auto_shard: min_group_bytes must be >= 0, got {min_group_bytes}; pass a size in "
            "bytes, or None (or 0) to shard each block alone"
        )


def _check_block_types(block_types: BlockTypes) -> tuple[tuple[type, ...], frozenset[str]]:
    if isinstance(block_types, (str, type)):
        block_types = [block_types]
    classes, names = [], []
    for t in block_types:
        if isinstance(t, str):
            names.append(t)
        elif isinstance(t, type) and issubclass(t, nn.Module):
            classes.append(t)
        else:
            raise TypeError(
                "auto_shard: block_types must hold nn.Module subclasses or class names, got "
                f"{t!r}; e.g. block_types={{TransformerBlock}}"
            )
    return tuple(classes), frozenset(names)


# ---------------------------------------------------------------------------------------------
# Choosing the blocks
# ---------------------------------------------------------------------------------------------
