"""Initialisation on the meta device, and ``module.to(...)`` / ``to_empty(...)`` on sharded models.

The recipe: build under ``torch.device("meta")``, ``fully_shard``, ``to_empty(device=...)``, then
``reset_parameters()``: each rank allocates and initialises only its shards. The model then trains
exactly like a plain model holding the same values. Peak memory during that recipe is measured by
counting the bytes of live tensors created (a ``TorchDispatchMode``), and compared with the size
of the unsharded model. Casting or moving a sharded model keeps it sharded and correct.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterator
from typing import Any

import expecttest
import pytest
import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tests.harness import IMPL_UNDER_TEST, fsdp_api, run_on_ranks
from tests.models import GPT, GPT_SEQ, MLPStack, build_model, make_batch
from tests.parity import (
    MODEL_SEED,
    adamw,
    check_sharded_layout,
    shard_model,
    train_global_batches,
)
from tests.tolerance import PARAM_ATOL, assert_fp32_close


def _train(
    name: str,
    model: nn.Module,
    num_steps: int,
    sharded: bool,
    input_dtype: torch.dtype | None = None,
) -> list[float]:
    """``train_global_batches`` from a fresh AdamW."""
    optim = adamw(model.parameters())
    return train_global_batches(
        name, model, optim, range(num_steps), sharded=sharded, input_dtype=input_dtype
    )


def _plain_copy(name: str, model: nn.Module, **cast: Any) -> nn.Module:
    """A plain model holding ``model``'s current (full) values."""
    plain = build_model(name, MODEL_SEED + 7).to(**cast)
    plain.load_state_dict(
        {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    )
    return plain


# ---------------------------------------------------------------------------------------------
# Meta-device initialisation
# ---------------------------------------------------------------------------------------------


def _meta_gpt() -> nn.Module:
    api = fsdp_api(IMPL_UNDER_TEST)
    with torch.device("meta"):
        model = GPT()
    for block in model.blocks:
        api.fully_shard(block)
    api.fully_shard(model)
    return model


def _initialise(model: nn.Module) -> None:
    """What a model's own init does after ``to_empty``: parameters, then non-persistent buffers
    (``to_empty`` leaves every tensor uninitialised)."""
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    for block in model.blocks:
        block.attn.causal_mask = torch.ones(GPT_SEQ, GPT_SEQ, dtype=torch.bool).tril()


def _meta_init_trains_like_plain() -> None:
    model = _meta_gpt()
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor) and param.device.type == "meta", name
    model.to_empty(device="cpu")
    _initialise(model)
    shapes = {k: p.shape for k, p in build_model("gpt", 0).named_parameters()}
    for name, param in model.named_parameters():
        check_sharded_layout(name, param, shapes[name])
        assert param.device.type == "cpu", name
    assert model.lm_head.weight is model.wte.weight, "the tie must survive to_empty"
    # reset_parameters ran on the shards: LayerNorm's values are exact, others in range.
    for block in model.blocks:
        assert torch.equal(block.ln1.weight.full_tensor(), torch.ones(32))
        assert torch.equal(block.ln1.bias.full_tensor(), torch.zeros(32))
        bound = 1 / 32**0.5  # kaiming_uniform(a=sqrt(5)) on fan_in 32
        assert block.attn.qkv.weight.full_tensor().abs().max() <= bound
    plain = _plain_copy("gpt", model)
    losses = _train("gpt", model, 3, sharded=True)
    assert_fp32_close(losses, _train("gpt", plain, 3, sharded=False))


@pytest.mark.parametrize("world_size", [2, 4])
def test_meta_init_trains_like_plain(world_size: int) -> None:
    run_on_ranks(world_size, _meta_init_trains_like_plain)


