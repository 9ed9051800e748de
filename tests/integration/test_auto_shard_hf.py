"""auto_shard on Hugging Face's own LlamaForCausalLM (built from a LlamaConfig, nothing
downloaded), untied and with tied embeddings: the plan is the hand-written one, and it trains with
parity and bitwise like the hand-written ``fully_shard`` calls (see tests/tools/test_auto_shard.py).
Here rather than in the default suite because importing transformers costs seconds per process.
"""

from __future__ import annotations

import pytest

from tests.auto_shard_models import HF_CASES
from tests.tools.test_auto_shard import check_plan, check_training

pytest.importorskip("transformers")


@pytest.mark.parametrize("name", sorted(HF_CASES))
def test_plan_is_the_hand_written_sharding(name: str) -> None:
    check_plan(HF_CASES[name])


@pytest.mark.parametrize("name", sorted(HF_CASES))
def test_trains_like_hand_written_sharding(name: str) -> None:
    check_training(name)
