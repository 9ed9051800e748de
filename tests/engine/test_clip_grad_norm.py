"""``clip_grad_norm_`` over sharded gradients equals the unsharded reference's."""

from __future__ import annotations

import torch

from tests.harness import run_on_ranks
from tests.parity import Lockstep, full, shard_model
from tests.tolerance import assert_fp32_close

NUM_STEPS = 3
MAX_NORM = 0.05


def _clip_grad_norm() -> list[float]:
    t = Lockstep("mlp")
    shard_model(t.model, "mlp")
    t.make_optimizers()
    norms = []
    for step in range(NUM_STEPS):
        t.forward_backward(step)
        norm = torch.nn.utils.clip_grad_norm_(t.model.parameters(), MAX_NORM)
        ref_norm = torch.nn.utils.clip_grad_norm_(t.ref.parameters(), MAX_NORM)
        assert_fp32_close(full(norm), ref_norm)
        norms.append(ref_norm.item())
        t.check_grads(f"step {step} clipped")
        t.optim_step()
    t.check_params("after training")
    return norms


def test_clip_grad_norm_over_sharded_grads(fsdp2_only: None) -> None:
    for norms in run_on_ranks(2, _clip_grad_norm):
        assert min(norms) > MAX_NORM  # clipping did something every step
