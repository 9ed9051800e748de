"""``fsdp2.summon_full_params``: full parameters for inspection, evaluation and editing.

Inside the context the model holds plain full tensors equal to a plain model's (ties kept, the
parameters' own dtype even under mixed precision); a forward there runs on them with no
collective. Edits are written back to the shards on exit (with ``writeback``), after which
training continues exactly like a plain model given the same edits. ``rank0_only``,
``offload_to_cpu`` and ``recurse`` do what they say; misuse fails with pinned messages.
fsdp2-only: torch's ``fully_shard`` has no such context manager.
"""

from __future__ import annotations

import functools
from typing import Any

import expecttest
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from tests.errors import error_text
from tests.harness import IMPL_UNDER_TEST, run_on_ranks
from tests.models import build_model, make_batch
from tests.parity import MODEL_SEED, adamw, train_global_batches
from tests.tolerance import assert_fp32_close

pytestmark = pytest.mark.usefixtures("fsdp2_only")


def _sharded(name: str = "gpt", **kwargs: Any) -> nn.Module:
    from fsdp2 import fully_shard

    model = build_model(name, MODEL_SEED)
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _kinds(model: nn.Module) -> dict[str, str]:
    return {k: "dtensor" if isinstance(p, DTensor) else "full" for k, p in model.named_parameters()}


def _assert_full_equals(model: nn.Module, plain: nn.Module) -> None:
    """Bitwise: sharding and gathering copy values, and edits run the same elementwise ops."""
    for (key, p), (_, expected) in zip(
        model.named_parameters(), plain.named_parameters(), strict=True
    ):
        assert type(p) is nn.Parameter and p.device.type == "cpu", key
        assert p.dtype == expected.dtype and torch.equal(p, expected), key


def _assert_sharded_equals(model: nn.Module, plain: nn.Module) -> None:
    for (key, p), (_, expected) in zip(
        model.named_parameters(), plain.named_parameters(), strict=True
    ):
        assert isinstance(p, DTensor), key
        assert torch.equal(p.full_tensor(), expected), key


def _train(model: nn.Module, num_steps: int, sharded: bool) -> list[float]:
    """``train_global_batches`` of the GPT from a fresh AdamW."""
    optim = adamw(model.parameters())
    return train_global_batches("gpt", model, optim, range(num_steps), sharded=sharded)


# ---------------------------------------------------------------------------------------------
# Reading, evaluating, editing
# ---------------------------------------------------------------------------------------------


def _read_and_evaluate() -> None:
    from fsdp2 import summon_full_params
    from fsdp2.engine.collectives import record_collectives

    model, plain = _sharded(), build_model("gpt", MODEL_SEED)
    held = [id(p) for p in model.parameters()]
    batch = make_batch("gpt", 1, 4)
    with summon_full_params(model):
        _assert_full_equals(model, plain)
        assert model.lm_head.weight is model.wte.weight
        with record_collectives() as issued, torch.no_grad():
            loss = model(*batch)
        assert issued == [], issued
        # The full parameters, the same ops, one process: the very same arithmetic.
        torch.testing.assert_close(loss, plain(*batch), rtol=0, atol=0)
    assert [id(p) for p in model.parameters()] == held, "the optimizer's objects come back"
    _assert_sharded_equals(model, plain)
    assert_fp32_close(_train(model, 2, True), _train(plain, 2, False))


def test_summoned_parameters_are_the_full_ones() -> None:
    run_on_ranks(2, _read_and_evaluate)


def _edit(model: nn.Module) -> None:
    with torch.no_grad():
        model.wte.weight.mul_(2)  # tied: lm_head changes with it
        model.blocks[1].mlp[0].weight.add_(0.5)
        model.ln_f.bias.fill_(0.25)


def _writeback() -> None:
    from fsdp2 import summon_full_params

    model, plain = _sharded(), build_model("gpt", MODEL_SEED)
    with summon_full_params(model, writeback=False):
        _edit(model)
    _assert_sharded_equals(model, plain)  # edits dropped
    with summon_full_params(model):
        _edit(model)
    _edit(plain)
    _assert_sharded_equals(model, plain)
    assert model.lm_head.weight is model.wte.weight
    # The shards are what the next all-gather sends: training sees the edits.
    assert_fp32_close(_train(model, 2, True), _train(plain, 2, False))


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_writeback(world_size: int) -> None:
    run_on_ranks(world_size, _writeback)


