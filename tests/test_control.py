"""The FSDPModule control surface: explicit unshard/reshard, prefetch, reduction knobs, custom
comms, grouping, ``reshard_after_forward=k``, gradient clipping and tied-weight errors.

Every training test steps a sharded model and its unsharded reference side by side on the same
global batch (see `tests/lockstep.py`) and compares losses, gradients and final parameters at
fp32 tolerance. Collectives are counted through `fsdp2.engine.collectives.record_collectives`, or with
`tests.lockstep.CollectiveCounter` where the same test also runs torch's own ``fully_shard``.
User-facing error messages are pinned with expecttest (regenerate with ``EXPECTTEST_ACCEPT=1``).
"""

from __future__ import annotations

import functools
import warnings
from collections import Counter
from collections.abc import Sequence
from typing import Any

import expecttest
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from tests.errors import error_text
from tests.harness import IMPL_UNDER_TEST, fsdp_api, run_on_ranks
from tests.lockstep import CollectiveCounter, Lockstep, fsdp_modules, full, shard_mlp
from tests.models import MLP_DIM, MLP_IN, MLP_OUT, Batch
from tests.tolerance import PARAM_ATOL, assert_fp32_close

# MLPStack's groups, in forward order: the root (its head), then one per block.
GROUPS = ["", "blocks.0", "blocks.1", "blocks.2"]
NUM_STEPS = 3


def _labels(records: Sequence[Any], kind: str) -> list[str]:
    return [r.label for r in records if r.kind == kind]


def _backward_counts(t: Lockstep, kind: str) -> list[int]:
    """Train ``NUM_STEPS`` checked lockstep steps; the ``kind`` collectives of each backward."""
    counts = []
    for step in range(NUM_STEPS):
        loss = t.model(*t.local(step))
        with CollectiveCounter() as counter:
            loss.backward()
        counts.append(counter.counts[kind])
        t.reference_step(loss, step)
        t.check_grads(f"step {step}")
        t.optim_step()
    t.check_params("after training")
    return counts


# ---------------------------------------------------------------------------------------------
# reshard_after_forward=<int>
# ---------------------------------------------------------------------------------------------


def _reshard_after_forward_int(k: int, shard_dim: int | None = None) -> list[dict[str, Any]]:
    from torch.distributed.tensor import Shard

    from fsdp2.engine.collectives import record_collectives

    t = Lockstep("mlp")
    kwargs: dict[str, Any] = {"reshard_after_forward": k}
    if shard_dim is not None:
        kwargs["shard_placement_fn"] = lambda p: Shard(shard_dim) if p.ndim > 1 else None
    shard_mlp(t.model, **kwargs)
    t.make_optimizers()
    steps = []
    for step in range(NUM_STEPS):
        with record_collectives() as forward:
            loss = t.model(*t.local(step))
        with record_collectives() as backward:
            loss.backward()
        t.reference_step(loss, step)
        t.check_grads(f"step {step}")
        t.optim_step()
        steps.append(
            {
                phase: sorted((r.kind, r.label, r.world_size, r.input_nbytes) for r in records)
                for phase, records in (("forward", forward), ("backward", backward))
            }
        )
    t.check_params("after training")
    return steps


def test_reshard_after_forward_int_gathers_within_k_ranks(fsdp2_only: None) -> None:
    """k=2 of 4 ranks: forward gathers over all 4; after it each rank keeps W/k = 2 chunks, so
    backward gathers within its pair of ranks, sending twice as much; reductions span all 4."""
    for steps in run_on_ranks(4, _reshard_after_forward_int, 2):
        for phases in steps:
            forward = {label: nbytes for _, label, _, nbytes in phases["forward"]}
            assert sorted(forward) == sorted(GROUPS)
            assert {ws for _, _, ws, _ in phases["forward"]} == {4}
            backward_gathers = [r for r in phases["backward"] if r[0] == "all_gather"]
            assert [(label, ws, nbytes) for _, label, ws, nbytes in backward_gathers] == [
                (label, 2, 2 * forward[label]) for label in sorted(GROUPS)
            ]
            reduce_scatters = [r for r in phases["backward"] if r[0] == "reduce_scatter"]
            assert [(label, ws) for _, label, ws, _ in reduce_scatters] == [
                (label, 4) for label in sorted(GROUPS)
            ]


