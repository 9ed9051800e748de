"""What one ``fully_shard`` call manages: the modules under it that no earlier call claimed, their
parameters (each with every place it sits), and the weights tied across calls that this call,
their common ancestor, takes over ([Note: weights tied across calls], ties.py)."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
import torch.nn as nn

from fsdp2.engine.policies import MixedPrecisionPolicy
from fsdp2.engine.state import STATES, state_of
from fsdp2.engine.ties import TIES

__all__ = ["managed_modules", "managed_params", "take_ties"]

logger = logging.getLogger("fsdp2")

# A parameter this call manages -> (its first FQN, every (module, name) it sits under).
Slots = dict[nn.Parameter, tuple[str, list[tuple[nn.Module, str]]]]


def managed_modules(modules: Iterable[nn.Module]) -> list[nn.Module]:
    """Modules under ``modules`` that no earlier ``fully_shard`` call claimed."""
    found: list[nn.Module] = []
    seen: set[int] = set()
    stack = list(reversed(list(modules)))
    while stack:
        mod = stack.pop()
        if id(mod) in seen:
            continue
        seen.add(id(mod))
        found.append(mod)
        stack.extend(
            child
            for child in reversed(list(mod.children()))
            if state_of(child) is None and id(child) not in seen
        )
    return found


def managed_params(modules: tuple[nn.Module, ...], ignored: set[nn.Parameter]) -> Slots:
    """Each parameter this call manages → (its first FQN, every (module, name) it sits under)."""
    managed = managed_modules(modules)
    names = {id(m): n for top in modules for n, m in top.named_modules()}
    out: Slots = {}
    for mod in managed:
        for name, param in mod._parameters.items():
            if param is None or param in ignored:
                continue
            fqn = f"{names.get(id(mod), '')}.{name}".lstrip(".")
            owner = getattr(param, "_fsdp2_owner", None)
            if owner is not None and TIES.meet(param, mod, name, fqn):
                continue  # [Note: weights tied across calls]: their common ancestor's
            if owner is not None:
                raise ValueError(
                    f"{fqn} (in {type(mod).__name__}) is already sharded by the fully_shard call "
                    f"on {owner}: a tied weight cannot live in two groups. Group the modules "
                    "that share it in one call, e.g. fully_shard([embedding, lm_head])"
                )
            entry = out.setdefault(param, (fqn, []))
            entry[1].append((mod, name))
    return out


def take_ties(
    modules: tuple[nn.Module, ...],
    slots: Slots,
    kept: dict[nn.Parameter, torch.dtype | None],
    mp_policy: MixedPrecisionPolicy,
) -> dict[nn.Parameter, torch.Tensor]:
    """Take in the tied weights this call is the common ancestor of ([Note: weights tied
    across calls]): each leaves the group that sharded it and joins this call's ``slots`` with
    all its places. Returns their current full values (the original objects may be stale)."""
    moved: dict[nn.Parameter, torch.Tensor] = {}
    names = {id(m): n for top in modules for n, m in top.named_modules()}
    for param, tie in TIES.resolved_by(modules):
        moved[param] = tie.group.remove(tie.fsdp_param)
        if not tie.group.fsdp_params:  # nothing left: the state that made it drops it
            for state in STATES.under(*modules):
                state.drop_group(tie.group)
        module, name = tie.places()[0]
        slots[param] = (f"{names[id(module)]}.{name}".lstrip("."), tie.places())
        kept[param] = mp_policy.kept_dtype(param)
        logger.info(
            "fsdp2: %s is tied to %s across fully_shard calls; the call on %s manages it",
            ", ".join(tie.met_fqns),
            tie.fsdp_param.fqn,
            ", ".join(type(m).__name__ for m in modules),
        )
    return moved
