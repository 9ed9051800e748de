"""The FSDPModule control surface's user-facing errors (``reshard_after_forward=k``, tied weights
across calls, prefetch, ``share_comm_ctx``, reduction knobs), produced on the ranks in one round
trip and pinned with expecttest (regenerate with ``EXPECTTEST_ACCEPT=1``)."""

from __future__ import annotations

import functools

import expecttest
import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from tests.errors import NO_ERROR, error_text
from tests.harness import IMPL_UNDER_TEST, run_on_ranks
from tests.models import MLP_IN
from tests.parity import Lockstep, shard_model

VOCAB = 16


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, MLP_IN)
        self.head = nn.Linear(MLP_IN, VOCAB, bias=False)
        self.head.weight = self.embed.weight


class Siblings(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(MLP_IN, MLP_IN)
        self.b = nn.Linear(MLP_IN, MLP_IN)
        self.b.weight = self.a.weight


def _untouched(model: nn.Module) -> bool:
    return not any(isinstance(p, DTensor) for p in model.parameters())


def _error_messages() -> dict[str, str]:
    from fsdp2 import fully_shard, share_comm_ctx

    messages = {}
    for k in (3, 0, -1, 2.0):
        mlp = Lockstep("mlp").model
        messages[f"reshard_after_forward={k}"] = error_text(
            lambda m=mlp, k=k: fully_shard(m, reshard_after_forward=k)
        )
        # A rejected call must leave the module as it was, ready for a corrected call.
        messages[f"untouched after reshard_after_forward={k}"] = str(_untouched(mlp))

    # [Note: weights tied across calls]: the root's call takes the tie over; two sibling
    # calls with no call on their parent raise at the first forward, naming both places.
    tied = TiedLM()
    fully_shard(tied.head)
    messages["tied: head, then root"] = error_text(lambda: fully_shard(tied))
    messages["tied: one parameter"] = str(tied.head.weight is tied.embed.weight)
    siblings = Siblings()
    fully_shard(siblings.a)
    messages["tied: siblings"] = error_text(lambda: fully_shard(siblings.b))
    x = torch.randn(2, MLP_IN)
    messages["tied: siblings, forward"] = error_text(lambda: siblings.b(siblings.a(x)))

    t = Lockstep("mlp")
    shard_model(t.model, "mlp")
    stray = nn.Linear(2, 2)
    messages["forward prefetch"] = error_text(
        lambda: t.model.set_modules_to_forward_prefetch([t.model.blocks[0], stray])
    )
    messages["backward prefetch"] = error_text(
        lambda: t.model.blocks[1].set_modules_to_backward_prefetch([stray])
    )
    messages["share_comm_ctx ok"] = error_text(lambda: share_comm_ctx([t.model, t.model.blocks[0]]))
    messages["share_comm_ctx"] = error_text(lambda: share_comm_ctx([t.model, stray]))
    for num in (0, -1, 1.5, True):
        messages[f"max_input_buffers={num}"] = error_text(
            lambda n=num: t.model.set_reduce_scatter_max_input_buffers(n)
        )
    messages["divide factor 0"] = error_text(lambda: t.model.set_gradient_divide_factor(0))
    return messages


@functools.cache
def error_messages(world_size: int) -> dict[str, str]:
    """One rank round trip for every message below; all ranks must agree."""
    results = run_on_ranks(world_size, _error_messages)
    assert all(r == results[0] for r in results), results
    return results[0]


@pytest.mark.skipif(IMPL_UNDER_TEST != "fsdp2", reason="pins fsdp2's messages")
class TestErrorMessages(expecttest.TestCase):
    def test_reshard_after_forward_int_must_divide_world_size(self) -> None:
        msgs = error_messages(4)
        self.assertExpectedInline(
            msgs["reshard_after_forward=3"],
            """ValueError: fully_shard(MLPStack): reshard_after_forward=3 must be a bool, None, or a divisor of the shard world size 4: one of [1, 2, 4] (1 means False, 4 means True)""",
        )
        self.assertExpectedInline(
            msgs["reshard_after_forward=0"],
            """ValueError: fully_shard(MLPStack): reshard_after_forward=0 must be a bool, None, or a divisor of the shard world size 4: one of [1, 2, 4] (1 means False, 4 means True)""",
        )
        self.assertExpectedInline(
            msgs["reshard_after_forward=-1"],
            """ValueError: fully_shard(MLPStack): reshard_after_forward=-1 must be a bool, None, or a divisor of the shard world size 4: one of [1, 2, 4] (1 means False, 4 means True)""",
        )
        self.assertExpectedInline(
            msgs["reshard_after_forward=2.0"],
            """ValueError: fully_shard(MLPStack): reshard_after_forward=2.0 must be a bool, None, or a divisor of the shard world size 4: one of [1, 2, 4] (1 means False, 4 means True)""",
        )

    def test_rejected_reshard_after_forward_leaves_module_alone(self) -> None:
        msgs = error_messages(4)
        for k in (3, 0, -1, 2.0):
            self.assertEqual(msgs[f"untouched after reshard_after_forward={k}"], "True")

    def test_tied_weight_across_calls(self) -> None:
        msgs = error_messages(2)
        self.assertEqual(msgs["tied: head, then root"], NO_ERROR)
        self.assertEqual(msgs["tied: one parameter"], "True")
        self.assertEqual(msgs["tied: siblings"], NO_ERROR)
        self.assertExpectedInline(
            msgs["tied: siblings, forward"],
            """ValueError: fsdp2: weights tied across fully_shard calls, and no call on a module holding every place they sit: FSDPLinear.weight (tied to FSDPLinear.weight). Call fully_shard on their common ancestor too (the root, last), or shard the modules that share them in one call, e.g. fully_shard([embedding, lm_head])""",
        )

    def test_prefetch_rejects_plain_modules(self) -> None:
        msgs = error_messages(2)
        self.assertExpectedInline(
            msgs["forward prefetch"],
            """ValueError: set_modules_to_forward_prefetch expects FSDPModules (modules fully_shard was applied to), got Linear; apply fully_shard to it first""",
        )
        self.assertExpectedInline(
            msgs["backward prefetch"],
            """ValueError: set_modules_to_backward_prefetch expects FSDPModules (modules fully_shard was applied to), got Linear; apply fully_shard to it first""",
        )

    def test_share_comm_ctx(self) -> None:
        msgs = error_messages(2)
        self.assertEqual(msgs["share_comm_ctx ok"], "no error")
        self.assertExpectedInline(
            msgs["share_comm_ctx"], """ValueError: share_comm_ctx expects FSDPModules, got Linear"""
        )

    def test_bad_reduce_scatter_max_input_buffers(self) -> None:
        msgs = error_messages(2)
        self.assertExpectedInline(
            msgs["max_input_buffers=0"],
            """ValueError: max_input_buffers must be at least 1, got 0""",
        )
        self.assertExpectedInline(
            msgs["max_input_buffers=-1"],
            """ValueError: max_input_buffers must be at least 1, got -1""",
        )
        self.assertExpectedInline(
            msgs["max_input_buffers=1.5"],
            """TypeError: max_input_buffers must be an int, got float""",
        )
        self.assertExpectedInline(
            msgs["max_input_buffers=True"],
            """TypeError: max_input_buffers must be an int, got bool""",
        )

    def test_bad_gradient_divide_factor(self) -> None:
        self.assertExpectedInline(
            error_messages(2)["divide factor 0"],
            """ValueError: set_gradient_divide_factor expects a positive factor, got 0""",
        )