def test_reshard_after_forward_int_with_shard_dim1(fsdp2_only: None) -> None:
    """The kept W/k chunks of a Shard(1) weight are cut out of the full (contiguous) parameter,
    not sliced from it: backward must still gather the right values (checked against the
    reference), with the same collectives as Shard(0)."""
    for steps, dim0_steps in zip(
        run_on_ranks(4, _reshard_after_forward_int, 2, 1),
        run_on_ranks(4, _reshard_after_forward_int, 2),
        strict=True,
    ):
        assert steps == dim0_steps


# ---------------------------------------------------------------------------------------------
# Explicit unshard / reshard
# ---------------------------------------------------------------------------------------------


def _explicit_unshard() -> list[dict[str, Any]]:
    from fsdp2 import UnshardHandle
    from fsdp2.engine.collectives import record_collectives

    t = Lockstep("mlp")
    shard_mlp(t.model)
    t.make_optimizers()
    block, ref_block = t.model.blocks[1], t.ref.blocks[1]
    t.forward_backward(0)  # lazy init through the root's forward first, as torch requires
    t.optim_step()
    steps = []
    for step in range(1, NUM_STEPS):
        with record_collectives() as issued:
            handle = block.unshard(async_op=True)
        assert isinstance(handle, UnshardHandle), handle
        handle.wait()
        # The gathered parameters are registered: plain tensors holding the full values.
        weight = block[0].weight
        assert not isinstance(weight, DTensor), type(weight)
        assert_fp32_close(weight.detach(), ref_block[0].weight.detach(), atol=PARAM_ATOL)
        with record_collectives() as forward:
            loss = t.model(*t.local(step))
        # The root keeps its parameters after forward; freeing them now means regathering them.
        t.model.reshard()
        assert isinstance(t.model.head.weight, DTensor)
        with record_collectives() as backward:
            loss.backward()
        t.reference_step(loss, step)
        t.check_grads(f"step {step}")
        t.optim_step()
        steps.append(
            {
                "issued": _labels(issued, "all_gather"),
                "forward": _labels(forward, "all_gather"),
                "backward": sorted(_labels(backward, "all_gather")),
            }
        )
    # A synchronous unshard returns nothing and leaves the parameters gathered until reshard().
    assert t.model.unshard() is None
    assert not isinstance(t.model.head.weight, DTensor)
    t.model.reshard()
    t.check_params("after training")
    return steps


def test_unshard_async_handle_and_explicit_reshard(fsdp2_only: None) -> None:
    for steps in run_on_ranks(2, _explicit_unshard):
        for phases in steps:
            assert phases["issued"] == ["blocks.1"]
            # blocks.1 was gathered ahead: forward gathers only the others.
            assert phases["forward"] == ["", "blocks.0", "blocks.2"]
            # The root was resharded by hand, so backward gathers it too.
            assert phases["backward"] == ["", "blocks.0", "blocks.1", "blocks.2"]


# ---------------------------------------------------------------------------------------------
# Explicit prefetch
# ---------------------------------------------------------------------------------------------


def _explicit_prefetch() -> list[dict[str, list[str]]]:
    from fsdp2.engine.collectives import record_collectives

    t = Lockstep("mlp")
    shard_mlp(t.model)
    t.make_optimizers()
    blocks = t.model.blocks
    t.model.set_modules_to_forward_prefetch([blocks[2]])
    blocks[2].set_modules_to_backward_prefetch([blocks[0]])
    steps = []
    for step in range(NUM_STEPS):
        with record_collectives() as forward:
            loss = t.model(*t.local(step))
        with record_collectives() as backward:
            loss.backward()
        t.reference_step(loss, step)
        t.check_grads(f"step {step}")
        t.optim_step()
        steps.append(
            {"forward": _labels(forward, "all_gather"), "backward": _labels(backward, "all_gather")}
        )
    t.check_params("after training")
    return steps


def test_explicit_prefetch_order(fsdp2_only: None) -> None:
    for steps in run_on_ranks(2, _explicit_prefetch):
        for phases in steps:
            # The root prefetches blocks.2 right after its own gather, ahead of blocks.0/1.
            assert phases["forward"] == ["", "blocks.2", "blocks.0", "blocks.1"]
            # blocks.2's backward prefetches blocks.0 before blocks.1 gathers on demand.
            assert phases["backward"] == ["blocks.2", "blocks.0", "blocks.1"]


