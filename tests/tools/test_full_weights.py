"""``fsdp2.iter_full_weights``: a sharded model's full weights, bucket by bucket.

Every tensor handed out equals ``full_tensor()`` of the sharded parameter bit for bit (the
gather and the cast copy the same values, elementwise, in both), under the unsharded module's
``state_dict()`` keys, tied weights once; on 1-D meshes with uneven and empty shards, a 0-d
parameter, ``Shard(1)``, HSDP and FSDP x TP. Each bucket is one all-gather; memory above the
sharded model stays within the bound the docstring states, counted by the CPU allocator; a
consumer raising on one rank ends every rank with an error, not a hang. fsdp2-only.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import expecttest
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from tests.errors import raised
from tests.harness import RemoteError, run_on_ranks
from tests.models import build_model

pytestmark = pytest.mark.usefixtures("fsdp2_only")

SEED = 7


def _shard(model: nn.Module, **kwargs: Any) -> nn.Module:
    from fsdp2 import fully_shard

    for block in getattr(model, "blocks", []):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _expected(model: nn.Module, buffers: bool = True) -> dict[str, torch.Tensor]:
    """``full_tensor()`` of every state_dict entry, each tensor once, in state_dict order."""
    params = {id(p) for p in model.parameters()}
    seen: set[int] = set()
    expected = {}
    for name, value in model.state_dict(keep_vars=True).items():
        if id(value) in seen or (not buffers and id(value) not in params):
            continue
        seen.add(id(value))
        value = value.detach()
        expected[name] = value.full_tensor() if isinstance(value, DTensor) else value
    return expected


def _check(model: nn.Module, **kwargs: Any) -> list[list[str]]:
    """Run ``iter_full_weights(model, **kwargs)`` and compare with ``full_tensor()``; return
    the names of each bucket."""
    from fsdp2 import iter_full_weights

    expected = _expected(model, kwargs.get("buffers", True))
    dtype = kwargs.get("dtype")
    buckets = []
    for bucket in iter_full_weights(model, **kwargs):
        buckets.append([name for name, _ in bucket])
        for name, tensor in bucket:
            want = expected[name]
            if dtype is not None and want.is_floating_point():
                want = want.to(dtype)  # the same elementwise cast, on the shard or the whole
            assert tensor.dtype == want.dtype and tensor.shape == want.shape, name
            assert torch.equal(tensor, want), name  # copies of the same values: bitwise
            assert type(tensor) is torch.Tensor and tensor.is_contiguous(), name
        del bucket
    names = [n for b in buckets for n in b]
    rank = kwargs.get("rank")
    if rank is None or rank == dist.get_rank():
        assert names == list(expected), (names, list(expected))
    else:
        assert names == [], names
    return buckets


def _equal_to_full_tensor() -> None:
    world = dist.get_world_size()
    models: list[tuple[str, Callable[[], nn.Module]]] = [
        ("gpt", lambda: _shard(build_model("gpt", SEED))),  # lm_head.weight tied to wte
        ("odd", lambda: _shard(build_model("odd_shapes_scalar", SEED))),  # uneven, empty, 0-d
        ("buffers", lambda: _shard(build_model("buffers", SEED))),
        (
            "shard1",
            lambda: _shard(
                build_model("odd_shapes_scalar", SEED),
                shard_placement_fn=lambda p: Shard(1) if p.ndim > 1 else None,
            ),
        ),
    ]
    for label, build in models:
        model = build()
        assert "lm_head.weight" not in _expected(model) or label != "gpt"
        for kwargs in (
            {},
            {"dtype": torch.bfloat16, "bucket_bytes": 300},
            {"bucket_bytes": 1},  # every tensor its own bucket
            {"buffers": False, "device": "cpu"},
            {"rank": world - 1, "dtype": torch.float16},
        ):
            try:
                _check(model, **kwargs)
            except AssertionError as error:
                raise AssertionError(f"{label} {kwargs}: {error}") from error


@pytest.mark.parametrize("world_size", [2, 3])
def test_equal_to_full_tensor(world_size: int) -> None:
    run_on_ranks(world_size, _equal_to_full_tensor)


def _coalesced_launch() -> None:
    """The launch other backends than gloo take (one coalesced all-gather; gloo's own
    coalesced form runs it here), so that it is checked without a GPU."""
    from unittest import mock

    with mock.patch("fsdp2.engine.collectives.is_gloo", return_value=False):
        _equal_to_full_tensor()


def test_the_coalesced_launch_gathers_the_same() -> None:
    run_on_ranks(3, _coalesced_launch)


def _one_gather_per_bucket() -> list[tuple[str, int]]:
    from fsdp2 import record_collectives

    model = _shard(build_model("gpt", SEED))  # three fully_shard groups
    sizes = [t.numel() * 4 for t in _expected(model).values()]
    counts = []
    for bucket_bytes in (2**30, 20_000):
        with record_collectives() as records:
            buckets = _check(model, bucket_bytes=bucket_bytes)
        # The plan, from the full sizes alone: greedy, in state_dict order.
        planned, total = 1, 0
        for size in sizes:
            if total and total + size > bucket_bytes:
                planned, total = planned + 1, 0
            total += size
        kinds = [r.kind for r in records]
        assert len(buckets) == planned, (len(buckets), planned)
        assert kinds == ["all_gather"] * planned + ["agree"], kinds
        counts.append((str(bucket_bytes), planned))
    return counts


def test_one_all_gather_per_bucket() -> None:
    counts = run_on_ranks(2, _one_gather_per_bucket)[0]
    assert counts[0] == (str(2**30), 1), counts  # the whole model: one all-gather, 3 groups
    assert counts[1][1] > 3, counts


def _hsdp() -> list[str]:
    from fsdp2 import record_collectives

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _shard(build_model("gpt", SEED), mesh=mesh)
    with record_collectives() as records:
        _check(model, bucket_bytes=20_000)
    _check(model, rank=3, dtype=torch.bfloat16)
    gathers = {(r.world_size, r.group) for r in records if r.kind == "all_gather"}
    assert gathers == {(2, mesh.get_group("shard").group_name)}, gathers
    return [r.kind for r in records]


def test_hsdp() -> None:
    kinds = run_on_ranks(4, _hsdp)[0]
    # The closing exchange runs over both mesh dims: a stop reaches the other replica too.
    assert kinds[-2:] == ["agree", "agree"], kinds


def _hfsdp() -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _shard(build_model("gpt", SEED), mesh=mesh, memory_mode="hfsdp")
    _check(model, bucket_bytes=20_000)  # over all four ranks, the flattened mesh's order


def test_hfsdp() -> None:
    run_on_ranks(4, _hfsdp)


def _tensor_parallel() -> None:
    from fsdp2 import fully_shard
    from tests.engine.test_tensor_parallel import TinyGPT, parallelize

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(SEED)
    model = TinyGPT()
    parallelize(model, mesh["tp"], False)
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    from fsdp2 import record_collectives

    with record_collectives() as records:
        _check(model, bucket_bytes=2_000)
    _check(model, rank=1, dtype=torch.bfloat16)
    # Each tensor-parallel weight's full tensor over the tp dim passes the seam (the hang
    # report, the checks): one "redistribute" each, on the tp group, named by its FQN.
    tp_sharded = sorted(
        name
        for name, p in model.named_parameters()
        if any(not x.is_replicate() for x in p._spec.placements[1:])  # type: ignore[attr-defined]
    )
    seen = [(r.label, r.group) for r in records if r.kind == "redistribute"]
    assert sorted(label for label, _ in seen) == tp_sharded, seen
    assert {group for _, group in seen} == {mesh.get_group("tp").group_name}, seen


def test_tensor_parallel() -> None:
    run_on_ranks(4, _tensor_parallel)


def _consumer_raises(where: str) -> str:
    """Rank 1's consumer raises at its second bucket; every rank must end with an error."""
    from fsdp2 import iter_full_weights

    mesh = None
    if dist.get_world_size() == 4:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _shard(build_model("gpt", SEED), **({"mesh": mesh} if mesh is not None else {}))
    start = time.monotonic()
    try:
        for i, _bucket in enumerate(iter_full_weights(model, bucket_bytes=20_000)):
            if dist.get_rank() == 1 and i == (1 if where == "middle" else 6):
                raise ValueError("push to the inference engine failed")
    except Exception as error:
        # Still usable afterwards: the ranks went on together, no collective left pending.
        dist.barrier()
        return f"{type(error).__name__}: {error} ({time.monotonic() - start:.1f}s)"
    return "finished"


