"""Copies of the state taken on another thread, consistent across an optimizer step.

``fsdp2.consistent_state`` ([Note: consistent state] in fsdp2/engine/steps.py) holds the next
optimizer step while a taker copies; with a process group, the takers of all ranks agree on
one step. The copies here are slow on purpose (a pause per tensor, ~0.1 s a copy, several of the
training's steps), so without the hold they would mix the parameters and the optimizer state of
consecutive steps, and ranks would copy at different steps:

- ``test_slow_copies_hold_one_step``: every copy equals, bit for bit, the state the training
  thread recorded after the step the context named; the ranks name the same steps; the losses
  equal a run without a taker. With AdamW, and with distributed Muon, whose step exchanges
  matrices between ranks (a hold taken while a peer waits in that step's exchange would
  deadlock: a step in flight is let end).
- ``test_saves_from_a_taker_thread``: ``dcp.save`` (written inside the context) and
  ``dcp.async_save`` (staged inside, written after) issued by a taker thread while training
  goes on, on the takers' group; each checkpoint loads back (at another world size) equal to the
  state after its step.
- ``test_a_raised_step_does_not_wedge_the_hold``: one rank, no group: an optimizer step that
  raised leaves no hold stuck for later copies.
- ``test_compiled_steps_count_and_plain_ones_do_not``: a compiled ``optimizer.step`` counts
  (its hooks run eagerly); an optimizer of plain tensors does not.
"""

from __future__ import annotations

import itertools
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from tests.engine.test_state_from_thread import _local, _optim_local, _step
from tests.harness import discard_pool, run_on_ranks
from tests.models import build_model
from tests.parity import MODEL_SEED, adamw, shard_model

pytestmark = pytest.mark.usefixtures("fsdp2_only")

STEPS = 12
COPIES = 3
PAUSE_S = 0.004  # per tensor copied: a copy spans several of the MLP's steps


def _state(model: nn.Module, optim: torch.optim.Optimizer, pause: float = 0.0) -> dict[str, Any]:
    """This rank's parameters and optimizer state, copied one tensor at a time."""
    model_sd, optim_sd = get_state_dict(model, optim)
    out: dict[str, torch.Tensor] = {}
    for way, tensors in (("param", _local(model_sd)), ("optim", _optim_local(optim_sd))):
        for key, value in tensors.items():
            out[f"{way}/{key}"] = value.clone()
            time.sleep(pause)
    return out


