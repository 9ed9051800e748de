"""``fsdp2.plan``: its predictions against what a real run allocates and sends.

The planner builds the model on meta and shards it over a fake process group; here the same
model and sharding train one step on real gloo ranks, and rank 0's shard buffers, gradients,
optimizer state and recorded collectives must equal the plan exactly (the plan is for rank 0,
which holds the most real rows).
"""

from __future__ import annotations

import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import expecttest
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

import fsdp2
from tests.errors import raised
from tests.harness import run_on_ranks
from tests.models import MODELS, build_model
from tests.parity import MODEL_SEED, local_batch

pytestmark = pytest.mark.usefixtures("fsdp2_only")

BF16 = fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def shard_blocks(model: nn.Module, mp: bool = False, mode: str = "zero3") -> None:
    """The tests' usual sharding: each block, then the root."""
    kwargs: dict[str, Any] = {"mp_policy": BF16} if mp else {}
    kwargs["memory_mode"] = mode
    for block in model.blocks:  # type: ignore[union-attr]
        fsdp2.fully_shard(block, **kwargs)
    fsdp2.fully_shard(model, **kwargs)


def shard_blocks_bf16(model: nn.Module) -> None:
    shard_blocks(model, mp=True)


def shard_blocks_hsdp(model: nn.Module, mesh: DeviceMesh) -> None:
    """HSDP over a (replicate, shard) mesh: the planner passes its fake mesh."""
    for block in model.blocks:  # type: ignore[union-attr]
        fsdp2.fully_shard(block, mesh=mesh)
    fsdp2.fully_shard(model, mesh=mesh)


def shard_blocks_hfsdp(model: nn.Module, mesh: DeviceMesh) -> None:
    """HFSDP over the (replicate, shard) mesh: two-level gathers, the first kept."""
    for block in model.blocks:  # type: ignore[union-attr]
        fsdp2.fully_shard(block, mesh=mesh, memory_mode="hfsdp")
    fsdp2.fully_shard(model, mesh=mesh, memory_mode="hfsdp")


def shard_blocks_grad_dtype(model: nn.Module) -> None:
    """bf16 compute with a bf16 ``grad_dtype`` on every matrix: those sharded gradients hold
    half the bytes of the fp32 parameters', the rest fp32 (torch's AdamW refuses gradients
    narrower than their parameters: see test_plan_grad_bytes_follow_grad_dtype)."""
    for param in model.parameters():
        if param.dim() == 2:
            param.grad_dtype = torch.bfloat16
    shard_blocks(model, mp=True)


def shard_blocks_zero2(model: nn.Module) -> None:
    """Parameters kept gathered between steps (bf16: the kept copies are in param_dtype)."""
    shard_blocks(model, mp=True, mode="zero2")


SHARDERS = {
    "plain": shard_blocks,
    "zero2": shard_blocks_zero2,
    "bf16": shard_blocks_bf16,
    "hsdp": shard_blocks_hsdp,
    "hfsdp": shard_blocks_hfsdp,
    "grad_dtype": shard_blocks_grad_dtype,
}


def frozen_first() -> nn.Module:
    """The MLP stack with its first block frozen: backward never reaches it (its input needs no
    gradient), so on CPU it is not gathered again; on accelerators block 1 prefetches it."""
    model = MODELS["mlp"].build()
    model.blocks[0].requires_grad_(False)  # type: ignore[index]
    return model


class ExpertBlock(nn.Module):
    """A 3-D stack of expert matrices (5 experts: uneven over 2 and 4 ranks) and a router."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(16, 5)
        self.experts = nn.Parameter(torch.randn(5, 16, 16) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = self.router(x).softmax(-1)
        return x + torch.einsum("be,eij,bj->bi", weights, self.experts, x)


def experts() -> nn.Module:
    model = MODELS["mlp"].build()
    model.blocks = nn.ModuleList(ExpertBlock() for _ in range(2))
    model.blocks.insert(0, nn.Sequential(nn.Linear(8, 16), nn.ReLU()))
    return model


# Models of this file (built from MODELS' seed, fed the MLP's batches).
LOCAL_MODELS = {"frozen_first": frozen_first, "experts": experts}


def _build(model_name: str) -> nn.Module:
    if model_name in LOCAL_MODELS:
        torch.manual_seed(MODEL_SEED)
        return LOCAL_MODELS[model_name]()
    return build_model(model_name, MODEL_SEED)


def _builder(model_name: str) -> Any:
    return LOCAL_MODELS.get(model_name) or MODELS[model_name].build


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the storages behind ``tensors``, each once (as benchmarks/scale.py counts)."""
    storages = {}
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(storages.values())


