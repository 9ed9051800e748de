"""Rank-side scenarios for `tests/debug/test_hang.py`: the ways ranks stop issuing matching
collectives.

Each scenario trains a small stack on its own fresh process group (so a half-done collective
leaves the pool's default group intact for the next scenario) and returns, per rank, what ended
its step: ``"<ErrorType>: <message>"`` with times normalised, or what the rank did instead.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

if __package__ in (None, ""):  # run as a script by torchrun: make `tests` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fsdp2 import FSDPModule
from fsdp2.engine.modes import Zero2
from tests.errors import Tripwire

DIM, OUT, WINDOW = 8, 4, 4
TIMEOUT_S = 1.5  # FSDP2_COLLECTIVE_TIMEOUT in these scenarios
# busy_store's: rank 1 must have issued its whole part of the step when rank 0 reports, and its
# publisher must answer within the report's window (a quarter of this); 1.5 s was too short
# beside a heavy load (load average 15-35 on 2 cores), where rank 1 was still mid-step.
BUSY_STORE_TIMEOUT_S = 6.0


class Gated(nn.Module):
    """One fully_shard group whose second layer runs only when asked (a gate, an MoE group)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        return self.a(x) + self.b(x) if use_b else self.a(x)


class Stack(nn.Module):
    """Blocks, two experts and a long-context layer, with switches that make ranks diverge."""

    def __init__(self, gated: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(3))
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(2))
        self.long_context = nn.Linear(DIM, DIM)  # only for sequences longer than WINDOW
        self.gated = Gated() if gated else None
        self.head = nn.Linear(DIM, OUT)
        self.skip: set[int] = set()  # block indices this rank skips
        self.num_experts = 2  # this rank's router picks experts[:num_experts]
        self.trip = False  # raise in backward, between blocks 1 and 2
        self.gate_b = True  # whether gated.b runs (gated is one fully_shard group)
        self.group: dist.ProcessGroup | None = None  # the group it is sharded over

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if i not in self.skip:
                x = torch.tanh(block(x))
            if i == 1 and self.trip:
                x = Tripwire.apply(x)
        x = sum((expert(x) for expert in self.experts[: self.num_experts]), torch.zeros_like(x))
        if x.shape[1] > WINDOW:
            x = self.long_context(x)
        if self.gated is not None:
            x = self.gated(x, self.gate_b)
        return F.mse_loss(self.head(x), y)


def build(group: dist.ProcessGroup | None = None, gated: bool = False) -> Stack:
    from tests.harness import fsdp_api

    fully_shard = fsdp_api("fsdp2").fully_shard
    torch.manual_seed(0)
    model = Stack(gated)
    model.group = group  # for the scenarios' own collectives (the scaler's)
    mesh = None if group is None else DeviceMesh.from_group(group, "cpu")
    for module in [*model.blocks, *model.experts, model.long_context, model.gated]:
        if module is not None:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def batch(step: int, seq: int = WINDOW) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return torch.randn(2, seq, DIM, generator=gen), torch.randn(2, seq, OUT, generator=gen)


def outcome(fn: Callable[[], Any]) -> str:
    try:
        result = fn()
    except Exception as e:
        return normalise(f"{type(e).__name__}: {e}")
    return str(result)


def normalise(text: str) -> str:
    """Times vary from run to run: ``2.3 s`` -> ``N s``."""
    return re.sub(r"\b\d+\.\d+ s\b", "N s", text)


def logged_report(
    proc: subprocess.CompletedProcess[str], deadline_s: float, backend_timeout_s: float
) -> tuple[dict[str, Any], str]:
    """A scenario whose rank 0 prints one JSON line (``logged``: ``(seconds, message)`` pairs):
    that line and the one hang report it logged, checked to be logged between fsdp2's deadline
    and the group's own timeout (a wait fsdp2 cannot end itself)."""
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, proc.stdout + proc.stderr
    (line,) = lines
    reports = [(t, m) for t, m in line["logged"] if "FSDP2_COLLECTIVE_TIMEOUT) for" in m]
    assert len(reports) == 1, line["logged"]
    when, report = reports[0]
    assert deadline_s <= when < backend_timeout_s, line["logged"]
    return line, report


def _step(model: Stack, step: int, seq: int = WINDOW) -> str:
    model(*batch(step, seq)).backward()
    return "finished the step"


def _skipped_block(model: Stack) -> str:
    model.skip = {1} if dist.get_rank() == 1 else set()
    return _step(model, 0)


def _skipped_kept_block(model: Stack) -> str:
    """Blocks kept gathered after forward (backward issues reduce-scatters only); a step in
    which rank 1 skips block 1: the ranks' reduce-scatters then differ (coalesced: in their
    buckets, which once gloo aborted the process on, their sizes differing)."""
    for block in model.blocks:
        cast(FSDPModule, block).set_reshard_after_forward(False)
    _step(model, 0)
    model.skip = {1} if dist.get_rank() == 1 else set()
    return _step(model, 1)