def _differences(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    if sorted(got) != sorted(want):
        return [f"keys {sorted(got)} != {sorted(want)}"]
    return [key for key, value in want.items() if not torch.equal(got[key], value)]


def _optimizer(model: nn.Module, name: str) -> torch.optim.Optimizer:
    if name == "muon":  # its step exchanges matrices between ranks: a step that communicates
        from fsdp2.optim import Muon

        params = list(model.parameters())
        matrices = [p for p in params if p.dim() == 2]
        return Muon(matrices, lr=0.02, adamw_params=[p for p in params if p.dim() != 2])
    return adamw(model.parameters())


def _train_with_taker(take: str, ckpt: str = "", optimizer: str = "adamw") -> dict[str, Any]:
    """Train ``STEPS`` steps, recording the state after each; with ``take`` ("copy", "save",
    "async_save"), a taker thread makes ``COPIES`` copies (or checkpoints) inside
    ``consistent_state`` from the first step on."""
    import fsdp2
    from fsdp2.engine.steps import optimizer_steps

    model = build_model("mlp", MODEL_SEED)
    shard_model(model, "mlp")
    optim = _optimizer(model, optimizer)
    takers = dist.new_group(backend="gloo")
    records: dict[int, dict[str, torch.Tensor]] = {}
    taken: list[tuple[int, Any]] = []
    errors: list[str] = []
    stepped = threading.Event()

    def taker() -> None:
        stepped.wait(timeout=60)
        try:
            for i in range(COPIES):
                with fsdp2.consistent_state(takers) as step:
                    if take == "copy":
                        taken.append((step, _state(model, optim, PAUSE_S)))
                        continue
                    model_sd, optim_sd = get_state_dict(model, optim)
                    state = {"model": model_sd, "optim": optim_sd}
                    if take == "save":  # written inside the hold: training waits for it
                        dcp.save(state, checkpoint_id=f"{ckpt}/{i}", process_group=takers)
                    else:  # staged inside, written after
                        written = dcp.async_save(
                            state, checkpoint_id=f"{ckpt}/{i}", process_group=takers
                        )
                    taken.append((step, f"{ckpt}/{i}"))
                if take == "async_save":
                    written.result()  # the writing, after the hold: training went on
                time.sleep(0.02)
        except BaseException as error:
            errors.append(repr(error))

    thread = threading.Thread(target=taker, daemon=True)
    losses = []
    for step in range(STEPS):
        losses.append(_step(model, optim, "mlp", step))
        records[optimizer_steps()] = _state(model, optim)
        if step == 0 and take:
            thread.start()
            stepped.set()
    if take:
        thread.join(timeout=120)
    return {"losses": losses, "records": records, "taken": taken, "errors": errors}


def _results(
    take: str, ckpt: str = "", optimizer: str = "adamw"
) -> tuple[list[dict[str, Any]], list[list[float]]]:
    discard_pool(2)  # fresh ranks: the takers' gloo group and DCP's writer thread stay out
    try:
        results = run_on_ranks(2, _train_with_taker, take, ckpt, optimizer)
        plain = run_on_ranks(2, _train_with_taker, "", "", optimizer)
    finally:
        discard_pool(2)
    for rank, result in enumerate(results):
        assert not result["errors"], f"rank {rank}: the taker failed: {result['errors']}"
        assert len(result["taken"]) == COPIES, f"rank {rank}: {len(result['taken'])} copies"
    steps = [[step for step, _ in result["taken"]] for result in results]
    assert steps[0] == steps[1], f"the ranks copied at different steps: {steps}"
    return results, [result["losses"] for result in plain]


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_slow_copies_hold_one_step(optimizer: str) -> None:
    results, plain = _results("copy", "", optimizer)
    for rank, result in enumerate(results):
        records = result["records"]
        steps = sorted(records)
        # Consecutive steps' states differ, so a copy of the wrong step cannot pass.
        for a, b in itertools.pairwise(steps):
            assert _differences(records[a], records[b]), f"steps {a} and {b} hold the same state"
        for step, copy in result["taken"]:
            assert step in records, f"rank {rank}: copied at step {step}, not one it recorded"
            differ = _differences(copy, records[step])
            assert not differ, f"rank {rank}: the copy at step {step} differs in {differ}"
        assert result["losses"] == plain[rank], f"rank {rank}: losses changed by the taker"


def _load(ckpt: str) -> dict[str, torch.Tensor]:
    """The checkpoint ``ckpt`` loaded into a fresh sharded model and optimizer, gathered to full
    tensors (comparable across world sizes)."""
    model = build_model("mlp", MODEL_SEED + 1)
    shard_model(model, "mlp")
    optim = adamw(model.parameters())
    _step(model, optim, "mlp", 0)  # the optimizer's state exists to load into
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=ckpt)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return _full(model, optim)


