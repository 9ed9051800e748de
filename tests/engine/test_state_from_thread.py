"""State taken from another thread while the training thread is inside a forward or a backward.

torchft's asynchronous quorum calls the user's ``state_dict()`` (torchtitan's:
``get_state_dict(model, optimizer)``) on its quorum thread while the training thread runs the
forward; a checkpointing or monitoring thread does the same at any moment (issue 42). The taker
must neither reshard nor swap what the training thread is using, and must get the sharded
parameters, not the gathered tensors a module holds mid-step:

- ``test_state_taken_inside_a_step``: a hook of the training thread (in the forward, or in the
  backward) hands over to a taker thread and waits for it, so the take lands there on every run.
  The taker's ``model.state_dict()``, ``get_model_state_dict`` and ``get_state_dict(model,
  optimizer)`` are compared bit for bit with the parameters and the optimizer state after the
  last completed step, and the training losses with a run that takes nothing.
- ``test_state_taken_at_any_moment``: a taker thread calls them in a loop while the training
  thread trains, unsynchronised (a take may overlap an optimizer step: only that it works, and
  that training is unchanged to the bit, is checked). It starts after the first optimizer step:
  before it, ``get_state_dict`` makes the optimizer's state by running a step with zero
  gradients and a zero learning rate, then ``zero_grad`` (torch's ``_init_optim_state``, on
  whatever thread calls it), which changes AdamW's step count and may drop the training
  thread's gradients.

fsdp2 only: torch's ``fully_shard`` fails both (``got mixed torch.Tensor and DTensor``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict
from torch.distributed.tensor import DTensor

from tests.harness import run_on_ranks
from tests.models import build_model
from tests.parity import GLOBAL_BATCH, MODEL_SEED, adamw, global_batch, rank_rows, shard_model

pytestmark = pytest.mark.usefixtures("fsdp2_only")

STEPS = 4


def _local(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Copies of a state dict's tensors, a DTensor as its local shard (what this rank holds)."""
    out = {}
    for key, value in state.items():
        if isinstance(value, DTensor):
            out[key] = value.to_local().detach().clone()
        elif isinstance(value, torch.Tensor):
            out[key] = value.detach().clone()
    return out


