"""``fully_shard(..., memory_mode="zero2")``: parameters stay gathered between optimizer steps.

ZeRO-2 computes what ZeRO-3 computes from the same gathered values with the same kernels, so the
two train bitwise alike (fp32 and bf16 mixed precision, FSDP and HSDP, with accumulation); ZeRO-3
is compared with the single-process reference throughout the suite, and ZeRO-2 is compared with
it here too at the suite's fp32 tolerance (tests/tolerance.py). What differs is what is
gathered when: one all-gather round per optimizer step, whatever the number of micro-batches,
and none while the shards did not change."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import fsdp2
from fsdp2.engine.collectives import record_collectives
from fsdp2.engine.modes import HFSDP, Mode, ReshardToK, Zero2, Zero3
from tests.errors import raised
from tests.harness import run_on_ranks
from tests.parity import (
    CollectiveCounter,
    adamw,
    local_batch,
    params_close_after_adamw,
    shard_model,
    step_both,
    twins,
)
from tests.parity.build import global_batch
from tests.tolerance import FP32_ATOL, FP32_RTOL

MICRO = 4  # micro-batches per optimizer step
STEPS = 3


def _shard(model: nn.Module, mode: str, bf16: bool, hsdp: bool) -> None:
    kwargs: dict[str, Any] = {"memory_mode": mode}
    if bf16:
        kwargs["mp_policy"] = fsdp2.MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    if hsdp:
        kwargs["mesh"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    shard_model(model, "gpt", **kwargs)


def _train(
    mode: str, bf16: bool = False, hsdp: bool = False, zero1: bool = False
) -> dict[str, Any]:
    """``STEPS`` AdamW steps of ``MICRO`` micro-batches each on the GPT; ``zero1``: gradient
    sync only on the last micro-batch (the ZeRO-1 recipe). Records every micro-batch's loss and
    collectives, each step's gradients and the final parameters (full)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, _ = twins("gpt")
    _shard(model, mode, bf16, hsdp)
    opt = adamw(model.parameters())
    out: dict[str, Any] = {"losses": [], "counts": [], "grads": [], "kept": [], "records": []}
    levels = model._groups(recurse=False)[0].info.levels
    if levels is not None:  # hfsdp: the groups of its two gathers
        out["groups"] = [group.group_name for group in levels]
    for step in range(STEPS):
        for micro in range(MICRO):
            if zero1:
                model.set_requires_gradient_sync(micro == MICRO - 1)
            with CollectiveCounter() as counter, record_collectives() as records:
                loss = model(*local_batch("gpt", step, micro, rank, world)) / MICRO
                loss.backward()
            out["losses"].append(loss.detach().float())
            out["counts"].append(dict(counter.counts))
            out["records"].append([(r.kind, r.group, r.input_nbytes) for r in records])
        out["grads"].append([p.grad.full_tensor() for p in model.parameters()])
        # Between steps the module holds the sharded parameters (what the optimizer and state
        # dicts see), and zero2 keeps the gathered copies besides.
        assert all(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())
        out["kept"].append([g.layout.unsharded_nbytes() for g in model._groups(recurse=True)])
        opt.step()
        opt.zero_grad()
    out["params"] = [p.full_tensor() for p in model.parameters()]
    out["optim_bytes"] = sum(
        t.to_local().numel() * t.element_size()
        for state in opt.state.values()
        for t in state.values()
        if isinstance(t, DTensor)
    )
    return out


def _same(got: dict[str, Any], ref: dict[str, Any], where: str) -> None:
    # Bitwise: the same gathered values through the same kernels in the same order.
    for a, b in zip(got["losses"], ref["losses"], strict=True):
        assert torch.equal(a, b), where
    for g, r in zip(got["grads"] + [got["params"]], ref["grads"] + [ref["params"]], strict=True):
        for a, b in zip(g, r, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=where)


