"""The planner's collectives against the engine's own step on the planner's meta model (issue 41,
"the planner asks the engine"): how far the engine is from planning itself.

    python benchmarks/plan_vs_engine.py              # every configuration of plan_snapshot.py
    python benchmarks/plan_vs_engine.py gpt/zero2    # those whose key contains a given text

For each configuration of ``plan_snapshot.py`` (the workloads x shardings x cpu/cuda x coalescing
off/on x world sizes) it plans with ``fsdp2.plan``, then builds the same model on the meta device,
shards it by the same function over a fake process group on a *meta* mesh, and runs two training
steps of the engine itself (an SGD step after each), recording the second one's collectives. It
prints how many plans match the engine in issue order, how many only as a multiset, how many
differ or fail, and the first of each.

No batch is needed: every sharded module's forward is replaced by a walk over its own parameters
and children in registration order (``x + p.sum() * 0`` for each parameter, each sharded child
called on the running value). That is the order and reach the planner assumes (pre-order; a
frozen first block is not reached in backward), so the engine's hooks run as in a real step.

The engine refuses a step on meta in a few places; this script lets it past them, by patches held
only while it runs (the list is what a planning mode in the engine would have to admit):

- ``layout.check_materialized`` and ``agreement.check_materialized``: meta parameters at the first
  forward are a user's mistake, here they are the point;
- ``agreement.agree_ints``: the small exchanges that make ranks raise alike read the gathered
  values on the host; a fake world agrees with itself;
- ``coalesce._joinable`` excludes meta groups (so the mistake above is reported first): the same
  rule without that line (the script refuses to run if the engine's rule has changed);
- ``coalesce.check_on_host``: a coalesced collective's header is compared on the host;
- ``Tensor.item`` on meta (a kept copy's check, zero2 and hfsdp): nothing wrote the shards, so 0;
- and torch's own: from 2.14 DTensor prices a redistribution by the mesh's devices per host,
  which a meta mesh cannot count (1 here).

tests/long/test_plan_engine.py runs it and wants every configuration equal in issue order.
"""

from __future__ import annotations

import argparse
import inspect
import math
import sys
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # fsdp2 from this checkout
import fsdp2
import fsdp2.api
import fsdp2.engine.coalesce_reduce
import fsdp2.engine.mesh
from fsdp2.engine import agreement, coalesce, collectives
from fsdp2.engine.layout import FlatLayout
from fsdp2.engine.param_group import FSDPParamGroup, ShardedState
from fsdp2.engine.state import STATES
from fsdp2.tools.planner.world import build_on_meta, call_shard
from plan_snapshot import configurations

Row = tuple[str, str, int, int, int]

# The engine's coalescing rule as this script restates it, less its meta line: checked against the
# engine's source so that a change there stops the script instead of comparing with a stale rule.
_JOINABLE_LINES = [
    "group.state is ShardedState.SHARDED",
    "and not group.unshard_pending",
    "and not group.layout.stale",
    "and ag_joinable(group)",
    'and group.layout.sharded_flat.device.type != "meta"',
    "and not group.still_gathered()",
]


def _joinable_on_meta(group: FSDPParamGroup) -> bool:
    return (
        group.state is ShardedState.SHARDED
        and not group.unshard_pending
        and not group.layout.stale
        and coalesce.ag_joinable(group)
        and not group.still_gathered()
    )


def _per_host(real: Callable[[str], int], device_type: str) -> int:
    return 1 if device_type == "meta" else real(device_type)


