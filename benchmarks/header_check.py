"""What the coalesced gather's header check costs on one accelerator ([Note: coalesced gathers]).

    python benchmarks/header_check.py        # on a GPU machine; on CPU a small dry run

Rank 0 of a fake 8-rank process group (torch's ``fake`` backend: collectives cost nothing and
move no data, so the step is the per-rank work of sharding 8 ways): 96 ``Linear`` blocks, each
its own ``fully_shard`` group, trained with AdamW, coalescing at the default budget and off,
twice each, interleaved. Prints the step time and the host time spent comparing headers (at the
gather's wait, or in the deferred checks before the next collective and at the end of forward
and backward). Three shapes: tiny blocks (launch-bound), and 128-wide blocks on batches large
enough that the device has a queue of work the host could run ahead of.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.testing._internal.distributed.fake_pg import FakeStore

import fsdp2
import fsdp2.engine.coalesce as coalesce
import fsdp2.engine.collectives as collectives
import fsdp2.engine.iteration as iteration

STEPS, WARMUP = 20, 5
spent = [0.0, 0]  # host seconds in header checks, checks started


def _timed(fn: Callable[..., None], count: bool) -> Callable[..., None]:
    def wrapper(*args: object) -> None:
        start = time.perf_counter()
        try:
            fn(*args)
        finally:
            spent[0] += time.perf_counter() - start
            spent[1] += count

    return wrapper


coalesce._check_headers = _timed(coalesce._check_headers, True)  # type: ignore[assignment]
deferred = _timed(collectives.run_deferred_checks, False)
collectives.run_deferred_checks = deferred  # type: ignore[assignment]
iteration.run_deferred_checks = deferred  # type: ignore[assignment]


def main() -> None:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    shapes = ((64, 16), (128, 65536), (128, 262144)) if on_gpu else ((64, 16), (128, 256))
    for dim, batch in shapes:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(dim, dim) for _ in range(96)]).to(device)
        for block in model:
            fsdp2.fully_shard(block)
        fsdp2.fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        x = torch.randn(batch, dim, device=device)

        def step(
            model: nn.Module = model, opt: torch.optim.Optimizer = opt, x: torch.Tensor = x
        ) -> None:
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()

        on = coalesce.DEFAULT_COALESCE_BYTES
        for budget in (on, 0, on, 0):
            fsdp2.set_coalesce_bytes(budget)
            for _ in range(WARMUP):
                step()
            sync()
            spent[:] = [0.0, 0]
            start = time.perf_counter()
            for _ in range(STEPS):
                step()
            sync()
            ms = (time.perf_counter() - start) / STEPS * 1e3
            print(
                f"dim {dim} batch {batch} budget {budget}: step {ms:.2f} ms, in header checks "
                f"{spent[0] / STEPS * 1e3:.2f} ms ({spent[1] / STEPS:.0f} checks/step)",
                flush=True,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