class LiveBytes(TorchDispatchMode):
    """The bytes of tensors created while active that are still alive, and their peak.

    A DTensor counts its local tensor. Storage sizes are read when asked, so a storage resized
    after creation counts at its current size.
    """

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # Keyed by the storage object, which torch keeps unique per storage while it lives;
        # not by address: a resized or freed storage's address is soon another's.
        for storage in _storages(tree_flatten(out)[0]):
            ref = self._live.get(id(storage))
            if ref is None or ref() is not storage:
                self._live[id(storage)] = weakref.ref(storage)
        self.peak = max(self.peak, self.current())
        return out

    def current(self) -> int:
        """Bytes of memory behind the live storages, each byte once: fsdp2's shards have
        storages of their own that lie inside their group's flat buffer."""
        spans = []
        for key, ref in list(self._live.items()):
            storage = ref()
            if storage is None:
                del self._live[key]
            else:
                spans.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
        total, end = 0, 0
        for lo, hi in sorted(spans):
            total += max(hi - max(lo, end), 0)
            end = max(end, hi)
        return total


def _storages(leaves: list[Any]) -> Iterator[torch.UntypedStorage]:
    for leaf in leaves:
        if isinstance(leaf, DTensor):
            leaf = leaf.to_local()
        if isinstance(leaf, torch.Tensor) and leaf.device.type != "meta":
            yield leaf.untyped_storage()


NUM_UNITS, UNIT_DIM = 8, 128
VOCAB, EMBED_DIM = 4096, 64
INIT_WORLD_SIZE = 4


def _meta_model(kind: str) -> nn.Module:
    """``units``: 8 equal Linear units, one ``fully_shard`` each; ``embedding``: one big group."""
    api = fsdp_api(IMPL_UNDER_TEST)
    with torch.device("meta"):
        if kind == "units":
            model = nn.Sequential(*(nn.Linear(UNIT_DIM, UNIT_DIM) for _ in range(NUM_UNITS)))
        else:
            model = nn.Sequential(nn.Embedding(VOCAB, EMBED_DIM))
    if kind == "units":
        for unit in model:
            api.fully_shard(unit)
    api.fully_shard(model)
    return model


def _init_peak(kind: str) -> dict[str, int]:
    """Live bytes after, and at the peak of, to_empty + reset_parameters of a meta-built model."""
    model = _meta_model(kind)
    with LiveBytes() as live:
        model.to_empty(device="cpu")
        for module in model:
            module.reset_parameters()
        after = live.current()
    return {"peak": live.peak, "after": after}


def test_meta_init_peak_memory_stays_near_the_shard_size() -> None:
    """4 ranks, 8 equal units: each rank ends with exactly a quarter of the model, and on the way
    holds at most its shards plus one unit in transit. Half the unsharded size is never
    reached: a rank that could hold only that much (so not the unsharded model) initialises it."""
    unit_bytes = (UNIT_DIM * UNIT_DIM + UNIT_DIM) * 4
    full_bytes = NUM_UNITS * unit_bytes
    shard_bytes = full_bytes // INIT_WORLD_SIZE
    for result in run_on_ranks(INIT_WORLD_SIZE, _init_peak, "units"):
        assert result["after"] == shard_bytes, result  # dims divide evenly: no padding
        assert result["peak"] <= shard_bytes + unit_bytes + unit_bytes // INIT_WORLD_SIZE, result
        assert result["peak"] < full_bytes / 2, result


def test_meta_init_of_one_big_group_stays_below_the_unsharded_size() -> None:
    """One group holding a big embedding: to_empty may hold the new shard twice (the fresh
    tensor and the buffer it is packed into), never the unsharded embedding."""
    full_bytes = VOCAB * EMBED_DIM * 4
    shard_bytes = full_bytes // INIT_WORLD_SIZE
    for result in run_on_ranks(INIT_WORLD_SIZE, _init_peak, "embedding"):
        assert result["after"] == shard_bytes, result
        assert result["peak"] <= 2 * shard_bytes, result


# ---------------------------------------------------------------------------------------------
# Using parameters still on the meta device
# ---------------------------------------------------------------------------------------------


def _meta_forward_error() -> str:
    with torch.device("meta"):
        model = MLPStack()
    shard_model(model, "mlp", "fsdp2")
    try:
        model(*make_batch("mlp", 0, 2))
    except RuntimeError as e:
        message = str(e)
    else:
        raise AssertionError("forward on meta parameters must raise")
    model.to_empty(device="cpu")
    model(*make_batch("mlp", 0, 2))  # materialised (uninitialised, but usable): no error
    return message