# ---------------------------------------------------------------------------------------------
# set_unshard_in_backward(False)
# ---------------------------------------------------------------------------------------------

VOCAB, SEQ = 16, 6


class EmbedMLP(nn.Module):
    """An embedding whose backward needs only the indices, never the weight."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, MLP_IN)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(MLP_IN, MLP_IN), nn.Tanh()) for _ in range(2)
        )
        self.head = nn.Linear(MLP_IN, MLP_OUT)

    def forward(self, idx: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx).mean(dim=1)
        for block in self.blocks:
            x = block(x)
        return F.mse_loss(self.head(x), y)


def _embed_batch(gen: torch.Generator, n: int) -> Batch:
    return torch.randint(0, VOCAB, (n, SEQ), generator=gen), torch.randn(n, MLP_OUT, generator=gen)


def _unshard_in_backward(impl: str, unshard_in_backward: bool) -> list[int]:
    fully_shard = fsdp_api(impl).fully_shard
    t = Lockstep(EmbedMLP, _embed_batch)
    for module in [t.model.embed, *t.model.blocks, t.model]:
        fully_shard(module)
    t.model.embed.set_unshard_in_backward(unshard_in_backward)
    t.make_optimizers()
    return _backward_counts(t, "allgather")


@pytest.mark.parametrize("impl", ["fsdp2", "torch"])
def test_unshard_in_backward_false_skips_the_gather(impl: str, fsdp2_only: None) -> None:
    # Backward regathers the two blocks; the embedding (resharded after forward) stays sharded.
    for gathers in run_on_ranks(2, _unshard_in_backward, impl, False):
        assert gathers == [2] * NUM_STEPS
    if impl == "fsdp2":  # the default regathers it
        for gathers in run_on_ranks(2, _unshard_in_backward, impl, True):
            assert gathers == [3] * NUM_STEPS


# ---------------------------------------------------------------------------------------------
# Gradient reduction: divide factor, forced sums, all-reduce hook, post-optim event, buffers
# ---------------------------------------------------------------------------------------------


def _divide_factor(factor: float | None, how: str) -> list[str]:
    """Train with every module's gradients divided by ``factor`` (None: the default mean)."""
    t = Lockstep("mlp")
    shard_mlp(t.model)
    caught: list[str] = []
    for module in fsdp_modules(t.model):
        with warnings.catch_warnings(record=True) as ws:
            warnings.simplefilter("always")
            if how == "set":
                module.set_gradient_divide_factor(factor)
            elif how == "deprecated":
                module.set_reduce_scatter_divide_factor(factor)
            elif how == "force_sum":
                module.set_force_sum_reduction_for_comms(True)
        caught += [f"{w.category.__name__}: {w.message}" for w in ws]
    t.make_optimizers()
    # The reference averages over ranks; a factor f instead gives sum / f = mean * W / f.
    scale = t.world_size / factor if factor is not None else 1.0
    for step in range(NUM_STEPS):
        t.forward_backward(step)
        t.check_grads(f"step {step}", lambda name: scale)
        for p in t.ref.parameters():
            p.grad.mul_(scale)  # so both take the same SGD step
        t.optim_step()
    t.check_params("after training")
    return caught


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("factor", [1.0, 3.0])
def test_gradient_divide_factor(world_size: int, factor: float, fsdp2_only: None) -> None:
    """sum / f for f != world size: torch 2.13 fails at this on gloo (no PREMUL_SUM)."""
    for caught in run_on_ranks(world_size, _divide_factor, factor, "set"):
        assert caught == []


def test_reduce_scatter_divide_factor_is_deprecated(fsdp2_only: None) -> None:
    for caught in run_on_ranks(2, _divide_factor, 3.0, "deprecated"):
        assert caught == [
            "FutureWarning: set_reduce_scatter_divide_factor is deprecated; use "
            "set_gradient_divide_factor"
        ] * len(GROUPS)


def test_force_sum_reduction_for_comms_same_numbers(fsdp2_only: None) -> None:
    for caught in run_on_ranks(2, _divide_factor, None, "force_sum"):
        assert caught == []