def _full(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    model_sd, optim_sd = get_state_dict(model, optim)

    def full(value: torch.Tensor) -> torch.Tensor:
        return value.full_tensor() if isinstance(value, DTensor) else value.clone()

    out = {f"param/{k}": full(v) for k, v in model_sd.items() if isinstance(v, torch.Tensor)}
    for fqn, per_param in optim_sd["state"].items():
        out.update(
            {
                f"optim/{fqn}/{name}": full(v)
                for name, v in per_param.items()
                if isinstance(v, torch.Tensor)
            }
        )
    return out


def _joined(per_rank: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Full tensors from the ranks' shards (dim-0 chunks in rank order; a 0-d tensor, AdamW's
    step, is the same on every rank)."""
    return {
        key: value if value.dim() == 0 else torch.cat([shards[key] for shards in per_rank])
        for key, value in per_rank[0].items()
    }


@pytest.mark.parametrize("take", ["save", "async_save"])
def test_saves_from_a_taker_thread(take: str, tmp_path: Path) -> None:
    results, plain = _results(take, str(tmp_path))
    for rank, result in enumerate(results):
        assert result["losses"] == plain[rank], f"rank {rank}: losses changed by the saves"
    for step, ckpt in results[0]["taken"]:
        want = _joined([result["records"][step] for result in results])
        got = run_on_ranks(1, _load, ckpt)[0]  # at world size 1: the full tensors
        differ = _differences(got, want)
        assert not differ, f"the checkpoint of step {step} differs in {differ}"


class _RaisesOnce(torch.optim.SGD):
    def __init__(self, params: Any) -> None:
        super().__init__(params, lr=0.1)
        self.raised = False

    def step(self, closure: Any = None) -> Any:
        if not self.raised:
            self.raised = True
            raise RuntimeError("a step that fails")
        return super().step(closure)


def _sharded_weight() -> nn.Parameter:
    """A DTensor parameter with a gradient, on this rank's 1-D mesh: what counts as a step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    weight = nn.Parameter(distribute_tensor(torch.ones(4), mesh, [Shard(0)]))
    weight.grad = distribute_tensor(torch.ones(4), mesh, [Shard(0)])
    return weight


def _raised_step() -> dict[str, Any]:
    import fsdp2
    from fsdp2.engine.steps import optimizer_steps, watch_optimizer_steps

    watch_optimizer_steps()
    before = optimizer_steps()
    optim = _RaisesOnce([_sharded_weight()])
    try:
        optim.step()
    except RuntimeError:
        pass
    # The failed step looks in flight until this thread steps again: a taker waits for that.
    seen: list[int] = []

    def taker() -> None:
        with fsdp2.consistent_state() as step:
            seen.append(step)

    thread = threading.Thread(target=taker)
    thread.start()
    time.sleep(0.1)
    optim.step()
    thread.join(timeout=10)
    with fsdp2.consistent_state() as between:  # on the stepping thread, between steps: no wait
        pass
    return {"before": before, "seen": seen, "after": optimizer_steps(), "between": between}


def test_a_raised_step_does_not_wedge_the_hold() -> None:
    got = run_on_ranks(1, _raised_step)[0]
    # The failed step counts as one (it may have written), then the copy, then the new step.
    assert got["seen"] == [got["before"] + 1], got
    assert got["after"] == got["between"] == got["before"] + 2, got


def _compiled_steps() -> dict[str, Any]:
    import warnings

    import torch._dynamo  # loaded, as by a model compiled before fully_shard
    from torch.optim.optimizer import _global_optimizer_pre_hooks

    from fsdp2.engine import steps
    from fsdp2.engine.steps import optimizer_steps, watch_optimizer_steps

    watch_optimizer_steps()
    assert torch._dynamo is not None
    ours = [
        hook
        for hook in _global_optimizer_pre_hooks.values()
        if getattr(hook, "__wrapped__", hook) is steps._before_step
    ]
    optim = torch.optim.AdamW([_sharded_weight()], lr=0.1)
    optim.step()  # the state exists before the compiled steps
    step = torch.compile(optim.step, backend="eager")
    before = optimizer_steps()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            step()
    compiled = optimizer_steps() - before
    plain = nn.Parameter(torch.ones(4))
    plain.grad = torch.ones(4)
    torch.optim.SGD([plain], lr=0.1).step()  # no sharded parameter: not counted
    return {
        "hooks": len(ours),
        "eager": ours[0] is not steps._before_step,  # wrapped by torch.compiler.disable
        "compiled": compiled,
        "plain": optimizer_steps() - before - compiled,
        "traced": [str(w.message) for w in caught if "get_ident" in str(w.message)],
    }


def test_compiled_steps_count_and_plain_ones_do_not() -> None:
    """``torch.compile(optimizer.step)`` (torch's recipe for a faster step): every compiled step
    counts. Where the hooks were installed after dynamo was loaded they run eagerly, not traced
    (dynamo warned on their thread ids and locks); the rank pool's process may have installed
    them before, so that part is checked only where it was after. An optimizer of plain tensors
    only does not count: it may step on some ranks only (a probe, one rank's head), and would
    part the ranks' counts."""
    got = run_on_ranks(1, _compiled_steps)[0]
    assert got["hooks"] == 1 and got["compiled"] == 3 and got["plain"] == 0, got
    if got["eager"]:
        assert got["traced"] == [], got


def test_a_taker_runs_none_of_the_trainings_deferred_checks() -> None:
    """The checks a training thread deferred (a coalesced gather's headers on an accelerator)
    wait for its next collective: a thread taking state, whose own collectives pass the seam
    too, leaves them to it (run there, one could raise in the taker and drop the training's)."""
    from fsdp2.engine.collectives import defer_check, run_deferred_checks, taking_state

    ran: list[str] = []

    def taker() -> None:
        with taking_state():
            run_deferred_checks()  # what a taker's collective does first
        ran.append("taker done")

    defer_check(lambda: ran.append("check"))
    thread = threading.Thread(target=taker)
    thread.start()
    thread.join()
    assert ran == ["taker done"]
    run_deferred_checks()  # the training thread's next collective
    assert ran == ["taker done", "check"]
