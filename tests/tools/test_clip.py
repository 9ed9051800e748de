"""``fsdp2.clip_grad_norm_``: the unsharded model's total norm and clipped gradients, for
gradients on any mix of meshes, in one all-reduce.

Each case trains one step of the same small network, sharded one way, beside an unsharded copy
on the same global batch (`_Net`: FSDP, HSDP, FSDP x TP and FSDP x EP layers, and a plain head),
then clips both and compares the returned norm and every clipped gradient, and counts the
collectives. torch's own ``clip_grad_norm_`` runs on the same sharded gradients beside it, and
each test pins what it does (see the README, "Gradient clipping across meshes").

Tolerances, from the arithmetic (tests/tolerance.py):

- Gradients: the sharded ones are reduced over ranks where the reference sums in one matmul,
  compared at `FP32` (`TP_TOL` where row-wise tensor parallelism adds tp partial sums: an atol
  of 2 fp32 roundings of the sum, as tests/engine/test_tensor_parallel.py).
- The norm against torch's norm of the *same* gradients gathered whole: both sum the same
  positive squares (no cancellation: sum |x| = |sum x|) in another order, per-shard sums then a
  W-term all-reduce against one reduction per tensor: ~(sqrt(n) + W) u relative for n <= ~10^3
  elements, about 3e-6 at u = 6e-8, halved by the square root: `FP32_RTOL` (1e-5) with room.
- The norm against the reference model's: the gradients' own differences, at most
  ``atol + rtol |g|`` each, move the norm by at most ``||dg|| <= sqrt(n) atol + rtol ||g||``
  (triangle inequality), plus the summation above: `NORM_TOL`.
- Clipped gradients ``g * c`` with ``c = max_norm / (norm + 1e-6)``: c carries the norm's
  relative error, the gradient its own: rtol adds up to 2 `FP32_RTOL` (`CLIPPED_TOL`).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from tests.errors import error_text
from tests.harness import run_on_ranks
from tests.parity import close, compare_grads, full
from tests.tolerance import FP32, FP32_RTOL, Tolerance

pytestmark = pytest.mark.usefixtures("fsdp2_only")

WORLD = 4
IN, HIDDEN, WIDTH, NUM_EXPERTS = 8, 5, 8, 4  # HIDDEN = 5 rows: uneven shards, one empty at W=4
LOCAL_BATCH = 2
TP_TOL = Tolerance(rtol=FP32_RTOL, atol=2e-6)
NUM_GRAD_ELEMENTS = 40 + 5 + 40 + 8 + 2 * 72 + 72 + NUM_EXPERTS * 64 + 9  # _Net's parameters
NORM_TOL = Tolerance(rtol=FP32_RTOL, atol=math.sqrt(NUM_GRAD_ELEMENTS) * 2e-6)
CLIPPED_TOL = Tolerance(rtol=2 * FP32_RTOL, atol=2e-6)


class _Net(nn.Module):
    """x -> a (FSDP) -> b (HSDP) -> tp (FSDP x TP) -> moe (FSDP x EP) -> head (plain)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.a = nn.Linear(IN, HIDDEN)
        self.b = nn.Linear(HIDDEN, WIDTH)
        self.tp = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))
        self.dense = nn.Linear(WIDTH, WIDTH)
        self.experts = nn.Parameter(torch.randn(NUM_EXPERTS, WIDTH, WIDTH) / WIDTH)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import Shard

        h = torch.tanh(self.dense(torch.tanh(self.tp(torch.tanh(self.b(torch.tanh(self.a(x))))))))
        experts = self.experts
        if isinstance(experts, DTensor):  # expert parallel: DTensor exchanges the ep tokens
            mesh = experts.device_mesh
            y = torch.einsum("bd,edf->bf", DTensor.from_local(h, mesh, [Shard(0)]), experts)
            y = y.redistribute(placements=[Shard(0)]).to_local()
        else:
            y = torch.einsum("bd,edf->bf", h, experts)
        return self.head(torch.tanh(y)).pow(2).mean()


@dataclass(frozen=True)
class Layout:
    """How `_shard` lays out `_Net`: ``base`` is the mesh of ``a`` and the root (dense, head);
    ``b_hsdp`` puts ``b`` on a 2x2 (rep, shard) mesh; ``tp`` makes ``tp`` column- then row-wise
    on ``(dp, tp)``; ``ep`` splits the experts over ``ep`` and shards them over ``efsdp``;
    ``plain_head``: the head stays unsharded (plain tensors, averaged by hand as DDP would)."""

    base: str = "world"  # or "hsdp", or "dp": the dp axis of (dp, tp), a mesh of half the ranks
    b_hsdp: bool = False
    tp: bool = False
    ep: bool = False
    plain_head: bool = False


