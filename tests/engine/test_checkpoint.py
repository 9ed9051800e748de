"""Checkpoints of model and optimizer: ``torch.distributed.checkpoint`` and full state dicts.

One run at world size 2 trains a few steps, saves (a DCP checkpoint of the sharded state, and a
full state dict that only rank 0 holds, written with ``torch.save``), then trains on: those later
losses are what an uninterrupted run gives. Every resumed run must reproduce them step by step:
from the DCP checkpoint at world sizes 1, 2 and 4 (resharding), from the full state dict in a
plain unsharded model, and from the full state dict broadcast from rank 0 into a model that has
never been materialised (meta device). Each global batch is fixed and split over the ranks, so
runs at different world sizes see the same data; at the saving world size the continuation must
be bitwise identical, at others equal up to reduction-order rounding. A run that issues
``dcp.async_save`` every two steps while training on must lose exactly what a run without
checkpoints loses, and each of its checkpoints must load, at 1, 2 and 4 ranks, into exactly the
state of the step it was issued at.
"""

from __future__ import annotations

import copy
import os
import shutil
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from tests.harness import IMPL_UNDER_TEST, discard_pool, fsdp_api, run_on_ranks
from tests.models import GPT, GPT_SEQ, build_model
from tests.parity import MODEL_SEED, adamw, shard_model, train_global_batches
from tests.tolerance import assert_fp32_close

NAME = "gpt"  # tied embedding/head weights, buffers, five fully_shard groups
SAVE_WORLD_SIZE = 2
STEPS_BEFORE = 2
RESUMED_STEPS = range(STEPS_BEFORE, STEPS_BEFORE + 3)
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
BROADCAST = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


