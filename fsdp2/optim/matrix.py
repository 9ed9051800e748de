"""The base of matrix optimizers on sharded parameters, and the AdamW that rides along.

[Note: the matrix optimizer protocol]
A subclass of :class:`MatrixOptimizer` says three things about a matrix parameter; the base does
the rest (owners, the all-to-all exchange, param groups, AdamW for everything else, state dict):

- ``matrix_input(param, grad, group, state) -> Tensor``: elementwise, on this rank's shard
  (``to_local()``): update the sharded state (momentum) and return the shard of the matrix the
  whole-matrix step needs.
- ``whole_matrix_update(index, full, group) -> Tensor``: at the owner only, on the full matrix
  (3-D: a stack of matrices): the full update. ``index`` is the parameter's position in the
  optimizer (``self.matrix_params()[index]``), stable across ranks and steps, for owner-side
  caches. State kept here lives on the owner only and is not in the state dict.
- ``apply_update(param, update, group)``: elementwise, on this rank's shard: apply the shard of
  the update that came back.

Per-parameter state lives in ``self.state[param]`` as tensors shaped like the parameter
(DTensors for sharded ones), so ``state_dict()`` and ``torch.distributed.checkpoint`` save and
reshard it like AdamW's. Elementwise arithmetic is written as separate multiplies and adds (no
fused ``addcmul``/``lerp``): each op rounds once, the same on a shard as on the full tensor, so a
sharded step is bitwise the single-process step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from fsdp2.optim.groups import ParamsT, from_unsplit_state_dict, split_groups, upgrade_groups
from fsdp2.optim.owners import MatrixLayout, assign_owners, exchange, matrix_layout

__all__ = ["MatrixOptimizer", "ParamsT"]


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` (``t`` itself when it is a plain tensor)."""
    if isinstance(t, DTensor):
        part: torch.Tensor = t.to_local()
        return part
    return t