FSDP = Layout()
HSDP = Layout(base="hsdp", b_hsdp=True)
FSDP_TP = Layout(base="dp", tp=True)  # the layers not split over tp: on dp alone
FSDP_EP = Layout(ep=True)
MIXED = Layout(b_hsdp=True, tp=True, ep=True, plain_head=True)


def _shard(model: _Net, layout: Layout) -> tuple[int, int]:
    """Shard ``model``; returns (this rank's block of the global batch, number of blocks)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from fsdp2 import fully_shard

    rank, world_size = dist.get_rank(), dist.get_world_size()
    world = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    hsdp = dp_tp = None
    if layout.base == "hsdp" or layout.b_hsdp:
        hsdp = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("rep", "shard"))
    if layout.base == "dp" or layout.tp:
        dp_tp = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp", "tp"))
    base = {"world": world, "hsdp": hsdp, "dp": dp_tp["dp"] if dp_tp else None}[layout.base]
    fully_shard(model.a, mesh=base)
    fully_shard(model.b, mesh=hsdp if layout.b_hsdp else base)
    block = (rank, world_size)
    if dp_tp is not None:
        coordinate = dp_tp.get_coordinate()
        assert coordinate is not None
        block = (coordinate[0], 2)  # tp peers feed the same rows
    if layout.tp:
        parallelize_module(model.tp, dp_tp["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model.tp, mesh=dp_tp["dp"])
    else:
        fully_shard(model.tp, mesh=base)
    place = None
    if layout.ep:
        sparse = world._unflatten(0, (2, world_size // 2), ("efsdp", "ep"))
        model.experts = nn.Parameter(
            distribute_tensor(model.experts.detach(), sparse["ep"], [Shard(0)])
        )
        on_efsdp = ShardPlacementResult(Shard(0), FSDPMeshInfo(sparse["efsdp"], shard_mesh_dim=0))

        def place(p: nn.Parameter) -> Any:
            return on_efsdp if p is model.experts else None

    ignored = set(model.head.parameters()) if layout.plain_head else None
    fully_shard(model, mesh=base, shard_placement_fn=place, ignored_params=ignored)
    if layout.ep:
        # The experts reduce over efsdp only, their ep peers' tokens already summed into their
        # gradient: dividing by the world size makes both kinds the global batch's mean.
        model.set_gradient_divide_factor(float(world_size))  # type: ignore[operator]
    return block


def _train_step(layout: Layout, seed: int = 0) -> tuple[nn.Module, nn.Module, Layout]:
    """One backward of the sharded model on this rank's rows and of the reference on all."""
    reference = _Net(seed)
    model = copy.deepcopy(reference)
    block, num_blocks = _shard(model, layout)
    x = torch.randn(num_blocks * LOCAL_BATCH, IN, generator=torch.Generator().manual_seed(seed))
    reference(x).backward()
    model(x[block * LOCAL_BATCH : (block + 1) * LOCAL_BATCH]).backward()
    if layout.plain_head:  # plain parameters: averaged by hand, as DDP does
        for p in model.head.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
    compare_grads(model, reference, "before clipping", TP_TOL if layout.tp else FP32)
    return model, reference, layout


def _torch_on_the_same_gradients(model: nn.Module, ours: float, norm_type: float | str) -> str:
    """What ``torch.nn.utils.clip_grad_norm_`` does on the sharded gradients: raises, or returns
    fsdp2's norm (``ours``) or another. A max_norm it never reaches: gradients times 1."""
    try:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9, norm_type)
    except Exception as e:  # which type is what the test pins
        return f"raises {type(e).__name__}: {str(e).splitlines()[0][:80]}"
    value = full(norm).item()
    if abs(value - ours) <= NORM_TOL.rtol * abs(ours):
        return "the same norm"
    return f"another norm: {value / ours:.4f} x fsdp2's"


