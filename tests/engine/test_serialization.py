"""Sharded tensors in users' hands: ``torch.save``, pickle, ``deepcopy`` and storage identity.

Each rank saving its own shards with ``torch.save(model.state_dict())`` is the most common
checkpoint idiom; ``copy.deepcopy`` of a state dict is how training loops keep their best model;
``broadcast_object_list``/``all_gather_object`` pickle whatever they are given; transformers and
accelerate find tied weights by comparing storages. fsdp2's shards live in one flat buffer per
group, so each must still behave as a tensor of its own: pickled and copied alone (only its own
bytes in a file), independent once copied, and sharing a storage only with a parameter it is
actually tied to. Resumed runs must reproduce the uninterrupted run bitwise (the same
computation, the same ranks) and both must match a plain model on the same global batches.
"""

from __future__ import annotations

import copy
import io
import os
import pickle
import zipfile
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor

from tests.harness import IMPL_UNDER_TEST, run_on_ranks
from tests.models import build_model
from tests.parity import (
    GLOBAL_BATCH,
    MODEL_SEED,
    adamw,
    global_batch,
    padded_shard_numel,
    rank_rows,
    shard_model,
    train_global_batches,
)
from tests.tolerance import assert_fp32_close

BEFORE, AFTER = range(2), range(2, 5)  # steps before a save, steps resumed after it


def _sharded(name: str, seed: int) -> nn.Module:
    model = build_model(name, seed)
    shard_model(model, name, IMPL_UNDER_TEST)
    return model


def _train(name: str, model: nn.Module, optim: torch.optim.Optimizer, steps: range) -> list[float]:
    return train_global_batches(name, model, optim, steps, sharded=True)


def _data_bytes(obj: Any) -> int:
    """Bytes of tensor data ``torch.save(obj)`` writes (the zip's storage records)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    with zipfile.ZipFile(buf) as archive:
        return sum(i.file_size for i in archive.infolist() if "/data/" in i.filename)


def _shard_bytes(obj: dict[str, Any] | DTensor) -> int:
    """``_data_bytes`` less the device meshes' own tensors (of ranks), saved along once."""
    values = obj.values() if isinstance(obj, dict) else [obj]
    meshes = {id(v.device_mesh): v.device_mesh for v in values if isinstance(v, DTensor)}.values()
    return _data_bytes(obj) - _data_bytes([m.mesh for m in meshes])


def _padded_bytes(tensor: DTensor) -> int:
    """What one rank's shard of ``tensor`` may occupy: its chunk, padding included."""
    world = dist.get_world_size()
    return padded_shard_numel(tensor.shape, world) * tensor.element_size()


def _check_saves_only_its_shard(model: nn.Module, sd: dict[str, Any]) -> None:
    """Every tensor saved alone writes its shard's bytes, never its whole group's buffer; the
    whole state dict writes each distinct shard once (tied weights share one)."""
    for key, value in sd.items():
        if isinstance(value, DTensor):
            local = value.to_local().nbytes
            assert local <= _shard_bytes(value) <= _padded_bytes(value), key
    distinct = {id(p): p for p in model.parameters()}.values()
    locals_ = sum(p.to_local().nbytes for p in distinct)  # type: ignore[attr-defined]
    padded = sum(_padded_bytes(p) for p in distinct)  # type: ignore[arg-type]
    buffers = sum(b.nbytes for k, b in sd.items() if not isinstance(b, DTensor))
    assert locals_ + buffers <= _shard_bytes(sd) <= padded + buffers


def _torch_save_resume(name: str, root: str) -> dict[str, Any]:
    model = _sharded(name, MODEL_SEED)
    optim = adamw(model.parameters())
    losses = _train(name, model, optim, BEFORE)
    path = os.path.join(root, f"rank{dist.get_rank()}.pt")
    torch.save({"model": model.state_dict(), "optim": optim.state_dict()}, path)
    _check_saves_only_its_shard(model, model.state_dict())
    expected = _train(name, model, optim, AFTER)
    fresh = _sharded(name, MODEL_SEED + 1)  # other values: loading must overwrite them all
    fresh_optim = adamw(fresh.parameters())
    saved = torch.load(path, weights_only=True)
    fresh.load_state_dict(saved["model"])
    fresh_optim.load_state_dict(saved["optim"])
    resumed = _train(name, fresh, fresh_optim, AFTER)
    assert resumed == expected  # the same computation on the same ranks: bitwise
    return {"losses": losses + expected}


@pytest.mark.parametrize(("name", "world_size"), [("gpt", 2), ("odd_shapes", 4), ("frozen", 2)])
def test_torch_save_per_rank_then_resume(name: str, world_size: int, tmp_path: Any) -> None:
    """Each rank saves model and AdamW state with ``torch.save`` and loads them into a fresh
    sharded model and optimizer, which trains on exactly as the saved one; a plain model on
    the same global batches agrees."""
    losses = run_on_ranks(world_size, _torch_save_resume, name, str(tmp_path))[0]["losses"]
    plain = build_model(name, MODEL_SEED)
    optim = adamw(plain.parameters())
    steps = range(AFTER.stop)
    expected = train_global_batches(name, plain, optim, steps, sharded=False)
    assert_fp32_close(losses, expected)