@pytest.mark.parametrize(
    "world, bf16, hsdp", [(2, False, False), (2, True, False), (4, False, True)]
)
def test_zero2_trains_as_zero3_with_one_gather_round_per_step(
    world: int, bf16: bool, hsdp: bool
) -> None:
    zero3 = run_on_ranks(world, _train, "zero3", bf16, hsdp)
    zero2 = run_on_ranks(world, _train, "zero2", bf16, hsdp)
    for rank, (got, ref) in enumerate(zip(zero2, zero3, strict=True)):
        where = f"rank {rank}, bf16={bf16}, hsdp={hsdp}"
        _same(got, ref, where)
        for step in range(STEPS):
            counts = got["counts"][step * MICRO : (step + 1) * MICRO]
            ref_counts = ref["counts"][step * MICRO : (step + 1) * MICRO]
            # The first micro-batch after an optimizer step gathers (every group, in at most as
            # many collectives as ZeRO-3's forward); the others gather nothing.
            assert 0 < counts[0].get("allgather", 0) <= ref_counts[0]["allgather"], where
            assert [c.get("allgather", 0) for c in counts[1:]] == [0] * (MICRO - 1), where
            # Gradients: reduced after every micro-batch, as in ZeRO-3.
            assert [c.get("reducescatter") for c in counts] == [
                c.get("reducescatter") for c in ref_counts
            ], where
        assert all(n > 0 for kept in got["kept"] for n in kept), where
        assert all(n == 0 for kept in ref["kept"] for n in kept), where


def test_zero1_recipe_reduces_once_per_step() -> None:
    """ZeRO-1 is zero2 with gradient sync on the last micro-batch only: gradients accumulate
    unsharded, one reduce-scatter round and one gather round per step."""
    zero3 = run_on_ranks(2, _train, "zero3", False, False, True)
    zero1 = run_on_ranks(2, _train, "zero2", False, False, True)
    for rank, (got, ref) in enumerate(zip(zero1, zero3, strict=True)):
        _same(got, ref, f"rank {rank}")
        for step in range(STEPS):
            counts = got["counts"][step * MICRO : (step + 1) * MICRO]
            assert [c.get("allgather", 0) > 0 for c in counts] == [True] + [False] * (MICRO - 1)
            assert [c.get("reducescatter", 0) > 0 for c in counts] == [False] * (MICRO - 1) + [True]


def _against_reference(mode: str) -> list[float]:
    """``mode`` with accumulation against one process on the global batch: losses and
    gradients at the fp32 tolerance, parameters after AdamW at PARAM_ATOL (tests/tolerance.py)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, ref = twins("gpt")
    _shard(model, mode, False, hsdp=world == 4)
    opt, ref_opt = adamw(model.parameters()), adamw(ref.parameters())
    losses = []
    for step in range(STEPS):
        ref_loss = torch.zeros(())
        loss = torch.zeros(())
        for micro in range(MICRO):
            local = model(*local_batch("gpt", step, micro, rank, world)) / MICRO
            local.backward()
            loss += local.detach()
            rows = world * local_batch("gpt", step, micro, rank, world)[0].shape[0]
            whole = ref(*global_batch("gpt", step, micro, rows)) / MICRO
            whole.backward()
            ref_loss += whole.detach()
        dist.all_reduce(loss)
        loss /= world
        torch.testing.assert_close(loss, ref_loss, rtol=FP32_RTOL, atol=FP32_ATOL)
        step_both(model, ref, opt, ref_opt)
        losses.append(loss.item())
    params_close_after_adamw(model, ref)
    return losses


@pytest.mark.parametrize("mode, world", [("zero2", 2), ("hfsdp", 4)])
def test_against_the_single_process_reference(mode: str, world: int) -> None:
    losses = run_on_ranks(world, _against_reference, mode)
    assert all(each == losses[0] for each in losses)


def _writes_between_steps(mode: str, hsdp: bool = False) -> dict[str, Any]:
    """Every way the shards change between steps must reach the next forward: a state dict
    loaded, an in-place write under no_grad, a DCP checkpoint loaded in place, an optimizer
    step; a step the scaler skips changes nothing (and zero2 gathers nothing then)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, _ = twins("gpt")
    _shard(model, mode, False, hsdp)
    opt = adamw(model.parameters())
    batch = local_batch("gpt", 0, 0, rank, world)
    out: dict[str, Any] = {"losses": [], "gathers": []}

    def forward() -> None:
        with CollectiveCounter() as counter, torch.no_grad():
            out["losses"].append(model(*batch))
        out["gathers"].append(counter.counts.get("allgather", 0))

    forward()
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model(*batch).backward()
    opt.step()
    opt.zero_grad()
    forward()  # after the step
    forward()  # nothing changed
    model.load_state_dict(saved)
    forward()  # the saved values again
    with torch.no_grad():
        next(iter(model.parameters())).mul_(0.5)
    forward()
    path = out["path"] = f"/tmp/fsdp2_memory_modes_{world}_{mode}"
    dcp.save({"model": saved}, checkpoint_id=path)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=path)  # in place, into the sharded tensors
    forward()
    return out