def _real_step(
    model_name: str, sharder: str, mesh_shape: tuple[int, ...], prefetch: bool = False
) -> dict[str, Any]:
    """Two AdamW steps on this rank; what it holds afterwards and what it sent in the second
    (the plan's steady state: with coalescing on, the first step's forward has no recorded
    order to coalesce by). ``prefetch``: the groups guess prefetches as on an accelerator
    (``guess_prefetch``; CPU meshes do not)."""
    from fsdp2.engine.collectives import record_collectives
    from fsdp2.engine.module import state_of

    model = _build(model_name)
    if len(mesh_shape) == 2:
        names = ("replicate", "shard")
        SHARDERS[sharder](model, init_device_mesh("cpu", mesh_shape, mesh_dim_names=names))
    else:
        SHARDERS[sharder](model)
    for group in {
        id(g): g for m in model.modules() if (s := state_of(m)) for g in s.groups
    }.values():
        group.settings.guess_prefetch = prefetch
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    data = "mlp" if model_name in LOCAL_MODELS else model_name
    for step in range(2):
        batch = local_batch(data, step, 0, dist.get_rank(), dist.get_world_size(), 2)
        opt.zero_grad()
        with record_collectives() as records:
            model(*batch).backward()
        opt.step()
    groups = {id(g): g for m in model.modules() if (s := state_of(m)) for g in s.groups}
    params = list(model.parameters())
    return {
        "flat": sum(g.layout.sharded_flat.untyped_storage().nbytes() for g in groups.values()),
        "params": _storage_bytes(params),
        "grads": _storage_bytes([p.grad for p in params if p.grad is not None]),
        "optim": _storage_bytes([t for s in opt.state.values() for t in s.values() if t.dim()]),
        "buffers": sum(b.numel() * b.element_size() for b in model.buffers()),
        "kept": sum(g.kept_nbytes() for g in groups.values()),
        "records": [
            (r.kind, r.label, r.input_nbytes, r.output_nbytes, r.world_size) for r in records
        ],
    }


def _plan(
    model_name: str, sharder: str, world_size: int | tuple[int, int], device: str = "cpu"
) -> fsdp2.Plan:
    return fsdp2.plan(_builder(model_name), SHARDERS[sharder], world_size=world_size, device=device)


@pytest.mark.parametrize(
    ("model_name", "sharder", "world_size"),
    [
        ("gpt", "plain", 2),
        ("gpt", "bf16", 2),
        ("odd_shapes", "plain", 2),
        ("gpt", "plain", 1),
        ("gpt", "hsdp", (1, 2)),
        ("mlp", "hsdp", (2, 1)),
        ("frozen", "plain", 2),
        ("frozen_first", "plain", 2),
        ("experts", "plain", 4),
        ("experts", "bf16", 2),
        ("gpt", "zero2", 2),
        ("odd_shapes", "zero2", 2),
        ("gpt", "hfsdp", (2, 2)),
        ("gpt", "hfsdp", (2, 1)),
    ],
)
def test_plan_matches_real_run(
    model_name: str, sharder: str, world_size: int | tuple[int, int]
) -> None:
    """Bytes held between steps and collectives per step: exactly what rank 0 allocates and
    sends (odd_shapes pads; bf16 gathers in bf16 and reduces in fp32; one rank sends nothing;
    HSDP all-reduces over the replicas, even one; frozen parameters get no gradient or state,
    and a frozen first block is not gathered in backward; 3-D expert stacks split unevenly)."""
    plan = _plan(model_name, sharder, world_size)
    shape = (world_size,) if isinstance(world_size, int) else world_size
    ranks = run_on_ranks(math.prod(shape), _real_step, model_name, sharder, shape, timeout=120)
    real, last = ranks[0], ranks[-1]
    assert plan.param_bytes == real["flat"] == last["flat"]
    assert sum(g.param_bytes for g in plan.groups) == real["params"]
    assert plan.param_bytes - plan.param_padding_bytes == last["params"]
    assert sum(g.grad_real_bytes for g in plan.groups) == real["grads"]
    # What .grad holds, on the rank with the most real rows and on the one with the fewest:
    # the "used" flags held beside the gradients are a line of their own (grad_flag_bytes).
    assert plan.grad_bytes == real["grads"]
    assert plan.grad_bytes - plan.grad_padding_bytes == last["grads"]
    assert plan.optim_bytes == real["optim"]
    assert plan.buffer_bytes == real["buffers"]
    assert plan.kept_gathered_bytes == real["kept"] == last["kept"]
    if sharder == "zero2" and world_size != 1:
        assert plan.kept_gathered_bytes > 0
    predicted = [
        (c.kind, c.label, c.input_nbytes, c.output_nbytes, c.world_size) for c in plan.collectives
    ]
    # In issue order, HSDP's all-reduces too: a rank finishes a reduction that issues one only
    # when the next reduce-scatter is issued or backward ends, never when it finds it done.
    assert predicted == real["records"]
    if model_name == "odd_shapes" and world_size > 1:
        assert plan.param_padding_bytes > 0  # the case is there to exercise padding


