"""Meshes: HSDP, replicate-only (DDP semantics), ``shard_placement_fn`` and ``ignored_params``.

Every layout trains an `MLPStack` (a group per block, then the root) side by side with an
unsharded reference (`tests/parity/`) and pins the collectives each step issues: which kind,
over how many ranks, and the bytes that show whether a gradient all-reduce moves a shard (HSDP)
or whole parameters (replicate). Error messages are pinned in the test process on a 1-rank group
(regenerate with ``EXPECTTEST_ACCEPT=1 python -m pytest tests/engine/test_meshes.py``).
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable
from typing import Any

import expecttest
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

import fsdp2
from fsdp2 import DataParallelMeshDims
from fsdp2.engine.collectives import record_collectives
from tests.errors import error_text, raised
from tests.harness import (
    RemoteError,
    discard_pool,
    fsdp_api,
    init_local_process_group,
    per_group_collectives,
    run_on_ranks,
)
from tests.models import MODELS, MLPStack, build_model
from tests.parity import (
    ADAM_EPS,
    LOCAL_BATCH,
    LR,
    MODEL_SEED,
    WEIGHT_DECAY,
    count,
    full,
    global_batch,
    kinds,
    local_batch,
    same_on_all_ranks,
    train_side_by_side,
    twins,
)
from tests.tolerance import PARAM_ATOL, assert_fp32_close

MLP_BATCH = MODELS["mlp"].make_batch
GROUPS = ["blocks.0", "blocks.1", "blocks.2", ""]  # one per fully_shard call, the root last
NUM_MICRO = 3


def shard_mlp(
    model: nn.Module, apply: Callable[..., Any] = fsdp2.fully_shard, **kwargs: Any
) -> None:
    for block in model.blocks:  # type: ignore[union-attr]
        apply(block, **kwargs)
    apply(model, **kwargs)


def check_layout(
    model: nn.Module, ref: nn.Module, placements: tuple[Placement, ...], shard_rank: int, world: int
) -> None:
    """Every parameter has ``placements`` and holds its ``torch.chunk`` of dim 0 (all of it
    when nothing is sharded)."""
    for (name, p), ref_p in zip(model.named_parameters(), ref.parameters(), strict=True):
        if not isinstance(p, DTensor) or tuple(p.placements) != placements:
            raise AssertionError(f"{name}: {p!r}, expected placements {placements}")
        expected = ref_p.detach().chunk(world)[shard_rank] if world > 1 else ref_p.detach()
        torch.testing.assert_close(p.to_local(), expected, rtol=0, atol=0)


def nbytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


# ---------------------------------------------------------------------------------------------
# HSDP: (replicate, shard) meshes, reduce-scatter then all-reduce
# ---------------------------------------------------------------------------------------------

# layout -> (mesh dim names, dp_mesh_dims). Without dp_mesh_dims, a 2-D mesh is (replicate,
# shard) by position; dp_mesh_dims picks the axes by name, in either order.
HSDP_LAYOUTS: dict[str, tuple[tuple[str, str], DataParallelMeshDims | None]] = {
    "mesh": (("replicate", "shard"), None),
    "dp_mesh_dims": (
        ("replicate", "shard"),
        DataParallelMeshDims(shard="shard", replicate="replicate"),
    ),
    "dp_mesh_dims_swapped": (
        ("shard", "replicate"),
        DataParallelMeshDims(shard="shard", replicate="replicate"),
    ),
    # Views unflattened from a 1-D world mesh, as torchtitan builds them.
    "mesh_unflattened": (("replicate", "shard"), None),
}


def mesh_2x2(names: tuple[str, str], unflattened: bool) -> DeviceMesh:
    if not unflattened:
        return init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
    world = init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
    return world._unflatten(0, (2, 2), names)


@per_group_collectives  # counts one gather per group (and its bytes)
def _hsdp(layout: str, knob: str | None) -> dict[str, Any]:
    names, dims = HSDP_LAYOUTS[layout]
    mesh = mesh_2x2(names, layout.endswith("_unflattened"))
    model, ref = twins(MLPStack)
    shard_mlp(model, mesh=mesh, dp_mesh_dims=dims)
    placements: list[Placement] = [Replicate(), Replicate()]
    placements[names.index("shard")] = Shard(0)
    check_layout(model, ref, tuple(placements), mesh.get_local_rank("shard"), 2)

    def turn_knob(step: int, micro: int) -> None:
        last = micro == NUM_MICRO - 1
        if knob == "requires_all_reduce":
            model.set_requires_all_reduce(last)  # type: ignore[operator]
        elif knob == "requires_gradient_sync":
            model.set_requires_gradient_sync(last)  # type: ignore[operator]

    # Every rank is a data-parallel rank: 4 slices of the global batch.
    result = train_side_by_side(
        model,
        ref,
        MLP_BATCH,
        dp_rank=dist.get_rank(),
        dp_size=4,
        num_micro=NUM_MICRO if knob else 1,
        before_micro=turn_knob,
    )
    records = result.records[-1]
    # The all-reduce runs on the reduce-scatter's output: a shard, not the whole gradient.
    rs_bytes = {r.label: r.output_nbytes for r in records if r.kind == "reduce_scatter"}
    ar_bytes = {r.label: r.input_nbytes for r in records if r.kind == "all_reduce"}
    return {
        "kinds": [kinds(r) for r in result.records],
        "all_reduces": count(records, "all_reduce"),
        "same_bytes": rs_bytes == ar_bytes,
    }


@pytest.mark.parametrize("layout", list(HSDP_LAYOUTS))
def test_hsdp_parity_and_collectives(layout: str) -> None:
    # Per group: a gather in forward (and again in backward for the blocks, resharded after
    # forward), a reduce-scatter over the 2 shard ranks, an all-reduce over the 2 replicas.
    expected = Counter({("all_gather", 2): 4 + 3, ("reduce_scatter", 2): 4, ("all_reduce", 2): 4})
    for result in run_on_ranks(4, _hsdp, layout, None):
        assert result["kinds"] == [expected] * 3
        assert result["all_reduces"] == Counter(GROUPS)
        assert result["same_bytes"]


@pytest.mark.parametrize(
    ("knob", "num_reduce_scatters"),
    [
        # Reduce-scatter every micro-step, add up the shards, all-reduce the sum once.
        ("requires_all_reduce", 4 * NUM_MICRO),
        # No communication at all until the last micro-step reduces the local sum.
        ("requires_gradient_sync", 4),
    ],
)
def test_hsdp_accumulation_defers_all_reduce(knob: str, num_reduce_scatters: int) -> None:
    expected = Counter(
        {
            ("all_gather", 2): 7 * NUM_MICRO,
            ("reduce_scatter", 2): num_reduce_scatters,
            ("all_reduce", 2): 4,
        }
    )
    for result in run_on_ranks(4, _hsdp, "mesh", knob):
        assert result["kinds"] == [expected] * 3
        assert result["all_reduces"] == Counter(GROUPS)


# ---------------------------------------------------------------------------------------------
# Replicate-only: whole parameters on every rank, gradients all-reduced
# ---------------------------------------------------------------------------------------------


def _replicate(how: str) -> dict[str, Any]:
    model, ref = twins(MLPStack)
    if how == "replicate":
        shard_mlp(model, fsdp2.replicate)
    else:  # a named mesh whose only data-parallel dim replicates: DDP through either call
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        apply = fsdp2.replicate if how == "replicate_dp_mesh_dims" else fsdp2.fully_shard
        shard_mlp(model, apply, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(replicate="dp"))
    check_layout(model, ref, (Replicate(),), 0, 1)
    result = train_side_by_side(model, ref, MLP_BATCH, dp_rank=dist.get_rank(), dp_size=4)

    # Each group's whole gradients, and one fp32 flag per parameter (whether this rank had its
    # gradient: [Note: gradients on some ranks only] in fsdp2/engine/reduce.py).
    def with_flags(module: nn.Module) -> int:
        return nbytes(module) + 4 * len(list(module.parameters()))

    whole = {f"blocks.{i}": with_flags(block) for i, block in enumerate(model.blocks)}
    whole[""] = with_flags(model.head)  # the root's own parameters
    ar_bytes = {r.label: r.input_nbytes for r in result.records[-1] if r.kind == "all_reduce"}
    return {
        "class": type(model).__name__,
        "kinds": [kinds(r) for r in result.records],
        "all_reduces": count(result.records[-1], "all_reduce"),
        "whole_gradients": ar_bytes == whole,
    }


@pytest.mark.parametrize(
    ("how", "class_name"),
    [
        ("replicate", "ReplicateMLPStack"),
        ("replicate_dp_mesh_dims", "ReplicateMLPStack"),
        ("fully_shard_dp_mesh_dims", "FSDPMLPStack"),
    ],
)
def test_replicate_parity_and_collectives(how: str, class_name: str) -> None:
    for result in run_on_ranks(4, _replicate, how):
        assert result["class"] == class_name
        # No gather (every rank holds everything) and one all-reduce per module, of its
        # whole gradients.
        assert result["kinds"] == [Counter({("all_reduce", 4): 4})] * 3
        assert result["all_reduces"] == Counter(GROUPS)
        assert result["whole_gradients"]


# ---------------------------------------------------------------------------------------------
# shard_placement_fn: shard another dim, uneven sizes included
# ---------------------------------------------------------------------------------------------


def _shard_dim(name: str, dim: int) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model, ref = twins(name)

    def placement(p: nn.Parameter) -> Shard | None:
        # dim 1 where there is one (1-D parameters keep the default); a negative dim for all.
        return Shard(dim) if dim < 0 or p.ndim > dim else None

    for unit in MODELS[name].shard_units(model):
        fsdp2.fully_shard(unit, shard_placement_fn=placement)
    fsdp2.fully_shard(model, shard_placement_fn=placement)
    layouts = {}
    for (fqn, p), ref_p in zip(model.named_parameters(), ref.parameters(), strict=True):
        choice = placement(ref_p)
        sharded = choice.dim % ref_p.ndim if choice is not None else 0
        chunks = ref_p.detach().chunk(world, dim=sharded)
        expected = chunks[rank] if rank < len(chunks) else ref_p.detach().narrow(sharded, 0, 0)
        assert isinstance(p, DTensor) and p.placements == (Shard(sharded),), (fqn, p)
        torch.testing.assert_close(p.to_local(), expected, rtol=0, atol=0)
        layouts[fqn] = tuple(p.to_local().shape)
    if name == "mlp":  # even sizes: torch's fully_shard takes them too and must agree
        torch_model = build_model(name, MODEL_SEED)
        for unit in MODELS[name].shard_units(torch_model):
            fsdp_api("torch").fully_shard(unit, shard_placement_fn=placement)
        fsdp_api("torch").fully_shard(torch_model, shard_placement_fn=placement)
        for (fqn, p), tp in zip(model.named_parameters(), torch_model.parameters(), strict=True):
            assert tp.placements == p.placements, (fqn, tp.placements, p.placements)
            torch.testing.assert_close(tp.to_local(), p.to_local(), rtol=0, atol=0)
    # foreach AdamW: its fused kernels take flat views of every parameter, gradient and state.
    optim = torch.optim.AdamW(
        model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, eps=ADAM_EPS, foreach=True
    )
    make_batch = MODELS[name].make_batch
    train_side_by_side(model, ref, make_batch, dp_rank=rank, dp_size=world, optim=optim)
    model(*local_batch(make_batch, 9, 0, rank, world)).backward()
    for fqn, p in model.named_parameters():
        # Contiguous tensors of their true local shape, as torch's (a flat view must work).
        assert isinstance(p.grad, DTensor), fqn
        state = optim.state[p]["exp_avg"]
        for what, t in (("param", p), ("grad", p.grad), ("exp_avg", state)):
            local = t.to_local()
            assert local.is_contiguous() and local.shape == layouts[fqn], (fqn, what, local)
            local.view(-1)
    return layouts


@pytest.mark.parametrize(
    ("name", "world_size", "dim"), [("mlp", 4, 1), ("odd_shapes", 2, 1), ("odd_shapes", 4, -1)]
)
def test_shard_placement_fn_parity(name: str, world_size: int, dim: int) -> None:
    layouts = run_on_ranks(world_size, _shard_dim, name, dim)
    if name == "odd_shapes" and world_size == 4:
        # blocks.i.a is (5, 3): its 3 columns make chunks of 1, 1, 1 and an empty one.
        assert [lay["blocks.0.a"] for lay in layouts] == [(5, 1), (5, 1), (5, 1), (5, 0)]


# ---------------------------------------------------------------------------------------------
# ignored_params: not sharded, not moved, not reduced
# ---------------------------------------------------------------------------------------------


@per_group_collectives  # the bytes of one group's own gather
def _ignored() -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model, ref = twins(MLPStack)
    local_ref = copy.deepcopy(ref)
    ignored = model.blocks[0][0].weight
    data_ptr = ignored.data_ptr()
    for block in model.blocks:
        fsdp2.fully_shard(block, ignored_params={ignored})
    fsdp2.fully_shard(model, ignored_params={ignored})
    assert model.blocks[0][0].weight is ignored and not isinstance(ignored, DTensor)
    assert ignored.data_ptr() == data_ptr
    with record_collectives() as records:
        model(*local_batch(MLP_BATCH, 0, 0, rank, world)).backward()
    ref(*global_batch(MLP_BATCH, 0, 0, world * LOCAL_BATCH)).backward()
    local_ref(*local_batch(MLP_BATCH, 0, 0, rank, world)).backward()
    for (name, p), ref_p, local_p in zip(
        model.named_parameters(), ref.parameters(), local_ref.parameters(), strict=True
    ):
        # The ignored weight's gradient is this rank's own, as if there were no FSDP.
        expected = local_p.grad if p is ignored else ref_p.grad
        assert expected is not None and p.grad is not None, name
        assert_fp32_close(full(p.grad), expected, msg=lambda m, n=name: f"{n}: {m}")
    assert isinstance(ignored.grad, torch.Tensor) and not isinstance(ignored.grad, DTensor)
    try:
        same_on_all_ranks(ignored.grad.tolist())
    except AssertionError:
        grads_differ = True
    else:
        grads_differ = False
    return {
        "grads_differ": grads_differ,
        "bytes": sorted({(r.kind, r.input_nbytes) for r in records if r.label == "blocks.0"}),
    }


def test_ignored_params() -> None:
    for result in run_on_ranks(2, _ignored):
        assert result["grads_differ"]
        # blocks.0 gathers and reduces only its bias: 16 floats, 8 per rank, and each rank's
        # chunk its flag ([Note: gradients on some ranks only] in fsdp2/engine/reduce.py).
        assert result["bytes"] == [("all_gather", 8 * 4), ("reduce_scatter", (16 + 2) * 4)]


# ---------------------------------------------------------------------------------------------
# Error messages
# ---------------------------------------------------------------------------------------------


def linear() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(4, 2)


class TestMeshErrors(expecttest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        init_local_process_group()

    def shard(self, mesh: DeviceMesh, **kwargs: Any) -> str:
        return raised(lambda: fsdp2.fully_shard(linear(), mesh=mesh, **kwargs))

    def test_dp_mesh_dims_on_unnamed_mesh(self) -> None:
        mesh = init_device_mesh("cpu", (1, 1))
        self.assertExpectedInline(
            self.shard(mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp")),
            """ValueError: dp_mesh_dims names mesh dims (shard=('dp',)), but the mesh has no dim names. Build it with init_device_mesh(..., mesh_dim_names=(...))""",
        )

    def test_dp_mesh_dims_names_missing_dim(self) -> None:
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
        self.assertExpectedInline(
            self.shard(mesh, dp_mesh_dims=DataParallelMeshDims(shard="fsdp")),
            """ValueError: dp_mesh_dims shard='fsdp' is not a dim of the mesh; its dims are ('dp', 'tp')""",
        )

    def test_dp_mesh_dims_empty(self) -> None:
        self.assertExpectedInline(
            raised(DataParallelMeshDims),
            """ValueError: DataParallelMeshDims needs shard=..., replicate=... or both; got neither""",
        )

    def test_3d_mesh_without_dp_mesh_dims(self) -> None:
        mesh = init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("a", "b", "tp"))
        self.assertExpectedInline(
            self.shard(mesh),
            """ValueError: fully_shard(Linear) expects a 1-D mesh (FSDP) or a 2-D mesh (HSDP: replicate, shard), got a 3-D mesh of shape (1, 1, 1). Pass its data-parallel slice (mesh[name], name one of ('a', 'b', 'tp')), or name the data-parallel dims of the full mesh with dp_mesh_dims=DataParallelMeshDims(shard=..., replicate=...)""",
        )

    def test_replicate_on_2d_mesh(self) -> None:
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
        self.assertExpectedInline(
            raised(lambda: fsdp2.replicate(linear(), mesh=mesh)),
            """ValueError: replicate expects a 1-D mesh, got a 2-D mesh of shape (1, 1); name its data-parallel dim with dp_mesh_dims=DataParallelMeshDims(replicate=...)""",
        )

    def test_replicate_with_a_shard_dim(self) -> None:
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
        dims = DataParallelMeshDims(shard="dp")
        self.assertExpectedInline(
            raised(lambda: fsdp2.replicate(linear(), mesh=mesh, dp_mesh_dims=dims)),
            """ValueError: replicate() takes replicate-only dims; dp_mesh_dims names a shard dim (DataParallelMeshDims(shard='dp', replicate=None)). Use fully_shard() to shard""",
        )

    def test_shard_placement_fn_bad_dim(self) -> None:
        mesh = init_device_mesh("cpu", (1,))
        self.assertExpectedInline(
            self.shard(mesh, shard_placement_fn=lambda p: Shard(2)),
            """ValueError: shard_placement_fn chose Shard(2) for weight of shape (2, 4), which has no such dim""",
        )
        self.assertExpectedInline(
            self.shard(mesh, shard_placement_fn=lambda p: Shard(-3)),
            """ValueError: shard_placement_fn chose Shard(-3) for weight of shape (2, 4), which has no such dim""",
        )

    def test_shard_placement_fn_not_a_shard(self) -> None:
        mesh = init_device_mesh("cpu", (1,))
        self.assertExpectedInline(
            self.shard(mesh, shard_placement_fn=lambda p: Replicate()),
            """ValueError: shard_placement_fn must return None or a Shard placement for weight, got Replicate()""",
        )


def _replicate_bf16() -> tuple[float, float, str]:
    import fsdp2

    rank = dist.get_rank()
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
    model = copy.deepcopy(reference)
    policy = fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fsdp2.replicate(model, mp_policy=policy)
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    reference(x).pow(2).mean().backward()
    model(x[rank * 4 : (rank + 1) * 4]).float().pow(2).mean().backward()
    errors = [
        ((p.grad.to_local() - q.grad).norm() / q.grad.norm()).item()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True)
    ]
    weight = model[0].weight
    return max(errors), weight.grad.to_local().abs().sum().item(), str(weight.dtype)


def test_replicate_with_mixed_precision() -> None:
    # A replicate-only mesh has no shard group: the bf16 cast is the whole "gather".
    results = run_on_ranks(2, _replicate_bf16)
    assert results[0][1] == results[1][1], results  # ranks hold the same all-reduced gradient
    assert results[0][2] == "torch.float32", results  # parameters stay in their own dtype
    assert results[0][0] < 2e-2, results  # bf16 compute, fp32 reduction


def _flattened_shard_dims(unflattened: bool) -> tuple[str, str, str]:
    import fsdp2

    rank = dist.get_rank()
    mesh = mesh_2x2(("a", "b"), unflattened)
    dims = fsdp2.DataParallelMeshDims(shard=("a", "b"))
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
    model = copy.deepcopy(reference)
    fsdp2.fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(step))
        reference(x).pow(2).mean().backward()
        model(x[rank * 2 : (rank + 1) * 2]).pow(2).mean().backward()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            assert_fp32_close(p.grad.full_tensor(), q.grad)
        for optimizer in (ref_opt, opt):
            optimizer.step()
            optimizer.zero_grad()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert_fp32_close(p.full_tensor(), q, atol=PARAM_ATOL)
    uneven = nn.Linear(8, 6)  # 6 rows over 4 flattened ranks
    return (
        str(model[0].weight.placements),
        str(tuple(model[0].weight.to_local().shape)),
        error_text(lambda: fsdp2.fully_shard(uneven, mesh=mesh, dp_mesh_dims=dims)),
    )


@pytest.mark.parametrize("unflattened", [False, True])
def test_dp_mesh_dims_flattens_several_shard_dims(unflattened: bool) -> None:
    placements, local_shape, uneven = run_on_ranks(4, _flattened_shard_dims, unflattened)[3]
    assert placements == "(Shard(dim=0), Shard(dim=0))", placements
    assert local_shape == "(4, 8)", local_shape  # 16 rows over 2 x 2 ranks
    assert uneven.startswith("NotImplementedError: weight: dim 0 of size 6 does not split"), uneven


# ---------------------------------------------------------------------------------------------
# Process groups rebuilt over the same ranks
# ---------------------------------------------------------------------------------------------


def _rebuilt_group(impl: str) -> list[float]:
    """A job (or a notebook) that destroys its group and shards a new model over a new group of
    the same ranks. DTensor's op cache compares meshes by ranks and names, so ``nn.Parameter``
    hands back the first mesh, whose group is gone: every DTensor op on the new parameters
    (``full_tensor``, ``state_dict``, clipping) fails to resolve it, unless the sharded
    parameters keep the mesh they were sharded over."""
    api = fsdp_api(impl)
    old = dist.new_group([0, 1])
    first, _ = twins(MLPStack)
    shard_mlp(
        first, api.fully_shard, mesh=DeviceMesh.from_group(old, "cpu", mesh_dim_names=("dp",))
    )
    first(*local_batch(MLP_BATCH, 0, 0, dist.get_rank(), 2)).backward()
    del first
    dist.barrier(old)  # every rank done with it before it closes (gloo's sockets)
    dist.destroy_process_group(old)

    new = dist.new_group([0, 1])
    mesh = DeviceMesh.from_group(new, "cpu", mesh_dim_names=("dp",))
    model, ref = twins(MLPStack)
    shard_mlp(model, api.fully_shard, mesh=mesh)
    assert all(p.device_mesh is mesh for p in model.parameters())
    # The parity helper compares full_tensor()s of the gradients and parameters.
    result = train_side_by_side(model, ref, MLP_BATCH, dp_rank=dist.get_rank(), dp_size=2)
    full_state = {k: full(v) for k, v in model.state_dict().items()}
    for k, v in ref.state_dict().items():
        assert_fp32_close(full_state[k], v, atol=PARAM_ATOL, msg=k)
    model(*local_batch(MLP_BATCH, 3, 0, dist.get_rank(), 2)).backward()
    ref(*global_batch(MLP_BATCH, 3, 0, 2 * LOCAL_BATCH)).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)  # an all-reduce on the mesh
    assert_fp32_close(full(norm), torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9))
    return result.losses


@pytest.mark.parametrize(
    "impl",
    [
        "fsdp2",
        pytest.param(
            "torch",
            marks=pytest.mark.xfail(
                reason="torch's parameters come back on the destroyed group's mesh",
                raises=RemoteError,
                strict=True,
            ),
        ),
    ],
)
def test_a_group_rebuilt_over_the_same_ranks(impl: str) -> None:
    # Fresh processes before and after: DTensor's cache keeps the destroyed group's mesh for
    # the life of the process, and would hand it to later tests' parameters.
    discard_pool(2)
    try:
        losses = run_on_ranks(2, _rebuilt_group, impl)
    finally:
        discard_pool(2)
    assert losses[0] == losses[1]


def _default_mesh_on_a_cuda_build_without_gpu() -> tuple[str, str]:
    """torch.accelerator as a CUDA build of torch answers on a machine without a GPU: cuda is
    the build's accelerator, but not available. Returns (the default mesh's device type, the
    device fsdp2.ShardedGradScaler picks)."""
    from unittest import mock

    def current_accelerator(check_available: bool = False) -> torch.device | None:
        return None if check_available else torch.device("cuda")

    with mock.patch.object(torch.accelerator, "current_accelerator", current_accelerator):
        from fsdp2.engine.mesh import default_mesh

        mesh = default_mesh()
        scaler = fsdp2.ShardedGradScaler()
    return mesh.device_type, scaler._device


def test_default_mesh_on_a_cuda_build_without_gpu() -> None:
    """fully_shard without a mesh, and ShardedGradScaler without a device, on a CUDA build of
    torch with no GPU (a laptop, a CPU CI runner): gloo on CPU, as the machine can run, not a
    cuda mesh that fails at the first tensor or a scaler that disables itself."""
    for result in run_on_ranks(2, _default_mesh_on_a_cuda_build_without_gpu):
        assert tuple(result) == ("cpu", "cpu"), result
