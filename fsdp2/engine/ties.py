"""Weights tied across ``fully_shard`` calls.

[Note: weights tied across calls]
Hugging Face ties ``lm_head.weight`` to ``embed_tokens.weight``, and the natural per-module
sharding puts the two modules in two calls. The later call meets a parameter an earlier call
sharded (the same ``Parameter`` object still sits in its module) and leaves it alone, noting
where it met it (``Ties.meet``). The first call whose modules hold every place the parameter
sits, the lowest common sharded ancestor (the root's call at the latest), takes it out of the
earlier group (``FSDPParamGroup.remove``) into its own, which registers it in every place: one
parameter again, whose gradient sums both uses as in the unsharded model, under every key of the
state dict. Decided from the module tree alone, so every rank decides the same. A tie that no
call resolved by the first forward raises there (``unresolved``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn as nn

from fsdp2.engine.param import FSDPParam
from fsdp2.engine.param_group import FSDPParamGroup

__all__ = ["TIES", "Tie", "Ties"]


@dataclass
class Tie:
    """A sharded parameter that later calls met in modules of their own."""

    group: FSDPParamGroup  # the group that sharded it first
    fsdp_param: FSDPParam
    met: list[tuple[nn.Module, str]] = field(default_factory=list)  # (module, name) elsewhere
    met_fqns: list[str] = field(default_factory=list)

    def places(self) -> list[tuple[nn.Module, str]]:
        return [*self.fsdp_param.slot_modules, *self.met]


class Ties:
    """Which group sharded each parameter, and the ties later calls met."""

    def __init__(self) -> None:
        self._pending: dict[int, tuple[nn.Parameter, Tie]] = {}

    def sharded(self, param: nn.Parameter, group: FSDPParamGroup, fsdp_param: FSDPParam) -> None:
        """``group`` shards ``param`` (the object its modules held). Kept on the object itself,
        which lives on only where a module still holds it: a tie."""
        param._fsdp2_sharded_by = (group, fsdp_param)  # type: ignore[attr-defined]
        self._pending.pop(id(param), None)

    def meet(self, param: nn.Parameter, module: nn.Module, name: str, fqn: str) -> bool:
        """A call found ``param`` as ``module.name``; whether an earlier call sharded it (the
        call then leaves it to their common ancestor's)."""
        owner: tuple[FSDPParamGroup, FSDPParam] | None = getattr(param, "_fsdp2_sharded_by", None)
        if owner is None:
            return False
        _, tie = self._pending.setdefault(id(param), (param, Tie(*owner)))
        tie.met.append((module, name))
        tie.met_fqns.append(fqn)
        return True

    def resolved_by(self, modules: tuple[nn.Module, ...]) -> list[tuple[nn.Parameter, Tie]]:
        """The ties whose every place is under ``modules`` (a call on their common ancestor),
        taken off the pending list, in the order they were met."""
        under = {id(m) for top in modules for m in top.modules()}
        found = [
            (param, tie)
            for param, tie in self._pending.values()
            if all(id(module) in under for module, _ in tie.places())
        ]
        for param, _ in found:
            del self._pending[id(param)]
        return found

    def unresolved(self, modules: tuple[nn.Module, ...]) -> list[str]:
        """Ties met under ``modules`` that no call resolved: "<fqn> (tied to <fqn>)" each."""
        names = {id(m): n for top in modules for n, m in top.named_modules()}

        def fqns(places: list[tuple[nn.Module, str]]) -> str:
            return ", ".join(
                f"{names.get(id(module)) or type(module).__name__}.{name}"
                for module, name in places
            )

        return [
            f"{fqns(tie.met)} (tied to {fqns(tie.fsdp_param.slot_modules)})"
            for _, tie in self._pending.values()
            if any(id(module) in names for module, _ in tie.met)
        ]


TIES = Ties()
