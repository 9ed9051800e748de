"""DTensor's redistributions pass the seam (``collectives.redistribute``, issue 41): a
tensor-parallel gradient laid out by DTensor, a tied weight's full tensor when a later
``fully_shard`` call takes it over, and a state dict loaded from another mesh are recorded as
"redistribute", with the values they had before they were seen, and a rank blocked in one gets
the hang report at ``FSDP2_COLLECTIVE_TIMEOUT``.

Run as a script (``launch``), ``hang``: rank 0 loads a state dict from another mesh, rank 1 does
not; rank 0 prints what fsdp2 logged and how the wait ended, as one JSON line."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from tests.hang_scenarios import logged_report
from tests.harness import launch, run_on_ranks

HANG_TIMEOUT_S, BACKEND_TIMEOUT_S = 1.5, 8.0  # FSDP2_COLLECTIVE_TIMEOUT, the group's own


class PartialGrad(torch.autograd.Function):
    """``(w.local * c).sum()`` whose backward hands ``w`` (``Shard(0)`` over tp) a ``Partial``
    gradient of the whole shape, as a vocabulary-parallel loss's hand-written backward may:
    DTensor's reduce-scatter lays it out as the parameter, not the seam's own sum."""

    @staticmethod
    def forward(ctx: Any, w: Any, c: float) -> torch.Tensor:
        ctx.spec = (w.device_mesh, w.shape, c)
        return (w.to_local() * c).sum()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, None]:
        from torch.distributed.tensor import DTensor, Partial

        mesh, shape, c = ctx.spec
        local = torch.full(shape, c, dtype=grad.dtype) * grad
        return DTensor.from_local(local, mesh, [Partial()], run_check=False), None


class TpShard(nn.Module):
    def __init__(self, tp_mesh: Any) -> None:
        super().__init__()
        from torch.distributed.tensor import Shard, distribute_tensor

        self.w = nn.Parameter(distribute_tensor(torch.ones(4), tp_mesh, [Shard(0)]))

    def forward(self, c: float) -> torch.Tensor:
        return PartialGrad.apply(self.w, c)  # type: ignore[no-any-return]


def _tp_partial_to_shard() -> tuple[list[tuple[str, str, int, bool]], list[float]]:
    from torch.distributed.device_mesh import init_device_mesh

    import fsdp2

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    module = TpShard(mesh["tp"])
    fsdp2.fully_shard(module, mesh=mesh["dp"])
    # tp rank 0 contributes 1 per element, tp rank 1 2: the laid-out gradient is 3 everywhere.
    c = 1.0 + mesh["tp"].get_local_rank()
    with fsdp2.record_collectives() as records:
        module(c).backward()
    tp = mesh["tp"].get_group().group_name
    grad = module.w.grad.to_local().tolist()  # type: ignore[union-attr]
    return [(r.kind, r.label, r.world_size, r.group == tp) for r in records], grad


@pytest.mark.usefixtures("fsdp2_only")
def test_tp_gradient_laid_out_by_dtensor_passes_the_seam() -> None:
    """A ``Partial`` gradient of a ``Shard(0)`` parameter: DTensor's reduce-scatter over tp, seen
    by the seam as one "redistribute" on the tp group (the backward's only collective at dp size
    1), and the gradient is the sum of both ranks' contributions, laid out as the parameter."""
    for records, grad in run_on_ranks(2, _tp_partial_to_shard):
        assert records == [("redistribute", "", 2, True)]
        assert grad == [3.0, 3.0]


class Shared(nn.Module):
    """Two blocks sharing their first weight, each sharded in its own call, then the root."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(2))
        self.blocks[1][0].weight = self.blocks[0][0].weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.sum()


def _tie_taken_over() -> tuple[list[tuple[str, int]], bool]:
    import fsdp2

    torch.manual_seed(0)
    model = Shared()
    before = model.blocks[0][0].weight.detach().clone()
    for block in model.blocks:
        fsdp2.fully_shard(block)
    with fsdp2.record_collectives() as records:
        fsdp2.fully_shard(model)  # takes the tied weight out of blocks.0's group
    after = model.blocks[1][0].weight.full_tensor()  # type: ignore[operator]
    return [(r.kind, r.world_size) for r in records if r.kind == "redistribute"], bool(
        torch.equal(after, before)
    )


@pytest.mark.usefixtures("fsdp2_only")
def test_tied_weight_taken_over_passes_the_seam() -> None:
    """The tied weight's full tensor, read when the root's call takes it over, is one
    "redistribute" over the two ranks, and the weight comes out bitwise as it went in."""
    for redistributions, unchanged in run_on_ranks(2, _tie_taken_over):
        assert redistributions == [("redistribute", 2)]
        assert unchanged


def _other_mesh_state_dict() -> tuple[list[tuple[str, str, int]], bool, bool]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    import fsdp2

    torch.manual_seed(0)
    model = nn.Linear(4, 4, bias=False)
    fsdp2.fully_shard(model)
    values = torch.arange(16.0).view(4, 4)
    other = init_device_mesh("cpu", (2, 1), mesh_dim_names=("a", "b"))
    rows = values.chunk(2)[dist.get_rank()]
    value = DTensor.from_local(rows, other, [Shard(0), Replicate()], run_check=False)
    with fsdp2.record_collectives() as records:
        model.load_state_dict({"weight": value})
    same = model.weight.to_local()  # type: ignore[operator]
    with fsdp2.record_collectives() as unmoved:  # in the parameter's own layout: no collective
        model.load_state_dict({"weight": model.weight.detach().clone()})
    loaded = bool(torch.equal(model.weight.full_tensor(), values))  # type: ignore[operator]
    return (
        [(r.kind, r.label, r.world_size) for r in records],
        loaded and bool(torch.equal(same, model.weight.to_local())),  # type: ignore[operator]
        not unmoved,
    )


@pytest.mark.usefixtures("fsdp2_only")
def test_state_dict_from_another_mesh_passes_the_seam() -> None:
    """A state dict whose DTensor lives on another mesh goes through its full tensor: one
    "redistribute" over the ranks of the dim it is sharded on, labelled with the parameter's
    name, and the values load bitwise; one in the parameter's own layout issues nothing."""
    for records, loaded, quiet in run_on_ranks(2, _other_mesh_state_dict):
        assert records == [("redistribute", "weight", 2)]
        assert loaded
        assert quiet