def _all_reduce_hook() -> list[list[int]]:
    """The root's hook doubles its reduced shard in place; the blocks keep plain means."""
    t = Lockstep("mlp")
    shard_mlp(t.model)
    calls: list[list[int]] = []

    def hook(reduced: torch.Tensor) -> None:
        calls[-1].append(reduced.numel())
        reduced.mul_(2)

    t.model.set_all_reduce_hook(hook)
    t.make_optimizers()
    for step in range(NUM_STEPS):
        calls.append([])
        t.forward_backward(step)
        t.check_grads(f"step {step}", lambda name: 2.0 if name.startswith("head.") else 1.0)
        for p in t.ref.head.parameters():
            p.grad.mul_(2)
        t.optim_step()
    t.check_params("after training")
    return calls


def test_all_reduce_hook_sees_the_reduced_shard(fsdp2_only: None) -> None:
    for calls in run_on_ranks(2, _all_reduce_hook):
        # Once per backward, on the root's shard: head.weight (4, 16) and head.bias (4), two
        # rows of each per rank: 2 * 16 + 2.
        assert calls == [[2 * MLP_DIM + 2]] * NUM_STEPS


class _Event:
    """Stands in for a device event (CPU has none): counts waits."""

    def __init__(self) -> None:
        self.num_waits = 0

    def wait(self) -> None:
        self.num_waits += 1


def _post_optim_event() -> list[int]:
    t = Lockstep("mlp")
    shard_mlp(t.model)
    t.make_optimizers()
    events = []
    for step in range(NUM_STEPS):
        t.forward_backward(step)
        t.check_grads(f"step {step}")
        t.optim_step()
        if step < NUM_STEPS - 1:
            events.append(_Event())
            t.model.set_post_optim_event(events[-1])  # type: ignore[arg-type]
    t.check_params("after training")
    return [e.num_waits for e in events]


def test_post_optim_event_waited_once_by_next_forward(fsdp2_only: None) -> None:
    for waits in run_on_ranks(2, _post_optim_event):
        assert waits == [1] * (NUM_STEPS - 1)


def _max_input_buffers(num: int) -> None:
    t = Lockstep("mlp")
    shard_mlp(t.model)
    t.model.set_reduce_scatter_max_input_buffers(num)
    t.make_optimizers()
    for step in range(NUM_STEPS):
        t.forward_backward(step)
        t.check_grads(f"step {step}")
        t.optim_step()
    t.check_params("after training")


@pytest.mark.parametrize("num", [2, 8])
def test_reduce_scatter_max_input_buffers(num: int, fsdp2_only: None) -> None:
    run_on_ranks(2, _max_input_buffers, num)


# ---------------------------------------------------------------------------------------------
# set_reduce_scatter_unused_params: ranks route to different experts
# ---------------------------------------------------------------------------------------------

NUM_EXPERTS = 2


class Experts(nn.Module):
    """Each sample goes to one expert; an expert no sample picked does not run at all."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(MLP_DIM, MLP_DIM) for _ in range(NUM_EXPERTS))

    def forward(self, h: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(h)
        for i, expert in enumerate(self.experts):
            picked = route == i
            if picked.any():
                out = out.index_put((picked,), expert(h[picked]))
        return out


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(MLP_IN, MLP_DIM)
        self.moe = Experts()
        self.head = nn.Linear(MLP_DIM, MLP_OUT)

    def forward(self, x: torch.Tensor, route: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.moe(torch.tanh(self.inp(x)), route)
        return F.mse_loss(self.head(torch.tanh(h)), y)


class RoutedLockstep(Lockstep):
    """Rank r's samples all go to expert r % NUM_EXPERTS: each rank leaves an expert unused."""

    def batch_for(self, step: int, micro: int, rank: int) -> Batch:
        x, y = super().batch_for(step, micro, rank)
        return x, torch.full((x.shape[0],), rank % NUM_EXPERTS), y


def _unused_params(impl: str) -> list[int]:
    fully_shard = fsdp_api(impl).fully_shard
    t = RoutedLockstep(MoE, lambda gen, n: (torch.randn(n, MLP_IN, generator=gen),
                                           torch.randn(n, MLP_OUT, generator=gen)))  # fmt: skip
    fully_shard(t.model.moe)
    fully_shard(t.model)
    # Without this, rank 0 would reduce-scatter only expert 0's gradients and rank 1 only
    # expert 1's: mismatched collectives. Here the experts have the same shape, so gloo would
    # not even complain: each expert would get the sum of both experts' gradients.
    t.model.moe.set_reduce_scatter_unused_params(True)
    t.make_optimizers()
    return _backward_counts(t, "reducescatter")