def _expert_on_rank0(model: Stack) -> str:
    model.num_experts = 2 if dist.get_rank() == 0 else 1
    return _step(model, 0)


def _raise_in_backward(model: Stack) -> str:
    model.trip = dist.get_rank() == 1
    return _step(model, 0)


def _batch_shapes(model: Stack) -> str:
    return _step(model, 0, seq=WINDOW + 2 * dist.get_rank())  # rank 1: longer sequences


def _never_enters(model: Stack) -> str:
    _step(model, 0)
    if dist.get_rank() == 1:
        return "skipped step 1"  # e.g. its data loader ran out a batch early
    return _step(model, 1)


def _silent_peer(model: Stack) -> str:
    """``never_enters`` with rank 1's publisher silenced after its step (a stand-in for a thread
    that the machine does not run, or a call holding the GIL): the report's ask goes unanswered,
    and rank 1's entry is the one it wrote by hand after its step."""
    from fsdp2.debug import hang

    assert model.group is not None
    store = dist.distributed_c10d._get_default_store()
    key = f"hang_scenarios/silent_peer/{model.group.group_name}"  # a fresh group: a fresh key
    _step(model, 0)
    if dist.get_rank() == 0:
        try:
            return _step(model, 1)
        finally:
            store.set(key, "reported")
    serve = hang._Rank.serve
    hang._Rank.serve = lambda self: None
    try:
        hang._rank_of(model.group).publish()
        store.wait([key], timedelta(seconds=60))
    finally:
        hang._Rank.serve = serve
        store.delete_key(key)
    return "skipped step 1"


def _eval_on_rank0(model: Stack) -> str:
    if dist.get_rank() == 0:  # e.g. a validation loss, logged by rank 0 only
        with torch.no_grad():
            model(*batch(99))
    return _step(model, 0)


def _unused_param(model: Stack) -> str:
    model.gate_b = dist.get_rank() == 0  # rank 1: gated.b gets no gradient
    return _step(model, 0)


def _unused_param_fixed(model: Stack) -> str:
    """The fix the mismatch report suggests: reduce zeros for parameters without gradients."""
    assert model.gated is not None
    cast(FSDPModule, model.gated).set_reduce_scatter_unused_params(True)
    return _unused_param(model)


def _scaler_step_on_rank0(model: Stack) -> str:
    """fp16-style loss scaling; rank 1 skips the optimizer step (its data ran out), so only
    rank 0 enters the scaler's found-inf all-reduce."""
    from fsdp2 import ShardedGradScaler

    scaler = ShardedGradScaler(device="cpu", process_group=model.group)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(*batch(0))).backward()
    if dist.get_rank() == 0:
        scaler.step(optim)
        scaler.update()
    return _step(model, 1)


