"""Recovery: a step that raises in forward or halfway through backward, then
``reset_iter_state()`` on the root, then training goes on as if the step never happened.

The sharded model trains in lockstep with a reference that skips the failed step (see
`tests/parity/lockstep.py`). The failure is planted in the middle of block 1, between its two linear
layers, so at the moment it fires some groups have reduce-scatters in flight or reduced shards
waiting, one group has half of its unsharded gradients, and (in forward) a prefetched gather is
pending. None of it may survive the reset: torch 2.13 leaves the failed step's gradients on the
root's parameters, where the next step adds to them; fsdp2 must not.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import expecttest
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from tests.errors import TRIPWIRE, Tripwire
from tests.harness import IMPL_UNDER_TEST, run_on_ranks
from tests.models import MLP_DIM, MLP_IN, MLP_OUT, Batch
from tests.parity import Lockstep, close, count, full

NUM_STEPS, FAIL_STEP = 4, 2


class FragileStack(nn.Module):
    """Blocks of two linear layers; ``armed`` plants a failure before block 1's second one."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(MLP_IN, MLP_DIM), nn.Tanh(), nn.Linear(MLP_DIM, MLP_IN))
            for _ in range(3)
        )
        self.head = nn.Linear(MLP_IN, MLP_OUT)
        self.armed: str | None = None  # "forward", "backward" or None
        self.blocks[1][2].register_forward_pre_hook(self._trip)

    def _trip(self, module: nn.Module, args: tuple[torch.Tensor, ...]) -> Any:
        if self.armed == "forward":
            raise RuntimeError(f"{TRIPWIRE} in forward")
        if self.armed == "backward":
            return (Tripwire.apply(args[0]),)
        return None

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return F.mse_loss(self.head(x), y)


def _batch(gen: torch.Generator, n: int) -> Batch:
    return torch.randn(n, MLP_IN, generator=gen), torch.randn(n, MLP_OUT, generator=gen)


def _sharded_fragile(impl: str) -> Lockstep:
    from tests.harness import fsdp_api

    fully_shard = fsdp_api(impl).fully_shard
    t = Lockstep(FragileStack, _batch)
    for block in t.model.blocks:
        fully_shard(block)
    fully_shard(t.model)
    t.make_optimizers()
    return t


def _fail(t: Lockstep, where: str, step: int, micro: int = 0) -> None:
    """Run a forward and backward that raise at ``where``, then reset."""
    t.model.armed = where
    try:
        t.model(*t.local(step, micro)).backward()
    except RuntimeError as e:
        if TRIPWIRE not in str(e):
            raise
    else:
        raise AssertionError(f"the tripwire in {where} did not fire")
    finally:
        t.model.armed = None
    t.model.reset_iter_state()


def _leftovers(t: Lockstep) -> dict[str, Any]:
    """What a reset must leave behind: sharded parameters (unchanged) and no gradients."""
    for (name, p), ref_p in zip(t.model.named_parameters(), t.ref.parameters(), strict=True):
        if not isinstance(p, DTensor):
            raise AssertionError(f"{name} is still unsharded after reset_iter_state()")
        close(f"after reset, param {name}", full(p), ref_p.detach())
    return {
        "grads": [n for n, p in t.model.named_parameters() if p.grad is not None],
        "training states": sorted({repr(s).split(", ")[2] for s in _states(t.model)}),
    }


def _states(model: nn.Module) -> list[Any]:
    return [m._get_fsdp_state() for m in model.modules() if hasattr(m, "_get_fsdp_state")]


def _recover(impl: str, where: str) -> dict[str, Any]:
    from fsdp2.engine.collectives import record_collectives

    t = _sharded_fragile(impl)
    comms: list[Counter[str]] = []
    leftovers: dict[str, Any] = {}
    for step in range(NUM_STEPS):
        if step == FAIL_STEP:
            _fail(t, where, step)
            leftovers = _leftovers(t)
            # No zero_grad here: whatever the failed step left would add to the next step's.
            continue
        with record_collectives() as records:
            t.forward_backward(step)
        comms.append(count(records, "all_gather") + count(records, "reduce_scatter"))
        t.check_grads(f"step {step}")
        t.optim_step()
    t.check_params("after training")
    return {"comms": comms, **leftovers}


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_reset_iter_state_after_failed_step(where: str, fsdp2_only: None) -> None:
    from fsdp2.engine.coalesce import coalesce_bytes

    for result in run_on_ranks(2, _recover, "fsdp2", where):
        assert result["grads"] == []
        assert result["training states"] == ["IDLE"]
        # The steps after the failure communicate exactly like those before it (with coalescing,
        # like step 1: step 0 has no recorded order to coalesce by, [Note: coalesced gathers]).
        comms = result["comms"] if not coalesce_bytes() else result["comms"][1:]
        assert all(c == comms[0] for c in comms), result["comms"]


def _recover_accumulation() -> dict[str, Any]:
    """A failure on the second of three no-sync micro-steps invalidates the whole sequence:
    the first micro-step's unreduced gradients must go too, and the step restarts."""
    t = _sharded_fragile("fsdp2")
    t.model.set_requires_gradient_sync(False)
    t.model(*t.local(0, 0)).backward()  # a micro-step that is thrown away with the failure
    _fail(t, "backward", 0, 1)
    leftovers = _leftovers(t)
    for micro in range(3):
        t.model.set_requires_gradient_sync(micro == 2)
        t.forward_backward(0, micro + 10)  # fresh micro-batches; the reference sees only these
    t.check_grads("after the restarted accumulation")
    t.optim_step()
    t.check_params("after training")
    return leftovers


def test_reset_iter_state_drops_unreduced_accumulation(fsdp2_only: None) -> None:
    for leftovers in run_on_ranks(2, _recover_accumulation):
        assert leftovers == {"grads": [], "training states": ["IDLE"]}


def _reset_messages() -> dict[str, str]:
    t = _sharded_fragile("fsdp2")
    messages = {}
    t.model.reset_iter_state()  # before any forward: nothing to reset, no error
    t.forward_backward(0)
    t.optim_step()
    t.model.reset_iter_state()  # after a clean step: harmless
    for name, module in (("block", t.model.blocks[0]), ("root", t.model)):
        try:
            module.reset_iter_state()
            messages[name] = "no error"
        except RuntimeError as e:
            messages[name] = f"RuntimeError: {e}"
    t.forward_backward(1)  # and training still works
    t.check_grads("step 1")
    return messages


@pytest.mark.skipif(IMPL_UNDER_TEST != "fsdp2", reason="pins fsdp2's messages")
class TestResetOnNonRoot(expecttest.TestCase):
    def test_reset_iter_state_on_non_root_raises(self) -> None:
        results = run_on_ranks(2, _reset_messages)
        assert results[0] == results[1]
        self.assertEqual(results[0]["root"], "no error")
        self.assertExpectedInline(
            results[0]["block"],
            """RuntimeError: reset_iter_state() was called on FSDPSequential (blocks.0), which is not the root fsdp2 module; call it on the module you run forward on""",
        )
