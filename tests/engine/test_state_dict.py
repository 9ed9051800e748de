"""``state_dict()`` / ``load_state_dict()`` of sharded models.

Saving gives each parameter as a DTensor with its true global shape and ``(Shard(0),)`` placement,
its local part exactly rank r's ``torch.chunk`` (no padding), whether the model is sharded or
unsharded at the time. Loading takes DTensors in the same layout, DTensors in another layout and
(fsdp2 only) plain full tensors, into a sharded or an unsharded model, also with ``assign=True``;
the loaded model then trains like a plain model loaded with the same values. A bad state
dict is refused before anything is copied (fsdp2 only; messages pinned with expecttest).
"""

from __future__ import annotations

import functools
from typing import Any

import expecttest
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from tests.errors import error_text
from tests.harness import IMPL_UNDER_TEST, fsdp_api, run_on_ranks
from tests.models import build_model
from tests.parity import (
    MODEL_SEED,
    adamw,
    check_sharded_layout,
    shard_model,
    train_global_batches,
)
from tests.tolerance import PARAM_ATOL, assert_fp32_close


def _shard(name: str, model: nn.Module) -> nn.Module:
    shard_model(model, name, IMPL_UNDER_TEST)
    return model


def _param_keys(plain: nn.Module) -> set[str]:
    """State-dict keys that are parameters, tied aliases included."""
    return {k for k, _ in plain.named_parameters(remove_duplicate=False)}


def _unshard_all(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, fsdp_api(IMPL_UNDER_TEST).FSDPModule):
            module.unshard()


def _train(name: str, model: nn.Module, num_steps: int, sharded: bool) -> list[float]:
    """``train_global_batches`` from a fresh AdamW."""
    optim = adamw(model.parameters())
    return train_global_batches(name, model, optim, range(num_steps), sharded=sharded)


# ---------------------------------------------------------------------------------------------
# Saving
# ---------------------------------------------------------------------------------------------


def _check_saved(name: str, when: str) -> None:
    plain = build_model(name, MODEL_SEED)
    model = _shard(name, build_model(name, MODEL_SEED))
    if when == "unsharded":
        _unshard_all(model)
    elif when == "after training":  # the same step on both, so the values still agree
        _train(name, model, 1, sharded=True)
        _train(name, plain, 1, sharded=False)
    saved, expected = model.state_dict(), plain.state_dict()
    assert list(saved) == list(expected), (list(saved), list(expected))
    params = _param_keys(plain)
    for key, value in saved.items():
        if key in params:
            check_sharded_layout(key, value, expected[key].shape)
            assert value.to_local().is_contiguous(), key
            assert_fp32_close(value.full_tensor(), expected[key], atol=PARAM_ATOL, msg=key)
        else:  # buffers stay whole, plain tensors
            assert not isinstance(value, DTensor), key
            torch.testing.assert_close(value, expected[key], rtol=0, atol=0, msg=key)
    if when == "unsharded":
        _unshard_all(model)  # state_dict() resharded; fine, gather again for the next one
        assert list(model.state_dict()) == list(expected)


@pytest.mark.parametrize("when", ["sharded", "unsharded", "after training"])
@pytest.mark.parametrize(("name", "world_size"), [("gpt", 2), ("odd_shapes", 4)])
def test_state_dict_holds_global_dtensors(name: str, world_size: int, when: str) -> None:
    run_on_ranks(world_size, _check_saved, name, when)


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


def _source(name: str, kind: str) -> dict[str, Any]:
    """The seed-MODEL_SEED model's state dict, in the form ``kind``."""
    plain = build_model(name, MODEL_SEED)
    if kind == "full":
        return plain.state_dict()
    if kind == "dtensor":
        return _shard(name, build_model(name, MODEL_SEED)).state_dict()
    assert kind == "replicated"
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    params = _param_keys(plain)
    return {
        k: distribute_tensor(v, mesh, [Replicate()]) if k in params else v
        for k, v in plain.state_dict().items()
    }


def _load_and_train(name: str, kind: str, unsharded: bool, assign: bool, meta: bool) -> None:
    if meta:  # never materialised: only assign=True can give it values
        with torch.device("meta"):
            model = _shard(name, build_model(name, MODEL_SEED + 1))
    else:
        model = _shard(name, build_model(name, MODEL_SEED + 1))  # other values: loading shows
    held = [id(p) for p in model.parameters()]
    if unsharded:
        _unshard_all(model)
    result = model.load_state_dict(_source(name, kind), assign=assign)
    assert not result.missing_keys and not result.unexpected_keys, result
    if not assign:  # the optimizer may already hold these objects: they must stay
        assert [id(p) for p in model.parameters()] == held
    plain = build_model(name, MODEL_SEED)
    for (key, p), (_, expected) in zip(
        model.named_parameters(), plain.named_parameters(), strict=True
    ):
        check_sharded_layout(key, p, expected.shape)
        torch.testing.assert_close(p.full_tensor(), expected, rtol=0, atol=0, msg=key)
    if name == "gpt":
        assert model.lm_head.weight is model.wte.weight, "the tie must survive loading"
    losses = _train(name, model, 3, sharded=True)
    ref_losses = _train(name, plain, 3, sharded=False)
    assert_fp32_close(losses, ref_losses)


