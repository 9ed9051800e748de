"""``set_reduce_scatter_unused_params``: ranks route to different experts, so each rank leaves
some parameters unused; every rank must still reduce-scatter the same tensors. Counted with
`tests.parity.CollectiveCounter`, for fsdp2 and for torch's own ``fully_shard``."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.harness import fsdp_api, run_on_ranks
from tests.models import MLP_DIM, MLP_IN, MLP_OUT, Batch
from tests.parity import Lockstep, backward_counts

NUM_STEPS = 3
NUM_EXPERTS = 2


class Experts(nn.Module):
    """Each sample goes to one expert; an expert no sample picked does not run at all."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(MLP_DIM, MLP_DIM) for _ in range(NUM_EXPERTS))

    def forward(self, h: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(h)
        for i, expert in enumerate(self.experts):
            picked = route == i
            if picked.any():
                out = out.index_put((picked,), expert(h[picked]))
        return out


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(MLP_IN, MLP_DIM)
        self.moe = Experts()
        self.head = nn.Linear(MLP_DIM, MLP_OUT)

    def forward(self, x: torch.Tensor, route: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.moe(torch.tanh(self.inp(x)), route)
        return F.mse_loss(self.head(torch.tanh(h)), y)


class RoutedLockstep(Lockstep):
    """Rank r's samples all go to expert r % NUM_EXPERTS: each rank leaves an expert unused."""

    def batch_for(self, step: int, micro: int, rank: int) -> Batch:
        x, y = super().batch_for(step, micro, rank)
        return x, torch.full((x.shape[0],), rank % NUM_EXPERTS), y


def _unused_params(impl: str) -> list[int]:
    fully_shard = fsdp_api(impl).fully_shard
    t = RoutedLockstep(MoE, lambda gen, n: (torch.randn(n, MLP_IN, generator=gen),
                                           torch.randn(n, MLP_OUT, generator=gen)))  # fmt: skip
    fully_shard(t.model.moe)
    fully_shard(t.model)
    # Without this, rank 0 would reduce-scatter only expert 0's gradients and rank 1 only
    # expert 1's: mismatched collectives. Here the experts have the same shape, so gloo would
    # not even complain: each expert would get the sum of both experts' gradients.
    t.model.moe.set_reduce_scatter_unused_params(True)
    t.make_optimizers()
    return backward_counts(t, NUM_STEPS, "reducescatter")


@pytest.mark.parametrize(("world_size", "impl"), [(2, "fsdp2"), (4, "fsdp2"), (2, "torch")])
def test_reduce_scatter_unused_params_moe(world_size: int, impl: str, fsdp2_only: None) -> None:
    from fsdp2.engine.coalesce import coalesce_bytes

    # The experts' group and the root's; coalesced ([Note: coalesced reduce-scatters]), one
    # reduce-scatter for both (the rank without an expert's gradient sends zeros for it).
    expected = 1 if impl == "fsdp2" and coalesce_bytes() else 2
    for reduce_scatters in run_on_ranks(world_size, _unused_params, impl):
        assert reduce_scatters == [expected] * NUM_STEPS
