"""``dp_mesh_dims`` with everything a DTensor on the full mesh (torchtitan's ``full_dtensor``).

Parameters are DTensors on the whole SPMD mesh (``Replicate()`` on the data-parallel dims, tensor
parallel on ``tp``), and each rank's batch enters as a ``Shard(0)`` DTensor over the data-parallel
dims. A weight's gradient then comes out of autograd ``Partial()`` on those dims: each rank holds
its own contribution. The reduce-scatter must reduce exactly those contributions once (summing
them first over the dp ranks counts each rank's share once per rank: a factor of the dp size).

Every layout trains side by side with the single-process reference on the global batch
(`tests/parity/`), and torch's own ``fully_shard`` trains the same way.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from fsdp2 import DataParallelMeshDims, MixedPrecisionPolicy
from tests.harness import fsdp_api, run_on_ranks
from tests.models import Batch
from tests.parity import train_side_by_side
from tests.tolerance import FP32, Tolerance

IN, HIDDEN, OUT = 8, 16, 4
# Row-wise layers add partial sums over the tp ranks: a different order than one matmul.
TP_TOL = Tolerance(rtol=1e-5, atol=2e-6, param_atol=2e-5)


class Net(nn.Module):
    """Two linear layers; ``forward(x, y)`` is the mean squared error over the local batch.
    With DTensor parameters, ``x`` enters as this rank's rows of a ``Shard(0)`` DTensor over
    the data-parallel dims, and the loss is taken over the local rows of the output."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(IN, HIDDEN), nn.Linear(HIDDEN, OUT)
        self.input_placements: tuple[Placement, ...] = ()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        weight = self.fc1.weight
        if isinstance(weight, DTensor):
            x = DTensor.from_local(x, weight.device_mesh, self.input_placements)
        out = self.fc2(torch.tanh(self.fc1(x)))
        if isinstance(out, DTensor):  # the local rows, whole over tp
            out = out.redistribute(placements=self.input_placements).to_local()
        return F.mse_loss(out, y)


def make_batch(gen: torch.Generator, batch_size: int) -> Batch:
    return torch.randn(batch_size, IN, generator=gen), torch.randn(batch_size, OUT, generator=gen)


# layout -> (mesh shape, dim names, dp_mesh_dims, the input's placements, tensor parallel)
LAYOUTS: dict[str, tuple[tuple[int, ...], tuple[str, ...], DataParallelMeshDims, bool]] = {
    "fsdp": ((2,), ("dp",), DataParallelMeshDims(shard="dp"), False),
    "fsdp_tp": ((2, 2), ("dp", "tp"), DataParallelMeshDims(shard="dp"), True),
    "hsdp": ((2, 2), ("rep", "dp"), DataParallelMeshDims(shard="dp", replicate="rep"), False),
}


@functools.cache
def full_mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """As torchtitan builds it: a view unflattened from a 1-D world mesh. One per rank process:
    DTensor caches specs by mesh equality, so a parameter can come back on an equal mesh
    object of an earlier test, and torch's fully_shard wants the very object it was given."""
    world = init_device_mesh("cpu", (torch.Size(shape).numel(),), mesh_dim_names=("world",))
    return world._unflatten(0, shape, names)


def distribute(model: Net, mesh: DeviceMesh, dims: DataParallelMeshDims, tp: bool) -> None:
    """Every parameter a DTensor on the full mesh: replicated over the data-parallel dims,
    column-wise fc1 and row-wise fc2 over ``tp``."""
    names = mesh.mesh_dim_names or ()
    on_tp = {"fc1.weight": Shard(0), "fc1.bias": Shard(0), "fc2.weight": Shard(1)}
    for fqn, param in list(model.named_parameters()):
        placements = [Replicate()] * mesh.ndim
        if tp:
            placements[names.index("tp")] = on_tp.get(fqn, Replicate())
        owner = model.get_submodule(fqn.rpartition(".")[0])
        value = distribute_tensor(param.detach(), mesh, placements)
        setattr(owner, fqn.rpartition(".")[2], nn.Parameter(value))
    model.input_placements = tuple(
        Shard(0) if n in (*dims.shard_names, *dims.replicate_names) else Replicate() for n in names
    )


def _train(
    layout: str, impl: str, knob: str | None, traced: bool = False, compiled: bool = False
) -> list[float]:
    shape, names, dims, tp = LAYOUTS[layout]
    mesh = full_mesh(shape, names)
    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    distribute(model, mesh, dims, tp)
    kwargs: dict[str, Any] = {"mesh": mesh, "dp_mesh_dims": dims}
    if knob == "no_sync_mp":
        # Computing in float64 and reducing in float32: no-sync micro-steps keep their sum in
        # reduce_dtype outside autograd (fsdp2's stash), at no loss of precision here.
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.float64, reduce_dtype=torch.float32
        )
    api = fsdp_api(impl)
    api.fully_shard(model.fc1, **kwargs)
    api.fully_shard(model, **kwargs)
    if traced:  # the reduce-scatter as autograd's, through DTensor.from_local's backward
        from fsdp2.engine.traced import set_traced

        set_traced(model)
    if compiled:
        torch._dynamo.reset()  # rank processes outlive tests
        model = torch.compile(model, backend="aot_eager", fullgraph=True)  # type: ignore[assignment]
    dp_rank, dp_size = 0, 1  # over the data-parallel dims, in mesh order (as the input)
    for name in names:
        if name in (*dims.replicate_names, *dims.shard_names):
            dp_rank = dp_rank * mesh.size(names.index(name)) + mesh.get_local_rank(name)
            dp_size *= mesh.size(names.index(name))

    def before_micro(step: int, micro: int) -> None:
        model.set_requires_gradient_sync(micro == 1)  # type: ignore[operator]

    result = train_side_by_side(
        model,
        ref,
        make_batch,
        dp_rank=dp_rank,
        dp_size=dp_size,
        num_micro=2 if knob else 1,
        before_micro=before_micro if knob else None,
        tol=TP_TOL if tp else FP32,
    )
    return result.losses


@pytest.mark.parametrize(
    ("layout", "knob"),
    [("fsdp", None), ("fsdp_tp", None), ("hsdp", None), ("fsdp_tp", "no_sync_mp")],
)
@pytest.mark.parametrize("impl", ["fsdp2", "torch"])
def test_partial_gradients_parity(layout: str, knob: str | None, impl: str) -> None:
    world = torch.Size(LAYOUTS[layout][0]).numel()
    results = run_on_ranks(world, _train, layout, impl, knob, timeout=120)
    assert all(losses == results[0] for losses in results)


@pytest.mark.parametrize(
    ("layout", "compiled"), [("fsdp_tp", False), ("hsdp", False), ("fsdp_tp", True)]
)
def test_partial_gradients_traced_parity(layout: str, compiled: bool) -> None:
    """Traced mode: the reduce-scatter is autograd's, behind ``DTensor.from_local``, and
    compiled (where a gradient hook would silently not run) the same."""
    results = run_on_ranks(
        4, _train, layout, "fsdp2", None, traced=True, compiled=compiled, timeout=300
    )
    assert all(losses == results[0] for losses in results)
