"""Coalesced all-gathers and reduce-scatters of small groups ([Note: coalesced gathers],
engine/coalesce.py; [Note: coalesced reduce-scatters], engine/coalesce_reduce.py).

A stack of tiny blocks, each its own group, trains with coalescing on: the same numbers as one
process (tolerance) and bitwise the same as coalescing off (an all-gather moves bytes: each
group receives exactly what its own gather would have brought; at 2 ranks a reduce-scatter adds
two values per element, in whichever order), fewer collectives, each within the budget, and the
unsharded memory (and the held reduce-scatter inputs) bounded by it.

fsdp2-only: coalescing and the internals the memory bound reads are fsdp2's.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from tests.harness import run_on_ranks
from tests.models import MLPStack
from tests.parity import adamw, cast_forward, twins
from tests.parity.compare import full
from tests.parity.lockstep import same_on_all_ranks, train_side_by_side
from tests.tolerance import FP32, SAME_ARITHMETIC

pytestmark = pytest.mark.usefixtures("fsdp2_only")

NUM_BLOCKS = 12
FROZEN = 5  # a frozen block in the middle: gathered, never reduced
# At 2 ranks a 16x16 block gathers 1,088 bytes, the first (8x16) 576, the head 272: three blocks
# (and the head and the first) fit in a bucket, the fourth starts the next.
BUDGET = 3_300


def _build() -> nn.Module:
    model = MLPStack(NUM_BLOCKS)
    model.blocks[FROZEN].requires_grad_(False)
    return model


def _sharded_twins(bf16: bool = False) -> tuple[nn.Module, nn.Module]:
    from fsdp2 import MixedPrecisionPolicy, fully_shard

    model, ref = twins(_build)
    mp = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if bf16 else MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model, ref


def _recording_grads(model: nn.Module) -> tuple[torch.optim.Optimizer, list[dict[str, Any]]]:
    """The suite's AdamW for ``model``, keeping every step's full gradients (None: none)."""
    optim = adamw(model.parameters())
    grads: list[dict[str, Any]] = []
    step = optim.step

    def recording_step(*args: Any, **kwargs: Any) -> Any:
        grads.append({n: p.grad if p.grad is None else full(p.grad) for n, p in named})
        return step(*args, **kwargs)

    named = list(model.named_parameters())
    optim.step = recording_step  # type: ignore[method-assign]
    return optim, grads


def _train(budget: int, num_micro: int, bf16: bool = False) -> dict[str, Any]:
    """Train with coalescing at ``budget``; the losses, each step's gradients, the final full
    parameters, and the all-gathers and reduce-scatters of each step."""
    from fsdp2.engine.coalesce import coalesce_bytes, set_coalesce_bytes
    from tests.models import MODELS

    saved = coalesce_bytes()
    set_coalesce_bytes(budget)
    try:
        model, ref = _sharded_twins(bf16)
        optim, grads = _recording_grads(model)

        def no_sync_but_last(step: int, micro: int) -> None:
            model.set_requires_gradient_sync(micro == num_micro - 1)  # type: ignore[operator]

        world = dist.get_world_size()
        out = train_side_by_side(
            model,
            ref,
            MODELS["mlp"].make_batch,
            dp_rank=dist.get_rank(),
            dp_size=world,
            num_steps=3,
            num_micro=num_micro,
            before_micro=no_sync_but_last,
            optim=optim,
            # bf16: the reference computes each rank's rows on its own bf16 casts (the same
            # arithmetic as sharded training, tests/engine/test_mixed_precision.py)
            tol=SAME_ARITHMETIC if bf16 else FP32,
            ref_forward=cast_forward(torch.bfloat16, world) if bf16 else None,
        )
    finally:
        set_coalesce_bytes(saved)  # the pool process runs later tests

    def of(kind: str, nbytes: str) -> tuple[list[list[str]], list[list[int]]]:
        chosen = [[r for r in records if r.kind == kind] for records in out.records]
        return (
            [[r.label for r in step] for step in chosen],
            [[getattr(r, nbytes) for r in step] for step in chosen],
        )

    gathers, gather_bytes = of("all_gather", "output_nbytes")
    reduces, reduce_bytes = of("reduce_scatter", "input_nbytes")
    return {
        "losses": out.losses,
        "grads": grads,
        "params": {n: full(p) for n, p in model.named_parameters()},
        "gathers": gathers,
        "gather_bytes": gather_bytes,
        "reduces": reduces,
        "reduce_bytes": reduce_bytes,
    }


def _same(on: dict[str, Any], off: dict[str, Any]) -> None:
    """Coalescing on and off trained bitwise alike: losses, every step's gradients, parameters."""
    if on["losses"] != off["losses"]:
        raise AssertionError(f"losses differ: coalesced {on['losses']}, alone {off['losses']}")
    for step, (grads, off_grads) in enumerate(zip(on["grads"], off["grads"], strict=True)):
        for name, g in grads.items():
            other = off_grads[name]
            if (g is None) != (other is None) or (g is not None and not torch.equal(g, other)):
                raise AssertionError(f"step {step} {name}: coalesced gradient differs from off")
    for name, p in on["params"].items():
        if not torch.equal(p, off["params"][name]):
            raise AssertionError(f"{name}: coalesced training differs from coalescing off")


