"""Finding a model's repeated blocks for ``auto_shard``, and grouping the small ones.

How the blocks are chosen (without ``block_types``):
- A *run* is the children of one container (``ModuleList``, ``Sequential``, ``ModuleDict``) that
  share a class: at least two of them, or the single child of a ``ModuleList``/``ModuleDict``
  (a one-layer configuration of a layer list). A child that ``fully_shard`` cannot take (a
  ``ModuleList``/``ModuleDict`` without a ``forward`` of its own) is never a block.
- Runs are taken largest first (by parameter count). A run inside a block already taken is part
  of that block (experts inside a layer); a run smaller than one block of the largest run is not
  worth its own all-gathers and stays with its parent. So a decoder gets its layers, an
  encoder-decoder both layer lists, and ``LlamaForCausalLM`` its ``model.layers``.

A block that shares a parameter (tied weights) or a submodule with anything outside it is not
sharded on its own: its parameters stay with the nearest sharded ancestor, which holds every use,
so a tied parameter always lives in exactly one group.

Small blocks are grouped (``min_group_bytes``, default 256 KiB gathered): each group costs an
all-gather and a reduce-scatter per step whose time, below a few hundred KiB, is the backend's
latency (~0.2-0.5 ms on gloo, tens of us on NCCL) whatever the size. A block's size is what its
all-gather moves: its parameters in the ``mp_policy``'s ``param_dtype`` when the policy passed
sets one (floating-point parameters only, as ``fully_shard`` casts), else in their own dtype; so
bf16 gathers count half the bytes of the fp32 parameters stored. So a block smaller than
``min_group_bytes`` shares one ``fully_shard([...])`` call with the blocks after it in its run
(consecutive siblings of one class, none skipped between them), until the call holds at least
``min_group_bytes``; a block that large is sharded alone, as without grouping. A list group is
gathered once, at its first member's forward, and resharded after its last member's (any order
is correct; the registration order, the usual execution order, keeps the gathered bytes short
lived), so the memory it adds is under twice ``min_group_bytes``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from fsdp2.engine.module import container_without_forward

__all__ = [
    "blocks_of_types",
    "claimed",
    "gather_dtype_of",
    "gathered_bytes",
    "grouped",
    "repeated_blocks",
    "submodule",
    "untied",
]

_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
_LAYER_LISTS = (nn.ModuleList, nn.ModuleDict)


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _inside(fqn: str, ancestor: str) -> bool:
    """``fqn`` names ``ancestor`` or a module below it."""
    return ancestor == "" or fqn == ancestor or fqn.startswith(ancestor + ".")


def _runs(model: nn.Module) -> list[list[str]]:
    """Each container's children grouped by class: the runs (child FQNs) that may be blocks."""
    runs = []
    for fqn, container in model.named_modules():
        if not isinstance(container, _CONTAINERS):
            continue
        by_class: dict[type, list[str]] = {}
        for name, child in container.named_children():
            if not container_without_forward(child) and _numel(child) > 0:
                by_class.setdefault(type(child), []).append(f"{fqn}.{name}" if fqn else name)
        for children in by_class.values():
            single_layer_list = isinstance(container, _LAYER_LISTS) and len(container) == 1
            if len(children) >= 2 or single_layer_list:
                runs.append(children)
    return runs


def repeated_blocks(model: nn.Module) -> list[str]:
    """The largest runs' blocks, in module order."""
    sizes = {tuple(run): sum(_numel(model.get_submodule(f)) for f in run) for run in _runs(model)}
    # Largest first; on a tie the outer run (shorter names) first, so it takes the inner one.
    order = sorted(sizes, key=lambda run: (-sizes[run], run[0].count(".")))
    chosen: list[str] = []
    for run in order:
        if sizes[run] < sizes[order[0]] / len(order[0]):
            break  # smaller than one block of the largest run
        if not any(_inside(run[0], block) for block in chosen):
            chosen.extend(run)
    position = {fqn: i for i, (fqn, _) in enumerate(model.named_modules())}
    return sorted(chosen, key=position.__getitem__)


def blocks_of_types(
    model: nn.Module, block_types: tuple[tuple[type, ...], frozenset[str]]
) -> list[str]:
    """Every module (not the root) of one of ``block_types``, children before parents."""
    classes, names = block_types
    matches = [
        fqn
        for fqn, m in model.named_modules()
        if fqn and (isinstance(m, classes) or type(m).__name__ in names)
    ]
    if not matches:
        wanted = ", ".join([c.__name__ for c in classes] + sorted(names))
        raise ValueError(
            f"auto_shard: block_types ({wanted}) match no submodule of "
            f"{type(model).__name__}; pass the class of its repeated blocks (e.g. "
            "block_types={LlamaDecoderLayer}), or leave block_types out to find them"
        )
    return _post_order(matches, model)