def _options() -> None:
    from fsdp2 import MixedPrecisionPolicy, summon_full_params

    plain = build_model("gpt", MODEL_SEED)
    model = _sharded(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    with summon_full_params(model, offload_to_cpu=True):  # fp32, not the bf16 compute copy
        _assert_full_equals(model, plain)
        _edit(model)
    _edit(plain)
    _assert_sharded_equals(model, plain)

    model, plain = _sharded(), build_model("gpt", MODEL_SEED)
    with summon_full_params(model, recurse=False):
        kinds = _kinds(model)
        own = {k for k in kinds if not k.startswith("blocks.")}
        assert all(kinds[k] == "full" for k in own), kinds
        assert all(kinds[k] == "dtensor" for k in kinds if k not in own), kinds
    with summon_full_params(model.blocks[1]):  # one block: only its parameters
        kinds = _kinds(model)
        assert {k for k, v in kinds.items() if v == "full"} == {
            k for k in kinds if k.startswith("blocks.1.")
        }, kinds
    assert set(_kinds(model).values()) == {"dtensor"}

    batch = make_batch("gpt", 1, 4)
    with summon_full_params(model, rank0_only=True, writeback=False):
        if dist.get_rank() == 0:
            _assert_full_equals(model, plain)
            with torch.no_grad():
                # The full parameters, the same ops, one process: the very same arithmetic.
                torch.testing.assert_close(model(*batch), plain(*batch), rtol=0, atol=0)
        else:
            assert set(_kinds(model).values()) == {"dtensor"}
    _assert_sharded_equals(model, plain)


def test_offload_recurse_and_rank0_only() -> None:
    run_on_ranks(2, _options)


# ---------------------------------------------------------------------------------------------
# Misuse
# ---------------------------------------------------------------------------------------------


class Probe(nn.Module):
    """Calls ``summon_full_params`` on itself from forward, or from a backward hook."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.where = where

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from fsdp2 import summon_full_params

        if self.where == "forward":
            with summon_full_params(self):
                pass
        h = self.lin(x)
        if self.where == "backward":
            h.register_hook(lambda grad: self._summon())
        return h.relu().sum()

    def _summon(self) -> None:
        from fsdp2 import summon_full_params

        with summon_full_params(self):
            pass


def _nested(model: nn.Module) -> None:
    from fsdp2 import summon_full_params

    with summon_full_params(model.blocks[0]), summon_full_params(model):
        pass


def _replace(model: nn.Module) -> None:
    from fsdp2 import summon_full_params

    with summon_full_params(model):
        model.ln_f.bias = nn.Parameter(torch.zeros(32))


def _misuse() -> dict[str, str]:
    from fsdp2 import fully_shard, summon_full_params

    out = {}
    for where in ("forward", "backward"):
        probe = fully_shard(Probe(where))
        out[where] = error_text(lambda p=probe: p(torch.ones(2, 4)).backward())
        probe.reset_iter_state()
        probe.where = ""
        probe(torch.ones(2, 4)).backward()  # recovered: the next iteration runs
    model, plain = _sharded(), build_model("gpt", MODEL_SEED)
    out["nested"] = error_text(lambda: _nested(model))
    out["replaced"] = error_text(lambda: _replace(model))
    _assert_sharded_equals(model, plain)  # nothing written back, shards registered again
    out["rank0_only with writeback"] = error_text(
        lambda: summon_full_params(model, rank0_only=True).__enter__()
    )

    def forward_on_rank_1() -> None:
        with summon_full_params(model, rank0_only=True, writeback=False):
            if dist.get_rank() == 1:
                model(*make_batch("gpt", 1, 4))

    out["rank0_only forward"] = error_text(forward_on_rank_1)
    out["not fsdp2"] = error_text(lambda: summon_full_params(nn.Linear(2, 2)).__enter__())
    out["not fsdp2, recurse=False"] = error_text(
        lambda: summon_full_params(model.ln_f, recurse=False).__enter__()
    )
    return out


@functools.cache
def misuse_messages() -> dict[str, str]:
    results = run_on_ranks(2, _misuse)
    assert {k: v for k, v in results[0].items() if k != "rank0_only forward"} == {
        k: v for k, v in results[1].items() if k != "rank0_only forward"
    }, results
    assert results[0]["rank0_only forward"] == "no error"
    return {**results[0], "rank0_only forward": results[1]["rank0_only forward"]}


@pytest.mark.skipif(IMPL_UNDER_TEST != "fsdp2", reason="pins fsdp2's messages")
class TestMisuse(expecttest.TestCase):
    def test_inside_forward_or_backward(self) -> None:
        self.assertExpectedInline(
            misuse_messages()["forward"],
            """RuntimeError: summon_full_params cannot run inside forward or backward: fsdp2 module FSDPProbe is in FORWARD. Call it before forward or after backward has finished""",
        )
        self.assertExpectedInline(
            misuse_messages()["backward"],
            """RuntimeError: summon_full_params cannot run inside forward or backward: fsdp2 module FSDPProbe is in PRE_BACKWARD. Call it before forward or after backward has finished""",
        )

    def test_nested(self) -> None:
        self.assertExpectedInline(
            misuse_messages()["nested"],
            """RuntimeError: summon_full_params is already active on fsdp2 module blocks.0; it cannot be nested over the same module""",
        )

    def test_replaced_parameter(self) -> None:
        self.assertExpectedInline(
            misuse_messages()["replaced"],
            """RuntimeError: ln_f.bias was replaced inside summon_full_params, so its new value cannot be written back; change the summoned tensor in place instead (e.g. `with torch.no_grad(): param.copy_(value)`)""",
        )

    def test_rank0_only(self) -> None:
        msgs = misuse_messages()
        self.assertExpectedInline(
            msgs["rank0_only with writeback"],
            """ValueError: summon_full_params(rank0_only=True) needs writeback=False: only rank 0 holds the full parameters, so the other ranks would have nothing to write back""",
        )
        self.assertExpectedInline(
            msgs["rank0_only forward"],
            """RuntimeError: fsdp2 module FSDPGPT ran forward inside summon_full_params(rank0_only=True) on rank 1, which holds only its shards; run forward on rank 0 only, or pass rank0_only=False""",
        )

    def test_not_an_fsdp2_module(self) -> None:
        self.assertExpectedInline(
            misuse_messages()["not fsdp2"],
            """ValueError: summon_full_params found no fsdp2 module in this Linear; apply fully_shard to it (or to its submodules) first""",
        )
        self.assertExpectedInline(
            misuse_messages()["not fsdp2, recurse=False"],
            """ValueError: summon_full_params(recurse=False) needs an fsdp2 module, got a LayerNorm that fully_shard was not applied to; apply it, or pass recurse=True to summon the fsdp2 modules below it""",
        )
