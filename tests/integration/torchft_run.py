"""One rank of a torchft replica group training a sharded MLP, as torchtitan's fault-tolerant
trainer sets it up; started by ``torchft_agent.py`` (for ``test_torchft.py``), which plays
torchrun's part: it starts the two ranks of a group and, when one dies, stops the other and
starts both again.

Each replica group shards the model over its own 2 ranks (``fully_shard`` on each block and on
the root, the default process group of the group); the groups average their reduced gradients
through ``set_all_reduce_hook`` over torchft's ``ManagedProcessGroup``, and a ``torchft.Manager``
(gloo, ``min_replica_size=2``) decides every step in a quorum with the Lighthouse the test runs.
A group that (re)starts behind the others heals from a peer: torchft fetches the peer's
``get_state_dict(model, optimizer)`` and this rank loads it with ``set_state_dict``.

The data depend only on (group, rank, committed step), so a step that is not committed (a peer
died during it) is taken again with the same batch, and every committed step of every run,
whatever failed in it, trains on the same numbers. The forward waits for the quorum halfway
([Note: a forward that outlasts the quorum]).

Environment (as torchrun sets it): ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``,
``TORCHELASTIC_RESTART_COUNT``; ``TORCHFT_LIGHTHOUSE``: the Lighthouse's address.

Written to ``<out>/g<group>r<rank>.jsonl``, one JSON object a line, parsed by the test:

    {"event": "start", "attempt": a, "pid": p}
    {"event": "step", "attempt": a, "step": s, "loss": hex, "committed": c, "healed": bool}
        one per training iteration: the step it trained for (the manager's step after the
        quorum), the loss (``float.hex``: exact), the step it committed (null: none), whether
        this rank loaded a peer's state in it
    {"event": "done", "attempt": a, "weights": path}
        the full parameters (``full_tensor()``, fp32) saved with ``torch.save`` at ``path``

``--die-at STEP:WHERE`` makes the rank send itself SIGKILL (``kill -9``) at training step STEP:
``forward`` (after the forward, before the backward) or ``backward`` (in the all-reduce hook of
the first reduced group, its peers waiting in collectives).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

if __package__ in (None, ""):  # run as a script: make `fsdp2` and `tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

WIDTH, IN, OUT, BATCH = 32, 16, 8, 4


def build_model() -> nn.Module:
    """Three blocks (Linear, ReLU) and a head, seeded alike in every group and attempt."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(IN if i == 0 else WIDTH, WIDTH), nn.ReLU()) for i in range(3)]
    return nn.Sequential(*blocks, nn.Linear(WIDTH, OUT))