@pytest.mark.parametrize(
    ("world_size", "where"), [(2, "middle"), (2, "last"), (4, "middle")], ids=str
)
def test_a_consumer_raising_on_one_rank_ends_every_rank(world_size: int, where: str) -> None:
    outcomes = run_on_ranks(world_size, _consumer_raises, where, timeout=60)
    assert outcomes[1].startswith("ValueError: push to the inference engine failed"), outcomes
    for rank, outcome in enumerate(outcomes):
        if rank != 1:
            assert outcome.startswith(
                "RuntimeError: iter_full_weights stopped on every rank: rank 1 stopped at bucket"
            ), outcomes


def _refusals() -> None:
    from fsdp2 import iter_full_weights

    model = _shard(build_model("gpt", SEED))
    with pytest.raises(ValueError, match="bucket_bytes >= 1"):
        iter_full_weights(model, bucket_bytes=0)
    with pytest.raises(ValueError, match=r"rank in \[0, 2\)"):
        iter_full_weights(model, rank=2)


def test_bad_arguments() -> None:
    run_on_ranks(2, _refusals)


def _default_buckets() -> tuple[int, int, int]:
    from fsdp2.tools.weight_plan import GLOO_BUCKET_BYTES, NCCL_BUCKET_BYTES, plan_buckets

    # 24 MiB of fp32 in 12 tensors of 2 MiB: two buckets on gloo's 16 MiB, one on NCCL's 256.
    model = nn.Sequential(*(nn.Linear(1024, 512, bias=False) for _ in range(12)))
    plain = len(plan_buckets(model, None, None, buffers=True))  # nothing gathered: NCCL's
    sharded = _shard(model)
    on_gloo = len(plan_buckets(sharded, None, None, buffers=True))
    if (GLOO_BUCKET_BYTES, NCCL_BUCKET_BYTES) != (16 * 2**20, 256 * 2**20):
        raise AssertionError("the defaults moved: update this test's sizes")
    return plain, on_gloo, len(plan_buckets(sharded, None, 2**30, buffers=True))