def _full(sd: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor() if isinstance(v, DTensor) else v.clone() for k, v in sd.items()}


def _check_copy(copied: dict[str, Any], live: dict[str, Any], what: str) -> None:
    """A copy holds the same shards in memory of its own."""
    assert copied.keys() == live.keys(), what
    for key, value in live.items():
        if isinstance(value, DTensor):
            got = copied[key]
            assert isinstance(got, DTensor), (what, key)
            assert got.placements == value.placements, (what, key)
            assert torch.equal(got.to_local(), value.to_local()), (what, key)
            if value.to_local().numel():
                assert got.to_local().data_ptr() != value.to_local().data_ptr(), (what, key)


def _copies_are_snapshots(name: str) -> None:
    model = _sharded(name, MODEL_SEED)
    optim = adamw(model.parameters())
    _train(name, model, optim, BEFORE)
    sd = model.state_dict()
    copies = {
        "deepcopy": copy.deepcopy(sd),
        "get_model_state_dict": copy.deepcopy(get_model_state_dict(model)),
        "clone": {k: v.clone() for k, v in sd.items()},  # the "best model" idiom
        "pickle": pickle.loads(pickle.dumps(sd)),
    }
    best_optim = copy.deepcopy(optim.state_dict())
    for what, copied in copies.items():
        _check_copy(copied, sd, what)
    snapshot = _full(sd)
    expected = _train(name, model, optim, AFTER)  # changes the live parameters, not the copies
    for what, copied in copies.items():
        assert _full(sd).keys() == snapshot.keys()
        for key, value in _full(copied).items():
            assert torch.equal(value, snapshot[key]), (what, key)
    # Restoring the best model and its optimizer replays the same steps bitwise.
    for copied in copies.values():
        model.load_state_dict(copied)
        optim.load_state_dict(copy.deepcopy(best_optim))
        assert _train(name, model, optim, AFTER) == expected


@pytest.mark.parametrize(("name", "world_size"), [("gpt", 2), ("odd_shapes", 4)])
def test_copies_of_state_dicts_are_snapshots(name: str, world_size: int) -> None:
    """``deepcopy`` of ``state_dict()`` and of ``get_model_state_dict``, a clone per tensor,
    and a pickle round trip: each keeps the values of its moment while training goes on, and
    loading it back (with a deepcopy of the optimizer's state) replays training exactly."""
    run_on_ranks(world_size, _copies_are_snapshots, name)


def _pickled_shards_reassemble(name: str) -> None:
    model = _sharded(name, MODEL_SEED)
    optim = adamw(model.parameters())
    _train(name, model, optim, BEFORE)
    model(*_batch(name)).backward()
    sd = model.state_dict()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    if IMPL_UNDER_TEST == "torch":
        grads = {}  # torch's gradients view its reduce-scatter output: pickling them fails
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"model": sd, "grads": grads})  # pickles the shards
    for kind, live in (("model", sd), ("grads", grads)):
        for key, value in live.items():
            if isinstance(value, DTensor):
                whole = torch.cat([g[kind][key].to_local() for g in gathered])
                assert torch.equal(whole, value.full_tensor()), (kind, key)
    for key, grad in grads.items():  # a gradient, too, is saved and copied alone
        assert _shard_bytes(grad) <= _padded_bytes(grad), key
        assert torch.equal(copy.deepcopy(grad).to_local(), grad.to_local()), key
    _check_ties(model)


def _batch(name: str) -> tuple[torch.Tensor, ...]:
    batch = global_batch(name, 0, 0, GLOBAL_BATCH)
    return rank_rows(batch, dist.get_rank(), dist.get_world_size())


def _check_ties(model: nn.Module) -> None:
    """Storage identity tells tied weights apart (transformers' ``id_tensor_storage``): only
    parameters that are the same tensor may share a storage."""
    by_storage: dict[int, set[int]] = {}
    for p in model.parameters():
        local = p.to_local()  # type: ignore[attr-defined]
        if local.numel():
            by_storage.setdefault(local.untyped_storage().data_ptr(), set()).add(id(p))
    shared = [ids for ids in by_storage.values() if len(ids) > 1]
    assert not shared, f"{len(shared)} storages hold several distinct parameters"


@pytest.mark.parametrize(("name", "world_size"), [("gpt", 2), ("odd_shapes", 4)])
def test_pickled_shards_and_grads_reassemble(name: str, world_size: int) -> None:
    """``all_gather_object`` of the sharded state dict and gradients: the ranks' unpickled
    local shards, concatenated, are the full tensors; each gradient saves only its shard."""
    run_on_ranks(world_size, _pickled_shards_reassemble, name)