def _zero2_step_on_rank0(model: Stack) -> str:
    """memory_mode="zero2" (parameters kept gathered between steps): rank 1 skips an optimizer
    step, so only rank 0's next forward gathers its kept copies again."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_reshard_after_forward(False)
            for group in module._groups(recurse=False):
                group.set_mode(Zero2())  # what memory_mode="zero2" sets up
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(model, 0)
    if dist.get_rank() == 0:
        optim.step()
    return _step(model, 1)


SCENARIOS: dict[str, Callable[[Stack], str]] = {
    "skipped_block": _skipped_block,
    "skipped_kept_block": _skipped_kept_block,
    "expert_on_rank0": _expert_on_rank0,
    "raise_in_backward": _raise_in_backward,
    "batch_shapes": _batch_shapes,
    "never_enters": _never_enters,
    "silent_peer": _silent_peer,
    "eval_on_rank0": _eval_on_rank0,
    "unused_param": _unused_param,
    "unused_param_fixed": _unused_param_fixed,
    "scaler_step_on_rank0": _scaler_step_on_rank0,
    "zero2_step_on_rank0": _zero2_step_on_rank0,
}
# Scenarios run with the checks on only: what they pin is the checks' report. (Off, the scaler's
# 4-byte all-reduce meets a peer's all-gather, and gloo aborts the process on the size mismatch.)
CHECKS_ONLY = ("eval_on_rank0", "unused_param", "unused_param_fixed", "scaler_step_on_rank0")


def run_scenarios(
    names: list[str], checks: bool, coalesce: int = 0
) -> dict[str, tuple[str, float]]:
    """Each scenario on a fresh group: (what ended this rank's step, seconds it took), with
    all-gathers coalesced up to ``coalesce`` bytes (0: each group's own)."""
    import fsdp2
    from fsdp2.engine.coalesce import coalesce_bytes, set_coalesce_bytes

    results = {}
    os.environ["FSDP2_COLLECTIVE_TIMEOUT"] = str(TIMEOUT_S)
    fsdp2.set_collective_checks(checks)
    saved = coalesce_bytes()
    set_coalesce_bytes(coalesce)
    try:
        for name in names:
            group = dist.new_group(backend="gloo")
            model = build(group, gated=name.startswith("unused_param"))
            start = time.monotonic()
            text = outcome(lambda: SCENARIOS[name](model))  # noqa: B023
            results[name] = (text, time.monotonic() - start)
    finally:
        del os.environ["FSDP2_COLLECTIVE_TIMEOUT"]
        fsdp2.set_collective_checks(False)
        set_coalesce_bytes(saved)
    return results


def train(checks: bool, steps: int = 3) -> dict[str, Any]:
    """A normal run: per-step losses, the collectives fsdp2 recorded and the ``torch.distributed``
    calls it made (counted under the seam, so an unrecorded collective would show)."""
    import fsdp2
    from fsdp2.engine import collectives

    calls: Counter[str] = Counter()

    def counting(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return fn(*args, **kwargs)

        return call

    # Built first: fully_shard's own exchange (every rank agrees on the model) is not a step's.
    model = build()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    patched = {
        (collectives, "_all_gather_single"): collectives._all_gather_single,
        (collectives, "_reduce_scatter_single"): collectives._reduce_scatter_single,
        (dist, "all_reduce"): dist.all_reduce,
        (dist, "all_gather"): dist.all_gather,  # gloo's gathers (collectives._gather)
    }
    for (module, name), fn in patched.items():
        setattr(module, name, counting(name, fn))
    fsdp2.set_collective_checks(checks)
    try:
        losses = []
        with collectives.record_collectives() as records:
            for step in range(steps):
                loss = model(*batch(step))
                loss.backward()
                optim.step()
                optim.zero_grad()
                losses.append(loss.detach())
    finally:
        fsdp2.set_collective_checks(False)
        for (module, name), fn in patched.items():
            setattr(module, name, fn)
    return {
        "losses": losses,
        "records": Counter(r.kind for r in records),
        "calls": sum(calls.values()),
    }


def early_exit_main() -> None:
    """Under torchrun (``tests/hang_scenarios.py early_exit TIMEOUT_S``): rank 1's data runs out
    after one step and its script ends, while rank 0 starts another step. Rank 0 prints one JSON
    line: what ended its step, and how long the step took."""
    import json

    from fsdp2.engine.coalesce import set_coalesce_bytes

    set_coalesce_bytes(0)  # the report pinned names one group's gather
    os.environ["FSDP2_COLLECTIVE_TIMEOUT"] = sys.argv[2]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = build()
    _step(model, 0)
    if dist.get_rank() == 1:
        return  # the loop is over: the interpreter exits
    start = time.monotonic()
    text = outcome(lambda: _step(model, 1))
    line = {"outcome": text, "seconds": time.monotonic() - start}
    sys.stdout.write(json.dumps(line) + "\n")
    sys.stdout.flush()
    os._exit(0)


def busy_store_main() -> None:
    """Under torchrun (``tests/hang_scenarios.py busy_store``), whose store is a TCPStore:
    ``never_enters`` with rank 1's store client busy from before its step until rank 0 has
    reported. A thread of rank 1 waits in the store, as a rendezvous (the next ``new_group``), a
    barrier or a user's ``store.wait`` does; a TCPStore client serves one request at a time, so
    a publisher writing through it would show rank 1 as it was before the step ([Note: fresh
    entries]). Rank 0 prints one JSON line: what ended its second step."""
    import json

    from fsdp2.engine.coalesce import set_coalesce_bytes

    set_coalesce_bytes(0)  # the report pinned names one group's gather
    os.environ["FSDP2_COLLECTIVE_TIMEOUT"] = str(BUSY_STORE_TIMEOUT_S)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    store = dist.distributed_c10d._get_default_store()
    model = build()
    if dist.get_rank() == 1:
        waiter = threading.Thread(target=store.wait, args=(["reported"], timedelta(seconds=60)))
        waiter.start()
        time.sleep(0.2)  # the waiter's request holds the client before the step starts
        _step(model, 0)
        waiter.join()
        return
    _step(model, 0)
    text = outcome(lambda: _step(model, 1))
    sys.stdout.write(json.dumps({"outcome": text}) + "\n")
    sys.stdout.flush()
    store.set("reported", "yes")
    time.sleep(0.5)  # rank 1 reads it before this process, the store's host, ends
    os._exit(0)


if __name__ == "__main__" and sys.argv[1:2] == ["early_exit"]:
    early_exit_main()
if __name__ == "__main__" and sys.argv[1:2] == ["busy_store"]:
    busy_store_main()