@pytest.mark.parametrize(("world_size", "impl"), [(2, "fsdp2"), (4, "fsdp2"), (2, "torch")])
def test_reduce_scatter_unused_params_moe(world_size: int, impl: str, fsdp2_only: None) -> None:
    for reduce_scatters in run_on_ranks(world_size, _unused_params, impl):
        assert reduce_scatters == [2] * NUM_STEPS  # the experts' group and the root's


# ---------------------------------------------------------------------------------------------
# Custom all-gather / reduce-scatter
# ---------------------------------------------------------------------------------------------


def _custom_comms() -> dict[str, int]:
    from fsdp2 import AllGather, ReduceScatter, record_collectives

    counts: Counter[str] = Counter()

    class CountingAllGather(AllGather):
        def allocate(
            self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
        ) -> torch.Tensor:
            counts["all_gather.allocate"] += 1
            return torch.empty(size, dtype=dtype, device=device)

        def __call__(
            self,
            output_tensor: torch.Tensor,
            input_tensor: torch.Tensor,
            group: dist.ProcessGroup,
            async_op: bool = False,
        ) -> dist.Work | None:
            counts["all_gather.call"] += 1
            return dist.all_gather_into_tensor(
                output_tensor, input_tensor, group=group, async_op=async_op
            )

    class CountingReduceScatter(ReduceScatter):
        def allocate(
            self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
        ) -> torch.Tensor:
            counts["reduce_scatter.allocate"] += 1
            return torch.empty(size, dtype=dtype, device=device)

        def __call__(
            self,
            output_tensor: torch.Tensor,
            input_tensor: torch.Tensor,
            group: dist.ProcessGroup,
            op: dist.ReduceOp.RedOpType,
            async_op: bool = False,
        ) -> dist.Work | None:
            counts["reduce_scatter.call"] += 1
            return dist.reduce_scatter_tensor(
                output_tensor, input_tensor, op=op, group=group, async_op=async_op
            )

    t = Lockstep("mlp")
    shard_mlp(t.model)
    for module in fsdp_modules(t.model):
        module.set_custom_all_gather(CountingAllGather())
        module.set_custom_reduce_scatter(CountingReduceScatter())
    t.make_optimizers()
    with record_collectives() as records:
        for step in range(NUM_STEPS):
            t.forward_backward(step)
            t.check_grads(f"step {step}")
            t.optim_step()
    t.check_params("after training")
    counts["seam.all_gather"] = len(_labels(records, "all_gather"))
    counts["seam.reduce_scatter"] = len(_labels(records, "reduce_scatter"))
    return dict(counts)


def test_custom_all_gather_and_reduce_scatter(fsdp2_only: None) -> None:
    for counts in run_on_ranks(2, _custom_comms):
        num_ag, num_rs = counts["seam.all_gather"], counts["seam.reduce_scatter"]
        # Per step: 4 forward gathers, 3 backward (the root keeps its parameters), 4 reductions.
        assert (num_ag, num_rs) == (7 * NUM_STEPS, 4 * NUM_STEPS)
        assert counts == {
            "seam.all_gather": num_ag,
            "seam.reduce_scatter": num_rs,
            "all_gather.call": num_ag,
            "all_gather.allocate": num_ag,  # the output buffer
            "reduce_scatter.call": num_rs,
            "reduce_scatter.allocate": 2 * num_rs,  # input and output
        }


# ---------------------------------------------------------------------------------------------
# Grouping: fully_shard([a, b]), forward methods, share_comm_ctx
# ---------------------------------------------------------------------------------------------

NUM_CHUNKS = 3