def _records(plan: fsdp2.Plan) -> list[tuple[Any, ...]]:
    return [
        (c.kind, c.label, c.input_nbytes, c.output_nbytes, c.world_size) for c in plan.collectives
    ]


@pytest.mark.parametrize("model_name", ["mlp", "frozen", "frozen_first", "gpt"])
def test_backward_gathers_follow_the_devices_prefetch(model_name: str) -> None:
    """A plan for an accelerator (``device="cuda"``) against a CPU run whose groups prefetch as
    on an accelerator: every collective, in order (the frozen first block is gathered by block
    1's prefetch; on CPU, by nothing: test_plan_matches_real_run)."""
    plan = _plan(model_name, "plain", 2, device="cuda")
    real = run_on_ranks(2, _real_step, model_name, "plain", (2,), True, timeout=120)[0]
    assert _records(plan) == real["records"]
    assert plan.held_bytes == _plan(model_name, "plain", 2).held_bytes  # the device: no matter


def _rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def llama_7b() -> nn.Module:
    """Llama-2-7B's shape (6.7e9 parameters) from the examples' model."""
    from examples.model import Llama, LlamaConfig

    config = LlamaConfig(
        vocab_size=32000,
        max_seq_len=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=32,
        embed_dim=4096,
        ffn_multiple_of=256,
    )
    return Llama(config)


def test_plan_7b_at_scale_allocates_nothing() -> None:
    """A 7B model planned at W = 8 ... 1024 in seconds, without its 27 GB of fp32 weights."""
    before, start = _rss_bytes(), time.perf_counter()
    plans = fsdp2.plan(llama_7b, world_size=8).compare([8, 64, 1024]).plans
    elapsed = time.perf_counter() - start
    assert _rss_bytes() - before < 512 * 2**20
    assert elapsed < 60  # seconds on a loaded 2-core machine; ~3 s alone
    assert 6.7e9 < plans[0].num_params < 6.8e9
    for plan in plans:  # fp32 params, grads and AdamW's two states: 16 bytes per parameter
        ideal = 16 * plans[0].num_params / plan.world_size[0]
        assert ideal <= plan.held_bytes - plan.buffer_bytes < 1.05 * ideal  # + padding
    # auto_shard: 32 blocks gathered in forward, again in backward but for the last one (kept
    # gathered after forward), and the root once.
    assert [p.counts()["all_gather"] for p in plans] == [64, 64, 64]
    assert "auto_shard" in plans[0].notes[0]


