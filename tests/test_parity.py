"""Parity of sharded training with a single-process reference (see `tests/parity/run.py`)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.harness import IMPL_UNDER_TEST, run_on_ranks
from tests.parity import ParityConfig, run_parity

# Models torch's fully_shard also supports; the odd-shapes model with a 0-d parameter is fsdp2's.
MODELS = ["mlp", "gpt", "odd_shapes", "frozen", "unused", "buffers", "no_own_params"]

cross_check = pytest.mark.skipif(
    IMPL_UNDER_TEST == "torch", reason="the suite already runs on torch's implementation"
)


def check_parity(world_size: int, cfg: ParityConfig) -> list[dict[str, Any]]:
    results = run_on_ranks(world_size, run_parity, cfg)
    # Every rank regenerated every rank's batches and trained its own reference: they must agree.
    for rank, result in enumerate(results[1:], start=1):
        assert result["ref_losses"] == results[0]["ref_losses"], f"rank {rank} reference differs"
        assert result["losses"] == results[0]["losses"], f"rank {rank} global loss differs"
    assert len(results[0]["losses"]) == cfg.num_steps
    assert results[0]["num_grads_compared"] > 0
    return results


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("model", MODELS)
def test_parity(model: str, world_size: int) -> None:
    check_parity(world_size, ParityConfig(model=model, impl=IMPL_UNDER_TEST))


def test_parity_world_size_1() -> None:
    check_parity(1, ParityConfig(model="gpt", impl=IMPL_UNDER_TEST))


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_parity_scalar_param(world_size: int, fsdp2_only: None) -> None:
    check_parity(world_size, ParityConfig(model="odd_shapes_scalar", impl="fsdp2"))


@pytest.mark.parametrize("reshard_after_forward", [True, False, None])
@pytest.mark.parametrize(("model", "world_size"), [("gpt", 2), ("odd_shapes", 4)])
def test_parity_reshard_after_forward(
    model: str, world_size: int, reshard_after_forward: bool | None
) -> None:
    cfg = ParityConfig(
        model=model, impl=IMPL_UNDER_TEST, reshard_after_forward=reshard_after_forward
    )
    check_parity(world_size, cfg)


@pytest.mark.parametrize("reshard_after_forward", [True, False])
@pytest.mark.parametrize("model", ["gpt", "unused"])
def test_parity_several_forwards_one_backward(model: str, reshard_after_forward: bool) -> None:
    cfg = ParityConfig(
        model=model,
        impl=IMPL_UNDER_TEST,
        num_microbatches=2,
        reshard_after_forward=reshard_after_forward,
    )
    check_parity(2, cfg)


@pytest.mark.parametrize("model", ["mlp", "frozen", "unused"])
def test_parity_zero_grad_keeps_grads(model: str) -> None:
    """``zero_grad(set_to_none=False)``: the sharded gradients are zeroed and accumulated into."""
    check_parity(2, ParityConfig(model=model, impl=IMPL_UNDER_TEST, set_to_none=False))


@pytest.mark.parametrize("reshard_after_forward", [True, False, None])
def test_parity_no_grad_forward_mid_training(reshard_after_forward: bool | None) -> None:
    cfg = ParityConfig(
        model="gpt",
        impl=IMPL_UNDER_TEST,
        eval_before_step=2,
        reshard_after_forward=reshard_after_forward,
    )
    check_parity(2, cfg)


@cross_check
@pytest.mark.parametrize(
    ("model", "world_size"), [("mlp", 2), ("gpt", 4), ("odd_shapes", 4), ("unused", 2)]
)
def test_parity_torch_cross_check(model: str, world_size: int) -> None:
    """The same parity holds for torch's own FSDP2, so the bar is the reference, not fsdp2."""
    check_parity(world_size, ParityConfig(model=model, impl="torch"))


def _parity_failure(cfg: ParityConfig) -> str:
    try:
        run_parity(cfg)
    except AssertionError as e:
        return str(e)
    return "no mismatch detected"


@pytest.mark.parametrize("corrupt", ["grad", "param"])
def test_parity_detects_a_wrong_shard(corrupt: str) -> None:
    """The parity check is not vacuous: a 1e-3 error in one element of one shard is caught."""
    cfg = ParityConfig(model="mlp", impl="torch", corrupt=corrupt)
    for message in run_on_ranks(2, _parity_failure, cfg):
        assert "not close" in message and f"{corrupt} " in message, message