class MatrixOptimizer(torch.optim.Optimizer):
    """Matrix params (2-D, and 3-D stacks) get a whole-matrix step; every other parameter, and
    the ones the user sends there (``adamw_params``, or a group with ``use_muon=False``), AdamW.
    See [Note: the matrix optimizer protocol] and [Note: the matrix part and the AdamW part]
    (fsdp2/optim/groups.py).

    Subclass it and implement :meth:`matrix_input`, :meth:`whole_matrix_update` and
    :meth:`apply_update` (``examples/spectral_sgd.py``; :class:`~fsdp2.optim.Muon`).

    Args:
        params: parameters or param groups, as for any ``torch.optim.Optimizer``; a group may
            set ``use_muon`` (``True``: matrices only, whole-matrix updates; ``False``: AdamW).
        defaults: the subclass's defaults for the matrix groups (its hyperparameters).
        adamw_params: parameters (or ``(name, parameter)`` pairs) trained with AdamW, whether
            or not ``params`` lists them too.
        adamw_lr: AdamW's learning rate (>= 0).
        adamw_betas: AdamW's ``(beta1, beta2)``.
        adamw_eps: AdamW's epsilon.
        adamw_weight_decay: AdamW's decoupled weight decay (>= 0).
    """

    def __init__(
        self,
        params: ParamsT,
        defaults: dict[str, Any],
        *,
        adamw_params: Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]] = (),
        adamw_lr: float = 3e-4,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.0,
    ) -> None:
        who = type(self).__name__
        for name, value in (("adamw_lr", adamw_lr), ("adamw_weight_decay", adamw_weight_decay)):
            if not value >= 0.0:
                raise ValueError(f"{who}: {name} must be >= 0, got {value}")
        # The AdamW groups' settings, filled in where a group does not give its own.
        self._adamw = {"lr": adamw_lr, "betas": adamw_betas, "eps": adamw_eps}
        self._adamw["weight_decay"] = adamw_weight_decay
        groups = split_groups(params, adamw_params, who)
        # The subclass's defaults win: Muon's ``eps`` is Newton-Schulz's (AdamW groups get
        # ``adamw_eps`` from ``self._adamw``).
        super().__init__(groups, {"betas": adamw_betas, "eps": adamw_eps, **defaults})
        self._layouts: list[MatrixLayout] | None = None
        self._layouts_for: list[int] = []
        self._check_groups()

    # -- the protocol ------------------------------------------------------------------------

    def matrix_input(
        self, param: torch.Tensor, grad: torch.Tensor, group: dict[str, Any], state: dict[str, Any]
    ) -> torch.Tensor:
        """What to send to the matrix's owner: this rank's shard of the input of the
        whole-matrix step (e.g. momentum), computed on the local shard.

        Args:
            param: the parameter (a sharded DTensor, or a plain tensor).
            grad: its gradient, sharded like it.
            group: its param group (hyperparameters).
            state: its optimizer state (``self.state[param]``), to update in place.
        """
        raise NotImplementedError

    def whole_matrix_update(
        self, index: int, full: torch.Tensor, group: dict[str, Any]
    ) -> torch.Tensor:
        """The update of one whole matrix, run on its owner rank only.

        Args:
            index: the matrix's position among the matrix parameters (stable across steps).
            full: the whole input matrix (every rank's :meth:`matrix_input` shard, joined).
            group: its param group.

        Returns:
            A tensor of ``full``'s shape; each rank receives its shard of it.
        """
        raise NotImplementedError

    def apply_update(
        self, param: torch.Tensor, update: torch.Tensor, group: dict[str, Any]
    ) -> None:
        """Apply this rank's shard of the update to the parameter, in place.

        Args:
            param: the parameter.
            update: this rank's shard of :meth:`whole_matrix_update`'s result.
            group: its param group (learning rate, weight decay).
        """
        raise NotImplementedError

    # -- machinery ---------------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if "use_muon" not in param_group:
            raise ValueError(
                f"{type(self).__name__}.add_param_group: the group needs 'use_muon': True for "
                "matrices (whole-matrix updates) or False for AdamW; got a group without it."
            )
        if not param_group["use_muon"]:
            param_group = {**self._adamw, **param_group}
        super().add_param_group(param_group)
        if hasattr(self, "_layouts"):  # not while __init__ adds the first groups
            try:
                self._check_groups()
            except ValueError:
                self.param_groups.pop()  # leave the optimizer as it was
                raise

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Also loads a state dict whose groups lack ``use_muon`` (saved by
        ``torch.optim.Muon``): its groups become this optimizer's matrix groups, in order."""
        groups = state_dict.get("param_groups", [])
        if groups and not all("use_muon" in g for g in groups):
            use_muon = [bool(g["use_muon"]) for g in self.param_groups]
            state_dict = from_unsplit_state_dict(
                state_dict, super().state_dict(), use_muon, type(self).__name__
            )
        else:  # fsdp2's own, maybe from before torch's names: add what its groups lack
            state_dict = upgrade_groups(state_dict, self.param_groups, type(self).__name__)
        super().load_state_dict(state_dict)

    def matrix_params(self) -> list[tuple[torch.Tensor, dict[str, Any]]]:
        return [(p, g) for g in self.param_groups if g["use_muon"] for p in g["params"]]

    def _check_groups(self) -> None:
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                if group["use_muon"] and p.ndim not in (2, 3):
                    raise ValueError(
                        f"{type(self).__name__}: parameter {_name(group, gi, pi)} is {p.ndim}-D "
                        f"(shape {list(p.shape)}) in a group with use_muon=True; only 2-D and "
                        "3-D (stacked) matrices get whole-matrix updates. Put it in adamw_params "
                        "or in a group with use_muon=False."
                    )
        self.layouts()  # refuses unsupported shardings now, on every rank

    def layouts(self) -> list[MatrixLayout]:
        """Every matrix parameter's layout with its owner (cached while the params stay)."""
        params = self.matrix_params()
        ids = [id(p) for p, _ in params]
        if self._layouts is None or ids != self._layouts_for:
            names = [
                _name(g, gi, pi)
                for gi, g in enumerate(self.param_groups)
                if g["use_muon"]
                for pi in range(len(g["params"]))
            ]
            who = type(self).__name__
            raw = [matrix_layout(p, n, who) for (p, _), n in zip(params, names, strict=True)]
            self._layouts, self._layouts_for = assign_owners(raw), ids
        return self._layouts

    def whole_matrix_updates(
        self, items: list[tuple[int, torch.Tensor]]
    ) -> dict[int, torch.Tensor]:
        """This rank's shard of the whole-matrix update of each ``(index, input shard)``."""
        layouts = self.layouts()
        groups = [g for _, g in self.matrix_params()]
        out: dict[int, torch.Tensor] = {}
        buckets: dict[tuple[str, torch.dtype], list[tuple[int, torch.Tensor]]] = {}
        for i, x in items:
            group = layouts[i].group
            if group is None:
                out[i] = self.whole_matrix_update(i, x, groups[i]).to(x.dtype)
            else:
                buckets.setdefault((group.group_name, x.dtype), []).append((i, x))
        for bucket in buckets.values():  # first-appearance order: the same on every rank
            ids = [i for i, _ in bucket]
            shards = exchange(
                [layouts[i] for i in ids], [x for _, x in bucket], self._by_position(ids, groups)
            )
            out.update(zip(ids, shards, strict=True))
        return out

    def _by_position(
        self, ids: list[int], groups: list[dict[str, Any]]
    ) -> Callable[[int, torch.Tensor], torch.Tensor]:
        """``exchange`` numbers a bucket's matrices 0.. ; the protocol uses optimizer indices."""
        return lambda j, full: self.whole_matrix_update(ids[j], full, groups[ids[j]])

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        items: list[tuple[int, torch.Tensor]] = []
        params = self.matrix_params()
        for i, (p, group) in enumerate(params):
            # A matrix without a gradient on every rank is skipped on every rank (grads of
            # sharded params exist everywhere or nowhere), so the exchange stays in step.
            if p.grad is not None:
                state = self.state[p]
                items.append((i, self.matrix_input(p, local(p.grad), group, state)))
        updates = self.whole_matrix_updates(items)
        for i, update in updates.items():
            self.apply_update(params[i][0], update, params[i][1])
        for group in self.param_groups:
            if not group["use_muon"]:
                for p in group["params"]:
                    if p.grad is not None:
                        _adamw(p, self.state[p], group)
        return loss


def _name(group: dict[str, Any], gi: int, pi: int) -> str:
    names = group.get("param_names")
    return names[pi] if names else f"param_groups[{gi}]['params'][{pi}]"


def _adamw(p: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
    """One AdamW step on this rank's shard, in separately rounded ops (see the Note)."""
    if p.grad is None:  # the caller steps parameters with a gradient only
        raise AssertionError("_adamw: expected a parameter with a gradient, got grad=None")
    g, x = local(p.grad), local(p)
    if not state:
        state["step"] = torch.zeros((), dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(p)
        state["exp_avg_sq"] = torch.zeros_like(p)
    state["step"] += 1
    step = int(state["step"].item())
    (b1, b2), lr, eps = group["betas"], group["lr"], group["eps"]
    m, v = local(state["exp_avg"]), local(state["exp_avg_sq"])
    x.mul_(1 - lr * group["weight_decay"])
    m.mul_(b1).add_(g * (1 - b1))
    v.mul_(b2).add_(g * g * (1 - b2))
    denom = (v.sqrt() / math.sqrt(1 - b2**step)).add_(eps)
    x.add_((m / denom) * (-lr / (1 - b1**step)))