def batch(group: int, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of the step's batch: a function of (group, rank, step) only."""
    gen = torch.Generator().manual_seed(10_000 * step + 100 * group + rank)
    return torch.randn(BATCH, IN, generator=gen), torch.randn(BATCH, OUT, generator=gen)


def parse_die_at(text: str | None) -> tuple[int, str] | None:
    if not text:
        return None
    step, where = text.split(":")
    if where not in ("forward", "backward"):
        raise ValueError(f"--die-at: expected STEP:forward or STEP:backward, got {text!r}")
    return int(step), where


class Recorder:
    """Appends this rank's JSON lines (the module docstring lists them) to its file."""

    def __init__(self, out: Path, group: int, rank: int, attempt: int) -> None:
        self.file = open(out / f"g{group}r{rank}.jsonl", "a")
        self.attempt = attempt

    def __call__(self, **fields: Any) -> None:
        self.file.write(json.dumps({"attempt": self.attempt, **fields}) + "\n")
        self.file.flush()


def shard(model: nn.Module, impl: str) -> type:
    """``fully_shard`` each block, then the root, with ``impl``'s; returns its ``FSDPModule``."""
    if impl == "fsdp2":
        from fsdp2 import FSDPModule, fully_shard
    else:
        from torch.distributed.fsdp import FSDPModule, fully_shard
    for block in model:
        fully_shard(block)
    fully_shard(model)
    return FSDPModule


@dataclass
class StepState:
    """What happened in the current training step, across the training and quorum threads."""

    healed: bool = False  # this rank loaded a peer's state
    reduced: bool = False  # an all-reduce hook ran
    in_forward: threading.Event = field(default_factory=threading.Event)  # the forward waits

    def new_step(self) -> None:
        self.healed = self.reduced = False
        self.in_forward.clear()


def make_manager(args: argparse.Namespace, model: nn.Module, inner: Any, now: StepState) -> Any:
    """A torchft ``Manager`` for this group: the state a peer heals from is
    ``get_state_dict(model, optimizer)`` (torchtitan's shape of it), loaded with
    ``set_state_dict``.

    [Note: a forward that outlasts the quorum] With the asynchronous quorum, torchft takes the
    state for a peer's heal on its quorum thread while this rank trains; for a model whose
    forward is longer than a quorum that is inside the forward. This MLP's forward takes a
    millisecond, so the runner makes it so: the state is taken once the training thread is
    inside the forward (``now.in_forward``), and the forward waits there for the quorum. Where
    the state is taken is then the same on every run. The synchronous quorum takes it before
    the forward, with the training thread waiting: no wait."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torchft import Manager, ProcessGroupGloo

    asynchronous = args.quorum == "async"

    def state_dict() -> dict[str, Any]:
        if asynchronous and not now.in_forward.wait(timeout=60):
            raise AssertionError("the training thread never reached the forward's wait")
        model_sd, optim_sd = get_state_dict(model, inner)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(sd: dict[str, Any]) -> None:
        set_state_dict(model, inner, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        now.healed = True

    return Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=10)),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=2,  # a lone survivor waits in the quorum for its peer to come back
        use_async_quorum=asynchronous,
        replica_id=f"torchft_run_{args.group}",
        timeout=timedelta(seconds=20),
        # Longer than the test's bound on a run: a survivor waits for a slow restart (a busy
        # machine: restarted ranks were seen taking over 90 s to import torch at load 40).
        quorum_timeout=timedelta(seconds=300),
        connect_timeout=timedelta(seconds=10),
    )


def hook_up(model: nn.Module, fsdp_module: type, manager: Any, die_at: Any, now: StepState) -> None:
    """The replica groups' gradient average (torchtitan's: ``set_all_reduce_hook`` on every
    FSDP module, ``all_reduce(AVG)`` over the ``ManagedProcessGroup``), the ``backward`` kill
    point, and the forward's wait for the quorum."""
    from torchft.process_group import ManagedProcessGroup

    replicate_pg = ManagedProcessGroup(manager)
    replicate_pg.register("dp_replicate")

    def all_reduce_hook(grad: torch.Tensor) -> None:
        if die_at == (manager.current_step(), "backward") and not now.reduced:
            os.kill(os.getpid(), signal.SIGKILL)
        now.reduced = True
        dist.all_reduce(grad, group=replicate_pg, op=dist.ReduceOp.AVG)

    for module in model.modules():
        if isinstance(module, fsdp_module):
            module.set_all_reduce_hook(all_reduce_hook)

    def forward_outlasts_quorum(module: nn.Module, inputs: Any) -> None:
        # [Note: a forward that outlasts the quorum] (synchronous quorum: over already)
        now.in_forward.set()
        manager.wait_quorum()

    # Registered after fully_shard's own hooks: the second block is unsharded when it runs.
    model[1].register_forward_pre_hook(forward_outlasts_quorum)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=("fsdp2", "torch"), required=True)
    parser.add_argument("--group", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--quorum", choices=("sync", "async"), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--die-at", default=None)
    args = parser.parse_args()
    from torchft import Optimizer

    rank = int(os.environ["RANK"])
    record = Recorder(args.out, args.group, rank, int(os.environ["TORCHELASTIC_RESTART_COUNT"]))
    record(event="start", pid=os.getpid())
    die_at = parse_die_at(args.die_at)
    # The group's own store and process group (rank 0 hosts the store), bounded: a peer that
    # died is found by a broken connection at once, ranks out of step by this timeout.
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))

    model = build_model()
    fsdp_module = shard(model, args.impl)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    now = StepState()
    manager = make_manager(args, model, inner, now)
    optimizer = Optimizer(manager, inner)  # zero_grad starts the quorum, step commits
    hook_up(model, fsdp_module, manager, die_at, now)

    while manager.current_step() < args.steps:
        now.new_step()
        optimizer.zero_grad()
        step = manager.current_step()
        x, y = batch(args.group, rank, step)
        loss = nn.functional.mse_loss(model(x), y)
        if die_at == (step, "forward"):
            os.kill(os.getpid(), signal.SIGKILL)
        loss.backward()
        optimizer.step()
        # The step committed (None: not committed): the step trained for, unless this rank
        # healed in the step's should_commit (asynchronous quorum), then the peer's.
        committed = manager.current_step() - 1 if manager.current_step() > step else None
        record(
            event="step",
            step=step,
            loss=loss.item().hex(),
            committed=committed,
            healed=now.healed,
        )

    weights = args.out / f"g{args.group}r{rank}.pt"
    torch.save({name: p.full_tensor() for name, p in model.named_parameters()}, weights)
    record(event="done", weights=str(weights))
    manager.shutdown(wait=False)
    # Results are written; leave without the interpreter's teardown (gloo on torch 2.13 can abort
    # at exit, which an agent would take for a failure and restart the group for).
    os._exit(0)


if __name__ == "__main__":
    main()
