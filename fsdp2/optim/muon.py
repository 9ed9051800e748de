"""Muon on sharded parameters: momentum, then Newton–Schulz orthogonalisation of the whole matrix
at its owner rank (see fsdp2/optim/owners.py), AdamW for everything else, in one optimizer."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from typing import Any, Literal

import torch

from fsdp2.optim.matrix import MatrixOptimizer, ParamsT, local

__all__ = ["Muon", "newton_schulz"]

# torch.optim.Muon's names and meanings: None is "original" (Keller Jordan's sqrt(max(1, A/B))).
AdjustLRFn = Literal["original", "match_rms_adamw", "spectral_unclamped"] | None
_ADJUST_LR_FNS = (None, "original", "match_rms_adamw", "spectral_unclamped")
# The quintic iteration's coefficients (Keller Jordan's Muon, torch.optim.Muon's defaults): they
# push every singular value of the normalised matrix into roughly [0.7, 1.2] in five steps, fast
# rather than exactly to 1.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
EPS = 1e-7
_UNSET: Any = object()


def newton_schulz(
    g: torch.Tensor,
    steps: int,
    dtype: torch.dtype = torch.float32,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = EPS,
) -> torch.Tensor:
    """Approximately orthogonalise ``g`` (a matrix, or a stack of them in the last two dims):
    ``U V^T`` of its SVD, with singular values near 1. Computed in ``dtype``: fp32 by default
    (closer to exact than torch.optim.Muon's bf16); with bf16 and a 2-D ``g`` it runs the same
    operations as torch.optim.Muon, so the results are the same.

    Args:
        g: a matrix, or a stack of matrices in its last two dims.
        steps: the number of Newton–Schulz iterations.
        dtype: the dtype of the iteration (the result has it too).
        coefficients: the quintic's ``(a, b, c)``.
        eps: the Frobenius norm is clamped at it before normalising (torch's
            ``max(norm, eps)``; ``norm + eps``, fsdp2's before, scales tiny inputs differently).
    """
    a, b, c = coefficients
    x = g.to(dtype)
    tall = g.size(-2) > g.size(-1)
    if tall:  # iterate on the wide side: X X^T is the smaller Gram matrix
        x = x.mT
    # Spectral norm <= Frobenius norm <= 1 (torch's divisor, clamped at eps, per matrix).
    norm = x.norm() if x.ndim == 2 else x.norm(dim=(-2, -1), keepdim=True)
    x = x / norm.clamp(min=eps)
    matmul_add = torch.addmm if x.ndim == 2 else torch.baddbmm
    for _ in range(steps):
        gram = x @ x.mT
        poly = matmul_add(gram, gram, gram, beta=b, alpha=c)  # b * gram + c * gram @ gram
        x = matmul_add(x, poly, x, beta=a)  # a * x + poly @ x
    out: torch.Tensor = x.mT if tall else x
    return out


def lr_scale(shape: tuple[int, ...], adjust_lr_fn: AdjustLRFn) -> float:
    """What the learning rate of the orthogonalised update is multiplied by, from the matrix's
    (rows, cols): torch.optim.Muon's ``adjust_lr_fn``."""
    rows, cols = shape[-2], shape[-1]
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    if adjust_lr_fn == "spectral_unclamped":  # torch 2.15's third choice (Bernstein's)
        return math.sqrt(rows / cols)
    return math.sqrt(max(1.0, rows / cols))  # None, "original"


def _dtype(value: torch.dtype | str) -> torch.dtype:
    """``ns_dtype`` as groups keep it: a name (``"bfloat16"``), so that full and CPU-offloaded
    state dicts, which accept plain values only, can carry it; a dtype from older groups."""
    if isinstance(value, torch.dtype):
        return value
    dtype = getattr(torch, str(value), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"Muon: ns_dtype must be a torch floating dtype, got {value!r}")
    return dtype


class Muon(MatrixOptimizer):
    """Muon for 2-D weights (and 3-D stacks of expert weights), AdamW for the rest.

    The arguments up to ``adjust_lr_fn`` are ``torch.optim.Muon``'s, with its defaults and
    meanings (README, "Matrix optimizers", has the table). Per matrix:
    ``buf = momentum * buf + (1 - momentum) * grad`` (sharded like the parameter), the Nesterov
    input ``(1 - momentum) * grad + momentum * buf`` (or ``buf``), its whole matrix
    orthogonalised by ``ns_steps`` Newton–Schulz steps (``ns_coefficients``, norm clamped at
    ``eps``) at the matrix's owner rank in ``ns_dtype``, then
    ``p *= 1 - lr * weight_decay; p -= lr * scale * update``, where ``adjust_lr_fn`` gives
    ``scale``: ``None`` or ``"original"``, ``sqrt(max(1, rows / cols))`` (Keller Jordan's);
    ``"match_rms_adamw"``, ``0.2 * sqrt(max(rows, cols))``, an update with AdamW's element RMS,
    so AdamW's lr and weight decay carry over (Moonshot's); ``"spectral_unclamped"``,
    ``sqrt(rows / cols)`` (Bernstein's, new in torch 2.15; offered on every release).

    fsdp2's choice: ``ns_dtype=torch.float32`` (closer to exact; torch always uses bf16, which
    ``ns_dtype=torch.bfloat16`` reproduces). Momentum and decay are separately rounded multiplies
    and adds (torch: ``lerp``), so that a sharded step is bitwise the single-process step; they
    differ from torch's by an ulp.

    What gets AdamW (``adamw_lr``, ``adamw_betas``, ``adamw_eps``, ``adamw_weight_decay``):
    ``adamw_params`` (trained whether or not ``params`` lists them), groups with
    ``use_muon=False``, and the non-matrix parameters of ``params`` (torch refuses those; put
    parameters in a group with ``use_muon=True`` to be refused the same way). See
    [Note: the matrix part and the AdamW part] in fsdp2/optim/groups.py.

    Args:
        params: parameters or param groups; 2-D and 3-D ones get Muon, the others AdamW. A
            group with ``use_muon=True`` is Muon only (raises on others, naming them);
            ``use_muon=False``: AdamW.
        lr: learning rate (default 1e-3, >= 0).
        weight_decay: decoupled weight decay (default 0.1, >= 0).
        momentum: momentum in [0, 1) (default 0.95).
        nesterov: use the Nesterov input (default ``True``).
        ns_coefficients: the quintic Newton–Schulz coefficients ``(a, b, c)``.
        eps: the norm is clamped at it before Newton–Schulz (default 1e-7).
        ns_steps: Newton–Schulz steps, in [1, 100) (default 5).
        adjust_lr_fn: ``None``/``"original"``, ``"match_rms_adamw"`` or
            ``"spectral_unclamped"`` (see above).
        ns_dtype: the dtype Newton–Schulz runs in (default ``torch.float32``).
        adamw_params: parameters (or ``(name, parameter)`` pairs) trained with AdamW.
        adamw_lr: AdamW's learning rate (default 3e-4).
        adamw_betas: AdamW's betas (default ``(0.9, 0.95)``).
        adamw_eps: AdamW's epsilon (default 1e-8).
        adamw_weight_decay: AdamW's weight decay (default 0).
        adjust_lr: the old name of ``adjust_lr_fn`` (``"spectral"``, ``"match_rms_adamw"``;
            warns with ``FutureWarning``).
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = EPS,
        ns_steps: int = 5,
        adjust_lr_fn: AdjustLRFn = None,
        *,
        ns_dtype: torch.dtype | str = torch.float32,
        adamw_params: Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]] = (),
        adamw_lr: float = 3e-4,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.0,
        adjust_lr: Any = _UNSET,
    ) -> None:
        if adjust_lr is not _UNSET:
            adjust_lr_fn = _renamed_adjust_lr(adjust_lr, adjust_lr_fn)
        _check(lr, weight_decay, momentum, ns_coefficients, eps, ns_steps, adjust_lr_fn)
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": tuple(ns_coefficients),
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
            "ns_dtype": str(_dtype(ns_dtype)).removeprefix("torch."),
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
        coefficients = tuple(group["ns_coefficients"])
        return newton_schulz(
            full, group["ns_steps"], _dtype(group["ns_dtype"]), coefficients, group["eps"]
        )

    def apply_update(
        self, param: torch.Tensor, update: torch.Tensor, group: dict[str, Any]
    ) -> None:
        x, lr = local(param), group["lr"]
        x.mul_(1 - lr * group["weight_decay"])
        x.add_(update * -(lr * lr_scale(tuple(param.shape), group["adjust_lr_fn"])))


def _check(
    lr: float,
    weight_decay: float,
    momentum: float,
    ns_coefficients: tuple[float, float, float],
    eps: float,
    ns_steps: int,
    adjust_lr_fn: AdjustLRFn,
) -> None:
    """torch.optim.Muon's checks (momentum: [0, 1), where torch takes any >= 0), at once."""
    if not lr >= 0.0:
        raise ValueError(f"Muon: lr must be >= 0, got {lr}")
    if not weight_decay >= 0.0:
        raise ValueError(f"Muon: weight_decay must be >= 0, got {weight_decay}")
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"Muon: momentum must be in [0, 1), got {momentum}")
    if adjust_lr_fn not in _ADJUST_LR_FNS:
        raise ValueError(
            f"Muon: adjust_lr_fn must be one of {_ADJUST_LR_FNS} (torch.optim.Muon's), got "
            f"{adjust_lr_fn!r}"
        )
    if len(tuple(ns_coefficients)) != 3:
        raise ValueError(
            f"Muon: ns_coefficients must be 3 numbers (a, b, c), got {ns_coefficients}"
        )
    if not 1 <= ns_steps < 100:
        raise ValueError(f"Muon: ns_steps must be in [1, 100), got {ns_steps}")
    if not eps > 0.0:
        raise ValueError(f"Muon: eps must be > 0, got {eps}")


def _renamed_adjust_lr(old: Any, new: AdjustLRFn) -> AdjustLRFn:
    """fsdp2 <= 0.x's ``adjust_lr``: its "spectral" is torch's "original"; its ``None`` (no
    scaling) has no torch equivalent, and torch's ``None`` means "original": refused."""
    if new is not None:
        raise TypeError("Muon: give adjust_lr_fn (torch.optim.Muon's name) only, not adjust_lr")
    mapped = {"spectral": "original", "match_rms_adamw": "match_rms_adamw"}
    if old not in mapped:
        raise ValueError(
            f"Muon: adjust_lr was renamed adjust_lr_fn (torch.optim.Muon's name and meanings); "
            f"adjust_lr={old!r} has no equivalent: adjust_lr_fn=None now means torch's "
            "'original' scaling, sqrt(max(1, rows / cols)). Use adjust_lr_fn='original' or "
            "'match_rms_adamw'."
        )
    warnings.warn(
        f"Muon: adjust_lr={old!r} is deprecated; write adjust_lr_fn={mapped[old]!r} "
        "(torch.optim.Muon's name)",
        FutureWarning,
        stacklevel=3,
    )
    return mapped[old]  # type: ignore[return-value]