def test_default_bucket_follows_the_backend() -> None:
    # gloo gathers: gloo's default (16 MiB); nothing gathered on gloo: NCCL's (256 MiB).
    for plain, on_gloo, one in run_on_ranks(2, _default_buckets):
        assert (plain, on_gloo, one) == (1, 2, 1)


def _subclass_weights() -> str:
    from fsdp2 import fully_shard, iter_full_weights
    from tests.engine.test_extension_legacy import _model

    model = _model()  # two Linear weights as a torchao-NF4-like wrapper subclass
    fully_shard(model[0])
    fully_shard(model)
    return raised(lambda: iter_full_weights(model))


class TestRefusal(expecttest.TestCase):
    def test_subclass_weights_are_refused_by_name_on_every_rank(self) -> None:
        messages = run_on_ranks(2, _subclass_weights)
        self.assertEqual(messages[0], messages[1])
        self.assertExpectedInline(
            messages[0],
            """NotImplementedError: iter_full_weights hands out plain tensors; 0.weight, 2.weight are tensor subclasses (quantized or all-gather extension weights). Convert them to plain tensors first (e.g. dequantize), or gather them yourself with DTensor's full_tensor()""",
        )


def _memory() -> dict[str, int]:
    """Bytes above the sharded model while iterating, counted by the CPU allocator.

    benchmarks/cpu_memory.cpp wraps torch's CPU allocator: every block it hands out, on any
    thread (gloo frees collective buffers on its worker threads), counts until freed, and the
    peak is updated at each allocation, not sampled, so no transient escapes it. Only blocks
    allocated inside the context count, so the model, built before, is the baseline. RSS would
    not do: it keeps freed pages the allocator caches, and a sampled peak misses short ones."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from fsdp2 import fully_shard, iter_full_weights
    from measure import CPUMemory  # type: ignore[import-not-found]

    torch.manual_seed(SEED)
    blocks = 16
    model = nn.Sequential(*(nn.Linear(256, 256, bias=False) for _ in range(blocks)))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    bucket_bytes = 3 * 256 * 256 * 4  # three layers per bucket
    counter = CPUMemory()
    with counter:
        base = counter.settled_live_bytes()
        counter.reset_peak()
        for bucket in iter_full_weights(model, bucket_bytes=bucket_bytes):
            del bucket  # dropped before the next bucket is gathered
        peak = counter.peak_bytes() - base
    return {"peak": peak, "bucket": bucket_bytes, "model": blocks * 256 * 256 * 4}


def test_memory_bound() -> None:
    try:
        results = run_on_ranks(2, _memory, timeout=180)
    except RemoteError as error:
        if "Error building extension" in str(error) or "Ninja is required" in str(error):
            pytest.skip("the CPU allocator counter (a C++ extension) cannot be built here")
        raise
    for result in results:
        peak, bucket = result["peak"], result["bucket"]
        # The bucket's one buffer, gathered in place, its parameters handed out as views of it
        # (all cut along dim 0), plus each rank's 16-byte header and alignment (32 bytes here)
        # and small allocations (the header, lists): 4 KiB. On gloo fsdp2 gathers by in-place
        # broadcasts, which allocate nothing (engine/collectives.py: all_gather_in_place); the
        # allocator counts gloo's threads too, so a temporary there would show.
        assert peak <= bucket + 4096, result
        assert peak < result["model"] / 2, result  # never the whole model
