"""``set_custom_all_gather`` / ``set_custom_reduce_scatter``: user collectives replace the
default ones (and still pass the recording seam), trained next to the unsharded reference."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch
import torch.distributed as dist

from tests.harness import run_on_ranks
from tests.parity import Lockstep, fsdp_modules, labels, shard_model

NUM_STEPS = 3


def _custom_comms() -> dict[str, int]:
    from fsdp2 import AllGather, ReduceScatter, record_collectives

    counts: Counter[str] = Counter()

    class CountingAllGather(AllGather):
        def allocate(
            self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
        ) -> torch.Tensor:
            counts["all_gather.allocate"] += 1
            return torch.empty(size, dtype=dtype, device=device)

        def __call__(
            self,
            output_tensor: torch.Tensor,
            input_tensor: torch.Tensor,
            group: dist.ProcessGroup,
            async_op: bool = False,
        ) -> dist.Work | None:
            counts["all_gather.call"] += 1
            return dist.all_gather_into_tensor(
                output_tensor, input_tensor, group=group, async_op=async_op
            )

    class CountingReduceScatter(ReduceScatter):
        def allocate(
            self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
        ) -> torch.Tensor:
            counts["reduce_scatter.allocate"] += 1
            return torch.empty(size, dtype=dtype, device=device)

        def __call__(
            self,
            output_tensor: torch.Tensor,
            input_tensor: torch.Tensor,
            group: dist.ProcessGroup,
            op: dist.ReduceOp.RedOpType,
            async_op: bool = False,
        ) -> dist.Work | None:
            counts["reduce_scatter.call"] += 1
            return dist.reduce_scatter_tensor(
                output_tensor, input_tensor, op=op, group=group, async_op=async_op
            )

    t = Lockstep("mlp")
    shard_model(t.model, "mlp")
    for module in fsdp_modules(t.model):
        module.set_custom_all_gather(CountingAllGather())
        module.set_custom_reduce_scatter(CountingReduceScatter())
    t.make_optimizers()
    with record_collectives() as records:
        for step in range(NUM_STEPS):
            t.forward_backward(step)
            t.check_grads(f"step {step}")
            t.optim_step()
    t.check_params("after training")
    counts["seam.all_gather"] = len(labels(records, "all_gather"))
    counts["seam.reduce_scatter"] = len(labels(records, "reduce_scatter"))
    return dict(counts)


def test_custom_all_gather_and_reduce_scatter(fsdp2_only: None) -> None:
    for counts in run_on_ranks(2, _custom_comms):
        num_ag, num_rs = counts["seam.all_gather"], counts["seam.reduce_scatter"]
        # Per step: 4 forward gathers, 3 backward (the root keeps its parameters), 4 reductions.
        assert (num_ag, num_rs) == (7 * NUM_STEPS, 4 * NUM_STEPS)
        assert counts == {
            "seam.all_gather": num_ag,
            "seam.reduce_scatter": num_rs,
            "all_gather.call": num_ag,
            "all_gather.allocate": num_ag,  # the output buffer
            "reduce_scatter.call": num_rs,
            "reduce_scatter.allocate": 2 * num_rs,  # input and output
        }