def _parity(num_micro: int, bf16: bool = False) -> dict[str, Any]:
    on = _train(BUDGET, num_micro, bf16)
    off = _train(0, num_micro, bf16)
    _same(on, off)
    same_on_all_ranks([on["gathers"], on["reduces"]])
    return {
        "on": on["gathers"],
        "off": off["gathers"],
        "bytes": on["gather_bytes"],
        "reduces_on": on["reduces"],
        "reduces_off": off["reduces"],
        "reduce_bytes": on["reduce_bytes"],
        "reduce_bytes_off": off["reduce_bytes"],
    }


def _expected_buckets(groups: list[str], sizes: dict[str, int], capacity: int) -> list[str]:
    """Consecutive groups, each bucket's bytes per rank within the capacity (greedy, in order)."""
    buckets: list[list[str]] = []
    total = capacity + 1
    for g in groups:
        if total + sizes[g] > capacity:
            buckets.append([])
            total = 0
        buckets[-1].append(g)
        total += sizes[g]
    return ["+".join(g or "<root>" for g in b) if len(b) > 1 else b[0] for b in buckets]


@pytest.mark.parametrize("num_micro", [1, 2], ids=["sync", "no_sync"])
def test_parity_and_counts(num_micro: int) -> None:
    """Against one process (train_side_by_side) and bitwise against coalescing off, over three
    AdamW steps, with a frozen block in the middle, with and without gradient accumulation."""
    result = run_on_ranks(2, _parity, num_micro)[0]
    blocks = [f"blocks.{i}" for i in range(NUM_BLOCKS)]
    # Coalescing off: one gather per group in forward, one per block in each backward.
    assert len(result["off"][1]) == num_micro * (1 + 2 * NUM_BLOCKS)
    # The first forward has no recorded order: nothing coalesces until it ends.
    # Per rank, each group's shard aligned to 16 bytes: the head's 136 bytes take 144.
    sizes = {"": 144, "blocks.0": 288, **dict.fromkeys(blocks[1:], 544)}
    # Each rank sends BUDGET / 2 (to 16 bytes: 1,648), less a 16-byte header naming the groups.
    capacity = 1648 - 16
    forward = _expected_buckets(["", *blocks], sizes, capacity)
    backward = _expected_buckets(blocks[::-1], sizes, capacity)  # the root stays gathered
    assert forward == ["<root>+blocks.0+blocks.1+blocks.2"] + [
        "+".join(blocks[i : i + 3]) for i in (3, 6, 9)
    ]
    for step in (1, 2):
        assert result["on"][step] == (forward + backward) * num_micro, step
    # Every coalesced gather has the same size, the budget's (a mismatch cannot abort gloo).
    assert {b for step in (1, 2) for b in result["bytes"][step]} == {2 * 1648}
    _check_reduces(result, num_micro)