def test_no_forward_trains_on_a_stale_gathered_copy() -> None:
    zero3 = run_on_ranks(2, _writes_between_steps, "zero3")
    zero2 = run_on_ranks(2, _writes_between_steps, "zero2")
    for got, ref in zip(zero2, zero3, strict=True):
        for a, b in zip(got["losses"], ref["losses"], strict=True):
            assert torch.equal(a, b)
        # Each change reached the forward: the outputs differ from the step before's.
        changed = [
            not torch.equal(a, b)
            for a, b in zip(ref["losses"][:-1], ref["losses"][1:], strict=True)
        ]
        assert changed == [True, False, True, True, True]
        # zero2 gathers only where something changed (the forward after an unchanged one is
        # free); zero3 gathers every time.
        assert [n > 0 for n in got["gathers"]] == [True, True, False, True, True, True]
        assert all(n > 0 for n in ref["gathers"])


def test_hfsdp_never_gathers_a_stale_replica_copy() -> None:
    """The same writes between steps under hfsdp (4 ranks, 2 x 2): its copy over the replicate
    dim is gathered again after each, so every forward sees what HSDP's sees."""
    hsdp = run_on_ranks(4, _writes_between_steps, "zero3", True)
    hfsdp = run_on_ranks(4, _writes_between_steps, "hfsdp", True)
    for got, ref in zip(hfsdp, hsdp, strict=True):
        for a, b in zip(got["losses"], ref["losses"], strict=True):
            torch.testing.assert_close(a, b, rtol=FP32_RTOL, atol=FP32_ATOL)
        changed = [
            not torch.equal(a, b)
            for a, b in zip(got["losses"][:-1], got["losses"][1:], strict=True)
        ]
        assert changed == [True, False, True, True, True]


def _bad_arguments() -> dict[str, str]:
    return {
        "mode": raised(lambda: fsdp2.fully_shard(nn.Linear(2, 2), memory_mode="zero4")),  # type: ignore[arg-type]
        "hfsdp 1-D": raised(lambda: fsdp2.fully_shard(nn.Linear(2, 2), memory_mode="hfsdp")),
        "raf": raised(
            lambda: fsdp2.fully_shard(
                nn.Linear(2, 2), memory_mode="zero2", reshard_after_forward=True
            )
        ),
    }


def test_bad_memory_mode_arguments_raise_clear_errors() -> None:
    errors = run_on_ranks(1, _bad_arguments)[0]
    assert "memory_mode='zero4' must be one of ('zero3', 'zero2', 'hfsdp')" in errors["mode"]
    assert "reshard_after_forward=True contradicts" in errors["raf"]
    assert "memory_mode='hfsdp' needs a 2-D mesh with named dims" in errors["hfsdp 1-D"]


def _explicit_reshard() -> list[int]:
    model, _ = twins("gpt")
    shard_model(model, "gpt", memory_mode="zero2")
    batch = local_batch("gpt", 0, 0, dist.get_rank(), dist.get_world_size())
    model(*batch).backward()
    groups = model._groups(recurse=True)
    before = sum(g.layout.unsharded_nbytes() for g in groups)
    for module in model.modules():
        if isinstance(module, fsdp2.FSDPModule):
            module.reshard()  # the user asks for the memory back
    return [before, sum(g.layout.unsharded_nbytes() for g in groups)]


def test_explicit_reshard_frees_the_kept_copy() -> None:
    before, after = run_on_ranks(2, _explicit_reshard)[0]
    assert before > 0 and after == 0


def _gathers_after_a_bool_reshard_setting() -> int:
    model, _ = twins("gpt")
    shard_model(model, "gpt", memory_mode="zero2")
    batch = local_batch("gpt", 0, 0, dist.get_rank(), dist.get_world_size())
    model(*batch).backward()
    model.set_reshard_after_forward(False)  # a bool: it replaces an int k, keeps the kept copy
    with record_collectives() as records:
        model(*batch).backward()
    return sum(r.kind == "all_gather" for r in records)


def test_a_bool_reshard_setting_keeps_zero2s_copy() -> None:
    """``set_reshard_after_forward(bool)`` drops a reshard-to-k mode, and nothing else: zero2's
    copy, gathered at the first forward and current, serves the next forward without a gather."""
    assert run_on_ranks(2, _gathers_after_a_bool_reshard_setting) == [0, 0]