def _post_order(fqns: list[str], model: nn.Module) -> list[str]:
    """``fqns`` (in module order) reordered so that each comes after every one inside it; those
    without parameters dropped (a group of nothing)."""
    out: list[str] = []
    pending: list[str] = []  # open ancestors, outermost first
    for fqn in fqns:
        while pending and not _inside(fqn, pending[-1]):
            out.append(pending.pop())
        pending.append(fqn)
    out.extend(reversed(pending))
    return [f for f in out if _numel(model.get_submodule(f)) > 0]


def untied(model: nn.Module, blocks: list[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """``blocks`` without those sharing a parameter with a module outside them."""
    owners: dict[int, list[str]] = {}  # parameter -> every "module.name" registering it
    for mod_fqn, module in model.named_modules(remove_duplicate=False):
        for name, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append(f"{mod_fqn}.{name}" if mod_fqn else name)
    kept, skipped = [], []
    for block in blocks:
        outside = next(
            (
                (inner, other)
                for names in owners.values()
                for inner in names
                if _inside(inner, block)
                for other in names
                if not _inside(other, block)
            ),
            None,
        )
        if outside is None:
            kept.append(block)
        else:
            why = f"{outside[0]} is also {outside[1]}: it goes to their common ancestor's group"
            skipped.append((block, why))
    return kept, skipped


def claimed(model: nn.Module, fqns: list[str]) -> dict[str, list[nn.Parameter]]:
    """The parameters each module claims, in call order (the first call to reach one owns it)."""
    claimed: set[int] = set()
    out = {}
    for fqn in fqns:
        params = [p for p in model.get_submodule(fqn).parameters() if id(p) not in claimed]
        claimed.update(id(p) for p in params)
        out[fqn] = params
    return out


def gather_dtype_of(kwargs: dict[str, Any]) -> torch.dtype | None:
    """The dtype ``fully_shard`` gathers floating-point parameters in: the ``mp_policy``'s
    ``param_dtype`` (fsdp2's or torch's policy), None when it sets none."""
    dtype = getattr(kwargs.get("mp_policy"), "param_dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else None


def gathered_bytes(params: list[nn.Parameter], gather_dtype: torch.dtype | None) -> int:
    """Bytes these parameters' all-gather moves (floating ones cast to ``gather_dtype``)."""
    return sum(
        p.numel()
        * (gather_dtype.itemsize if gather_dtype and p.is_floating_point() else p.element_size())
        for p in params
    )


# ---------------------------------------------------------------------------------------------
# Grouping small blocks
# ---------------------------------------------------------------------------------------------


def _run_position(model: nn.Module, fqn: str) -> tuple[str, type, int]:
    """(parent, class, index among the parent's children of that class): two blocks follow
    each other in one run when the first two agree and the indices are consecutive."""
    parent, _, name = fqn.rpartition(".")
    module = model.get_submodule(fqn)
    siblings = [
        n
        for n, child in model.get_submodule(parent).named_children()
        if type(child) is type(module)
    ]
    return parent, type(module), siblings.index(name)


def grouped(
    model: nn.Module, blocks: list[str], min_group_bytes: int, gather_dtype: torch.dtype | None
) -> list[tuple[str, ...]]:
    """``blocks`` (in call order) as the modules of each call: a block gathering under
    ``min_group_bytes`` joins the open group of the block just before it in its run, until the
    group holds ``min_group_bytes``; a block that large is alone."""
    claims = claimed(model, blocks)
    out: list[list[str]] = []
    open_bytes = 0  # bytes of out[-1] while it is open to the next block; 0: closed
    previous: tuple[str, type, int] | None = None
    for fqn in blocks:
        nbytes = gathered_bytes(claims[fqn], gather_dtype)
        position = _run_position(model, fqn) if min_group_bytes else None
        follows = (
            position is not None
            and previous is not None
            and position[:2] == previous[:2]
            and position[2] == previous[2] + 1
        )
        if nbytes < min_group_bytes and follows and open_bytes:
            out[-1].append(fqn)
            open_bytes += nbytes
        else:
            out.append([fqn])
            open_bytes = nbytes if nbytes < min_group_bytes else 0
        if open_bytes >= min_group_bytes:
            open_bytes = 0
        previous = position
    return [tuple(group) for group in out]


def submodule(model: nn.Module, fqn: str) -> nn.Module:
    try:
        return model.get_submodule(fqn)
    except AttributeError:
        raise ValueError(
            f"AutoShardResult.apply: {type(model).__name__} has no submodule {fqn!r}; replay a "
            "result onto a model built the same way as the one auto_shard planned"
        ) from None
