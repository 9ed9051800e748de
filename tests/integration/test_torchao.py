"""torchao's training subclasses under fsdp2, against torch's ``fully_shard``.

``torchao_run.py`` trains a tiny residual MLP on 2 gloo ranks under ``torchrun``, once per
implementation, same seed and data: QLoRA (frozen ``NF4Tensor`` base weights, LoRA adapters)
and float8 training with float8 all-gather (``WeightWithDynamicFloat8CastTensor``, scales
precomputed after each step). Both subclasses use the one-argument ``fsdp_pre_all_gather(mesh)``
and implement only a few ops (NF4: no ``narrow`` of a part, no ``.to(copy=True)``). fsdp2 must
give torch's losses and gradient norms at every step, with the shards still the subclass.

Needs the ``integration`` extra (torchao pinned there); skipped without it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torchao")

from tests.integration.torchrun_pair import Run, assert_same_training, run_both

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parent / "torchao_run.py"
TIMEOUT_S = 180
STEPS = 5
SHARD_TYPE = {"qlora": "NF4Tensor", "float8": "WeightWithDynamicFloat8CastTensor"}


@pytest.fixture(scope="module", params=list(SHARD_TYPE))
def runs(request: pytest.FixtureRequest) -> tuple[str, dict[str, Run]]:
    recipe = request.param
    args = ["--recipe", recipe, "--steps", str(STEPS)]
    return recipe, run_both(SCRIPT, args, TIMEOUT_S, keys=("SHARD",))


def test_shards_stay_torchao_subclasses(runs: tuple[str, dict[str, Run]]) -> None:
    recipe, by_impl = runs
    for run in by_impl.values():
        assert run.keys.get("SHARD") == SHARD_TYPE[recipe], run.tail()


def test_losses_and_grad_norms_match_torch(runs: tuple[str, dict[str, Run]]) -> None:
    assert_same_training(runs[1], STEPS)