class TestPlanErrors(expecttest.TestCase):
    def test_build_allocating_real_memory(self) -> None:
        def huge() -> nn.Module:  # a 40 GB layer, built with an explicit device
            return nn.Linear(100_000, 100_000, device="cpu")

        before = _rss_bytes()
        self.assertExpectedInline(
            raised(lambda: fsdp2.plan(huge, world_size=8)),
            """PlanError: the build function allocates real memory: 38147 MiB off the meta device so far (at empty), more than the planner's limit of 64 MiB. fsdp2.plan runs it under torch.device('meta'): drop explicit device= arguments (and checkpoint loading) from the build function, or build on device='meta' yourself""",
        )
        assert _rss_bytes() - before < 64 * 2**20

    def test_shard_without_fully_shard(self) -> None:
        self.assertExpectedInline(
            raised(lambda: fsdp2.plan(MODELS["mlp"].build, lambda model: None, world_size=8)),
            """PlanError: the shard function did not call fully_shard on the model (no fsdp2 parameter group was found). It must apply fsdp2.fully_shard (or fsdp2.auto_shard) to the model it is given, e.g. its blocks and then the model itself""",
        )

    def test_world_size_not_split_as_asked(self) -> None:
        def shard_flattened(model: nn.Module, mesh: Any) -> None:
            # Two mesh dims sharded as one: parameters must split evenly over their product.
            for block in model.blocks:  # type: ignore[union-attr]
                fsdp2.fully_shard(
                    block,
                    mesh=mesh,
                    dp_mesh_dims=fsdp2.DataParallelMeshDims(shard=("replicate", "shard")),
                )

        self.assertExpectedInline(
            raised(lambda: fsdp2.plan(MODELS["mlp"].build, shard_flattened, world_size=(3, 2))),
            """PlanError: sharding at world size (3, 2) failed: 0.weight: dim 0 of size 16 does not split evenly over the 6 ranks of the flattened data-parallel dims; uneven sizes need one shard dim""",
        )

    def test_bad_world_size_and_optimizer(self) -> None:
        self.assertExpectedInline(
            raised(lambda: fsdp2.plan(MODELS["mlp"].build, world_size=0)),
            """PlanError: world_size must be a positive int (FSDP) or a pair (replicate, shard) of positive ints (HSDP), got 0""",
        )
        self.assertExpectedInline(
            raised(lambda: fsdp2.plan(MODELS["mlp"].build, optimizer="lion")),
            """PlanError: optimizer must be one of ['adam', 'adamw', 'none', 'sgd'] or bytes per parameter element (a number), got 'lion'""",
        )

    def test_process_group_untouched_after_plan(self) -> None:
        before = dist.group.WORLD if dist.is_initialized() else None
        fsdp2.plan(MODELS["mlp"].build, world_size=4)
        assert (dist.group.WORLD if dist.is_initialized() else None) is before


