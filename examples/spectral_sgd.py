"""A second matrix optimizer on fsdp2.optim's owner machinery, in ~30 lines: spectral SGD.

Momentum SGD whose step on each weight matrix is divided by that matrix's spectral norm (its
largest singular value): a step of spectral size ``lr`` whatever the gradient's scale. The norm
needs the whole matrix, so it runs at the matrix's owner rank; momentum stays sharded. The three
methods below are the whole protocol (see [Note: the matrix optimizer protocol] in
fsdp2/optim/matrix.py); a Shampoo-style preconditioner would keep its factors at the owner,
keyed by ``index``, and compute them in ``whole_matrix_update``.

    from spectral_sgd import SpectralSGD
    optimizer = SpectralSGD(model.named_parameters(), lr=0.02)   # after fully_shard
"""

from __future__ import annotations

from typing import Any

import torch

from fsdp2.optim import MatrixOptimizer
from fsdp2.optim.matrix import ParamsT, local


class SpectralSGD(MatrixOptimizer):
    def __init__(self, params: ParamsT, *, lr: float = 0.02, momentum: float = 0.9, **adamw: Any):
        super().__init__(params, {"lr": lr, "momentum": momentum}, **adamw)

    def matrix_input(
        self, param: torch.Tensor, grad: torch.Tensor, group: dict[str, Any], state: dict[str, Any]
    ) -> torch.Tensor:
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(param)  # a DTensor, like the param
        buf = local(state["momentum_buffer"])
        return buf.mul_(group["momentum"]).add_(grad)

    def whole_matrix_update(
        self, index: int, full: torch.Tensor, group: dict[str, Any]
    ) -> torch.Tensor:
        norm = torch.linalg.matrix_norm(full, ord=2, keepdim=True)  # per matrix of a stack
        return full / (norm + 1e-12)

    def apply_update(
        self, param: torch.Tensor, update: torch.Tensor, group: dict[str, Any]
    ) -> None:
        local(param).add_(update * -group["lr"])