# At 2 ranks a 16x16 block's reduce-scatter input is 2 x (136 + 2 flags) floats, 1,104 bytes: two
# fit in BUDGET, a third does not. The frozen block reduces nothing and does not end a bucket.
REDUCE_BUCKETS = [
    "blocks.11+blocks.10",
    "blocks.9+blocks.8",
    "blocks.7+blocks.6",
    "blocks.4+blocks.3",
    # blocks.0 (8x16) and the root's head are smaller; the root reduces at the end of backward,
    # joining the bucket still held there.
    "blocks.2+blocks.1+blocks.0+<root>",
]


def _check_reduces(result: dict[str, Any], num_micro: int) -> None:
    """One reduce-scatter per bucket from the first step on (it needs no recorded order), only
    in the micro-step with sync; each within the budget."""
    off = result["reduces_off"]
    trained = [f"blocks.{i}" for i in reversed(range(NUM_BLOCKS)) if i != FROZEN]
    assert all(step == [*trained, ""] for step in off), off
    sizes = dict(zip(off[0], result["reduce_bytes_off"][0], strict=True))
    assert sizes["blocks.3"] == 1104
    assert _expected_buckets([*trained, ""], sizes, BUDGET) == REDUCE_BUCKETS
    assert result["reduces_on"] == [REDUCE_BUCKETS] * 3
    assert max(max(b) for b in result["reduce_bytes"]) <= BUDGET


def _mixed_precision_parity() -> dict[str, Any]:
    return _parity(2, bf16=True)


def test_mixed_precision_parity_and_counts() -> None:
    """bf16 parameters, fp32 reduction, with gradient accumulation: bitwise as coalescing off
    and as the sliced bf16 reference; the fp32 reduce-scatters coalesce as in fp32 training."""
    _check_reduces(run_on_ranks(2, _mixed_precision_parity)[0], 2)


