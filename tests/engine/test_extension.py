"""The all-gather extension protocol (int8 weights) and the low-precision reduce-scatter."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import Shard

from tests.harness import per_group_collectives, run_on_ranks

WORLD = 2
STEPS = 30


def _mlp(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(3)])


@per_group_collectives  # the int8 groups never coalesce: compared with plain ones alone
def _train(int8: bool, steps: int) -> dict[str, object]:
    """Regress onto a fixed teacher; report losses, gather bytes and unsharded tensor ids."""
    import fsdp2
    from examples.int8_allgather import int8_gathered
    from fsdp2.engine.collectives import record_collectives

    rank = dist.get_rank()
    model = _mlp(0)
    if int8:
        int8_gathered(model)
    for block in model:
        fsdp2.fully_shard(block)
    fsdp2.fully_shard(model)
    teacher = _mlp(1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses, gathered, unsharded_ids = [], [], set()
    for step in range(steps):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(step * WORLD + rank))
        with torch.no_grad():
            y = teacher(x)
        with record_collectives() as records:
            out = model(x)
            unsharded_ids.add(id(model[0][0].weight))  # gathered weight, registered in forward
            loss = (out - y).pow(2).mean()
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / WORLD)
        gathered.append(sum(r.input_nbytes for r in records if r.kind == "all_gather"))
    return {"losses": losses, "gathered": gathered, "unsharded_ids": len(unsharded_ids)}


@pytest.mark.parametrize("steps", [STEPS])
def test_int8_gather_moves_a_quarter_of_the_bytes_and_still_converges(steps: int) -> None:
    plain = run_on_ranks(WORLD, _train, False, steps)[0]
    int8 = run_on_ranks(WORLD, _train, True, steps)[0]
    # Weights travel as int8 plus one fp32 scale per row; biases stay fp32.
    ratio = int8["gathered"][0] / plain["gathered"][0]
    assert 0.25 < ratio < 0.32, ratio
    # The post-all-gather hook refills one unsharded tensor in place after its first build.
    assert int8["unsharded_ids"] == 1
    first, last = int8["losses"][0], int8["losses"][-1]
    assert last < 0.5 * first, int8["losses"]
    # Quantised gathers perturb the forward a little, not the optimisation.
    assert abs(last - plain["losses"][-1]) < 0.15 * plain["losses"][-1], (last, plain["losses"])


def _uneven_extension() -> list[bool]:
    """3 rows over 2 ranks: each rank's int8 rows and scales are padded to the chunk, and the
    gathered weight is cut back to 3 rows, dequantised exactly as the full weight would be."""
    import fsdp2
    from examples.int8_allgather import Int8GatherWeight, int8_gathered

    torch.manual_seed(0)
    model = int8_gathered(nn.Sequential(nn.Linear(4, 3)))
    full = model[0].weight.detach().clone()
    fsdp2.fully_shard(model)
    checks = []
    for _ in range(2):  # the first gather builds the weight, the second refills it (out=)
        model.unshard()
        (quantised, scale), _ = full.as_subclass(Int8GatherWeight).fsdp_pre_all_gather(
            None, full.shape, full.stride(), model, None
        )
        # Bitwise: per-row quantisation, the same operations on the same rows.
        dequantised = quantised.float() * scale[:, None]
        checks.append(torch.equal(model[0].weight.detach(), dequantised))
        model(torch.randn(2, 4)).sum().backward()
        model.reshard()
    return checks


def test_uneven_extension_parameter_is_padded_and_cut_back() -> None:
    assert run_on_ranks(WORLD, _uneven_extension) == [[True, True]] * WORLD


def _uneven_extension_other_dim() -> str:
    import fsdp2
    from examples.int8_allgather import int8_gathered
    from tests.errors import raised

    model = int8_gathered(nn.Sequential(nn.Linear(3, 4)))  # dim 1: 3 columns over 2 ranks
    return raised(lambda: fsdp2.fully_shard(model, shard_placement_fn=lambda p: Shard(p.dim() - 1)))


def test_uneven_extension_parameter_on_another_dim_is_refused() -> None:
    messages = run_on_ranks(WORLD, _uneven_extension_other_dim)
    assert messages == [messages[0]] * WORLD  # every rank raises, alike
    assert messages[0] == (
        "NotImplementedError: 0.weight: all-gather extension parameters sharded on a dim "
        "other than 0, or tensor parallel, must split evenly over the 2 shard ranks (every "
        "rank's inputs the same size); make that size divisible, or shard dim 0"
    ), messages[0]


def _low_precision_reduce(comm_dtype: torch.dtype) -> dict[str, object]:
    import fsdp2
    from fsdp2 import LowPrecisionReduceScatter, record_collectives

    rank = dist.get_rank()
    reference, model = _mlp(0), _mlp(0)
    for block in model:
        fsdp2.fully_shard(block)
        block.set_custom_reduce_scatter(LowPrecisionReduceScatter(comm_dtype))
    fsdp2.fully_shard(model)
    x = torch.randn(WORLD * 8, 32, generator=torch.Generator().manual_seed(0))
    reference(x).pow(2).mean().backward()
    with record_collectives() as records:
        model(x[rank * 8 : (rank + 1) * 8]).pow(2).mean().backward()
    errors = [
        ((p.grad.full_tensor() - q.grad).norm() / q.grad.norm()).item()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True)
    ]
    scattered = sum(r.input_nbytes for r in records if r.kind == "reduce_scatter")
    sent = sum(r.input_nbytes for r in records if r.kind == "all_to_all")
    return {"max_error": max(errors), "scattered": scattered, "sent": sent}


def test_low_precision_reduce_scatter_halves_the_bytes() -> None:
    result = run_on_ranks(WORLD, _low_precision_reduce, torch.bfloat16)[0]
    # 3 blocks' fp32 gradients handed to the comm, sent as bf16: half the bytes on the wire.
    assert result["sent"] * 2 == result["scattered"], result
    assert result["max_error"] < 1e-2, result  # bf16 rounding once per value, fp32 sums


def _released_outputs(release: bool) -> dict[str, object]:
    """Train int8-gathered blocks kept gathered after forward (``reshard_after_forward=False``);
    report the losses and, after each forward, the bytes of the gathered int8 inputs still held."""
    import fsdp2
    from examples.int8_allgather import Int8GatherWeight, int8_gathered
    from fsdp2.engine.state import state_of

    class ReleasingInt8(Int8GatherWeight):
        def fsdp_should_release_all_gather_outputs_after_post_all_gather(self) -> bool:
            return True

    rank = dist.get_rank()
    model = _mlp(0)
    int8_gathered(model)
    if release:
        for block in model:
            weight = block[0].weight
            block[0].weight = nn.Parameter(weight.detach().as_subclass(ReleasingInt8))
    for block in model:
        fsdp2.fully_shard(block, reshard_after_forward=False)
    fsdp2.fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses, held = [], []
    for step in range(3):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(step * WORLD + rank))
        loss = model(x).pow(2).mean()
        held.append(
            sum(
                out.untyped_storage().nbytes()
                for block in model
                for p in state_of(block).groups[0].layout.ext_params
                for out in p.ext.outputs or ()
            )
        )
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "held": held}


def test_extension_may_release_its_gathered_inputs() -> None:
    """An extension whose post hook builds a new tensor (int8 dequantised) declares it
    (``fsdp_should_release_all_gather_outputs_after_post_all_gather``, torch 2.15's hook): its
    gathered int8 inputs are freed right after the post hook, not at reshard, and the next
    gather regrows them. Same arithmetic either way: the losses agree bit for bit."""
    kept = run_on_ranks(WORLD, _released_outputs, False)
    released = run_on_ranks(WORLD, _released_outputs, True)
    for keep, rel in zip(kept, released, strict=True):
        assert rel["losses"] == keep["losses"]
        assert all(b > 0 for b in keep["held"])  # 3 weights x (32x32 int8 + 32 fp32 scales)
        assert rel["held"] == [0, 0, 0]


class NotABool(torch.Tensor):
    def fsdp_pre_all_gather(self, mesh: object) -> tuple[tuple[torch.Tensor, ...], None]:
        return (self.as_subclass(torch.Tensor),), None

    def fsdp_post_all_gather(self, *args: object, **kwargs: object) -> None:
        return None

    def fsdp_should_release_all_gather_outputs_after_post_all_gather(self) -> object:
        return 1


def _not_a_bool() -> str:
    import fsdp2

    linear = nn.Linear(4, 4)
    linear.weight = nn.Parameter(linear.weight.detach().as_subclass(NotABool))
    try:
        fsdp2.fully_shard(linear)
    except TypeError as error:
        return str(error)
    return "no error"


def test_release_hook_must_answer_a_bool() -> None:
    for message in run_on_ranks(WORLD, _not_a_bool):
        assert message == (
            "NotABool.fsdp_should_release_all_gather_outputs_after_post_all_gather() must "
            "return a bool, got int"
        )
