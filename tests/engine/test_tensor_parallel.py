"""FSDP x TP: tensor-parallel DTensor parameters sharded again over the data-parallel mesh.

A GPT-like model is tensor-parallelised on ``mesh["tp"]`` of a (dp=2, tp=2) mesh (column-wise
q/k/v and fc, row-wise projections, optionally sequence-parallel norms), then each block and the
root are ``fully_shard``-ed over the data-parallel ranks. The two ranks of one tp group feed the
same slice of the global batch; the reference is the plain model on the whole batch. Placements
are checked against torch's own ``fully_shard`` applied to the same TP model.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import expecttest
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import _StridedShard

import fsdp2
from fsdp2 import DataParallelMeshDims, MixedPrecisionPolicy
from tests.errors import raised
from tests.harness import fsdp_api, init_local_process_group, run_on_ranks
from tests.models import Batch
from tests.parity import cast_forward, full, train_side_by_side
from tests.tolerance import BF16_TOL, Tolerance, assert_fp32_close

VOCAB, SEQ, DIM, HEAD_DIM, NUM_BLOCKS = 32, 8, 16, 4, 2
SEED = 4321
# Row-wise layers add partial sums over the tp ranks: a different order than one matmul.
TP_TOL = Tolerance(rtol=1e-5, atol=2e-6, param_atol=2e-5)
# bf16 adds the row-wise partial sums in bf16 too: a few bf16 ulps more than data parallelism
# alone (BF16_TOL), still far below what a wrong scale or a missing reduction would show.
TP_BF16_TOL = dataclasses.replace(BF16_TOL, rtol=5e-2)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # No bias: a key bias's gradient is zero in theory (softmax is shift-invariant), so
        # it is pure rounding noise, which no tolerance relative to it can accept.
        self.q, self.k, self.v = (nn.Linear(DIM, DIM, bias=False) for _ in range(3))
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # Under tensor parallelism q, k and v hold this rank's heads only: count them by width.
        q, k, v = (m(x).view(b, t, -1, HEAD_DIM).transpose(1, 2) for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, 4 * DIM)
        self.proj = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(DIM), Attention()
        self.ln2, self.mlp = nn.LayerNorm(DIM), MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, DIM), nn.Embedding(SEQ, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(NUM_BLOCKS))
        self.ln_f, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(self.ln_f(x)).flatten(0, 1), targets.flatten())


def make_batch(gen: torch.Generator, batch_size: int) -> Batch:
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def tp_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Megatron-style: q/k/v and fc column-wise, the projections row-wise. With sequence
    parallelism the norms work on this rank's positions and the attention/MLP inputs are
    gathered first; the projections reduce-scatter back to positions."""
    plan: dict[str, ParallelStyle] = {
        **{f"attn.{n}": ColwiseParallel() for n in ("q", "k", "v")},
        "mlp.fc": ColwiseParallel(),
    }
    if not sequence_parallel:
        return {**plan, "attn.proj": RowwiseParallel(), "mlp.proj": RowwiseParallel()}
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return {
        **plan,
        "ln1": SequenceParallel(),
        "ln2": SequenceParallel(),
        "attn": gather,
        "mlp": gather,
        "attn.proj": RowwiseParallel(output_layouts=Shard(1)),
        "mlp.proj": RowwiseParallel(output_layouts=Shard(1)),
    }