def _sharded_model(seed: int, memory_mode: str = "zero3") -> nn.Module:
    model = build_model(NAME, seed)
    kwargs: dict[str, Any] = {"memory_mode": memory_mode} if memory_mode != "zero3" else {}
    if memory_mode == "hfsdp":
        shape = (2, dist.get_world_size() // 2)
        kwargs["mesh"] = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    shard_model(model, NAME, IMPL_UNDER_TEST, **kwargs)
    return model


def _train(
    model: nn.Module, optim: torch.optim.Optimizer, steps: range, sharded: bool = True
) -> list[float]:
    """Losses of the global batches ``steps``; a sharded model takes its rank's rows of each."""
    return train_global_batches(NAME, model, optim, steps, sharded=sharded)


def _full_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """A copy of the full, CPU state of model and optimizer on rank 0 (empty dicts elsewhere).
    Copied: CPU tensors that need no gathering (AdamW's step, a 1-rank model's parameters)
    come back as the live tensors themselves, which training goes on to change."""
    model_sd, optim_sd = get_state_dict(model, optim, options=FULL)
    return copy.deepcopy({"model": model_sd, "optim": optim_sd})


def _save(ckpt: str, full_file: str) -> dict[str, Any]:
    model = _sharded_model(MODEL_SEED)
    optim = adamw(model.parameters())
    _train(model, optim, range(STEPS_BEFORE))
    model_sd, optim_sd = get_state_dict(model, optim)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=ckpt)
    full = copy.deepcopy(
        {
            "model": get_model_state_dict(model, options=FULL),
            "optim": get_optimizer_state_dict(model, optim, options=FULL),
        }
    )
    together = _full_state(model, optim)  # collectives: every rank calls it
    if dist.get_rank() == 0:
        _assert_same_state(full, together)  # get_state_dict agrees with the per-object helpers
        torch.save(full, full_file)
    else:
        assert full == {"model": {}, "optim": {}}, "only rank 0 holds the full state"
    dist.barrier()
    return {"full": full, "losses": _train(model, optim, RESUMED_STEPS)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("ckpt")
    ckpt, full_file = str(root / "dcp"), str(root / "full.pt")
    result = run_on_ranks(SAVE_WORLD_SIZE, _save, ckpt, full_file)[0]
    return {"ckpt": ckpt, "full_file": full_file, **result}


def _assert_same_state(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    """Exactly equal full model and optimizer state (tensors compared bitwise)."""
    assert actual["model"].keys() == expected["model"].keys()
    for key, value in expected["model"].items():
        assert torch.equal(actual["model"][key], value), key
    # Broadcasting turns tuples (AdamW's betas) into lists; the values must agree.
    assert _lists(actual["optim"]["param_groups"]) == _lists(expected["optim"]["param_groups"])
    assert actual["optim"]["state"].keys() == expected["optim"]["state"].keys()
    for fqn, state in expected["optim"]["state"].items():
        for name, value in state.items():
            assert torch.equal(actual["optim"]["state"][fqn][name], value), (fqn, name)


def _lists(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in groups]


def _check_losses(losses: list[float], expected: list[float], world_size: int) -> None:
    if world_size == SAVE_WORLD_SIZE:
        assert losses == expected  # the same computation, resumed: bitwise
    else:
        assert_fp32_close(losses, expected)


# ---------------------------------------------------------------------------------------------
# torch.distributed.checkpoint: save at 2 ranks, load at 1, 2 and 4
# ---------------------------------------------------------------------------------------------


def _dcp_resume(
    ckpt: str, memory_mode: str = "zero3", steps: range = RESUMED_STEPS
) -> dict[str, Any]:
    """The full state loaded from ``ckpt``, and the losses of training ``steps`` on from it."""
    # Other values: loading must overwrite them all.
    model = _sharded_model(MODEL_SEED + 1, memory_mode)
    optim = adamw(model.parameters())
    model_sd, optim_sd = get_state_dict(model, optim)
    for key, value in model_sd.items():  # loading reads into the parameters' own storage
        assert isinstance(value, DTensor) or "causal_mask" in key, key
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=ckpt)
    set_state_dict(model, optim, model_state_dict=model_sd, optim_state_dict=optim_sd)
    full = _full_state(model, optim)
    return {"full": full, "losses": _train(model, optim, steps)}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_dcp_save_then_load_at_any_world_size(saved: dict[str, Any], world_size: int) -> None:
    resumed = run_on_ranks(world_size, _dcp_resume, saved["ckpt"])[0]
    _assert_same_state(resumed["full"], saved["full"])
    _check_losses(resumed["losses"], saved["losses"], world_size)


@pytest.mark.skipif(IMPL_UNDER_TEST != "fsdp2", reason="memory_mode is fsdp2's")
@pytest.mark.parametrize("world_size, mode", [(2, "zero2"), (4, "zero2"), (4, "hfsdp")])
def test_dcp_resume_in_another_memory_mode(
    saved: dict[str, Any], world_size: int, mode: str
) -> None:
    """Saved with parameters sharded between steps (zero3), resumed keeping them gathered
    (zero2: bitwise as zero3 at the saving world size), or as HFSDP on a 2 x 2 mesh: the same
    full state, loaded exactly."""
    resumed = run_on_ranks(world_size, _dcp_resume, saved["ckpt"], mode)[0]
    _assert_same_state(resumed["full"], saved["full"])
    _check_losses(resumed["losses"], saved["losses"], world_size)


ASYNC_STEPS = 7
# Steps trained when each async_save is issued: 2, 4, 6, each with training after it.
ASYNC_SAVE_STEPS = range(STEPS_BEFORE, ASYNC_STEPS, 2)


def _async_ckpt(root: str, step: int) -> str:
    return os.path.join(root, f"step{step}")


def _train_without_checkpoints() -> dict[str, Any]:
    model = _sharded_model(MODEL_SEED)
    optim = adamw(model.parameters())
    losses = _train(model, optim, range(ASYNC_STEPS))
    return {"losses": losses, "full": _full_state(model, optim)}


def _async_saves_while_training(root: str) -> dict[str, Any]:
    """torchtitan's async checkpointing: at each of ``ASYNC_SAVE_STEPS``, ``dcp.async_save``
    into a directory of its own, on a gloo group of its own (its writer thread's collectives
    must not interleave with training's). The previous save is awaited only before the next one
    is issued, so training goes on while each is written. Returns the losses and the full state
    at each save step (and at the end, ``ASYNC_STEPS``)."""
    model = _sharded_model(MODEL_SEED)
    optim = adamw(model.parameters())
    group = dist.new_group(backend="gloo")
    losses: list[float] = []
    states: dict[int, dict[str, Any]] = {}
    written = None
    for step in range(ASYNC_STEPS):
        if step in ASYNC_SAVE_STEPS:
            states[step] = _full_state(model, optim)
            if written is not None:
                written.result()
            model_sd, optim_sd = get_state_dict(model, optim)
            written = dcp.async_save(
                {"model": model_sd, "optim": optim_sd},
                checkpoint_id=_async_ckpt(root, step),
                process_group=group,
            )
        losses += _train(model, optim, range(step, step + 1))
    if written is None:
        raise AssertionError(f"expected saves at steps {list(ASYNC_SAVE_STEPS)}, found none")
    written.result()
    states[ASYNC_STEPS] = _full_state(model, optim)
    return {"losses": losses, "states": states}  # the group stays: the pool is discarded


def _dcp_resume_each(root: str) -> dict[int, dict[str, Any]]:
    """Every async checkpoint resumed in a fresh model, trained on to ``ASYNC_STEPS``."""
    return {
        step: _dcp_resume(_async_ckpt(root, step), steps=range(step, ASYNC_STEPS))
        for step in ASYNC_SAVE_STEPS
    }


def _assert_params_moved(earlier: dict[str, Any], later: dict[str, Any]) -> None:
    moved = [k for k, v in earlier["model"].items() if not torch.equal(v, later["model"][k])]
    assert moved, "no parameter changed between the two states"


def test_dcp_async_save_keeps_the_state_of_its_step(saved: dict[str, Any], tmp_path: Path) -> None:
    root = str(tmp_path)
    # Fresh rank processes, discarded after: DCP's writer thread and the extra gloo group stay
    # out of later tests. (Once in ~10 full runs, rank 0 crashed with SIGSEGV in the resume
    # below when it shared its processes with the tests before; not reproduced alone.)
    discard_pool(SAVE_WORLD_SIZE)
    try:
        plain = run_on_ranks(SAVE_WORLD_SIZE, _train_without_checkpoints)[0]
        run = run_on_ranks(SAVE_WORLD_SIZE, _async_saves_while_training, root)[0]
        resumed = run_on_ranks(SAVE_WORLD_SIZE, _dcp_resume, _async_ckpt(root, STEPS_BEFORE))[0]
    finally:
        discard_pool(SAVE_WORLD_SIZE)
    # Saving while training changes no step: bitwise the run without checkpoints, and the
    # synchronous run's (fixture) losses after its save.
    assert run["losses"] == plain["losses"]
    assert [plain["losses"][step] for step in RESUMED_STEPS] == saved["losses"]
    states = run["states"]
    _assert_same_state(states[ASYNC_STEPS], plain["full"])
    _assert_same_state(states[STEPS_BEFORE], saved["full"])
    # Each state differs from the next, so a checkpoint holding a later step's state (written
    # after training went on) fails the comparisons below.
    for earlier, later in pairwise(sorted(states)):
        _assert_params_moved(states[earlier], states[later])
    _assert_same_state(resumed["full"], states[STEPS_BEFORE])
    _check_losses(resumed["losses"], saved["losses"], SAVE_WORLD_SIZE)
    for world_size in (1, 4):  # resharded: the same state, loaded exactly
        for step, loaded in run_on_ranks(world_size, _dcp_resume_each, root)[0].items():
            _assert_same_state(loaded["full"], states[step])
            _check_losses(loaded["losses"], run["losses"][step:], world_size)


def _dcp_resume_error(ckpt: str) -> str:
    """The error of resuming from ``ckpt``. Caught here: DCP raises on every rank alike, and
    the rank pool stays usable. (``CheckpointException`` is a ``BaseException``.)"""
    try:
        _dcp_resume(ckpt)
    except (Exception, dcp.CheckpointException) as e:
        return str(e)
    return "no error"


def _incomplete_copy(saved: dict[str, Any], tmp_path: Path, remove: str) -> str:
    ckpt = str(tmp_path / "partial")
    shutil.copytree(saved["ckpt"], ckpt)
    os.remove(os.path.join(ckpt, remove))
    return ckpt


@pytest.mark.parametrize("remove", [".metadata", "__1_0.distcp"])
def test_incomplete_checkpoint_is_refused(
    saved: dict[str, Any], tmp_path: Path, remove: str
) -> None:
    """DCP writes ``.metadata`` last (atomically, by rename) once every rank has written its
    data: a directory without it, or missing a data file, must never load."""
    ckpt = _incomplete_copy(saved, tmp_path, remove)
    for message in run_on_ranks(SAVE_WORLD_SIZE, _dcp_resume_error, ckpt):
        assert "No such file or directory" in message, message
        assert remove in message, message


# ---------------------------------------------------------------------------------------------
# Full state dicts: rank 0's plain copy, loadable anywhere
# ---------------------------------------------------------------------------------------------


def test_full_state_dict_loads_into_a_plain_model(saved: dict[str, Any]) -> None:
    """``torch.load(weights_only=True)`` reads it; a plain model and AdamW resume from it."""
    full = torch.load(saved["full_file"], weights_only=True)
    for key, value in full["model"].items():
        assert type(value) is torch.Tensor and value.device.type == "cpu", key
    plain = build_model(NAME, MODEL_SEED + 1)
    plain.load_state_dict(full["model"])
    optim = adamw(plain.parameters())
    set_optimizer_state_dict(plain, optim, full["optim"], options=FULL)
    assert optim.state_dict()["state"][0]["step"] == STEPS_BEFORE
    losses = _train(plain, optim, RESUMED_STEPS, sharded=False)
    assert_fp32_close(losses, saved["losses"])


def _broadcast_resume(full_file: str, on_meta: bool) -> dict[str, Any]:
    api = fsdp_api(IMPL_UNDER_TEST)
    # Only rank 0 reads the file; the others bring empty dicts.
    full = torch.load(full_file, weights_only=True) if dist.get_rank() == 0 else {}
    if on_meta:
        with torch.device("meta"):
            model = GPT()
        for block in model.blocks:
            api.fully_shard(block)
        api.fully_shard(model)
    else:
        model = _sharded_model(MODEL_SEED + 1)
    set_model_state_dict(model, full.get("model", {}), options=BROADCAST)
    if on_meta:  # non-persistent buffers are in no state dict: the model's own init makes them
        for block in model.blocks:
            block.attn.causal_mask = torch.ones(GPT_SEQ, GPT_SEQ, dtype=torch.bool).tril()
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor) and param.device.type == "cpu", name
    assert model.lm_head.weight is model.wte.weight
    optim = adamw(model.parameters())
    set_optimizer_state_dict(model, optim, full.get("optim", {}), options=BROADCAST)
    state = _full_state(model, optim)
    return {"full": state, "losses": _train(model, optim, RESUMED_STEPS)}


@pytest.mark.parametrize("on_meta", [True, False], ids=["meta-model", "materialised-model"])
def test_broadcast_full_state_from_rank0(saved: dict[str, Any], on_meta: bool) -> None:
    if on_meta and IMPL_UNDER_TEST != "fsdp2":
        pytest.skip("torch's fully_shard unties shared weights that assign=True loading replaces")
    resumed = run_on_ranks(SAVE_WORLD_SIZE, _broadcast_resume, saved["full_file"], on_meta)[0]
    _assert_same_state(resumed["full"], saved["full"])
    _check_losses(resumed["losses"], saved["losses"], SAVE_WORLD_SIZE)