@contextmanager
def _meta_admitted(mesh: DeviceMesh) -> Iterator[None]:
    """The engine let past its refusals of a meta step (the module docstring), and
    ``default_mesh`` (for shard functions that pass no mesh) made ``mesh``."""
    source = inspect.getsource(coalesce._joinable)
    missing = [line for line in _JOINABLE_LINES if line not in source]
    if missing:
        raise SystemExit(f"coalesce._joinable changed ({missing} not found): update this script")
    agree = collectives.agree_ints
    check = coalesce.check_on_host
    item = torch.Tensor.item

    def agree_ints(values: list[int], group: dist.ProcessGroup, device: torch.device) -> Any:
        agree(values, group, torch.device("cpu"))  # issued (and recorded) as the engine would
        return [list(values) for _ in range(group.size())]

    def check_on_host(header: torch.Tensor, compare: Callable[[torch.Tensor], None]) -> None:
        if header.device.type != "meta":
            check(header, compare)

    def meta_item(t: torch.Tensor) -> Any:
        return (False if t.dtype == torch.bool else 0) if t.device.type == "meta" else item(t)

    patches: list[tuple[Any, str, Any]] = [
        (FlatLayout, "check_materialized", lambda self: None),
        (agreement, "check_materialized", lambda groups: None),
        (agreement, "agree_ints", agree_ints),
        (coalesce, "_joinable", _joinable_on_meta),
        (coalesce, "check_on_host", check_on_host),
        (fsdp2.engine.coalesce_reduce, "check_on_host", check_on_host),
        (torch.Tensor, "item", meta_item),
        (fsdp2.api, "default_mesh", lambda: mesh),
        (fsdp2.engine.mesh, "default_mesh", lambda: mesh),
    ]
    resources = getattr(torch.distributed.device_mesh, "_mesh_resources", None)
    per_host = getattr(resources, "num_devices_per_host", None)
    if per_host is not None:  # torch >= 2.14 costs redistributions by devices per host
        patches.append((resources, "num_devices_per_host", partial(_per_host, per_host)))
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    try:
        for obj, name, new in patches:
            setattr(obj, name, new)
        yield
    finally:
        for obj, name, old in saved:
            setattr(obj, name, old)


def drive(model: nn.Module) -> None:
    """Replace each sharded module's forward by a walk over its parameters and children in
    registration order, calling sharded children as modules (so their hooks run)."""
    managed = {id(m) for state in STATES.under(model) for m in state.modules}

    def walk(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        for p in module.parameters(recurse=False):
            x = x + p.sum().to(x.dtype) * 0
        for child in module.children():
            x = child(x) if id(child) in managed else walk(child, x)
        return x

    for module in list(model.modules()):
        if id(module) in managed:
            module.forward = lambda x, m=module: walk(m, x)  # type: ignore[method-assign]


def engine_step(
    build: Callable[[], nn.Module],
    shard: Callable[..., Any],
    shape: tuple[int, ...],
    prefetch: bool,
) -> list[Row]:
    """The collectives of the engine's second step on the meta model (an SGD step before it, as
    the plan's steady state is the first micro-batch after an optimizer step)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=math.prod(shape))
    try:
        names = ("shard",) if len(shape) == 1 else ("replicate", "shard")
        ranks = torch.arange(math.prod(shape)).view(shape)
        mesh = DeviceMesh("meta", ranks, mesh_dim_names=names)
        with _meta_admitted(mesh):
            model = build_on_meta(build)
            call_shard(shard, model, mesh)
            for state in STATES.under(model):
                for group in state.groups:
                    group.settings.guess_prefetch = prefetch  # as the tests do: cpu does not
            drive(model)
            optim = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
            x = torch.zeros(4, device="meta")
            for _ in range(2):
                with fsdp2.record_collectives() as records:
                    model(x).sum().backward()
                optim.step()
                optim.zero_grad()
        return [(r.kind, r.label, r.input_nbytes, r.output_nbytes, r.world_size) for r in records]
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("only", nargs="*", help="configurations whose key contains one of these")
    args = parser.parse_args()
    outcome: Counter[str] = Counter()
    first: dict[str, str] = {}
    for key, build, shard, world, device in configurations():
        if args.only and not any(text in key for text in args.only):
            continue
        shape = (world,) if isinstance(world, int) else tuple(world)
        try:
            plan = fsdp2.plan(build, shard, world_size=world, device=device)
            want = [
                (c.kind, c.label, c.input_nbytes, c.output_nbytes, c.world_size)
                for c in plan.collectives
            ]
            got = engine_step(build, shard, shape, prefetch=device != "cpu")
        except Exception:
            kind, detail = "failed", traceback.format_exc(limit=-3)
        else:
            kind = (
                "in order"
                if got == want
                else "as a multiset"
                if Counter(got) == Counter(want)
                else "differ"
            )
            detail = f"plan   {want}\nengine {got}"
        outcome[kind] += 1
        first.setdefault(kind, f"{key}\n{detail}")
    print(", ".join(f"{kind}: {n}" for kind, n in outcome.most_common()))
    for kind in ("as a multiset", "differ", "failed"):
        if kind in first:
            print(f"\nfirst {kind}: {first[kind]}")


if __name__ == "__main__":
    main()