def _memory_bound(budget: int) -> int:
    """Train two steps; the most unsharded bytes held at once, outside the root's group and the
    running block's, by the groups and the coalesced gathers' outputs."""
    from fsdp2.engine import coalesce
    from fsdp2.engine.coalesce import coalesce_bytes, set_coalesce_bytes
    from tests.models import MODELS

    outputs: list[torch.Tensor] = []  # the coalesced gathers' outputs and send buffers
    real = coalesce.all_gather

    def spy(out: torch.Tensor, send: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        outputs.extend((out, send))
        return real(out, send, *args, **kwargs)

    coalesce.all_gather = spy  # type: ignore[assignment]
    saved = coalesce_bytes()
    set_coalesce_bytes(budget)
    try:
        model, _ = _sharded_twins()
        root = model._get_fsdp_state().group  # type: ignore[operator]
        peak = [0]

        def held(running: nn.Module) -> None:
            own = running._get_fsdp_state().group  # type: ignore[operator]
            groups = [b._get_fsdp_state().group for b in model.blocks]  # type: ignore[operator]
            nbytes = sum(g.layout.unsharded_nbytes() for g in groups if g not in (root, own))
            nbytes += sum(o.untyped_storage().nbytes() for o in outputs)
            peak[0] = max(peak[0], nbytes)

        for block in model.blocks:
            block.register_forward_pre_hook(lambda m, a: held(m))
            block.register_full_backward_pre_hook(lambda m, g: held(m))
        for step in range(3):
            x, y = MODELS["mlp"].make_batch(torch.Generator().manual_seed(step), 4)
            model(x, y).backward()
    finally:
        set_coalesce_bytes(saved)  # the pool process runs later tests
        coalesce.all_gather = real  # type: ignore[assignment]
    if not outputs:
        raise AssertionError("expected coalesced gathers, found none")
    return peak[0]


def test_memory_bounded_by_budget() -> None:
    """Outside the running block, never more than the budget: the gathered-ahead groups wait in
    the shared output (within the budget), and each copies out only when it runs; the send
    buffers count too (each freed once its gather is done), with no slack."""
    for peak in run_on_ranks(2, _memory_bound, BUDGET):
        assert 0 < peak <= BUDGET


def _ranks_disagree() -> str:
    """Coalescing on rank 0 only, with the collective checks on: the first coalesced gather
    (the root's, alone: the first forward has no order) meets the root's own on rank 1. Returns
    the error this rank raised."""
    import fsdp2
    from fsdp2.engine.coalesce import coalesce_bytes, set_coalesce_bytes
    from tests.models import MODELS

    saved = coalesce_bytes()
    set_coalesce_bytes(BUDGET if dist.get_rank() == 0 else 0)
    fsdp2.set_collective_checks(True)
    try:
        model, _ = _sharded_twins()
        for step in range(2):
            x, y = MODELS["mlp"].make_batch(torch.Generator().manual_seed(step), 4)
            model(x, y).backward()
    except fsdp2.CollectiveMismatchError as error:
        return str(error)
    finally:
        set_coalesce_bytes(saved)  # the pool process runs later tests
        fsdp2.set_collective_checks(False)
    raise AssertionError("expected a CollectiveMismatchError")


def test_collective_checks_name_the_coalesced_groups() -> None:
    """FSDP2_CHECK_COLLECTIVES compares the coalesced gather as one collective named after its
    groups: ranks that bucket differently raise on every rank instead of exchanging wrong
    sizes."""
    for message in run_on_ranks(2, _ranks_disagree):
        # (the collective's number counts this rank process's collectives so far: not pinned)
        # The first gather: the root's, coalesced alone at the fixed size on rank 0.
        assert "rank 0: all-gather #" in message, message
        assert "for `<root>` (412 elements, float32)" in message, message
        assert "for `<root>` (34 elements, float32)" in message, message


def _held_reduce_bytes(budget: int) -> dict[str, int]:
    """Train three steps; the most bytes of reduce-scatter inputs held at once (measured on
    their storages), and the most members one bucket had."""
    from fsdp2.engine import coalesce_reduce
    from fsdp2.engine.coalesce import coalesce_bytes, set_coalesce_bytes
    from tests.models import MODELS

    saved = coalesce_bytes()

    held = coalesce_reduce.Reductions
    real_reduce, real_flush = held.reduce, held.flush
    peak = {"bytes": 0, "members": 0}

    def measure(self: Any) -> None:
        nbytes = sum(b.inp.untyped_storage().nbytes() for _, b in self.held.members)
        peak["bytes"] = max(peak["bytes"], nbytes)
        peak["members"] = max(peak["members"], len(self.held.members))

    def reduce(self: Any, *args: Any, **kwargs: Any) -> None:
        real_reduce(self, *args, **kwargs)
        measure(self)

    def flush(self: Any, *args: Any, **kwargs: Any) -> None:
        measure(self)
        real_flush(self, *args, **kwargs)

    held.reduce, held.flush = reduce, flush  # type: ignore[method-assign]
    set_coalesce_bytes(budget)
    try:
        model, _ = _sharded_twins()
        for step in range(3):
            x, y = MODELS["mlp"].make_batch(torch.Generator().manual_seed(step), 4)
            model(x, y).backward()
    finally:
        set_coalesce_bytes(saved)
        held.reduce, held.flush = real_reduce, real_flush  # type: ignore[method-assign]
    return peak


def test_held_reduce_inputs_bounded_by_budget() -> None:
    """The reduce-scatter inputs waiting for their bucket's collective never exceed the budget."""
    for peak in run_on_ranks(2, _held_reduce_bytes, BUDGET):
        assert peak["members"] == 4, peak  # the last bucket: blocks.2, 1, 0 and the root
        assert 0 < peak["bytes"] <= BUDGET, peak


class _Gate(nn.Module):
    """A block that runs only where ``on``: elsewhere its output is its input (still a node of
    the graph, so its group's backward hooks run, with no gradient for its parameters)."""

    def __init__(self, inner: nn.Module, on: bool) -> None:
        super().__init__()
        self.inner = inner
        self.on = on

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) if self.on else x * 1.0