def test_cli(capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m fsdp2.plan``: JSON per world size; without --shard it says how it sharded."""
    from fsdp2.tools.planner.cli import main

    assert main(["tests.models:GPT", "--world-size", "2,4", "--batch", "2x16,2x16", "--json"]) == 0
    plans = json.loads(capsys.readouterr().out)
    assert [p["world_size"] for p in plans] == [[2], [4]]
    assert plans[0]["activation_bytes"] > 0
    assert "no shard function given" in plans[0]["notes"][0]
    assert main(["tests.models:GPT", "--world-size", "two"]) == 2
    assert "expected N or RxS" in capsys.readouterr().err


def test_module_entry_point() -> None:
    """``python -m fsdp2.plan`` runs although ``fsdp2.plan`` is the function."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        [sys.executable, "-m", "fsdp2.plan", "tests.models:MLPStack", "--world-size", "2"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    ).stdout
    assert "held between steps" in out
    assert callable(fsdp2.plan)


def test_plan_module_is_only_the_entry_point() -> None:
    """Importing fsdp2/plan.py as ``fsdp2.plan`` would replace the planner function in the
    package: it is refused, and the function stays."""
    import importlib

    with pytest.raises(ImportError, match=r"fsdp2\.plan is the planner function"):
        importlib.import_module("fsdp2.plan")
    assert callable(fsdp2.plan) and fsdp2.plan.__name__ == "plan"


class TestPlanText(expecttest.TestCase):
    def test_plain_text_without_rich(self) -> None:
        """Without rich installed, the same tables in aligned plain text."""
        plan = fsdp2.plan(MODELS["mlp"].build, shard_blocks, world_size=2, device="cpu")
        with pytest.MonkeyPatch.context() as patch:
            patch.setitem(sys.modules, "rich.console", None)  # makes `import rich...` fail
            self.assertExpectedInline(
                str(plan),
                """\
fsdp2.plan: world 2, 756 parameters, per rank
  parameters (sharded)                 1.48 KiB  (padding 0 B)
  gradients                            1.48 KiB  (padding 0 B)
  gradient flags (one per parameter)   32 B
  optimizer state (adamw)              2.95 KiB
  buffers                              0 B
  held between steps                   5.94 KiB
  FSDP transient, forward              7.50 KiB  at <root>
  FSDP transient, backward             8.03 KiB  at blocks.2
  activations (fake-tensor run)        -
  peak                                 13.97 KiB
  coalescing budget                    256.00 KiB
  all_gather per step                  2 x (2 coalesced), 6.00 KiB payload
  reduce_scatter per step              1 x (1 coalesced), 3.05 KiB payload
  sent (= received) per rank per step  4.52 KiB
  group     params  unsharded  shard  reshard after fwd
  <root>        68      272 B  136 B                 no
  blocks.0     144      576 B  288 B                yes
  blocks.1     272   1.06 KiB  544 B                yes
  blocks.2     272   1.06 KiB  544 B                yes
note: collectives and transients of a steady-state step (every step after the first) with coalescing at 262,144 B: the first step gathers each group alone in forward, having no recorded order yet""",
            )


def _grad_bytes(model_name: str) -> tuple[int, int]:
    model = _build(model_name)
    shard_blocks_grad_dtype(model)
    batch = local_batch(model_name, 0, 0, dist.get_rank(), dist.get_world_size(), 2)
    model(*batch).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    narrow = sum(g.dtype == torch.bfloat16 for g in grads)
    return _storage_bytes(grads), narrow


def test_plan_grad_bytes_follow_grad_dtype() -> None:
    """A ``grad_dtype`` set on parameters sizes their sharded gradients: the plan's gradient
    bytes are what .grad holds on the first and the last rank (uneven shapes: they differ)."""
    plan = _plan("odd_shapes", "grad_dtype", 2)
    ranks = run_on_ranks(2, _grad_bytes, "odd_shapes")
    (first, narrow), (last, _) = ranks[0], ranks[-1]
    assert narrow > 0  # the case is there: some gradients are bf16
    assert plan.grad_bytes == first
    assert plan.grad_bytes - plan.grad_padding_bytes == last


def test_hsdp_reduction_stays_in_flight_through_frozen_blocks() -> None:
    """A reduction that all-reduces over the replicas (HSDP) is finished only when the next
    reduce-scatter is issued, never early (its peers would pair the all-reduce with another
    collective): through frozen blocks it stays in flight, its buffers alive. Measured once
    (session 28; this model at 2 gloo ranks, the counting allocator at blocks.0's reduce-scatter):
    HSDP (1, 2) held 793,144 B more than FSDP, the last block's reduce-scatter input. The plan
    now has that reduction in flight at blocks.0 (it had both transients equal)."""
    import dataclasses

    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
    import workloads
    from fsdp2.engine.coalesce import coalesce_bytes, set_coalesce_bytes

    size = dataclasses.replace(workloads.DEFAULT_SIZES["gpt"], layers=4)

    def middle_frozen() -> nn.Module:
        model = workloads.build_model("gpt", size)
        for i in (1, 2):
            workloads.blocks_of(model)[i].requires_grad_(False)
        return model

    before = coalesce_bytes()
    set_coalesce_bytes(0)  # each reduce-scatter alone, as measured
    try:
        fsdp = fsdp2.plan(middle_frozen, shard_blocks, world_size=2, device="cpu")
        hsdp = fsdp2.plan(middle_frozen, shard_blocks_hsdp, world_size=(1, 2), device="cpu")
    finally:
        set_coalesce_bytes(before)
    last = next(g for g in hsdp.groups if g.label == "blocks.3")
    in_flight = last.reduce_in_bytes + last.reduce_out_bytes
    assert (fsdp.backward_transient_at, hsdp.backward_transient_at) == ("blocks.3", "blocks.0")
    assert hsdp.backward_transient_bytes == fsdp.backward_transient_bytes + in_flight