@pytest.mark.parametrize("unsharded", [False, True], ids=["into-sharded", "into-unsharded"])
@pytest.mark.parametrize("kind", ["dtensor", "replicated", "full"])
@pytest.mark.parametrize(("name", "world_size"), [("gpt", 2), ("odd_shapes", 4)])
def test_load_state_dict(name: str, world_size: int, kind: str, unsharded: bool) -> None:
    if kind == "full" and IMPL_UNDER_TEST != "fsdp2":
        pytest.skip("loading plain full tensors into sharded parameters is fsdp2's extension")
    if kind == "replicated" and name == "odd_shapes" and IMPL_UNDER_TEST != "fsdp2":
        pytest.skip("torch's in-place DTensor copy_ cannot reshard into uneven Shard(0) shards")
    run_on_ranks(world_size, _load_and_train, name, kind, unsharded, False, False)


@pytest.mark.parametrize("kind", ["dtensor", "full"])
@pytest.mark.parametrize(
    ("name", "meta"),
    # gpt is not tried on meta: its causal mask is a non-persistent buffer, in no state dict.
    [("gpt", False), ("odd_shapes", False), ("odd_shapes", True)],
    ids=["gpt", "odd_shapes", "odd_shapes-on-meta"],
)
def test_load_state_dict_assign(name: str, meta: bool, kind: str, fsdp2_only: None) -> None:
    """``assign=True`` registers new parameter objects: fsdp2 adopts them (ties restored) and
    packs them into its buffers; a model still on the meta device is materialised that way."""
    run_on_ranks(2, _load_and_train, name, kind, False, True, meta)


def _load_like_accelerate() -> None:
    """accelerate's ``cpu_ram_efficient_loading``: the model is moved to meta, sharded with the
    tied embedding, its output head and the final norm in one ``fully_shard([...])`` group,
    then every key gets its own DTensor through ``load_state_dict(assign=True)``."""
    fully_shard = fsdp_api(IMPL_UNDER_TEST).fully_shard
    plain = build_model("gpt", MODEL_SEED)
    model = build_model("gpt", MODEL_SEED + 1).to("meta")
    model.lm_head.weight = model.wte.weight  # .to("meta") unties; accelerate calls tie_weights()
    for block in model.blocks:
        fully_shard(block)
    fully_shard([model.ln_f, model.wte, model.lm_head], reshard_after_forward=False)
    fully_shard(model)
    full = plain.state_dict()
    sharded = {
        key: distribute_tensor(full[key], value.device_mesh, value.placements)
        for key, value in model.state_dict().items()
    }
    model.load_state_dict(sharded, assign=True)
    if IMPL_UNDER_TEST == "fsdp2":  # (torch re-ties at its lazy init)
        assert model.lm_head.weight is model.wte.weight, "loading must keep the tie"
    for block, plain_block in zip(model.blocks, plain.blocks, strict=True):
        block.attn.causal_mask = plain_block.attn.causal_mask  # non-persistent: in no state dict
    losses = _train("gpt", model, 3, sharded=True)
    ref_losses = _train("gpt", plain, 3, sharded=False)
    assert_fp32_close(losses, ref_losses)
    assert model.lm_head.weight is model.wte.weight, "the tie must survive loading"
    for (key, p), (_, expected) in zip(
        model.named_parameters(), plain.named_parameters(), strict=True
    ):
        assert_fp32_close(p.full_tensor(), expected, atol=PARAM_ATOL, msg=key)


def test_load_assign_into_meta_group_of_several_modules() -> None:
    """One group over several modules gets the load hook once per module; the first fires while
    the others' parameters are still on meta, and the tied alias (lm_head) is assigned its own
    new object after the group was packed: it must end up tied to the packed parameter."""
    run_on_ranks(2, _load_like_accelerate)


# ---------------------------------------------------------------------------------------------
# Bad state dicts: refused whole, before anything is copied
# ---------------------------------------------------------------------------------------------


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: v.full_tensor() if isinstance(v, DTensor) else v.clone()
        for k, v in model.state_dict().items()
    }