def _load_beside_a_forward() -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    import fsdp2

    model = nn.Linear(4, 4, bias=False)
    fsdp2.fully_shard(model)
    model(torch.ones(2, 4)).sum().backward()  # lazy init done, on both ranks
    other = init_device_mesh("cpu", (2, 1), mesh_dim_names=("a", "b"))
    rows = torch.arange(16.0).view(4, 4).chunk(2)[dist.get_rank()]
    value = DTensor.from_local(rows, other, [Shard(0), Replicate()], run_check=False)
    fsdp2.set_collective_checks(True)
    try:
        if dist.get_rank() == 0:
            model.load_state_dict({"weight": value})
        else:
            model(torch.ones(2, 4))
    except fsdp2.CollectiveMismatchError as e:
        return str(e)
    finally:
        fsdp2.set_collective_checks(False)
    return "no error"


@pytest.mark.usefixtures("fsdp2_only")
def test_checks_compare_a_redistribution_with_the_peers_collective() -> None:
    """With the collective checks on, rank 0's load from another mesh meets rank 1's forward
    all-gather: both ranks raise before either is issued, each naming both."""
    for said in run_on_ranks(2, _load_beside_a_forward):
        assert "were about to issue different collectives" in said, said
        # The sequence numbers count this process's earlier tests too: the same on both ranks.
        assert re.search(r"rank 0: DTensor redistribution #\d+ for `weight` \(16 elements", said), (
            said
        )
        assert re.search(r"rank 1: all-gather #\d+ for `<root>`", said), said
        assert "Likely cause: some ranks load a state dict" in said, said


@pytest.mark.slow
@pytest.mark.usefixtures("fsdp2_only")
def test_rank_blocked_in_a_dtensor_redistribution_gets_the_report() -> None:
    """Rank 0 loads a state dict from another mesh, rank 1 never does: rank 0's full tensor
    waits inside DTensor, where fsdp2 sets no deadline, so the report is logged at
    FSDP2_COLLECTIVE_TIMEOUT (naming the redistribution and rank 1 as missing from it), and the
    group's own timeout ends the wait."""
    proc = launch(__file__, 2, "hang", timeout=120)
    line, report = logged_report(proc, HANG_TIMEOUT_S, BACKEND_TIMEOUT_S)
    # #2 on the group of ranks [0, 1]: a mesh dim over the whole world is the default group,
    # where the step issued all-gather #0 and reduce-scatter #1.
    assert "for the DTensor redistribution #2 for `weight` (16 elements, float32)" in report, report
    assert "rank 0 (this rank): blocked in it" in report, report
    assert "rank 1: MISSING" in report, report
    assert report.endswith(
        "DTensor waits: fsdp2 cannot end the wait, which goes on until the backend's own timeout."
    ), report
    assert line["seconds"] >= BACKEND_TIMEOUT_S - 0.5, line  # the group's own timeout ended it


def _hang_main() -> None:
    import datetime
    import logging

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=BACKEND_TIMEOUT_S))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    import fsdp2

    logged: list[tuple[float, str]] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            logged.append((time.monotonic(), record.getMessage()))

    logging.getLogger("fsdp2").addHandler(Keep(logging.INFO))
    model = nn.Linear(4, 4, bias=False)
    fsdp2.fully_shard(model)
    other = init_device_mesh("cpu", (2, 1), mesh_dim_names=("a", "b"))
    rows = torch.arange(16.0).view(4, 4).chunk(2)[dist.get_rank()]
    value = DTensor.from_local(rows, other, [Shard(0), Replicate()], run_check=False)
    model(torch.ones(2, 4)).sum().backward()  # a step on both: each rank's publisher is up
    # Only now the short deadline: on a busy machine one rank may reach the step seconds late.
    os.environ["FSDP2_COLLECTIVE_TIMEOUT"] = str(HANG_TIMEOUT_S)
    if dist.get_rank() == 1:
        time.sleep(BACKEND_TIMEOUT_S + 4)  # alive, never in the collective
        os._exit(0)
    start = time.monotonic()
    try:
        model.load_state_dict({"weight": value})
        outcome = "finished"
    except Exception as e:  # gloo's timeout
        outcome = f"{type(e).__name__}: {e}"
    seconds = time.monotonic() - start
    line = {"logged": [(t - start, m) for t, m in logged], "outcome": outcome, "seconds": seconds}
    sys.stdout.write(json.dumps(line) + "\n")
    sys.stdout.flush()
    os._exit(0)  # skip teardown: the group is half done


if __name__ == "__main__":
    if sys.argv[1:] == ["hang"]:
        _hang_main()
