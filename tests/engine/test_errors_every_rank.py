"""A mistake made on one rank only raises the same clear error on every rank (no hang).

Each case makes the bad input happen on rank 1 only (a different shape, dtype, frozen weight,
parameter order, mixed precision policy, a parameter on another device, one left on meta) and runs ``fully_shard`` and one training
step on both ranks; every rank must come back with the error. Before fsdp2 exchanged these facts
(see [Note: errors on every rank] in fsdp2/engine/agreement.py), rank 1 raised alone, or nobody raised
and the first collective hung or mixed up bytes: the short timeout turns such a hang into a
failure (and the harness then discards the pool, whose ranks may be stuck in a collective).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import expecttest
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from tests.errors import NO_ERROR, error_text
from tests.harness import IMPL_UNDER_TEST, per_group_collectives, run_on_ranks
from tests.test_api import ClaimsDevice

TIMEOUT_S = 30.0  # a hang shows as a TimeoutError well before the harness's default


def _model(rank: int, case: str) -> nn.Sequential:
    torch.manual_seed(0)
    width = 5 if case == "shape" and rank == 1 else 3
    model = nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 2))
    if rank == 1:
        if case == "dtype":
            model[2].to(torch.float64)
        elif case == "frozen":
            model[0].weight.requires_grad_(False)
        elif case == "order":  # the same parameters, registered in another order
            layer = model[2]
            layer._parameters = dict(reversed(layer._parameters.items()))
        elif case == "device":
            weight = ClaimsDevice(model[2].weight.shape, torch.device("cuda", 0))
            model[2].weight = nn.Parameter(weight)
    return model


def _shard_and_step(case: str) -> str:
    """``fully_shard`` the model (its first layer, then the root) and run one step."""
    from fsdp2 import MixedPrecisionPolicy, fully_shard

    model = _model(dist.get_rank(), case)
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    policy = bf16 if case == "policy" and dist.get_rank() == 1 else MixedPrecisionPolicy()

    def step() -> None:
        fully_shard(model[0], mp_policy=policy)
        fully_shard(model)
        model(torch.randn(8, 4, dtype=model[0].weight.dtype)).sum().backward()

    return error_text(step)


def _meta_then_step(case: str) -> str:
    """Build on meta, ``fully_shard``, then materialise (``to_empty``) and run one step; rank 1
    forgets ``to_empty`` ("meta") or freezes a weight after ``fully_shard`` ("frozen")."""
    from fsdp2 import fully_shard

    rank = dist.get_rank()
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    fully_shard(model[0])
    fully_shard(model)
    if not (case == "meta" and rank == 1):
        model.to_empty(device="cpu")
    if case == "frozen" and rank == 1:
        model[2].bias.requires_grad_(False)
    return error_text(lambda: model(torch.randn(8, 4)).sum().backward())


def _every_rank(fn: Callable[[str], str], case: str) -> str:
    results = run_on_ranks(2, fn, case, timeout=TIMEOUT_S)
    assert results[0] != NO_ERROR, f"rank 0 did not raise; rank 1: {results[1]}"
    assert results[0] == results[1], results
    text: str = results[0]
    return text


@pytest.mark.skipif(IMPL_UNDER_TEST != "fsdp2", reason="pins fsdp2's messages")
class TestErrorsOnEveryRank(expecttest.TestCase):
    def test_shapes_differ_at_fully_shard(self) -> None:
        self.assertExpectedInline(
            _every_rank(_shard_and_step, "shape"),
            """\
ValueError: fully_shard(Linear): the ranks of the mesh differ in what they shard, so its collectives would not match (a hang, or mixed-up values):
  weight: shape (3, 4), float32, requires_grad on rank 0; shape (5, 4), float32, requires_grad on rank 1
  bias: shape (3,), float32, requires_grad on rank 0; shape (5,), float32, requires_grad on rank 1
Every rank must build the same model (shapes, dtypes, frozen parameters) and call fully_shard with the same arguments""",
        )

    def test_dtypes_differ_at_fully_shard(self) -> None:
        self.assertExpectedInline(
            _every_rank(_shard_and_step, "dtype"),
            """\
