"""Which parameters a matrix optimizer gives whole-matrix updates and which AdamW, and loading
state dicts saved by optimizers without that split (``torch.optim.Muon``).

[Note: the matrix part and the AdamW part]
Every parameter given in ``params`` or ``adamw_params`` trains; each goes to exactly one part:
- AdamW: the parameters in ``adamw_params`` (whether or not ``params`` lists them too), those in
  a group with ``use_muon=False``, and those of ``params`` that are not 2-D or 3-D;
- whole-matrix updates: the other 2-D matrices (and 3-D stacks of them) of ``params``.
A group with ``use_muon=True`` is the matrix part explicitly: a parameter in it that is not a
matrix, or that ``adamw_params`` also lists, is refused by name (``torch.optim.Muon`` refuses
non-2-D parameters the same way). ``adamw_params`` not listed in ``params`` form one more AdamW
group, after the others.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

__all__ = ["ParamsT", "from_unsplit_state_dict", "split_groups", "upgrade_groups"]

ParamsT = Iterable[torch.Tensor] | Iterable[dict[str, Any]] | Iterable[tuple[str, torch.Tensor]]


def _tensor(item: Any) -> torch.Tensor:
    """A parameter given as a tensor or a ``(name, tensor)`` pair."""
    t: torch.Tensor = item[1] if isinstance(item, tuple) else item
    return t


def split_groups(params: ParamsT, adamw_params: Iterable[Any], who: str) -> list[dict[str, Any]]:
    """The optimizer's groups, per [Note: the matrix part and the AdamW part]."""
    given: list[Any] = list(params)
    groups: list[dict[str, Any]] = (
        given if given and isinstance(given[0], dict) else [{"params": given}]
    )
    extra = list(adamw_params)
    adamw_ids = {id(_tensor(x)) for x in extra}

    def is_matrix(item: Any) -> bool:
        return _tensor(item).ndim in (2, 3) and id(_tensor(item)) not in adamw_ids

    out: list[dict[str, Any]] = []
    listed: set[int] = set()
    for gi, group in enumerate(groups):
        items = [group["params"]] if isinstance(group["params"], torch.Tensor) else group["params"]
        items = list(items)
        listed.update(id(_tensor(x)) for x in items)
        if "use_muon" in group:
            if group["use_muon"]:
                _refuse_adamw_in_matrix_group(items, adamw_ids, gi, who)
            out.append({**group, "params": items})
            continue
        matrices = [x for x in items if is_matrix(x)]
        others = [x for x in items if not is_matrix(x)]
        if matrices:
            out.append({**group, "params": matrices, "use_muon": True})
        if others:
            out.append({"params": others, "use_muon": False})
    unlisted = [x for x in extra if id(_tensor(x)) not in listed]
    if unlisted:
        out.append({"params": unlisted, "use_muon": False})
    return out


def _refuse_adamw_in_matrix_group(items: list[Any], adamw_ids: set[int], gi: int, who: str) -> None:
    for pi, item in enumerate(items):
        if id(_tensor(item)) in adamw_ids:
            name = item[0] if isinstance(item, tuple) else f"param_groups[{gi}]['params'][{pi}]"
            raise ValueError(
                f"{who}: parameter {name} is in a group with use_muon=True and in adamw_params; "
                "a parameter gets one update rule. Take it out of one of the two."
            )


def from_unsplit_state_dict(
    saved: dict[str, Any], current: dict[str, Any], use_muon: Sequence[bool], who: str
) -> dict[str, Any]:
    """A state dict saved by an optimizer whose groups have no ``use_muon`` (``torch.optim.Muon``
    over the matrices), made into this optimizer's: its groups, in order, become the matrix
    groups (keeping this optimizer's settings it lacks, such as ``ns_dtype``), and the AdamW
    groups keep their current settings and state (``current``: ``self.state_dict()``)."""
    theirs = list(saved["param_groups"])
    n_matrix = sum(use_muon)
    if len(theirs) != n_matrix:
        raise ValueError(
            f"{who}.load_state_dict: the state dict's {len(theirs)} param groups have no "
            f"'use_muon' (saved by torch.optim.Muon?); they are loaded into this optimizer's "
            f"matrix groups, of which there are {n_matrix}. Build the optimizer with the same "
            "matrix groups, in the same order, as the optimizer that saved it."
        )
    groups: list[dict[str, Any]] = []
    state: dict[Any, Any] = {}
    matrix = iter(theirs)
    index = 0
    for mine, is_matrix in zip(current["param_groups"], use_muon, strict=True):
        src, src_state = (next(matrix), saved["state"]) if is_matrix else (mine, current["state"])
        if len(src["params"]) != len(mine["params"]):
            raise ValueError(
                f"{who}.load_state_dict: a saved param group has {len(src['params'])} "
                f"parameters where this optimizer's matrix group has {len(mine['params'])}"
            )
        ids = list(range(index, index + len(src["params"])))
        for old, new in zip(src["params"], ids, strict=True):
            if old in src_state:
                state[new] = src_state[old]
        groups.append({**mine, **src, "use_muon": is_matrix, "params": ids})
        index += len(ids)
    return {"state": state, "param_groups": groups}


def upgrade_groups(
    saved: dict[str, Any], current: list[dict[str, Any]], who: str
) -> dict[str, Any]:
    """A state dict of fsdp2's own, from before Muon took torch.optim.Muon's argument names:
    ``adjust_lr`` becomes ``adjust_lr_fn``, and settings the groups did not have yet
    (``ns_coefficients``) come from this optimizer's groups."""
    groups = []
    for group, mine in zip(saved["param_groups"], current, strict=False):
        group = {**{k: v for k, v in mine.items() if k != "params"}, **group}
        if "adjust_lr" in group and group.get("use_muon"):
            old = group.pop("adjust_lr")
            if old not in ("spectral", "match_rms_adamw"):
                raise ValueError(
                    f"{who}.load_state_dict: the state dict's adjust_lr={old!r} (no scaling) has "
                    "no equivalent now that Muon takes torch.optim.Muon's adjust_lr_fn; set "
                    "group['adjust_lr_fn'] in the state dict's param_groups to 'original' or "
                    "'match_rms_adamw' to load it"
                )
            group["adjust_lr_fn"] = "original" if old == "spectral" else old
        groups.append(group)
    return {**saved, "param_groups": groups + saved["param_groups"][len(groups) :]}