class ChunkedLM(nn.Module):
    """The loss is computed in sequence chunks, calling ``head`` once per chunk."""

    def __init__(self, num_chunks: int = NUM_CHUNKS) -> None:
        super().__init__()
        self.num_chunks = num_chunks
        self.embed = nn.Embedding(VOCAB, MLP_IN)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(MLP_IN, MLP_IN), nn.Tanh()) for _ in range(2)
        )
        self.norm = nn.LayerNorm(MLP_IN)
        self.head = nn.Linear(MLP_IN, VOCAB)

    def hidden(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.norm(x)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.hidden(idx)
        total = sum(
            F.cross_entropy(self.head(xc).flatten(0, 1), tc.flatten(), reduction="sum")
            for xc, tc in zip(
                x.chunk(self.num_chunks, 1), targets.chunk(self.num_chunks, 1), strict=True
            )
        )
        return total / targets.numel()

    def generate(self, idx: torch.Tensor, num_new: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy decoding; uses the root's own ``norm`` outside ``forward``. Returns the
        tokens and the logits each new token was picked from. Call it under ``no_grad``: FSDP
        checks grad mode around the method, not inside it, to decide what to free."""
        all_logits = []
        for _ in range(num_new):
            logits = self.head(self.hidden(idx[:, -SEQ:])[:, -1])
            all_logits.append(logits)
            idx = torch.cat([idx, logits.argmax(dim=-1, keepdim=True)], dim=1)
        return idx, torch.stack(all_logits, dim=1)


def _lm_batch(gen: torch.Generator, n: int) -> Batch:
    tokens = torch.randint(0, VOCAB, (n, SEQ + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _shard_chunked_lm(model: nn.Module, impl: str) -> None:
    fully_shard = fsdp_api(impl).fully_shard
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block)
    fully_shard([model.embed, model.head])  # one group: the input and output embeddings
    fully_shard(model)


def _grouped(impl: str, num_chunks: int) -> list[dict[str, int]]:
    t = Lockstep(functools.partial(ChunkedLM, num_chunks), _lm_batch)
    _shard_chunked_lm(t.model, impl)
    t.make_optimizers()
    comms = []
    for step in range(NUM_STEPS):
        with CollectiveCounter() as forward:
            loss = t.model(*t.local(step))
        with CollectiveCounter() as backward:
            loss.backward()
        comms.append(
            {
                "forward all-gathers": forward.counts["allgather"],
                "backward all-gathers": backward.counts["allgather"],
                "reduce-scatters": forward.counts["reducescatter"]
                + backward.counts["reducescatter"],
            }
        )
        t.reference_step(loss, step)
        t.check_grads(f"step {step}")
        t.optim_step()
    t.check_params("after training")
    return comms


# Groups: root, blocks.0, blocks.1, [embed, head]; the head runs 3 times per step.
GROUPED_COMMS = {
    # fsdp2 gathers [embed, head] once for the embedding and the first head call (held through
    # the blocks, as in torch), once more for the later head calls, and keeps that into
    # backward, where the head comes first: nothing to gather for the group there.
    "fsdp2": {"forward all-gathers": 1 + 2 + 2, "backward all-gathers": 2 + 0},
    # torch keeps [embed, head] gathered from the embedding until every module of the group
    # has run once (1 + 1 for the later head calls), and gathers it twice in backward.
    "torch": {"forward all-gathers": 1 + 2 + 2, "backward all-gathers": 2 + 2},
}


# The same with one head call: the group is gathered once for forward (held from the
# embedding to the head) and once for backward, the least a group that reshards can do.
GROUPED_COMMS_ONE_CALL = {
    "fsdp2": {"forward all-gathers": 1 + 2 + 1, "backward all-gathers": 2 + 1},
    "torch": {"forward all-gathers": 1 + 2 + 1, "backward all-gathers": 2 + 1},
}


@pytest.mark.parametrize("impl", ["fsdp2", "torch"])
@pytest.mark.parametrize("num_chunks", [1, NUM_CHUNKS])
def test_one_group_over_two_modules_with_chunked_loss(
    impl: str, num_chunks: int, fsdp2_only: None
) -> None:
    expected_gathers = (GROUPED_COMMS if num_chunks > 1 else GROUPED_COMMS_ONE_CALL)[impl]
    for comms in run_on_ranks(2, _grouped, impl, num_chunks):
        # One reduce-scatter per group and step, however many times the head ran.
        expected = {**expected_gathers, "reduce-scatters": 4}
        assert comms == [expected] * NUM_STEPS


def _forward_method() -> None:
    from fsdp2 import register_fsdp_forward_method

    t = Lockstep(ChunkedLM, _lm_batch)
    _shard_chunked_lm(t.model, "fsdp2")
    register_fsdp_forward_method(t.model, "generate")
    t.make_optimizers()
    prompt = t.local(100)[0][:, :2]
    for step in range(2):
        with torch.no_grad():
            tokens, logits = t.model.generate(prompt, 4)
            ref_tokens, ref_logits = t.ref.generate(prompt, 4)
        assert_fp32_close(logits, ref_logits)
        assert torch.equal(tokens, ref_tokens)
        # Under no_grad everything is freed again: training goes on as usual.
        assert all(isinstance(p, DTensor) for p in t.model.parameters())
        t.forward_backward(step)
        t.check_grads(f"step {step}")
        t.optim_step()
    t.check_params("after training")


def test_register_fsdp_forward_method(fsdp2_only: None) -> None:
    run_on_ranks(2, _forward_method)


# ---------------------------------------------------------------------------------------------
# Gradient clipping over sharded gradients
# ---------------------------------------------------------------------------------------------

MAX_NORM = 0.05


def _clip_grad_norm() -> list[float]:
    t = Lockstep("mlp")
    shard_mlp(t.model)
    t.make_optimizers()
    norms = []
    for step in range(NUM_STEPS):
        t.forward_backward(step)
        norm = torch.nn.utils.clip_grad_norm_(t.model.parameters(), MAX_NORM)
        ref_norm = torch.nn.utils.clip_grad_norm_(t.ref.parameters(), MAX_NORM)
        assert_fp32_close(full(norm), ref_norm)
        norms.append(ref_norm.item())
        t.check_grads(f"step {step} clipped")
        t.optim_step()
    t.check_params("after training")
    return norms


def test_clip_grad_norm_over_sharded_grads(fsdp2_only: None) -> None:
    for norms in run_on_ranks(2, _clip_grad_norm):
        assert min(norms) > MAX_NORM  # clipping did something every step


# ---------------------------------------------------------------------------------------------
# Errors: pinned messages (each produced on the ranks, pinned here)
# ---------------------------------------------------------------------------------------------


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, MLP_IN)
        self.head = nn.Linear(MLP_IN, VOCAB, bias=False)
        self.head.weight = self.embed.weight


class Siblings(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(MLP_IN, MLP_IN)
        self.b = nn.Linear(MLP_IN, MLP_IN)
        self.b.weight = self.a.weight


def _untouched(model: nn.Module) -> bool:
    return not any(isinstance(p, DTensor) for p in model.parameters())


def _error_messages() -> dict[str, str]:
    from fsdp2 import fully_shard, share_comm_ctx

    messages = {}
    for k in (3, 0, -1, 2.0):
        mlp = Lockstep("mlp").model
        messages[f"reshard_after_forward={k}"] = error_text(
            lambda m=mlp, k=k: fully_shard(m, reshard_after_forward=k)
        )
        # A rejected call must leave the module as it was, ready for a corrected call.
        messages[f"untouched after reshard_after_forward={k}"] = str(_untouched(mlp))

    tied = TiedLM()
    fully_shard(tied.head)
    messages["tied: head, then root"] = error_text(lambda: fully_shard(tied))
    siblings = Siblings()
    fully_shard(siblings.a)
    messages["tied: siblings"] = error_text(lambda: fully_shard(siblings.b))

    t = Lockstep("mlp")
    shard_mlp(t.model)
    stray = nn.Linear(2, 2)
    messages["forward prefetch"] = error_text(
        lambda: t.model.set_modules_to_forward_prefetch([t.model.blocks[0], stray])
    )
    messages["backward prefetch"] = error_text(
        lambda: t.model.blocks[1].set_modules_to_backward_prefetch([stray])
    )
    messages["share_comm_ctx ok"] = error_text(lambda: share_comm_ctx([t.model, t.model.blocks[0]]))
    messages["share_comm_ctx"] = error_text(lambda: share_comm_ctx([t.model, stray]))
    for num in (0, -1, 1.5, True):
        messages[f"max_input_buffers={num}"] = error_text(
            lambda n=num: t.model.set_reduce_scatter_max_input_buffers(n)
        )
    messages["divide factor 0"] = error_text(lambda: t.model.set_gradient_divide_factor(0))
    return messages


@functools.cache
def error_messages(world_size: int) -> dict[str, str]:
    """One rank round trip for every message below; all ranks must agree."""
    results = run_on_ranks(world_size, _error_messages)
    assert all(r == results[0] for r in results), results
    return results[0]


@pytest.mark.skipif(IMPL_UNDER_TEST != "fsdp2", reason="pins fsdp2's messages")
class TestErrorMessages(expecttest.TestCase):
    def test_reshard_after_forward_int_must_divide_world_size(self) -> None:
        msgs = error_messages(4)
        self.assertExpectedInline(
            msgs["reshard_after_forward=3"],
            """ValueError: fully_shard(MLPStack): reshard_after_forward=3 must be a bool, None, or a divisor of the shard world size 4: one of [1, 2, 4] (1 means False, 4 means True)""",
        )
        self.assertExpectedInline(
            msgs["reshard_after_forward=0"],
            """ValueError: fully_shard(MLPStack): reshard_after_forward=0 must be a bool, None, or a divisor of the shard world size 4: one of [1, 2, 4] (1 means False, 4 means True)""",
        )
        self.assertExpectedInline(
            msgs["reshard_after_forward=-1"],
            """ValueError: fully_shard(MLPStack): reshard_after_forward=-1 must be a bool, None, or a divisor of the shard world size 4: one of [1, 2, 4] (1 means False, 4 means True)""",
        )
        self.assertExpectedInline(
            msgs["reshard_after_forward=2.0"],
            """ValueError: fully_shard(MLPStack): reshard_after_forward=2.0 must be a bool, None, or a divisor of the shard world size 4: one of [1, 2, 4] (1 means False, 4 means True)""",
        )

    def test_rejected_reshard_after_forward_leaves_module_alone(self) -> None:
        msgs = error_messages(4)
        for k in (3, 0, -1, 2.0):
            self.assertEqual(msgs[f"untouched after reshard_after_forward={k}"], "True")

    def test_tied_weight_across_calls(self) -> None:
        msgs = error_messages(2)
        self.assertExpectedInline(
            msgs["tied: head, then root"],
            """ValueError: embed.weight (in Embedding) is already sharded by the fully_shard call on Linear: a tied weight cannot live in two groups. Group the modules that share it in one call, e.g. fully_shard([embedding, lm_head])""",
        )
        self.assertExpectedInline(
            msgs["tied: siblings"],
            """ValueError: weight (in Linear) is already sharded by the fully_shard call on Linear: a tied weight cannot live in two groups. Group the modules that share it in one call, e.g. fully_shard([embedding, lm_head])""",
        )

    def test_prefetch_rejects_plain_modules(self) -> None:
        msgs = error_messages(2)
        self.assertExpectedInline(
            msgs["forward prefetch"],
            """ValueError: set_modules_to_forward_prefetch expects FSDPModules (modules fully_shard was applied to), got Linear; apply fully_shard to it first""",
        )
        self.assertExpectedInline(
            msgs["backward prefetch"],
            """ValueError: set_modules_to_backward_prefetch expects FSDPModules (modules fully_shard was applied to), got Linear; apply fully_shard to it first""",
        )

    def test_share_comm_ctx(self) -> None:
        msgs = error_messages(2)
        self.assertEqual(msgs["share_comm_ctx ok"], "no error")
        self.assertExpectedInline(
            msgs["share_comm_ctx"], """ValueError: share_comm_ctx expects FSDPModules, got Linear"""
        )

    def test_bad_reduce_scatter_max_input_buffers(self) -> None:
        msgs = error_messages(2)
        self.assertExpectedInline(
            msgs["max_input_buffers=0"],
            """ValueError: max_input_buffers must be at least 1, got 0""",
        )
        self.assertExpectedInline(
            msgs["max_input_buffers=-1"],
            """ValueError: max_input_buffers must be at least 1, got -1""",
        )
        self.assertExpectedInline(
            msgs["max_input_buffers=1.5"],
            """TypeError: max_input_buffers must be an int, got float""",
        )
        self.assertExpectedInline(
            msgs["max_input_buffers=True"],
            """TypeError: max_input_buffers must be an int, got bool""",
        )

    def test_bad_gradient_divide_factor(self) -> None:
        self.assertExpectedInline(
            error_messages(2)["divide factor 0"],
            """ValueError: set_gradient_divide_factor expects a positive factor, got 0""",
        )
