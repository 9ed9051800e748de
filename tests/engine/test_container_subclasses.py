"""``nn.ModuleList`` / ``nn.ModuleDict`` subclasses that define their own ``forward``: ordinary
modules to ``fully_shard``, hooked and trained like any other, as torch's ``fully_shard`` does.
Only a container whose class keeps ``nn.Module.forward`` is refused (tests/test_api.py pins
that message)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.harness import IMPL_UNDER_TEST, fsdp_api, run_on_ranks
from tests.models import Batch
from tests.parity import Lockstep

DIM, NUM_STEPS = 8, 3


class Layers(nn.ModuleList):
    """A layer list that runs its layers itself."""

    def __init__(self) -> None:
        super().__init__(nn.Linear(DIM, DIM) for _ in range(2))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for layer in self:
            h = torch.tanh(layer(h))
        return h


class Heads(nn.ModuleDict):
    """Named heads whose outputs it adds."""

    def __init__(self) -> None:
        super().__init__({"a": nn.Linear(DIM, DIM), "b": nn.Linear(DIM, DIM)})

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self["a"](h) + self["b"](h)


class ContainerModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.layers = Layers()
        self.heads = Heads()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.heads(self.layers(self.inp(x))), y)


def _batch(gen: torch.Generator, n: int) -> Batch:
    return torch.randn(n, DIM, generator=gen), torch.randn(n, DIM, generator=gen)


def _train(layout: str, impl: str) -> list[str]:
    fully_shard = fsdp_api(impl).fully_shard
    t = Lockstep(ContainerModel, _batch)
    model = t.model
    for container in (model.layers, model.heads):
        if layout == "children_then_container":
            # The container's own call then holds no parameter: only its hooks.
            for child in container.children():
                fully_shard(child)
        fully_shard(container, reshard_after_forward=True)
    fully_shard(model)
    t.make_optimizers()
    t.train(NUM_STEPS)
    return [type(model.layers).__name__, type(model.heads).__name__]


@pytest.mark.parametrize("layout", ["container", "children_then_container"])
def test_container_with_forward_trains_like_plain(layout: str) -> None:
    """The subclasses are sharded (their class swapped as any module's), regathered in backward
    after resharding, and train as the unsharded reference on the same global batch."""
    for names in run_on_ranks(2, _train, layout, IMPL_UNDER_TEST):
        assert names == ["FSDPLayers", "FSDPHeads"]