ValueError: fully_shard(Sequential): the ranks of the mesh differ in what they shard, so its collectives would not match (a hang, or mixed-up values):
  2.weight: shape (2, 3), float32, requires_grad on rank 0; shape (2, 3), float64, requires_grad on rank 1
  2.bias: shape (2,), float32, requires_grad on rank 0; shape (2,), float64, requires_grad on rank 1
Every rank must build the same model (shapes, dtypes, frozen parameters) and call fully_shard with the same arguments""",
        )

    def test_requires_grad_differs_at_fully_shard(self) -> None:
        self.assertExpectedInline(
            _every_rank(_shard_and_step, "frozen"),
            """\
ValueError: fully_shard(Linear): the ranks of the mesh differ in what they shard, so its collectives would not match (a hang, or mixed-up values):
  weight: shape (3, 4), float32, requires_grad on rank 0; shape (3, 4), float32, frozen on rank 1
Every rank must build the same model (shapes, dtypes, frozen parameters) and call fully_shard with the same arguments""",
        )

    def test_parameter_order_differs_at_fully_shard(self) -> None:
        # Not even a hang before: the gather silently mixed weight and bias chunks.
        self.assertExpectedInline(
            _every_rank(_shard_and_step, "order"),
            """\
ValueError: fully_shard(Sequential): the ranks of the mesh differ in what they shard, so its collectives would not match (a hang, or mixed-up values):
  order: 2.weight, 2.bias on rank 0; 2.bias, 2.weight on rank 1
Every rank must build the same model (shapes, dtypes, frozen parameters) and call fully_shard with the same arguments""",
        )

    def test_arguments_differ_at_fully_shard(self) -> None:
        self.assertExpectedInline(
            _every_rank(_shard_and_step, "policy"),
            """\
ValueError: fully_shard(Linear): the ranks of the mesh differ in what they shard, so its collectives would not match (a hang, or mixed-up values):
  arguments of fully_shard: DeviceMesh((2,), 'cpu', stride=(1,)), reshard_after_forward=None, MixedPrecisionPolicy(param_dtype=None, reduce_dtype=None, output_dtype=None, cast_forward_inputs=True), OffloadPolicy() on rank 0; DeviceMesh((2,), 'cpu', stride=(1,)), reshard_after_forward=None, MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=None, output_dtype=None, cast_forward_inputs=True), OffloadPolicy() on rank 1
Every rank must build the same model (shapes, dtypes, frozen parameters) and call fully_shard with the same arguments""",
        )

    def test_device_differs_at_fully_shard(self) -> None:
        self.assertExpectedInline(
            _every_rank(_shard_and_step, "device"),
            """ValueError: 2.weight of Sequential is on cuda:0 on rank 1, but the mesh's device is cpu. Move the module to cpu (or keep it on CPU: fully_shard moves it) before calling fully_shard, or pass a mesh on the parameters' device. Only on rank 1: did every rank call torch.accelerator.set_device_index(local_rank) before building its model?""",
        )

    def test_meta_left_on_one_rank_at_lazy_init(self) -> None:
        self.assertExpectedInline(
            _every_rank(_meta_then_step, "meta"),
            """\
RuntimeError: fsdp2: parameters are still on the meta device at the first forward on some ranks:
  rank 1: fsdp2 module '<root>' (2.weight, 2.bias)
  rank 1: fsdp2 module '0' (weight, bias)
Materialise them on every rank before forward: module.to_empty(device=...), then module.reset_parameters() (or your own init, or load a checkpoint)""",
        )

    def test_requires_grad_changed_on_one_rank_before_lazy_init(self) -> None:
        self.assertExpectedInline(
            _every_rank(_meta_then_step, "frozen"),
            """\
RuntimeError: fsdp2: at the first forward, the ranks differ in their parameters' dtypes or requires_grad (changed on some ranks after fully_shard):
  2.bias: float32, requires_grad on rank 0; float32, frozen on rank 1