def _clip(layout: Layout, norm_type: float | str = 2.0) -> dict[str, Any]:
    import fsdp2
    from fsdp2.engine.collectives import record_collectives

    model, reference, _ = _train_step(layout)
    whole = [full(p.grad).clone() for p in model.parameters()]  # the same gradients, whole
    max_norm = (
        0.5
        * torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()], norm_type).item()
    )
    with record_collectives() as records:
        norm = fsdp2.clip_grad_norm_(model.parameters(), max_norm, norm_type)
    assert type(norm) is torch.Tensor and norm.dtype == torch.float32, (type(norm), norm.dtype)
    close(
        "norm, against torch's on the same gradients",
        norm,
        torch.nn.utils.get_total_norm(whole, norm_type),
        FP32,
    )
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm, norm_type)
    close("norm, against the unsharded model's", norm, ref_norm, NORM_TOL)
    compare_grads(model, reference, "clipped", CLIPPED_TOL)
    # The norm again, of the clipped gradients: max_norm, to the clip's rounding.
    after = fsdp2.clip_grad_norm_(model.parameters(), 1e9, norm_type)
    close("norm after clipping", after, torch.tensor(max_norm), CLIPPED_TOL)
    return {
        "norm": norm.item(),
        "collectives": [(r.kind, r.label, r.world_size) for r in records],
        "torch": _torch_on_the_same_gradients(model, after.item(), norm_type),
    }


def _same_on_every_rank(results: list[dict[str, Any]]) -> dict[str, Any]:
    # Bitwise: every rank reads the same all-reduced bits and applies the same ops to them.
    assert all(r == results[0] for r in results), results
    return results[0]


ONE_ALL_REDUCE = [("all_reduce", "clip_grad_norm_", WORLD)]


def test_fsdp_uneven_shards() -> None:
    """5 rows over 2 ranks (3 and 2), one 1-D mesh: one all-reduce; torch's call works too."""
    result = _same_on_every_rank(run_on_ranks(2, _clip, FSDP))
    assert result["collectives"] == [("all_reduce", "clip_grad_norm_", 2)], result
    assert result["torch"] == "the same norm", result["torch"]


# What torch 2.13's own clip_grad_norm_ does on the same gradients (also 2.15: see the README).
ACROSS_MESHES = "raises RuntimeError: All operands in aten.stack.default must have the same mesh"
WITH_PLAIN = "raises RuntimeError: aten._foreach_norm.Scalar got mixed torch.Tensor and DTensor"


@pytest.mark.parametrize(
    ("layout", "torch_does"),
    [
        (HSDP, "the same norm"),
        (FSDP_TP, ACROSS_MESHES),
        (FSDP_EP, ACROSS_MESHES),
        (MIXED, WITH_PLAIN),
    ],
    ids=["hsdp", "fsdp_tp", "fsdp_ep", "mixed"],
)
def test_one_all_reduce_for_any_mix_of_meshes(layout: Layout, torch_does: str) -> None:
    """HSDP on one 2-D mesh (Replicate counted once); FSDP x TP with the layers not split over
    tp on dp alone (a mesh of half the ranks: the copy holding rank 0 counts); experts on
    (efsdp, ep) beside dense layers on the world; all of them and a plain head in one model.
    torch's call is right on one mesh, and raises across meshes."""
    result = _same_on_every_rank(run_on_ranks(WORLD, _clip, layout))
    assert result["collectives"] == ONE_ALL_REDUCE, result
    assert result["torch"].startswith(torch_does), result["torch"]


def test_inf_norm_over_mixed_meshes() -> None:
    result = _same_on_every_rank(run_on_ranks(WORLD, _clip, MIXED, "inf"))
    assert result["collectives"] == ONE_ALL_REDUCE, result
    assert result["torch"].startswith(WITH_PLAIN), result["torch"]


# ---------------------------------------------------------------------------------------------
# Non-finite gradients
# ---------------------------------------------------------------------------------------------

NONFINITE_ERROR = (
    "RuntimeError: clip_grad_norm_: the total norm of order {p} of the gradients is {total}, so "
    "it cannot be clipped (the same on every rank). Find the non-finite gradient, or pass "
    "error_if_nonfinite=False to scale the gradients by it anyway"
)


