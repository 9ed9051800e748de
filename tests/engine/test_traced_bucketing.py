"""Traced mode under inductor's FX collective bucketing (docs/compile.md, "Bucketing").

With ``bucket_all_gathers_fx="all"`` and ``bucket_reduce_scatters_fx="all"`` passed to
``torch.compile``, inductor's post-grad passes merge fsdp2's per-group collectives: one all-gather
in the forward graph, one all-gather (the resharded groups, gathered again) and one
reduce-scatter in the backward graph, whatever the number of groups. The test trains such a model
next to eager fsdp2 (the hooks) and compares losses, gradient shards and final parameters at
every step, and counts the collectives before and after the post-grad passes.

Tolerance: bucketing itself changes no arithmetic (the bucket is a concatenation, the all-gather
a copy, and with 2 ranks the reduce-scatter's sum of two values is the same in either order), so
what differs from eager is inductor's own code: fused C++ kernels that sum LayerNorm statistics
and the loss in their own (vectorised) order, and their gelu. That is fp32 reordering and a few
ulps per element, the case ``tests.tolerance.FP32_RTOL`` covers; SGD moves each parameter by
lr times the gradient, so parameters compare as gradients (``SGD_FP32``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from fsdp2.engine.traced import set_traced
from tests.engine.test_compile import (
    COMPILE_TIMEOUT_S,
    MODEL_SEED,
    _fresh_dynamo,
    _shard,
    _train_side_by_side,
    _Trainer,
)
from tests.harness import run_on_ranks
from tests.models import build_model
from tests.tolerance import SGD_FP32

pytestmark = pytest.mark.usefixtures("fsdp2_only")

BUCKETING = {"bucket_all_gathers_fx": "all", "bucket_reduce_scatters_fx": "all"}
_c10d = torch.ops._c10d_functional
_GATHERS = (_c10d.all_gather_into_tensor.default, _c10d.all_gather_into_tensor_out.default)


def _count(gm: torch.fx.GraphModule) -> tuple[int, int]:
    """(all-gathers, reduce-scatters) in a post-grad graph."""
    calls = [node.target for node in gm.graph.nodes if node.op == "call_function"]
    gathers = sum(target in _GATHERS for target in calls)
    return gathers, sum(target == _c10d.reduce_scatter_tensor.default for target in calls)


@contextmanager
def _post_grad_counts() -> Iterator[list[tuple[tuple[int, int], tuple[int, int]]]]:
    """Collectives of each graph inductor compiles: before and after its post-grad passes, where
    the bucketing runs. Wraps inductor's ``post_grad_passes`` (an internal name: if it moves, this
    fails loudly rather than counting nothing)."""
    import torch._inductor.compile_fx as compile_fx

    inner: Callable[..., None] = compile_fx.post_grad_passes
    counts: list[tuple[tuple[int, int], tuple[int, int]]] = []

    def counted(gm: torch.fx.GraphModule, is_inference: bool) -> None:
        before = _count(gm)
        inner(gm, is_inference)
        counts.append((before, _count(gm)))

    compile_fx.post_grad_passes = counted
    try:
        yield counts
    finally:
        compile_fx.post_grad_passes = inner


def _bucketed(name: str, options: dict[str, Any]) -> dict[str, Any]:
    _fresh_dynamo()
    model = build_model(name, MODEL_SEED)
    _shard(model, name, None, "")
    set_traced(model)
    # Compile for real: a cache hit (inductor's FX graph cache, AOTAutograd's) skips the passes.
    options = {**options, "fx_graph_cache": False}
    compiled = torch.compile(model, fullgraph=True, options=options)
    no_cache = torch._functorch.config.patch(enable_autograd_cache=False)
    with no_cache, _post_grad_counts() as counts:
        report = _train_side_by_side(name, _Trainer(model, name, compiled), SGD_FP32, traced=True)
    report["groups"] = sum(1 for _ in model.blocks) + 1  # every block, and the root
    report["collectives"] = counts  # forward graph, then backward graph
    return report


@pytest.mark.slow
def test_traced_bucketing_inductor() -> None:
    """Bucketed: one all-gather per graph and one reduce-scatter, and training matches eager."""
    for report in run_on_ranks(2, _bucketed, "mlp", BUCKETING, timeout=COMPILE_TIMEOUT_S):
        groups = report["groups"]
        forward, backward = report["collectives"]
        # Unbucketed: every group gathered in forward; in backward, every block gathered again
        # but the first (its input needs no gradient, so its weight is not needed) and the root
        # (it keeps its parameters), and every group reduce-scattered.
        assert forward == ((groups, 0), (1, 0)), report
        assert backward == ((groups - 2, groups), (1, 1)), report
        assert report["graph_breaks"] == 0, report
        assert not report["recompiled_after_first_step"], report