def _gradients_some_ranks_only(budget: int) -> dict[str, Any]:
    """blocks.3 runs on rank 0 only, blocks.4 on no rank. Coalescing at ``budget`` (or, at 0,
    every rank reducing zeros for what it lacks: set_reduce_scatter_unused_params), with the
    collective checks on; a backward for the input only first. Each step's gradients."""
    import fsdp2
    from fsdp2 import fully_shard
    from fsdp2.engine.coalesce import coalesce_bytes, set_coalesce_bytes
    from tests.models import MODELS

    saved = coalesce_bytes()
    set_coalesce_bytes(budget)
    fsdp2.set_collective_checks(True)
    try:
        model, _ = twins(_build)
        model.blocks[3] = _Gate(model.blocks[3], on=dist.get_rank() == 0)
        model.blocks[4] = _Gate(model.blocks[4], on=False)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        model.set_reduce_scatter_unused_params(not budget)  # type: ignore[operator]
        optim, grads = _recording_grads(model)
        make_batch = MODELS["mlp"].make_batch
        x, y = make_batch(torch.Generator().manual_seed(100), 4)
        x.requires_grad_(True)
        torch.autograd.grad(model(x, y), x)  # for the input only: no parameter gets a gradient
        untouched = all(p.grad is None for p in model.parameters())
        for step in range(2):
            model(*make_batch(torch.Generator().manual_seed(step), 4)).backward()
            optim.step()
            optim.zero_grad()
    finally:
        set_coalesce_bytes(saved)
        fsdp2.set_collective_checks(False)
    return {"grads": grads, "untouched": untouched}


def _some_ranks_only() -> bool:
    on = _gradients_some_ranks_only(BUDGET)
    off = _gradients_some_ranks_only(0)
    unused = [n for n in on["grads"][0] if n.startswith("blocks.4.")]
    for step, (grads, off_grads) in enumerate(zip(on["grads"], off["grads"], strict=True)):
        for name, g in grads.items():
            if name in unused:
                zeros = off_grads[name] is not None and not off_grads[name].any()
                if g is not None or not zeros:
                    raise AssertionError(f"step {step} {name}: expected None (and zeros off)")
            elif (g is None) != (off_grads[name] is None) or (
                g is not None and not torch.equal(g, off_grads[name])
            ):
                raise AssertionError(f"step {step} {name}: coalesced gradient differs")
    return bool(on["untouched"])  # (off: set_reduce_scatter_unused_params gives zeros there)


def test_gradients_on_some_ranks_only() -> None:
    """A group whose parameters got no gradient on one rank still joins its bucket there, as
    zeros flagged unused: every rank forms the same buckets (the collective checks would raise
    otherwise), the gradients are those of every rank reducing zeros for what it lacks, and a
    parameter no rank used stays None. A backward for an input only gives no gradient."""
    for untouched in run_on_ranks(2, _some_ranks_only):
        assert untouched


def _diverge(skip_on_rank1: int, step_to_skip: int, deferred: bool = False) -> str:
    """Coalescing on, checks off; in one step rank 1 skips a block (a user's rank-dependent
    control flow). Returns the error this rank raised. ``deferred``: the headers are compared
    as on an accelerator, before the next collective instead of at the wait."""
    import fsdp2.engine.coalesce as coalesce
    from fsdp2.engine.coalesce import coalesce_bytes, set_coalesce_bytes
    from tests.models import MODELS

    saved, saved_defers = coalesce_bytes(), coalesce._defers
    set_coalesce_bytes(BUDGET)
    if deferred:
        coalesce._defers = lambda device: True  # type: ignore[assignment]
    try:
        model, _ = _sharded_twins()
        every = list(model.blocks)  # type: ignore[arg-type]
        for step in range(3):
            if step == step_to_skip and dist.get_rank() == 1:
                model.blocks = nn.ModuleList(b for i, b in enumerate(every) if i != skip_on_rank1)
            x, y = MODELS["mlp"].make_batch(torch.Generator().manual_seed(step), 4)
            model(x, y).backward()
    except RuntimeError as error:
        return f"{type(error).__name__}: {error}"
    finally:
        set_coalesce_bytes(saved)  # the pool process runs later tests
        coalesce._defers = saved_defers  # type: ignore[method-assign]
    return "no error"