@functools.cache
def meta_forward_error() -> str:
    return run_on_ranks(2, _meta_forward_error)[0]


@pytest.mark.skipif(IMPL_UNDER_TEST != "fsdp2", reason="pins fsdp2's messages")
class TestMetaForwardError(expecttest.TestCase):
    def test_forward_on_meta_parameters_names_them_and_the_fix(self) -> None:
        self.assertExpectedInline(
            meta_forward_error(),
            """fsdp2 module '<root>' has parameters on the meta device (head.weight, head.bias). Materialise them before forward: module.to_empty(device=...) and then module.reset_parameters() (or your own init)""",
        )


# ---------------------------------------------------------------------------------------------
# module.to(dtype), .to(device), .to_empty() on a sharded model
# ---------------------------------------------------------------------------------------------


def _to_float64_trains_like_plain(name: str) -> None:
    model = build_model(name, MODEL_SEED)
    shard_model(model, name, IMPL_UNDER_TEST)
    held = [id(p) for p in model.parameters()]
    model.to(torch.float64)
    assert [id(p) for p in model.parameters()] == held, "an optimizer may hold these objects"
    plain = build_model(name, MODEL_SEED).to(torch.float64)
    for (key, param), (_, expected) in zip(
        model.named_parameters(), plain.named_parameters(), strict=True
    ):
        check_sharded_layout(key, param, expected.shape)
        assert param.dtype == torch.float64, key
        torch.testing.assert_close(param.full_tensor(), expected, rtol=0, atol=0)
    losses = _train(name, model, 3, sharded=True, input_dtype=torch.float64)
    # float64 throughout: assert_close's float64 defaults are the arithmetic's tolerance.
    torch.testing.assert_close(
        losses, _train(name, plain, 3, sharded=False, input_dtype=torch.float64)
    )
    for (key, param), (_, expected) in zip(
        model.named_parameters(), plain.named_parameters(), strict=True
    ):
        torch.testing.assert_close(param.full_tensor(), expected, msg=key)


@pytest.mark.parametrize(("name", "world_size"), [("mlp", 2), ("odd_shapes", 4)])
def test_to_float64_keeps_sharding_and_parity(name: str, world_size: int) -> None:
    run_on_ranks(world_size, _to_float64_trains_like_plain, name)


def _to_device_and_to_empty() -> None:
    model = build_model("gpt", MODEL_SEED)
    shard_model(model, "gpt", IMPL_UNDER_TEST)
    before = {k: v.full_tensor() for k, v in model.named_parameters()}
    model.to("cpu")  # already there: nothing may change
    for key, param in model.named_parameters():
        assert torch.equal(param.full_tensor(), before[key]), key
    model.to_empty(device="cpu")  # fresh, uninitialised storage, same layout
    shapes = {k: p.shape for k, p in build_model("gpt", 0).named_parameters()}
    for key, param in model.named_parameters():
        check_sharded_layout(key, param, shapes[key])
    assert model.lm_head.weight is model.wte.weight
    plain = build_model("gpt", MODEL_SEED)
    set_model_state_dict(model, plain.state_dict(), options=StateDictOptions(full_state_dict=True))
    for block in model.blocks:  # non-persistent: in no state dict, so rebuilt by hand
        block.attn.causal_mask = torch.ones(GPT_SEQ, GPT_SEQ, dtype=torch.bool).tril()
    losses = _train("gpt", model, 3, sharded=True)
    assert_fp32_close(losses, _train("gpt", plain, 3, sharded=False))


def test_to_device_and_to_empty_keep_sharding() -> None:
    run_on_ranks(2, _to_device_and_to_empty)


# ---------------------------------------------------------------------------------------------
# One fully_shard group spanning several modules (torchtitan: fully_shard([norm, output]))
# ---------------------------------------------------------------------------------------------


def _gpt_with_list_group(device: str) -> nn.Module:
    """The GPT with its last block and final norm in one group, as torchtitan groups its final
    norm with its output projection (whose weight this GPT ties to the root's wte)."""
    api = fsdp_api(IMPL_UNDER_TEST)
    with torch.device(device):
        model = build_model("gpt", MODEL_SEED) if device == "cpu" else GPT()
    api.fully_shard(model.blocks[0])
    api.fully_shard([model.blocks[1], model.ln_f])
    api.fully_shard(model)
    return model


