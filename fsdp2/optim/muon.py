"""Muon on sharded parameters: momentum, then Newton–Schulz orthogonalisation of the whole matrix
at its owner rank (see fsdp2/optim/owners.py), AdamW for everything else, in one optimizer."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import torch

from fsdp2.optim.matrix import MatrixOptimizer, ParamsT, local

__all__ = ["Muon", "newton_schulz"]

AdjustLR = Literal["spectral", "match_rms_adamw"] | None
_ADJUST_LR = ("spectral", "match_rms_adamw", None)
# The quintic iteration's coefficients (Keller Jordan's Muon): they push every singular value of
# the normalised matrix into roughly [0.7, 1.2] in five steps, fast rather than exactly to 1.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz(g: torch.Tensor, steps: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Approximately orthogonalise ``g`` (a matrix, or a stack of them in the last two dims):
    ``U V^T`` of its SVD, with singular values near 1. Computed in ``dtype`` (fp32 by default:
    exact enough for bitwise-reproducible parity; bf16 is the usual speed choice on GPUs)."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype)
    tall = g.size(-2) > g.size(-1)
    if tall:  # iterate on the wide side: X X^T is the smaller Gram matrix
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.mT
        poly = b * gram + c * (gram @ gram)
        x = a * x + poly @ x
    out: torch.Tensor = x.mT if tall else x
    return out


def lr_scale(shape: tuple[int, ...], adjust_lr: AdjustLR) -> float:
    """What the orthogonalised update is multiplied by, from the matrix's (rows, cols)."""
    rows, cols = shape[-2], shape[-1]
    if adjust_lr == "spectral":
        return float(max(1.0, rows / cols) ** 0.5)
    if adjust_lr == "match_rms_adamw":
        return 0.2 * float(max(rows, cols) ** 0.5)
    return 1.0


class Muon(MatrixOptimizer):
    """Muon for 2-D weights (and 3-D stacks of expert weights), AdamW for the rest.

    Per matrix: ``buf = momentum * buf + (1 - momentum) * grad`` (sharded like the parameter),
    the Nesterov input ``(1 - momentum) * grad + momentum * buf`` (or ``buf``), its whole matrix
    orthogonalised by ``ns_steps`` Newton–Schulz steps at the matrix's owner rank in ``ns_dtype``,
    scaled by ``adjust_lr``, then ``p *= 1 - lr * weight_decay; p -= lr * update``.

    ``adjust_lr``: ``"spectral"`` (default) scales by ``sqrt(max(1, rows / cols))``, so that tall
    matrices' updates keep a comparable spectral size per input dimension (Keller Jordan's
    recipe); ``"match_rms_adamw"`` by ``0.2 * sqrt(max(rows, cols))``, giving the update the
    element RMS (~0.2) of an AdamW update so that AdamW's lr and weight decay carry over
    (Moonshot's recipe); ``None`` leaves the orthogonal update as is.

    Parameters that are not 2-D/3-D, those in ``adamw_params`` (embeddings and the output head,
    usually) and groups given ``use_muon=False`` get AdamW (``adamw_lr``, ``adamw_betas``,
    ``adamw_eps``, ``adamw_weight_decay``; their group's ``"lr"`` is ``adamw_lr``). Defaults:
    lr 0.02, momentum 0.95, nesterov, 5 steps, no weight decay, fp32 Newton–Schulz.
    """

    def __init__(
        self,
        params: ParamsT,
        *,
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        weight_decay: float = 0.0,
        adjust_lr: AdjustLR = "spectral",
        ns_dtype: torch.dtype = torch.float32,
        adamw_params: Iterable[torch.Tensor] = (),
        adamw_lr: float = 3e-4,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.0,
    ) -> None:
        if adjust_lr not in _ADJUST_LR:
            raise ValueError(f"Muon: adjust_lr must be one of {_ADJUST_LR}, got {adjust_lr!r}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"Muon: momentum must be in [0, 1), got {momentum}")
        if ns_steps < 1:
            raise ValueError(f"Muon: ns_steps must be at least 1, got {ns_steps}")
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_steps": ns_steps,
            "weight_decay": weight_decay,
            "adjust_lr": adjust_lr,
            "ns_dtype": ns_dtype,
        }
        super().__init__(
            params,
            defaults,
            adamw_params=adamw_params,
            adamw_lr=adamw_lr,
            adamw_betas=adamw_betas,
            adamw_eps=adamw_eps,
            adamw_weight_decay=adamw_weight_decay,
        )

    def matrix_input(
        self, param: torch.Tensor, grad: torch.Tensor, group: dict[str, Any], state: dict[str, Any]
    ) -> torch.Tensor:
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(param)
        buf, beta = local(state["momentum_buffer"]), float(group["momentum"])
        buf.mul_(beta).add_(grad * (1 - beta))
        return grad * (1 - beta) + buf * beta if group["nesterov"] else buf

    def whole_matrix_update(
        self, index: int, full: torch.Tensor, group: dict[str, Any]
    ) -> torch.Tensor:
        update = newton_schulz(full, group["ns_steps"], group["ns_dtype"])
        scaled: torch.Tensor = update * lr_scale(tuple(full.shape), group["adjust_lr"])
        return scaled

    def apply_update(
        self, param: torch.Tensor, update: torch.Tensor, group: dict[str, Any]
    ) -> None:
        x = local(param)
        x.mul_(1 - group["lr"] * group["weight_decay"])
        x.add_(update * -group["lr"])