Change them alike on every rank""",
        )


@per_group_collectives  # counts one gather per group
def _meta_on_rank1_only() -> dict[str, object]:
    """accelerate's ``cpu_ram_efficient_loading``: real weights on rank 0, meta elsewhere at
    ``fully_shard``; the others ``to_empty`` and receive rank 0's values. Legitimate: no error,
    and one exchange at lazy init (none per step)."""
    from fsdp2 import fully_shard
    from fsdp2.engine.collectives import record_collectives

    rank = dist.get_rank()
    torch.manual_seed(0)
    with torch.device("cpu" if rank == 0 else "meta"):
        model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    with record_collectives() as at_init:
        fully_shard(model[0])
        fully_shard(model)
    if rank != 0:
        model.to_empty(device="cpu")
    kinds = []
    for _ in range(2):
        with record_collectives() as records:
            model(torch.randn(8, 4)).sum().backward()
        kinds.append(dict(Counter(r.kind for r in records)))
    return {"init": dict(Counter(r.kind for r in at_init)), "steps": kinds}


@per_group_collectives  # counts one gather per group
def _plain_steps() -> list[dict[str, int]]:
    """A model that never saw meta: no exchange in any step, the first included."""
    from fsdp2 import fully_shard
    from fsdp2.engine.collectives import record_collectives

    model = _model(dist.get_rank(), "same")
    fully_shard(model[0])
    fully_shard(model)
    kinds = []
    for _ in range(2):
        with record_collectives() as records:
            model(torch.randn(8, 4)).sum().backward()
        kinds.append(dict(Counter(r.kind for r in records)))
    return kinds


def test_meta_on_some_ranks_at_fully_shard_is_fine(fsdp2_only: None) -> None:
    for result in run_on_ranks(2, _meta_on_rank1_only, timeout=TIMEOUT_S):
        assert result == {
            "init": {"agree": 2},  # one per fully_shard call
            "steps": [
                {"agree": 1, "all_gather": 3, "reduce_scatter": 2},  # lazy init: meta was seen
                {"all_gather": 3, "reduce_scatter": 2},
            ],
        }, result


def test_no_exchange_in_steps_without_meta(fsdp2_only: None) -> None:
    for steps in run_on_ranks(2, _plain_steps, timeout=TIMEOUT_S):
        assert steps == [{"all_gather": 3, "reduce_scatter": 2}] * 2, steps


def _hsdp_one_rank_differs() -> str:
    """2 x 2 HSDP: rank 3 builds another shape. Its shard group (2, 3) sees the difference; ranks
    0 and 1 learn of it through their replicate groups."""
    from fsdp2 import fully_shard

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = nn.Linear(4, 5 if rank == 3 else 3)
    return error_text(lambda: fully_shard(model, mesh=mesh))


@pytest.mark.skipif(IMPL_UNDER_TEST != "fsdp2", reason="pins fsdp2's messages")
class TestHSDP(expecttest.TestCase):
    def test_one_rank_differs_every_rank_raises(self) -> None:
        results = run_on_ranks(4, _hsdp_one_rank_differs, timeout=TIMEOUT_S)
        assert NO_ERROR not in results, results
        # Ranks 2 and 3 (their shard group) and 1 (replicate group with 3) see the difference;
        # rank 0's own groups agree, and it hears of it from rank 2.
        assert results[1].replace("rank 1", "rank 2") == results[2] == results[3], results
        self.assertExpectedInline(
            results[3],
            """\
ValueError: fully_shard(Linear): the ranks of the mesh differ in what they shard, so its collectives would not match (a hang, or mixed-up values):
  weight: shape (3, 4), float32, requires_grad on rank 2; shape (5, 4), float32, requires_grad on rank 3
  bias: shape (3,), float32, requires_grad on rank 2; shape (5,), float32, requires_grad on rank 3
Every rank must build the same model (shapes, dtypes, frozen parameters) and call fully_shard with the same arguments""",
        )
        self.assertExpectedInline(
            results[0],
            """ValueError: fully_shard(Linear): ranks of the mesh differ in what they shard; this rank's own groups agree, and rank 2's error says what differs. Every rank must build the same model and call fully_shard with the same arguments""",
        )