def _optim_local(osd: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The optimizer state's tensors, keyed ``fqn/name``."""
    return {
        f"{fqn}/{name}": value.to_local().clone() if isinstance(value, DTensor) else value.clone()
        for fqn, per_param in osd["state"].items()
        for name, value in per_param.items()
        if isinstance(value, torch.Tensor)
    }


def _take(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """Everything a taker reads, copied at once: the three ways users take the state."""
    plain = model.state_dict()
    for key, value in plain.items():
        if key.endswith(("weight", "bias")) and not isinstance(value, DTensor):
            raise AssertionError(f"{key}: a {type(value).__name__}, not the sharded DTensor")
    model_sd, optim_sd = get_state_dict(model, optim)
    return {
        "state_dict": _local(plain),
        "get_model_state_dict": _local(get_model_state_dict(model)),
        "get_state_dict": _local(model_sd),
        "optimizer": _optim_local(optim_sd),
    }


def _expected(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """The same, taken by the training thread between steps (the state after the last one)."""
    params = _local(model.state_dict())
    _model_sd, optim_sd = get_state_dict(model, optim)
    return {
        "state_dict": params,
        "get_model_state_dict": params,
        "get_state_dict": params,
        "optimizer": _optim_local(optim_sd),
    }


def _step(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    name: str,
    step: int,
    backward: Callable[[torch.Tensor], None] = torch.Tensor.backward,
) -> float:
    """One training step on this rank's rows of the global batch; the global loss."""
    rank, world = dist.get_rank(), dist.get_world_size()
    loss = model(*rank_rows(global_batch(name, step, 0, GLOBAL_BATCH), rank, world))
    backward(loss)
    optim.step()
    optim.zero_grad()
    loss = loss.detach().clone()
    dist.all_reduce(loss)
    return loss.item() / world


def _options(setting: str) -> dict[str, Any]:
    """``fully_shard``'s arguments for each setting the take is checked with."""
    import fsdp2

    if setting == "bf16":  # gathered in bf16; the state holds the fp32 shards
        return {"mp_policy": fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16)}
    if setting == "zero2":  # gathered copies kept between steps
        return {"memory_mode": "zero2"}
    if setting == "offload":  # the shards live on the CPU, gathered on the device
        return {"offload_policy": fsdp2.CPUOffloadPolicy()}
    if setting == "reshard1":  # resharded after forward to one rank's copy (int reshard)
        return {"reshard_after_forward": 1}
    return {}


def _train(name: str, setting: str, where: str) -> tuple[list[float], list[str]]:
    """Train ``STEPS`` steps; with ``where`` ("forward", "backward"), a taker thread takes the
    state at that point of every step after the first while the training thread waits. Returns
    the losses and what differed between each take and the state after the step before it."""
    model = build_model(name, MODEL_SEED)
    shard_model(model, name, **_options(setting))
    optim = adamw(model.parameters())
    ask, done = threading.Event(), threading.Event()
    takes: list[dict[str, dict[str, torch.Tensor]]] = []
    errors: list[BaseException] = []
    stop = [False]

    def taker() -> None:
        while True:
            ask.wait()
            ask.clear()
            if stop[0]:
                return
            try:
                takes.append(_take(model, optim))
            except BaseException as error:  # reported by the training thread
                errors.append(error)
            done.set()

    thread = threading.Thread(target=taker, daemon=True)
    thread.start()
    armed = [False]
    # Block 1's first module with parameters of its own (the MLP's Linear, the GPT's LayerNorm).
    block = model.blocks[1]
    inner = next(m for m in block.modules() if m is not block and m._parameters)

    def hand_over() -> None:
        # The take must land where block 1 is gathered (its module holds a plain tensor the
        # training thread is using), or it would show nothing.
        if isinstance(next(iter(inner._parameters.values())), DTensor):
            raise AssertionError(f"block 1 is not gathered at the {where} take")
        done.clear()
        ask.set()
        done.wait(timeout=60)
        if errors:
            raise errors[0]

    if where == "forward":  # after fsdp2's own pre-forward, which gathered block 1
        inner.register_forward_pre_hook(lambda *_: hand_over() if armed[0] else None)
    elif where == "backward":  # block 1's backward, after its pre-backward gathered it again
        inner.register_full_backward_pre_hook(lambda *_: hand_over() if armed[0] else None)
    losses, expected = [], []
    for step in range(STEPS):
        armed[0] = where != "none" and step > 0
        if armed[0]:
            expected.append(_expected(model, optim))
        losses.append(_step(model, optim, name, step))
    stop[0] = True
    ask.set()
    thread.join(timeout=10)
    differ = []
    if len(takes) != len(expected):
        differ.append(f"{len(takes)} takes, {len(expected)} steps with one")
    for i, (took, want) in enumerate(zip(takes, expected, strict=False)):
        for way, tensors in want.items():
            got = took[way]
            if sorted(got) != sorted(tensors):
                differ.append(f"step {i + 1} {way}: keys {sorted(got)} != {sorted(tensors)}")
                continue
            differ.extend(
                f"step {i + 1} {way}: {key}"
                for key, value in tensors.items()
                if not torch.equal(got[key], value)
            )
    return losses, differ


@pytest.mark.parametrize(
    ("name", "setting", "where"),
    [
        ("mlp", "plain", "forward"),
        ("mlp", "plain", "backward"),
        ("mlp", "bf16", "backward"),
        ("mlp", "zero2", "forward"),
        ("mlp", "offload", "backward"),
        ("mlp", "reshard1", "backward"),
        ("gpt", "plain", "backward"),  # lm_head tied to wte: both keys, one shard
    ],
)
def test_state_taken_inside_a_step(name: str, setting: str, where: str) -> None:
    results = run_on_ranks(2, _train, name, setting, where)
    baseline = run_on_ranks(2, _train, name, setting, "none")
    for rank, ((losses, differ), (plain, _)) in enumerate(zip(results, baseline, strict=True)):
        assert not differ, f"rank {rank}: taken state differs from the last step's: {differ}"
        assert losses == plain, f"rank {rank}: losses {losses} != {plain} without a taker"


def _train_beside_a_taker(take: bool) -> tuple[list[float], int, list[str]]:
    model = build_model("mlp", MODEL_SEED)
    shard_model(model, "mlp")
    optim = adamw(model.parameters())
    stop, stepped = threading.Event(), threading.Event()
    taken, errors = [0], []

    def taker() -> None:
        stepped.wait(timeout=60)
        while not stop.is_set():
            try:
                _take(model, optim)
                taken[0] += 1
            except BaseException as error:
                errors.append(repr(error))
                return

    thread = threading.Thread(target=taker, daemon=True)
    if take:
        thread.start()
    losses = []
    for step in range(3 * STEPS):
        losses.append(_step(model, optim, "mlp", step))
        stepped.set()
    stop.set()
    if take:
        thread.join(timeout=30)
    return losses, taken[0], errors


def test_state_taken_at_any_moment() -> None:
    results = run_on_ranks(2, _train_beside_a_taker, True)
    baseline = run_on_ranks(2, _train_beside_a_taker, False)
    for rank, ((losses, taken, errors), (plain, _, _)) in enumerate(
        zip(results, baseline, strict=True)
    ):
        assert not errors, f"rank {rank}: the taker failed: {errors}"
        assert taken > 0, f"rank {rank}: the taker took nothing"
        assert losses == plain, f"rank {rank}: losses {losses} != {plain} without a taker"


def _load_beside(setting: str, by_taker: bool) -> tuple[list[float], list[str]]:
    """Train ``STEPS`` steps; before step 2, load the state saved after step 0: on a taker
    thread (``by_taker``) while the training thread waits between steps, else on the training
    thread. With ``by_taker``, the taker also tries to load inside each forward, which must be
    refused. Returns the losses and the refusals' messages."""
    model = build_model("mlp", MODEL_SEED)
    shard_model(model, "mlp", **_options(setting))
    optim = adamw(model.parameters())
    saved: dict[str, torch.Tensor] = {}
    refusals: list[str] = []

    def on_taker(fn: Any) -> None:
        errors: list[BaseException] = []

        def run() -> None:
            try:
                fn()
            except BaseException as error:
                errors.append(error)

        thread = threading.Thread(target=run)
        thread.start()
        thread.join(timeout=60)
        if errors:
            raise errors[0]

    def load() -> None:
        model.load_state_dict(saved)

    def mid_forward(*_: Any) -> None:
        if by_taker and saved:
            try:
                on_taker(load)
            except RuntimeError as error:
                refusals.append(str(error))
            else:
                refusals.append("loaded mid-step")

    inner = model.blocks[1][0]
    inner.register_forward_pre_hook(mid_forward)
    losses = []
    for step in range(STEPS):
        if step == 2:
            on_taker(load) if by_taker else load()
        losses.append(_step(model, optim, "mlp", step))
        if step == 0:
            saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return losses, refusals


@pytest.mark.parametrize("setting", ["plain", "zero2"])
def test_load_from_another_thread(setting: str) -> None:
    """Between steps a taker's load is the training thread's, bit for bit; inside a forward it
    is refused before anything is copied, and training goes on unchanged."""
    results = run_on_ranks(2, _load_beside, setting, True)
    baseline = run_on_ranks(2, _load_beside, setting, False)
    for rank, ((losses, refusals), (plain, _)) in enumerate(zip(results, baseline, strict=True)):
        assert len(refusals) == STEPS - 1, f"rank {rank}: {refusals}"
        for message in refusals:
            assert "load_state_dict from another thread" in message, message
            assert "nothing was loaded" in message, message
        assert losses == plain, f"rank {rank}: losses {losses} != {plain} loading on the trainer"


def _backward_on_another_thread(elsewhere: bool) -> tuple[list[float], list[bool]]:
    """Forward on this thread, backward on another (``elsewhere``), as autograd runs a CUDA
    backward on a device thread of its own. A hook in block 1's backward reads the block's
    ``named_parameters()``: that thread trains, so it sees what the block holds then (the
    gathered parameters), not the shards another thread's taker gets. Returns the losses and,
    per step, whether the hook saw a sharded DTensor."""
    model = build_model("mlp", MODEL_SEED)
    shard_model(model, "mlp")
    optim = adamw(model.parameters())
    block = model.blocks[1]
    inner = next(m for m in block.modules() if m is not block and m._parameters)
    seen: list[bool] = []
    inner.register_full_backward_pre_hook(
        lambda *_: seen.append(any(isinstance(p, DTensor) for _, p in block.named_parameters()))
    )

    def on_another_thread(loss: torch.Tensor) -> None:
        thread = threading.Thread(target=loss.backward)
        thread.start()
        thread.join(timeout=60)

    backward = on_another_thread if elsewhere else torch.Tensor.backward
    losses = [_step(model, optim, "mlp", step, backward) for step in range(STEPS)]
    return losses, seen


def test_backward_on_another_thread_trains() -> None:
    results = run_on_ranks(2, _backward_on_another_thread, True)
    baseline = run_on_ranks(2, _backward_on_another_thread, False)
    for rank, ((losses, seen), (plain, seen_plain)) in enumerate(
        zip(results, baseline, strict=True)
    ):
        assert losses == plain, f"rank {rank}: losses {losses} != {plain} with one thread"
        assert seen == seen_plain == [False] * STEPS, f"rank {rank}: {seen} / {seen_plain}"