@pytest.mark.parametrize("bf16", [False, True])
def test_hfsdp_trains_as_hsdp(bf16: bool) -> None:
    """hfsdp lays parameters, gradients and optimizer state out as zero3 over the flattened
    (replicate, shard) mesh, reduces as HSDP does (a reduce-scatter over the shard dim, then
    one over the replicate dim in place of HSDP's all-reduce: HSDP's sums in HSDP's order) and
    gathers in two levels to the same values: bitwise HSDP's training. Per step, gathers over
    the replicate dim only in the first micro-batch; every other gather over the shard dim,
    and no all-reduce but the 4-byte agreement that the replica copy is current (kept.py).
    Optimizer state: HSDP's over the replicas, to the byte (every size here
    splits evenly)."""
    hfsdp = run_on_ranks(4, _train, "hfsdp", bf16, True)
    hsdp = run_on_ranks(4, _train, "zero3", bf16, True)
    for rank, (got, ref) in enumerate(zip(hfsdp, hsdp, strict=True)):
        where = f"rank {rank}, bf16={bf16}"
        _same(got, ref, where)
        replicate, shard = got["groups"]
        for micro, records in enumerate(got["records"]):
            gathers = {group for kind, group, _ in records if kind == "all_gather"}
            first = micro % MICRO == 0
            assert gathers == ({replicate, shard} if first else {shard}), (where, micro)
            scatters = [group for kind, group, _ in records if kind == "reduce_scatter"]
            assert scatters == [shard, replicate] * (len(scatters) // 2) and scatters, where
            reduces = {(group, n) for kind, group, n in records if kind == "all_reduce"}
            assert reduces <= {(replicate, 4)}, where
        assert got["optim_bytes"] * 2 == hsdp[rank]["optim_bytes"], where


def _fused_available() -> bool:
    try:
        torch.optim.AdamW([nn.Parameter(torch.zeros(1))], fused=True)
    except (RuntimeError, ValueError):
        return False
    return True


def _every_write_path(mode: str, hsdp: bool = False) -> dict[str, Any]:
    """Each public way to write the shards, then a forward under ``no_grad``: its output must be
    what the written values give. Among them the writes no counter sees: ``torch._foreach_*``
    ops on a list of DTensors (a hand-written step, an EMA swap, ``AveragedModel``'s update),
    ``dcp.load`` into a state dict taken before a forward, and ``.data``. ``gathered`` says
    which forwards gathered: zero2 gathers exactly after a write, and never twice for one."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, _ = twins("gpt")
    _shard(model, mode, False, hsdp)
    batch = local_batch("gpt", 0, 0, rank, world)
    params = list(model.parameters())
    out: dict[str, Any] = {"names": [], "losses": [], "gathered": [], "written": []}

    def forward(name: str, written: bool = True) -> None:
        with CollectiveCounter() as counter, torch.no_grad():
            out["losses"].append(model(*batch))
        out["names"].append(name)
        out["gathered"].append(counter.counts.get("allgather", 0) > 0)
        out["written"].append(written)

    def micro_batch() -> None:  # a forward and backward that keep the copy
        model(*batch).backward()

    def grads() -> list[torch.Tensor]:
        return [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]

    forward("first")
    forward("nothing written", written=False)
    micro_batch()
    with torch.no_grad():
        torch._foreach_add_(params, grads(), alpha=-0.1)  # a hand-written step
    forward("foreach_add_ step")
    with torch.no_grad():
        torch._foreach_lerp_(params, [torch.ones_like(p) for p in params], 0.25)
    forward("foreach_lerp_")
    saved = [p.detach().clone() for p in params]
    average = [p.detach().clone() * 0.5 for p in params]
    with torch.no_grad():
        torch._foreach_lerp_(params, average, 1.0)  # swap the average in (exactly: weight 1)
    forward("average swapped in")
    with torch.no_grad():
        torch._foreach_lerp_(params, saved, 1.0)
    forward("swapped back")
    with torch.no_grad():
        for p in params:
            p.data.mul_(0.75)
    forward(".data write")
    for kwargs in ({"foreach": True}, {"foreach": False}, {"fused": True}):
        if "fused" in kwargs and not _fused_available():
            continue
        micro_batch()
        opt = torch.optim.AdamW(params, lr=0.01, **kwargs)
        opt.step()
        opt.zero_grad()
        forward(f"AdamW {kwargs}")
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    micro_batch()
    with torch.no_grad():
        torch._foreach_mul_(params, 1.5)
    forward("foreach_mul_")
    model.load_state_dict(sd)
    forward("load_state_dict")
    with torch.no_grad():
        torch._foreach_mul_(params, 1.5)
    forward("foreach_mul_ again")
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, sd)
    forward("set_model_state_dict")
    path = f"/tmp/fsdp2_write_paths_{world}_{mode}_{hsdp}"
    dcp.save({"model": sd}, checkpoint_id=path)
    with torch.no_grad():
        torch._foreach_mul_(params, 1.5)
    forward("foreach_mul_ before a load")
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=path)  # in place, before any forward
    forward("dcp.load")
    with torch.no_grad():
        torch._foreach_mul_(params, 1.5)
    state = {"model": model.state_dict()}
    micro_batch()  # gathers the written values and keeps them, after the state dict was taken
    forward("a forward after state_dict()", written=False)
    dcp.load(state, checkpoint_id=path)
    forward("dcp.load into a state dict taken before a forward")
    forward("nothing written again", written=False)
    return out


def _ema_average(mode: str) -> list[torch.Tensor]:
    """The README's EMA: ``AveragedModel`` with ``get_ema_multi_avg_fn`` over an average
    sharded like the model (``mode``), updated after each step and evaluated under no_grad."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    rank, world = dist.get_rank(), dist.get_world_size()
    model, copy = twins("gpt")
    shard_model(model, "gpt", memory_mode=mode)
    average = AveragedModel(copy, multi_avg_fn=get_ema_multi_avg_fn(0.5), use_buffers=True)
    shard_model(average.module, "gpt", memory_mode=mode)
    opt = adamw(model.parameters())
    losses = []
    for step in range(3):
        batch = local_batch("gpt", step, 0, rank, world)
        model(*batch).backward()
        opt.step()
        opt.zero_grad()
        average.update_parameters(model)
        with torch.no_grad():
            losses += [average(*batch), average(*batch)]
    return losses


@pytest.mark.parametrize("mode, world, hsdp", [("zero2", 2, False), ("hfsdp", 4, True)])
def test_every_write_to_the_shards_reaches_the_next_forward(
    mode: str, world: int, hsdp: bool
) -> None:
    got = run_on_ranks(world, _every_write_path, mode, hsdp)
    ref = run_on_ranks(world, _every_write_path, "zero3", hsdp)
    for rank, (mine, theirs) in enumerate(zip(got, ref, strict=True)):
        names = mine["names"]
        # Bitwise: the same values gathered, through the same kernels.
        for name, a, b in zip(names, mine["losses"], theirs["losses"], strict=True):
            assert torch.equal(a, b), f"rank {rank}, {mode}: after {name}"
        if mode == "zero2":  # hfsdp gathers over the shard dim at every use anyway
            assert mine["gathered"] == mine["written"], list(
                zip(names, mine["gathered"], strict=True)
            )


def test_the_readme_ema_average_evaluates_its_current_values() -> None:
    zero2 = run_on_ranks(2, _ema_average, "zero2")
    zero3 = run_on_ranks(2, _ema_average, "zero3")
    for got, ref in zip(zero2, zero3, strict=True):
        for i, (a, b) in enumerate(zip(got, ref, strict=True)):
            assert torch.equal(a, b), f"eval {i}"


def _all_modes(cls: type[Mode]) -> list[type[Mode]]:
    return [cls] + [m for sub in cls.__subclasses__() for m in _all_modes(sub)]


def test_a_coalescing_mode_gathers_the_flat_shard() -> None:
    """A coalesced gather sends each group's ``layout.gather_source()`` over its shard group
    without asking the mode (coalesce.py): that is what ``Mode.coalesces`` promises, so a mode
    that changes its gather input must say ``coalesces = False``, or its coalesced gathers would
    silently send the plain shard."""
    modes = _all_modes(Mode)
    assert {Zero3, Zero2, ReshardToK, HFSDP} <= set(modes)  # the walk finds them all
    wrong = [m.__name__ for m in modes if m.coalesces and m.gather_input is not Mode.gather_input]
    assert not wrong, f"modes that coalesce but change their gather input: {wrong}"