def _bad_loads() -> dict[str, str]:
    fully_shard = fsdp_api(IMPL_UNDER_TEST).fully_shard
    model = _shard("mlp", build_model("mlp", MODEL_SEED))
    before = _snapshot(model)
    # Good values for every key, different from the model's: a partial copy would show.
    good = {k: v + 1 for k, v in before.items()}
    cases: dict[str, dict[str, Any]] = {
        "missing": {k: v for k, v in good.items() if not k.startswith("head.")},
        "unexpected": {**good, "head.scale": torch.ones(4), "blocks.3.0.weight": torch.ones(1)},
        # head.weight comes last: nn.Module alone would have copied every block first.
        "wrong shape": {**good, "head.weight": torch.ones(4, 15)},
        "wrong dtensor shape": {**good, "head.bias": fully_shard(nn.Linear(4, 5)).bias},
        "not a tensor": {**good, "head.bias": 0.5},
        "everything": {
            **{k: v for k, v in good.items() if k != "blocks.0.0.bias"},
            "head.weight": torch.ones(3, 16),
            "extra": torch.ones(1),
        },
    }
    out: dict[str, str] = {}
    for case, state_dict in cases.items():
        for unsharded in (False, True):
            if unsharded:
                _unshard_all(model)
            message = error_text(lambda sd=state_dict: model.load_state_dict(sd))
            after = _snapshot(model)
            untouched = all(torch.equal(after[k], before[k]) for k in before)
            assert untouched, f"{case}: the model changed"
            out[case] = message
    lenient = cases["missing"] | {"head.scale": torch.ones(4)}
    result = model.load_state_dict(lenient, strict=False)
    out["strict=False result"] = repr(result)
    loaded = _snapshot(model)
    out["strict=False loaded"] = str(
        all(torch.equal(loaded[k], good[k] if k in lenient else before[k]) for k in before)
    )
    out["strict=False wrong shape"] = error_text(
        lambda: model.load_state_dict(cases["wrong shape"], strict=False)
    )
    return out


@functools.cache
def bad_load_messages() -> dict[str, str]:
    results = run_on_ranks(2, _bad_loads)
    assert results[0] == results[1], results
    return results[0]


@pytest.mark.skipif(IMPL_UNDER_TEST != "fsdp2", reason="pins fsdp2's messages")
class TestBadStateDicts(expecttest.TestCase):
    def test_missing_keys(self) -> None:
        self.assertExpectedInline(
            bad_load_messages()["missing"],
            """\
RuntimeError: load_state_dict for FSDPMLPStack found problems; nothing was loaded, the model is unchanged:
  missing keys (2): head.weight, head.bias
Pass strict=False to load a subset of the keys; shapes must match anyway.""",
        )

    def test_unexpected_keys(self) -> None:
        self.assertExpectedInline(
            bad_load_messages()["unexpected"],
            """\
RuntimeError: load_state_dict for FSDPMLPStack found problems; nothing was loaded, the model is unchanged:
  unexpected keys (2): head.scale, blocks.3.0.weight
Pass strict=False to load a subset of the keys; shapes must match anyway.""",
        )

    def test_wrong_shapes(self) -> None:
        msgs = bad_load_messages()
        self.assertExpectedInline(
            msgs["wrong shape"],
            """\
RuntimeError: load_state_dict for FSDPMLPStack found problems; nothing was loaded, the model is unchanged:
  bad values (1): head.weight has shape (4, 15), the model's is (4, 16)""",
        )
        self.assertExpectedInline(
            msgs["wrong dtensor shape"],
            """\
RuntimeError: load_state_dict for FSDPMLPStack found problems; nothing was loaded, the model is unchanged:
  bad values (1): head.bias has shape (5,), the model's is (4,)""",
        )
        self.assertExpectedInline(
            msgs["not a tensor"],
            """\
RuntimeError: load_state_dict for FSDPMLPStack found problems; nothing was loaded, the model is unchanged:
  bad values (1): head.bias is a float, not a tensor""",
        )

    def test_everything_listed_at_once(self) -> None:
        self.assertExpectedInline(
            bad_load_messages()["everything"],
            """\
RuntimeError: load_state_dict for FSDPMLPStack found problems; nothing was loaded, the model is unchanged:
  missing keys (1): blocks.0.0.bias
  unexpected keys (1): extra
  bad values (1): head.weight has shape (3, 16), the model's is (4, 16)
Pass strict=False to load a subset of the keys; shapes must match anyway.""",
        )

    def test_strict_false_loads_the_rest_but_never_a_wrong_shape(self) -> None:
        msgs = bad_load_messages()
        self.assertExpectedInline(
            msgs["strict=False result"],
            """_IncompatibleKeys(missing_keys=['head.weight', 'head.bias'], unexpected_keys=['head.scale'])""",
        )
        self.assertEqual(msgs["strict=False loaded"], "True")
        self.assertExpectedInline(
            msgs["strict=False wrong shape"],
            """\
RuntimeError: load_state_dict for FSDPMLPStack found problems; nothing was loaded, the model is unchanged:
  bad values (1): head.weight has shape (4, 15), the model's is (4, 16)""",
        )