def _list_group_init(path: str) -> None:
    """Each of these converts the group's modules one after the other."""
    dtype = torch.float64 if path == "to_float64" else None
    if path == "to_empty":
        model = _gpt_with_list_group("meta")
        model.to_empty(device="cpu")
        _initialise(model)
        plain = _plain_copy("gpt", model)
    elif path == "assign":  # accelerate's cpu_ram_efficient_loading: shards of a full state
        model = _gpt_with_list_group("meta")
        plain = build_model("gpt", MODEL_SEED)
        full = plain.state_dict()
        shards = {
            key: distribute_tensor(full[key], value.device_mesh, value.placements)
            for key, value in model.state_dict().items()
        }
        model.load_state_dict(shards, assign=True)
        for block in model.blocks:  # non-persistent: in no state dict, so rebuilt by hand
            block.attn.causal_mask = torch.ones(GPT_SEQ, GPT_SEQ, dtype=torch.bool).tril()
    else:
        model = _gpt_with_list_group("cpu")
        model.to(torch.float64)
        plain = build_model("gpt", MODEL_SEED).to(torch.float64)
    for name, param in plain.named_parameters():
        sharded = model.get_parameter(name)
        check_sharded_layout(name, sharded, param.shape)
        assert sharded.device.type == "cpu" and sharded.dtype == param.dtype, name
    losses = _train("gpt", model, 3, sharded=True, input_dtype=dtype)
    expected = _train("gpt", plain, 3, sharded=False, input_dtype=dtype)
    if dtype == torch.float64:  # assert_close's float64 defaults are the arithmetic's tolerance
        torch.testing.assert_close(losses, expected)
        for key, param in plain.named_parameters():
            torch.testing.assert_close(model.get_parameter(key).full_tensor(), param, msg=key)
        return
    assert_fp32_close(losses, expected)
    for key, param in plain.named_parameters():
        full = model.get_parameter(key).full_tensor()
        assert_fp32_close(full, param, atol=PARAM_ATOL, msg=key)


@pytest.mark.parametrize("path", ["to_empty", "assign", "to_float64"])
def test_group_of_several_modules_converted_trains_like_plain(path: str) -> None:
    run_on_ranks(2, _list_group_init, path)


def _half_converted_group_error() -> str:
    model = _gpt_with_list_group("meta")
    model.to_empty(device="cpu")
    _initialise(model)
    # Only one module of the [blocks.1, ln_f] group, to another device: the group cannot be
    # gathered from two. (A half conversion on one device is followed: test_state_changes.)
    model.ln_f.to("meta")
    try:
        model(*make_batch("gpt", 0, 2))
    except RuntimeError as e:
        return str(e)
    raise AssertionError("gathering a half-converted group must raise")


@pytest.mark.skipif(IMPL_UNDER_TEST != "fsdp2", reason="pins fsdp2's messages")
class TestHalfConvertedGroupError(expecttest.TestCase):
    def test_gathering_a_half_converted_group_names_both_halves(self) -> None:
        messages = run_on_ranks(2, _half_converted_group_error)
        assert messages[0] == messages[1], "every rank must raise alike"
        self.assertExpectedInline(
            messages[0],
            """fsdp2 group 'blocks.1,ln_f': the parameters ln_f.weight, ln_f.bias were replaced (by .to(), to_empty() or load_state_dict(assign=True)) and are on meta, but blocks.1.ln1.weight, blocks.1.ln1.bias, blocks.1.attn.qkv.weight, blocks.1.attn.proj.weight, blocks.1.attn.proj.bias, blocks.1.ln2.weight, blocks.1.ln2.bias, blocks.1.mlp.0.weight, blocks.1.mlp.0.bias, blocks.1.mlp.2.weight, blocks.1.mlp.2.bias were not and are on cpu; the modules of one fully_shard call are gathered together, so convert all of them (e.g. call .to()/to_empty() on their parent)""",
        )