@pytest.mark.parametrize("deferred", [False, True], ids=["at_wait", "deferred"])
@pytest.mark.parametrize("skip", [4, 3], ids=["inside_a_bucket", "starts_a_bucket"])
def test_diverging_ranks_named_on_every_rank(skip: int, deferred: bool) -> None:
    """A block skipped on one rank: the ranks' coalesced gathers serve different groups. Each
    has the same size (gloo would abort a process on a size mismatch, with no report), and a
    header naming its groups, so that every rank raises an error naming both sides (each
    rank's groups in the model's order). ``deferred``: compared as on an accelerator, before
    the next collective: the same error, and no rank issues a collective past it."""
    messages = run_on_ranks(2, _diverge, skip, 1, deferred)
    for message in messages:
        assert message.startswith(
            "CollectiveMismatchError: fsdp2: the ranks gathered different groups in one "
            "coalesced all-gather:"
        ), message
        assert "Every rank must run every sharded module" in message, message
    assert messages[0] == messages[1]
    expected = {
        # Forward: the bucket started at blocks.3 on both ranks; rank 1 ran it without blocks.4,
        # so backward's bucket from blocks.5 reaches blocks.3 on rank 1 only.
        4: "  rank 0: `blocks.3+blocks.4+blocks.5`\n  rank 1: `blocks.2+blocks.3+blocks.5`\n",
        # Forward: rank 1 skips blocks.3, which starts a bucket on rank 0 (it needs it now).
        3: "  rank 0: `blocks.3+blocks.4+blocks.5`\n  rank 1: `blocks.4+blocks.5+blocks.6`\n",
    }[skip]
    assert expected in messages[0], messages[0]


def test_long_labels_are_elided() -> None:
    """A coalesced gather of many groups names its first two and last, and how many; a
    fully_shard([...]) group of many modules, its first and last: labels appear in every
    report, and a joined list of 256 names is no name."""
    from fsdp2.engine.coalesce import bucket_label
    from fsdp2.engine.state import module_label

    blocks = [f"blocks.{i}" for i in range(12)]
    assert bucket_label(blocks[:6]) == "+".join(blocks[:6])
    assert bucket_label(["", *blocks]) == "<root>+blocks.0+...+blocks.11 (13 groups)"
    assert bucket_label([""]) == ""  # one group: its own gather's label
    assert module_label(blocks[:4]) == "blocks.0,blocks.1,blocks.2,blocks.3"
    assert (
        module_label([f"layers.{i}" for i in range(256)]) == "layers.0 .. layers.255 (256 modules)"
    )


def _list_group_labels() -> list[str]:
    from fsdp2 import fully_shard
    from fsdp2.engine.collectives import record_collectives
    from tests.models import MODELS

    model = MLPStack(NUM_BLOCKS)
    fully_shard(list(model.blocks))
    fully_shard(model)
    with record_collectives() as records:
        x, y = MODELS["mlp"].make_batch(torch.Generator().manual_seed(0), 4)
        model(x, y).backward()
    return sorted({r.label for r in records})


def test_list_group_label_in_collectives() -> None:
    for seen in run_on_ranks(2, _list_group_labels):
        group = "blocks.0 .. blocks.11 (12 modules)"
        # the reduce-scatter of the list group coalesces with the root's (default budget)
        assert seen == ["", group, f"{group}+<root>"], seen


def _many_groups(budget: int) -> list[float]:
    """70 blocks, each its own group (more than an int64 word of header bits): losses."""
    from fsdp2 import fully_shard
    from fsdp2.engine.coalesce import coalesce_bytes, set_coalesce_bytes
    from tests.models import MODELS

    saved = coalesce_bytes()
    set_coalesce_bytes(budget)
    try:
        torch.manual_seed(0)
        model = MLPStack(70)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for step in range(3):
            x, y = MODELS["mlp"].make_batch(torch.Generator().manual_seed(step), 4)
            loss = model(x, y)
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.item())
    finally:
        set_coalesce_bytes(saved)
    return losses


def test_more_groups_than_a_header_word() -> None:
    """The header's bits span several words: groups past the 32nd (and the 64th) coalesce."""
    on = run_on_ranks(2, _many_groups, BUDGET)
    off = run_on_ranks(2, _many_groups, 0)
    assert on == off