def parallelize(model: TinyGPT, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    for block in model.blocks:
        if sequence_parallel:
            # The block takes and returns whole sequences; inside, the residual stream holds
            # this rank's positions only.
            parallelize_module(
                block,
                tp_mesh,
                PrepareModuleInputOutput(
                    input_layouts=(Replicate(),),
                    desired_input_layouts=(Shard(1),),
                    use_local_input=True,
                    output_layouts=(Shard(1),),
                    desired_output_layouts=(Replicate(),),
                ),
            )
        parallelize_module(block, tp_mesh, tp_plan(sequence_parallel))


def expected_placements(name: str, sequence_parallel: bool, layout: str) -> tuple[Placement, ...]:
    """On the (dp, tp) mesh. Column-wise weights are split on dim 0 by tp and then again by dp
    inside each tp piece: dp's split is strided. Plain parameters get (Shard(0),) on the dp
    mesh, or (Shard(0), Replicate()) when fully_shard got the full mesh (dp_mesh_dims)."""
    parts = name.split(".")
    if name.startswith("blocks."):
        module = ".".join(parts[2:-1])
        if module in ("attn.q", "attn.k", "attn.v", "mlp.fc"):
            return (_StridedShard(0, split_factor=2), Shard(0))
        if module in ("attn.proj", "mlp.proj"):
            return (Shard(0), Shard(1)) if parts[-1] == "weight" else (Shard(0), Replicate())
        if sequence_parallel:  # the norms: replicated DTensors over tp
            return (Shard(0), Replicate())
    return (Shard(0),) if layout == "dp_slice" else (Shard(0), Replicate())


def dp_tp_mesh(unflattened: bool) -> DeviceMesh:
    """The (dp=2, tp=2) mesh: from init_device_mesh, or as torchtitan builds it, a view
    unflattened from one 1-D mesh over the world (its root is that 1-D mesh)."""
    if not unflattened:
        return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    world = init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
    return world._unflatten(0, (2, 2), ("dp", "tp"))


def _fsdp_tp(
    sequence_parallel: bool,
    layout: str,
    precision: str,
    shard_dim: int,
    traced: bool = False,
    unflattened: bool = False,
    memory_mode: str = "zero3",
) -> list[float]:
    mesh = dp_tp_mesh(unflattened)
    torch.manual_seed(SEED)
    model = TinyGPT()
    ref, torch_model = copy.deepcopy(model), copy.deepcopy(model)
    parallelize(model, mesh["tp"], sequence_parallel)
    if layout == "dp_slice":
        kwargs: dict[str, Any] = {"mesh": mesh["dp"]}
    else:  # the full mesh, its data-parallel dim named
        kwargs = {"mesh": mesh, "dp_mesh_dims": DataParallelMeshDims(shard="dp")}
    if shard_dim:  # where tp split the same dim (row-wise weights) dp's split is strided too
        kwargs["shard_placement_fn"] = lambda p: Shard(shard_dim) if p.ndim > shard_dim else None
    torch_kwargs = dict(kwargs)
    bf16 = precision == "bf16"
    if bf16:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    if memory_mode != "zero3":
        kwargs["memory_mode"] = memory_mode
    for block in model.blocks:
        fsdp2.fully_shard(block, **kwargs)
    fsdp2.fully_shard(model, **kwargs)
    if traced:  # collectives as functional ops around each forward (fsdp2.engine.traced), not hooks
        from fsdp2.engine.traced import set_traced

        set_traced(model)

    if not shard_dim:
        for name, p in model.named_parameters():
            expected = expected_placements(name, sequence_parallel, layout)
            assert isinstance(p, DTensor) and p.placements == expected, (name, p, expected)
    # full_tensor() and the state dict hold the true global tensors, not a tp or dp piece.
    for (name, value), ref_value in zip(
        model.state_dict().items(), ref.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(full(value), ref_value, rtol=0, atol=0, msg=name)
    if layout == "dp_slice":
        # torch's fully_shard on the same TP model: the same placements and local pieces.
        parallelize(torch_model, mesh["tp"], sequence_parallel)
        for block in torch_model.blocks:
            fsdp_api("torch").fully_shard(block, **torch_kwargs)
        fsdp_api("torch").fully_shard(torch_model, **torch_kwargs)
        for (name, p), tp in zip(model.named_parameters(), torch_model.parameters(), strict=True):
            assert tp.placements == p.placements, (name, tp.placements, p.placements)
            torch.testing.assert_close(tp.to_local(), p.to_local(), rtol=0, atol=0, msg=name)

    result = train_side_by_side(
        model,
        ref,
        make_batch,
        dp_rank=mesh.get_local_rank("dp"),
        dp_size=2,
        tol=TP_BF16_TOL if bf16 else TP_TOL,
        # bf16: the reference computes each dp slice on bf16 casts of its fp32 weights.
        ref_forward=cast_forward(torch.bfloat16, 2) if bf16 else None,
    )
    return result.losses


@pytest.mark.parametrize(
    ("sequence_parallel", "layout", "precision", "shard_dim", "unflattened"),
    [
        (False, "dp_slice", "fp32", 0, False),
        (True, "dp_slice", "fp32", 0, False),
        (False, "dp_mesh_dims", "fp32", 0, False),
        (True, "dp_mesh_dims", "fp32", 0, False),
        (False, "dp_slice", "bf16", 0, False),
        (False, "dp_slice", "fp32", 1, False),  # row-wise weights: (_StridedShard(1), Shard(1))
        # Meshes that are views of a 1-D world mesh (torchtitan's DeviceMesh._unflatten).
        (True, "dp_slice", "fp32", 0, True),
        (False, "dp_mesh_dims", "fp32", 0, True),
    ],
)
def test_fsdp_tp_parity(
    sequence_parallel: bool, layout: str, precision: str, shard_dim: int, unflattened: bool
) -> None:
    results = run_on_ranks(
        4,
        _fsdp_tp,
        sequence_parallel,
        layout,
        precision,
        shard_dim,
        unflattened=unflattened,
        timeout=120,
    )
    assert all(losses == results[0] for losses in results)


def test_fsdp_tp_zero2_parity() -> None:
    """Parameters kept gathered between steps (memory_mode="zero2") on FSDP x TP: the same
    parity with the unsharded reference, each step's forward after the optimizer's update."""
    results = run_on_ranks(
        4, _fsdp_tp, False, "dp_slice", "fp32", 0, memory_mode="zero2", timeout=120
    )
    assert all(losses == results[0] for losses in results)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_fsdp_tp_traced_parity(sequence_parallel: bool) -> None:
    """Traced mode (no hooks; functional collectives around each forward) on the same TP
    model: the same parity with the single-process reference."""
    results = run_on_ranks(
        4, _fsdp_tp, sequence_parallel, "dp_slice", "fp32", 0, traced=True, timeout=120
    )
    assert all(losses == results[0] for losses in results)


def _traced_compiled_vs_hooks(sequence_parallel: bool) -> dict[str, Any]:
    """The same TP model twice: traced and compiled with ``fullgraph=True``, and with the hooks."""
    from torch._dynamo.utils import counters

    from fsdp2.engine.traced import set_traced

    torch._dynamo.reset()  # rank processes outlive tests
    counters.clear()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(SEED)
    model = TinyGPT()
    hooked = copy.deepcopy(model)
    for m in (model, hooked):
        parallelize(m, mesh["tp"], sequence_parallel)
        for block in m.blocks:
            fsdp2.fully_shard(block, mesh=mesh["dp"])
        fsdp2.fully_shard(m, mesh=mesh["dp"])
    set_traced(model)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    gen = torch.Generator().manual_seed(mesh.get_local_rank("dp"))
    for step in range(2):
        batch = make_batch(gen, 2)
        loss, ref_loss = compiled(*batch), hooked(*batch)
        loss.backward()
        ref_loss.backward()
        assert_fp32_close(loss, ref_loss, msg=f"step {step}")
        for (name, p), ref_p in zip(model.named_parameters(), hooked.parameters(), strict=True):
            assert_fp32_close(full(p.grad), full(ref_p.grad), msg=f"{name} step {step}")
            p.grad = ref_p.grad = None
    return {"graph_breaks": sum(counters["graph_break"].values())}


def test_fsdp_tp_traced_fullgraph() -> None:
    """Traced FSDP x TP (sequence parallel) compiles to one graph and matches the hooks."""
    for report in run_on_ranks(4, _traced_compiled_vs_hooks, True, timeout=300):
        assert report == {"graph_breaks": 0}


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


def _partial_reshard_with_tp() -> str:
    # reshard_after_forward=k needs a dp axis of more than k ranks: dp=4, and a tp axis of 1.
    mesh = init_device_mesh("cpu", (4, 1), mesh_dim_names=("dp", "tp"))
    model = parallelize_module(nn.Linear(4, 8), mesh["tp"], ColwiseParallel())
    return raised(lambda: fsdp2.fully_shard(model, mesh=mesh["dp"], reshard_after_forward=2))


def _overlapping_meshes() -> str:
    # Two meshes over the same 2 ranks: no mesh has both as dims.
    tp = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    dp = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    model = parallelize_module(nn.Linear(4, 2), tp, ColwiseParallel())
    return raised(lambda: fsdp2.fully_shard(model, mesh=dp))


class TestTensorParallelErrors(expecttest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        init_local_process_group()

    def test_dtensor_on_a_mesh_that_overlaps_the_dp_mesh(self) -> None:
        messages = run_on_ranks(2, _overlapping_meshes)
        assert all(m == messages[0] for m in messages)
        self.assertExpectedInline(
            messages[0],
            """ValueError: weight is a DTensor on mesh DeviceMesh((tp=2), 'cpu', stride=(1,)), which cannot be joined with fully_shard's mesh DeviceMesh((dp=2), 'cpu', stride=(1,)) (cannot concatenate overlapping meshes). Build both as disjoint named dims of one mesh, e.g. mesh['dp'] and mesh['tp'] of init_device_mesh(..., mesh_dim_names=('dp', 'tp')), or world._unflatten(0, (dp, tp), ('dp', 'tp'))""",
        )

    def test_dp_mesh_dims_parameter_sharded_on_dp(self) -> None:
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
        model = nn.Linear(4, 2)
        model.weight = nn.Parameter(
            distribute_tensor(model.weight.detach(), mesh, [Shard(0), Replicate()])
        )
        dims = DataParallelMeshDims(shard="dp")
        self.assertExpectedInline(
            raised(lambda: fsdp2.fully_shard(model, mesh=mesh, dp_mesh_dims=dims)),
            """ValueError: weight is Shard(dim=0) on data-parallel mesh dim 0; dp_mesh_dims expects parameters replicated over the data-parallel dims""",
        )

    def test_reshard_after_forward_int_with_tp(self) -> None:
        messages = run_on_ranks(4, _partial_reshard_with_tp)
        assert all(m == messages[0] for m in messages)
        self.assertExpectedInline(
            messages[0],
            """NotImplementedError: reshard_after_forward=2 with tensor-parallel (DTensor) parameters is not supported; use True or False for modules whose parameters are DTensors""",
        )
