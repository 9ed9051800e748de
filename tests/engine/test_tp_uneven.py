"""FSDP x TP on the same dim with uneven pieces: tensor parallelism leaves pieces of different
sizes (27 rows over tp=2: 14 and 13) and fsdp2 splits each again over dp=2 (7+7, 7+6).

The sharded parameter is ``(_StridedShard(d, sf=2), Shard(d))`` on the (dp, tp) mesh, as torch's
``fully_shard`` makes it. Training matches the single-process reference, and ``full_tensor()``,
the state dict and a DCP save/load round trip hold the true global tensors.
"""

from __future__ import annotations

import copy
from pathlib import Path

import expecttest
import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

from fsdp2.engine.mesh import MeshInfo
from fsdp2.engine.param import FSDPParam
from tests.errors import raised
from tests.harness import fsdp_api, init_local_process_group, run_on_ranks
from tests.models import Batch
from tests.parity import full, train_side_by_side
from tests.tolerance import Tolerance

IN, HIDDEN = 9, 27  # HIDDEN over tp=2: pieces of 14 and 13 rows, neither divisible by dp=2
# Row-wise layers add partial sums over the tp ranks: a different order than one matmul.
TP_TOL = Tolerance(rtol=1e-5, atol=2e-6, param_atol=2e-5)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(IN, HIDDEN), nn.Linear(HIDDEN, IN)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.down(F.relu(self.up(x))), y)


def make_batch(gen: torch.Generator, batch_size: int) -> Batch:
    return torch.randn(batch_size, IN, generator=gen), torch.randn(batch_size, IN, generator=gen)


def sharded(impl: str, shard_dim: int) -> tuple[MLP, MLP]:
    """The model tensor-parallel then sharded by ``impl``, and its unsharded twin."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    ref = MLP()
    model = copy.deepcopy(ref)
    # up's output stays a DTensor: a local tensor would be rewrapped assuming even pieces.
    plan = {"up": ColwiseParallel(use_local_output=False), "down": RowwiseParallel()}
    parallelize_module(model, mesh["tp"], plan)
    # shard_dim=1: down.weight (9, 27) is split on dim 1 by tp, and again by fsdp.
    place = (lambda p: Shard(shard_dim) if p.ndim > shard_dim else None) if shard_dim else None
    fsdp_api(impl).fully_shard(model, mesh=mesh["dp"], shard_placement_fn=place)
    return model, ref


def _uneven(shard_dim: int, ckpt: str) -> list[float]:
    model, ref = sharded("fsdp2", shard_dim)
    strided = "up.weight" if shard_dim == 0 else "down.weight"
    expected = (_StridedShard(shard_dim, split_factor=2), Shard(shard_dim))
    assert dict(model.named_parameters())[strided].placements == expected
    if shard_dim == 0:  # torch's fully_shard refuses uneven splits of other dims
        theirs, _ = sharded("torch", shard_dim)
        for (name, p), q in zip(model.named_parameters(), theirs.parameters(), strict=True):
            assert p.placements == q.placements, (name, p.placements, q.placements)
            torch.testing.assert_close(p.to_local(), q.to_local(), rtol=0, atol=0, msg=name)
    for (name, value), ref_value in zip(
        model.state_dict().items(), ref.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(full(value), ref_value, rtol=0, atol=0, msg=name)
    dp_rank = dict(model.named_parameters())["up.weight"].device_mesh.get_local_rank("dp")
    result = train_side_by_side(model, ref, make_batch, dp_rank=dp_rank, dp_size=2, tol=TP_TOL)
    # A checkpoint of the trained shards loads into a fresh model as the same global tensors.
    dcp.save(model.state_dict(), checkpoint_id=ckpt)
    fresh, _ = sharded("fsdp2", shard_dim)
    state = fresh.state_dict()
    dcp.load(state, checkpoint_id=ckpt)
    fresh.load_state_dict(state)
    for (name, p), q in zip(fresh.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.full_tensor(), q.detach(), rtol=0, atol=TP_TOL.param_atol)
        torch.testing.assert_close(
            p.to_local(), dict(model.named_parameters())[name].to_local(), rtol=0, atol=0
        )
    return result.losses


@pytest.mark.parametrize("shard_dim", [0, 1])
def test_uneven_tp_pieces_split_again_parity(shard_dim: int, tmp_path: Path) -> None:
    results = run_on_ranks(4, _uneven, shard_dim, str(tmp_path / "ckpt"), timeout=120)
    assert all(losses == results[0] for losses in results)


def chunks(t: torch.Tensor, n: int) -> list[list[int]]:
    """``torch.chunk`` into exactly ``n`` pieces (empty ones last), as DTensor's ``Shard``."""
    size = -(-t.numel() // n)
    return [t[i * size : (i + 1) * size].tolist() for i in range(n)]


def test_uneven_nesting_matches_dtensor() -> None:
    """fsdp2's rows (each tp piece cut in ceil(rows / dp) chunks) against DTensor's own split
    for (_StridedShard, Shard): where they differ, fully_shard must refuse on every rank."""
    from fsdp2.engine.chunk import dp_rows_mismatch

    mismatches = 0
    for rows in range(1, 40):
        for tp in (2, 3, 4):
            for dp in (2, 3, 4):
                full_rows = torch.arange(rows)
                ours = [
                    [chunks(torch.tensor(p), dp)[i] for p in chunks(full_rows, tp)]
                    for i in range(dp)
                ]
                strided = _StridedShard(0, split_factor=tp)
                per_dp, _ = strided._split_tensor(full_rows, dp, with_padding=False)
                theirs = [chunks(per_dp[i], tp) for i in range(dp)]
                found = dp_rows_mismatch(rows, 0, (dp, tp), (strided, Shard(0)), 0)
                assert found == (ours != theirs), (rows, tp, dp)
                mismatches += found
    assert mismatches > 0  # the check has cases to catch (e.g. 7 rows, tp=2, dp=3)


class TestUnevenNestingError(expecttest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        init_local_process_group()

    def test_refused_on_a_rank_whose_own_piece_splits_evenly(self) -> None:
        """7 rows over tp=2 (pieces of 4 and 3), then dp=3: DTensor cannot describe it. This
        rank sits at (dp 0, tp 1) of a 6-rank (dp, tp) mesh (built without process groups):
        its own piece of 3 rows splits evenly, yet it must refuse like the others, or they
        would wait for it in the next collective."""
        ranks = torch.tensor([[1, 0], [3, 2], [5, 4]])
        mesh = DeviceMesh("cpu", ranks, mesh_dim_names=("dp", "tp"), _init_backend=False)
        info = MeshInfo(mesh, 0, None, None, 3, 0, None, 1)
        model = nn.Linear(3, 7)
        piece = DTensor.from_local(
            torch.zeros(3, 3),
            mesh,
            [Replicate(), Shard(0)],
            run_check=False,
            shape=(7, 3),
            stride=(3, 1),
        )
        model.weight = nn.Parameter(piece)
        param = FSDPParam(model.weight, [(model, "weight")], "weight", "Linear")
        self.assertExpectedInline(
            raised(lambda: param.set_chunk(info)),
            """NotImplementedError: weight: tensor parallelism splits dim 0 (size 7) into pieces of [4, 3] rows and fsdp2 splits each again over 3 data-parallel ranks; DTensor's (_StridedShard(dim=0, sf=2), Shard(dim=0)) would place these uneven rows elsewhere. Make the size divisible by 3 x the tensor-parallel degree, or shard another dim with shard_placement_fn""",
        )