def _nonfinite(bad: float, norm_type: float | str, error_if_nonfinite: bool) -> str:
    """``bad`` in one element of rank 1's shard only (row 3 of a.weight: rows 3-4 are rank
    1's), and in the reference's same element."""
    import fsdp2

    model, reference, _ = _train_step(FSDP)
    if dist.get_rank() == 1:
        model.a.weight.grad.to_local()[0, 0] = bad
    reference.a.weight.grad[3, 0] = bad
    if error_if_nonfinite:
        return error_text(lambda: fsdp2.clip_grad_norm_(model.parameters(), 0.01, norm_type, True))
    norm = fsdp2.clip_grad_norm_(model.parameters(), 0.01, norm_type)
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.01, norm_type)
    torch.testing.assert_close(norm, ref_norm, equal_nan=True)
    # torch's semantics: scaled by 0.01 / inf = 0 (the inf element: inf * 0 = NaN), or by NaN.
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(full(p.grad), q.grad, equal_nan=True, msg=name)
    return str(norm.item())


def _nonfinite_cases() -> list[str]:
    cases = [(math.inf, 2.0, True), (math.inf, 2.0, False), (math.nan, "inf", False)]
    return [_nonfinite(*case) for case in cases]


def test_non_finite_gradient_on_one_rank() -> None:
    """Every rank raises the same error, or scales by the same non-finite norm as torch; a NaN
    on one rank reaches every rank's inf norm (a MAX all-reduce may drop a NaN: fsdp2 sends a
    flag beside the max)."""
    results = _same_on_every_rank(run_on_ranks(2, _nonfinite_cases))
    assert results == [NONFINITE_ERROR.format(p=2.0, total=math.inf), "inf", "nan"], results


# ---------------------------------------------------------------------------------------------
# Pipeline stages
# ---------------------------------------------------------------------------------------------


def _stage_references() -> tuple[list[_Net], list[torch.Tensor]]:
    """Two stages' networks (different parameters), each with its own batch, backward done."""
    references = [_Net(seed) for seed in (1, 2)]
    batches = [
        torch.randn(2 * LOCAL_BATCH, IN, generator=torch.Generator().manual_seed(seed))
        for seed in (1, 2)
    ]
    return references, batches


def _pipeline() -> list[list[tuple[str, int]]]:
    """A (pp 2, dp 2) mesh: stage s's ranks hold network s, sharded over dp (folded into one
    world all-reduce), then plain and averaged over dp by hand (one all-reduce over pp)."""
    from torch.distributed.device_mesh import init_device_mesh

    import fsdp2
    from fsdp2 import fully_shard
    from fsdp2.engine.collectives import record_collectives

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    coordinate = mesh.get_coordinate()
    assert coordinate is not None
    stage, row = coordinate
    counts = []
    for sharded in (True, False):
        references, batches = _stage_references()
        model = copy.deepcopy(references[stage])
        if sharded:
            for part in (model.a, model.b, model.tp):
                fully_shard(part, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
        for reference, x in zip(references, batches, strict=True):
            reference(x).backward()
        model(batches[stage][row * LOCAL_BATCH : (row + 1) * LOCAL_BATCH]).backward()
        if not sharded:  # plain copies in each stage: averaged over dp by hand, as DDP does
            for p in model.parameters():
                dist.all_reduce(p.grad, group=mesh["dp"].get_group())
                p.grad /= 2
        every = [p for reference in references for p in reference.parameters()]
        max_norm = 0.5 * torch.nn.utils.get_total_norm([p.grad for p in every]).item()
        with record_collectives() as records:
            norm = fsdp2.clip_grad_norm_(model.parameters(), max_norm, pp_mesh=mesh["pp"])
        close(
            "norm over both stages", norm, torch.nn.utils.clip_grad_norm_(every, max_norm), NORM_TOL
        )
        compare_grads(model, references[stage], "clipped", CLIPPED_TOL)
        counts.append([(r.kind, r.world_size) for r in records])
    return counts


def test_pipeline_stages_add_up() -> None:
    counts = _same_on_every_rank(run_on_ranks(WORLD, _pipeline))
    # dp (2 ranks) x pp (2 stages) is the world: one all-reduce. Plain stages: over pp only.
    assert counts == [[("all_reduce", WORLD)], [("all_reduce", 2)]], counts


def test_norm_type_must_be_positive_or_inf() -> None:
    """Raised before any collective, from the argument alone: on every rank alike."""
    import fsdp2

    assert error_text(lambda: fsdp2.clip_grad_norm_(torch.ones(2), 1.0, 0)) == (
        "ValueError: clip_grad_norm_: norm_type must be > 0 or 'inf', got 0: a norm of order "
        "<= 0 is no sum over the gradients' shards. Pass 2.0 (the default) or 'inf'"
    )
