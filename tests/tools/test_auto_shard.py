"""auto_shard: it picks what a careful hand-written sharding picks, and trains like it.

For each model in tests/auto_shard_models.py (the examples' GPT, a Llama nested as Hugging Face
nests it, an encoder-decoder, cross-layer weight sharing; HF's own LlamaForCausalLM in
tests/integration/test_auto_shard_hf.py):
- the plan is exactly the expected list of (fqn, kwargs);
- on 2 gloo ranks the auto-sharded model trains with parity against a single-process reference
  on the same global batch, and bitwise like the hand-written ``fully_shard`` calls (the same
  calls in the same order: the same arithmetic), with the same collectives per group.

These models are toy-size stand-ins for real transformers, whose layers (megabytes each) are far
above ``min_group_bytes``: their block choice is checked with grouping off (``UNGROUPED``), and
test_real_transformer_layers_are_not_grouped checks real sizes on meta. Grouping small blocks
(``ManySmall``, the upstream user's hundreds of tiny layers in a ModuleDict) is tested at the end.
"""

from __future__ import annotations

from typing import Any

import expecttest
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp2
from fsdp2.tools.auto import plan_auto_shard
from tests.auto_shard_models import ALL_CASES, CASES, Case, block_calls, build_gpt, token_batch
from tests.errors import raised
from tests.harness import per_group_collectives, run_on_ranks
from tests.parity import count, full, train_side_by_side

NUM_STEPS = 3
# Grouping off: the toy models' blocks are all under the default min_group_bytes.
UNGROUPED: dict[str, Any] = {"min_group_bytes": None}


def check_plan(case: Case) -> None:
    result = plan_auto_shard(case.build(), **UNGROUPED)
    assert list(result) == case.expected
    assert tuple(fqn for fqn, _ in result.skipped) == case.skipped


@pytest.mark.parametrize("name", sorted(CASES))
def test_plan_is_the_hand_written_sharding(name: str) -> None:
    check_plan(CASES[name])


def test_plan_on_the_meta_device_allocates_nothing() -> None:
    with torch.device("meta"):
        model = build_gpt()
    assert list(plan_auto_shard(model, **UNGROUPED)) == CASES["gpt"].expected


def test_block_types_by_class_or_name_nested_bottom_up() -> None:
    from examples.model import Block, CausalSelfAttention

    model = build_gpt(num_layers=2)
    by_class = plan_auto_shard(model, block_types={Block, CausalSelfAttention}, **UNGROUPED)
    by_name = plan_auto_shard(model, block_types=["Block", "CausalSelfAttention"], **UNGROUPED)
    expected = [
        ("blocks.0.attn", {"reshard_after_forward": True}),
        ("blocks.0", {"reshard_after_forward": True}),
        ("blocks.1.attn", {"reshard_after_forward": True}),
        ("blocks.1", {"reshard_after_forward": False}),
        ("", {}),
    ]
    assert list(by_class) == expected
    assert list(by_name) == expected


def test_block_types_tied_to_the_outside_stay_with_the_root() -> None:
    # Embedding and lm_head share one weight: neither may form a group of its own.
    result = plan_auto_shard(build_gpt(num_layers=1), block_types={nn.Embedding})
    assert list(result) == [("pos_emb", {"reshard_after_forward": False}), ("", {})]
    assert [fqn for fqn, _ in result.skipped] == ["tok_emb"]


def test_explicit_kwargs_go_to_every_call() -> None:
    policy = fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    result = plan_auto_shard(
        build_gpt(num_layers=2), reshard_after_forward=2, mp_policy=policy, **UNGROUPED
    )
    kwargs = {"reshard_after_forward": 2, "mp_policy": policy}
    assert list(result) == [("blocks.0", kwargs), ("blocks.1", kwargs), ("", kwargs)]


def test_zero2_leaves_reshard_after_forward_alone() -> None:
    """memory_mode="zero2" keeps every group gathered, so auto_shard chooses no
    reshard_after_forward (fully_shard would refuse a True beside it)."""
    result = plan_auto_shard(build_gpt(num_layers=2), memory_mode="zero2", **UNGROUPED)
    kwargs = {"memory_mode": "zero2"}
    assert list(result) == [("blocks.0", kwargs), ("blocks.1", kwargs), ("", kwargs)]


class MoELayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(16, 4)
        self.experts = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))


class Imbalanced(nn.Module):
    """One large MoE encoder layer, five small decoder layers: the encoder's experts are a run
    bigger than a decoder layer, but inside a block already taken."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.ModuleDict({"layers": nn.ModuleList([MoELayer()])})
        self.decoder = nn.ModuleDict({"layers": nn.ModuleList(nn.Linear(16, 16) for _ in range(5))})


def _titan_like() -> nn.Module:
    # torchtitan keeps its layers in a ModuleDict ("0", "1", ...), beside a bias-free head.
    model = nn.Module()
    model.tok_embeddings = nn.Embedding(8, 4)
    model.layers = nn.ModuleDict({str(i): nn.Sequential(nn.Linear(4, 4)) for i in range(2)})
    model.output = nn.Linear(4, 8, bias=False)
    return model


class Stage(nn.ModuleList):
    """A layer list with a forward of its own: fully_shard takes it, so it can be a block."""

    def __init__(self) -> None:
        super().__init__(nn.Linear(16, 16) for _ in range(2))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for layer in self:
            h = layer(h)
        return h


def _stages() -> nn.Module:
    model = nn.Module()
    model.stages = nn.ModuleList(Stage() for _ in range(2))
    return model


@pytest.mark.parametrize(
    ("build", "expected"),
    [
        (
            Imbalanced,
            [
                *block_calls("encoder.layers", 1, last_of_all=False),
                *block_calls("decoder.layers", 5),
                ("", {}),
            ],
        ),
        (_titan_like, [*block_calls("layers", 2), ("", {})]),
        # Each stage is a block (the layers inside are its own runs, inside a taken block).
        (_stages, [*block_calls("stages", 2), ("", {})]),
        (  # blocks among other children of a Sequential
            lambda: nn.Sequential(
                nn.Embedding(8, 4),
                nn.TransformerEncoderLayer(4, 1, 8),
                nn.TransformerEncoderLayer(4, 1, 8),
                nn.LayerNorm(4),
            ),
            [
                ("1", {"reshard_after_forward": True}),
                ("2", {"reshard_after_forward": False}),
                ("", {}),
            ],
        ),
    ],
    ids=[
        "run_inside_a_block",
        "module_dict",
        "container_subclasses_with_forward",
        "sequential_of_mixed_children",
    ],
)
def test_plan_structures(build: Any, expected: list[tuple[str, dict[str, Any]]]) -> None:
    assert list(plan_auto_shard(build(), **UNGROUPED)) == expected


def test_a_model_without_blocks_is_one_group() -> None:
    result = plan_auto_shard(nn.Sequential(nn.Linear(2, 3), nn.ReLU()))
    assert list(result) == [("", {})]


class TestPrinted(expecttest.TestCase):
    def test_str(self) -> None:
        self.assertExpectedInline(
            str(plan_auto_shard(CASES["shared_layers"].build())),
            """\
auto_shard: 3 fully_shard calls, bottom-up
  module    params  options
  blocks.0   3,280  reshard_after_forward=True
  blocks.3   3,280  reshard_after_forward=False
  <root>     6,208  -
not sharded on its own: blocks.1 (blocks.1.mlp.fc.weight is also blocks.2.mlp.fc.weight: it goes to their common ancestor's group)
not sharded on its own: blocks.2 (blocks.2.mlp.fc.weight is also blocks.1.mlp.fc.weight: it goes to their common ancestor's group)""",
        )

    def test_str_common_kwargs(self) -> None:
        policy = fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        self.assertExpectedInline(
            str(plan_auto_shard(nn.Sequential(nn.Linear(2, 3)), mp_policy=policy)),
            """\
auto_shard: 1 fully_shard call, bottom-up
  module  params  options
  <root>       9  -
every call also gets: mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=None, output_dtype=None, cast_forward_inputs=True)
no repeated blocks found: the root holds every parameter""",
        )


class TestErrors(expecttest.TestCase):
    def test_no_parameters(self) -> None:
        self.assertExpectedInline(
            raised(lambda: fsdp2.auto_shard(nn.Sequential(nn.ReLU()))),
            """ValueError: auto_shard: Sequential has no parameters, so there is nothing to shard; build the model before sharding it""",
        )

    def test_block_types_match_nothing(self) -> None:
        self.assertExpectedInline(
            raised(lambda: fsdp2.auto_shard(build_gpt(), block_types={nn.Conv2d, "Layer"})),
            """ValueError: auto_shard: block_types (Conv2d, Layer) match no submodule of GPTLoss; pass the class of its repeated blocks (e.g. block_types={LlamaDecoderLayer}), or leave block_types out to find them""",
        )

    def test_block_types_not_classes(self) -> None:
        self.assertExpectedInline(
            raised(lambda: fsdp2.auto_shard(build_gpt(), block_types=[nn.Linear(2, 2)])),
            """TypeError: auto_shard: block_types must hold nn.Module subclasses or class names, got Linear(in_features=2, out_features=2, bias=True); e.g. block_types={TransformerBlock}""",
        )

    def test_already_sharded_on_every_rank(self) -> None:
        messages = run_on_ranks(2, _already_sharded_error, timeout=30)
        assert messages[0] == messages[1], "every rank must raise alike"
        self.assertExpectedInline(
            messages[0],
            """ValueError: auto_shard: module 'blocks.1' (FSDPBlock) is already sharded; auto_shard makes every fully_shard call itself: give it a model that fully_shard was not applied to, or shard this one by hand""",
        )

    def test_apply_to_another_structure(self) -> None:
        result = plan_auto_shard(build_gpt(num_layers=3))
        self.assertExpectedInline(
            raised(lambda: result.apply(build_gpt(num_layers=2))),
            """ValueError: AutoShardResult.apply: GPTLoss has no submodule 'blocks.2'; replay a result onto a model built the same way as the one auto_shard planned""",
        )


def _mesh_passed_through() -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard"))  # HSDP
    model = build_gpt(num_layers=2)
    result = fsdp2.auto_shard(model, mesh=mesh, **UNGROUPED)
    assert all(kw["mesh"] is mesh for _, kw in result), list(result)
    # None for a parameter left a plain tensor.
    dim_names = {
        p.device_mesh.mesh_dim_names if isinstance(p, DTensor) else None for p in model.parameters()
    }
    return sorted(map(str, dim_names))


def test_mesh_goes_to_every_call() -> None:
    assert run_on_ranks(2, _mesh_passed_through, timeout=30) == [["('replicate', 'shard')"]] * 2


def _already_sharded_error() -> str:
    model = build_gpt()
    fsdp2.fully_shard(model.blocks[1])
    return raised(lambda: fsdp2.auto_shard(model))


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------


def _train(name: str, how: str, grouped: bool = False) -> dict[str, Any]:
    """Shard a copy of ``CASES[name]`` (``how``: auto / hand / torch) and train it beside an
    unsharded reference (which raises on any mismatch); return what the others must equal.
    ``grouped``: auto_shard's default grouping of small blocks (else ``UNGROUPED``)."""
    case = ALL_CASES[name]
    torch.manual_seed(0)
    model, ref = case.build(), case.build()
    ref.load_state_dict(model.state_dict())
    options = {} if grouped else UNGROUPED
    calls = None
    if how == "auto":
        calls = list(fsdp2.auto_shard(model, **options))
    elif how == "hand":
        case.hand(model, fsdp2.fully_shard)
    else:  # the same plan through torch's fully_shard
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        plan_auto_shard(ref, **options).apply(model, fully_shard=torch_fully_shard)
    out = train_side_by_side(
        model,
        ref,
        token_batch,
        dp_rank=dist.get_rank(),
        dp_size=dist.get_world_size(),
        num_steps=NUM_STEPS,
    )
    return {
        "calls": calls,
        "losses": out.losses,
        "params": [full(p).detach() for p in model.parameters()],
        "gathers": [count(r, "all_gather") for r in out.records],
        "reduces": [count(r, "reduce_scatter") for r in out.records],
    }


@per_group_collectives  # one reduce-scatter per group is counted: coalescing off
def _train_per_group(*args: Any) -> dict[str, Any]:
    return _train(*args)


def check_training(name: str) -> None:
    """auto_shard's calls, parity with the reference (inside _train) and bitwise equality with
    the hand-written sharding."""
    auto = run_on_ranks(2, _train_per_group, name, "auto", timeout=120)[0]
    hand = run_on_ranks(2, _train_per_group, name, "hand", timeout=120)[0]
    assert auto["calls"] == ALL_CASES[name].expected
    # Same fully_shard calls in the same order: the same arithmetic, so bitwise.
    assert auto["losses"] == hand["losses"]
    for a, h in zip(auto["params"], hand["params"], strict=True):
        assert torch.equal(a, h)
    assert auto["gathers"] == hand["gathers"] and auto["reduces"] == hand["reduces"]
    num_groups = len(ALL_CASES[name].expected)
    assert all(len(c) == num_groups for c in auto["reduces"]), auto["reduces"]


@pytest.mark.parametrize("name", sorted(CASES))
def test_trains_like_hand_written_sharding(name: str) -> None:
    check_training(name)


@pytest.mark.parametrize("grouped", [False, True], ids=["per_block", "grouped"])
def test_replayed_through_torch_fully_shard(grouped: bool) -> None:
    auto = run_on_ranks(2, _train, "gpt", "auto", grouped, timeout=120)[0]
    torch_run = run_on_ranks(2, _train, "gpt", "torch", grouped, timeout=120)[0]
    if grouped:  # the toy GPT's three blocks (13 KB each) in one fully_shard([...]) call
        assert [target for target, _ in auto["calls"]] == [["blocks.0", "blocks.1", "blocks.2"], ""]
    # Losses are bitwise equal to torch's on the same grouping (see README: Performance).
    assert auto["losses"] == torch_run["losses"]


# ---------------------------------------------------------------------------------------------
# Grouping small blocks: hundreds of tiny layers in a few fully_shard([...]) calls
# ---------------------------------------------------------------------------------------------

FEATURES = 16


class Tiny(nn.Module):
    """A residual layer of 33 * hidden floats (33 to 990 for hidden 1 to 30)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(FEATURES, hidden)
        self.down = nn.Linear(hidden, FEATURES, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 0.1 * self.down(torch.tanh(self.up(x)))


class ManySmall(nn.Module):
    """The upstream user's model: hundreds of layers of 1 to 1,000 floats in a ModuleDict,
    beside a small head at the root (615 KB of parameters in all)."""

    def __init__(self, num_layers: int = 300) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({f"l{i}": Tiny(1 + i * 7 % 30) for i in range(num_layers)})
        self.head = nn.Linear(FEATURES, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return (self.head(x).squeeze(-1) - y).square().mean()


def many_small_batch(gen: torch.Generator, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, FEATURES, generator=gen), torch.randn(batch_size, generator=gen)


def test_many_small_layers_get_a_few_groups() -> None:
    model = ManySmall()
    result = plan_auto_shard(model)
    limit = result.min_group_bytes
    assert limit == 256 * 1024
    *groups, root = result.calls
    # 300 layers of 132 to 3,960 bytes (615 KB): groups of at least 256 KiB, the last one what
    # remains, in registration order and together every layer once.
    assert len(groups) == 3
    assert [f for c in groups for f in c.fqns] == [f"layers.l{i}" for i in range(300)]
    assert all(sum(c.nbytes) >= limit for c in groups[:-1])
    # Closed by the block that reached the limit: without it, each group was under it.
    assert all(sum(c.nbytes[:-1]) < limit for c in groups)
    assert [c.kwargs for c in groups] == [{"reshard_after_forward": True}] * 2 + [
        {"reshard_after_forward": False}
    ]
    assert root.fqns == ("",) and root.numel == FEATURES + 1
    first_target, _ = next(iter(result))
    assert first_target == [f"layers.l{i}" for i in range(len(groups[0].fqns))]


def test_grouping_off_is_one_call_per_block() -> None:
    expected = [*block_calls("layers.l", 300), ("", {})]
    expected = [(fqn.replace("l.", "l"), kw) for fqn, kw in expected]
    assert list(plan_auto_shard(ManySmall(), min_group_bytes=None)) == expected
    assert list(plan_auto_shard(ManySmall(), min_group_bytes=0)) == expected


def test_real_transformer_layers_are_not_grouped() -> None:
    """GPT-2 small and Llama-2-7B shapes on meta: layers of 28 MB and 800 MB, far above the
    default; every layer gets its own call, as with grouping off."""
    from examples.model import GPT, GPTConfig, Llama, LlamaConfig

    llama_7b = LlamaConfig(
        vocab_size=32000, max_seq_len=4096, num_layers=32, num_heads=32, num_kv_heads=32,
        embed_dim=4096, ffn_multiple_of=256,
    )  # fmt: skip
    with torch.device("meta"):
        gpt2 = GPT(GPTConfig(vocab_size=50257, block_size=1024, num_layers=12, embed_dim=768))
        llama = Llama(llama_7b)
    assert list(plan_auto_shard(gpt2)) == [*block_calls("blocks", 12), ("", {})]
    assert list(plan_auto_shard(llama)) == list(plan_auto_shard(llama, min_group_bytes=None))
    assert len(list(plan_auto_shard(llama))) == 33


class Mixed(nn.Module):
    """Small layers around a tied pair and a large layer, and a second run of small layers."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.ModuleList(nn.Linear(4, 4) for _ in range(8))
        self.a[3].weight = self.a[4].weight  # tied: neither is sharded on its own
        self.a[6] = nn.Linear(4, 16)  # 320 bytes: large at the threshold below
        self.b = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))


def test_groups_never_span_a_skipped_block_a_large_one_or_two_runs() -> None:
    small = 20 * 4  # bytes of one Linear(4, 4)
    result = plan_auto_shard(Mixed(), min_group_bytes=2 * small)
    assert [target for target, _ in result] == [
        ["a.0", "a.1"],
        "a.2",  # the next one (a.3) is skipped: tied to a.4
        "a.5",  # the next one (a.6) is large: alone, as without grouping
        "a.6",
        "a.7",
        ["b.0", "b.1"],  # another run: a.7 does not join it
        "b.2",
        "",
    ]
    assert [fqn for fqn, _ in result.skipped] == ["a.3", "a.4"]
    # A block as large as the threshold is not small.
    assert all(isinstance(t, str) for t, _ in plan_auto_shard(Mixed(), min_group_bytes=small))


def test_threshold_counts_gathered_bytes() -> None:
    """Under a bf16 ``mp_policy`` a block's all-gather moves half its fp32 bytes: it counts
    half (so a threshold groups as an fp32 one twice its size), printed as such; a policy
    without ``param_dtype`` (reduce only) and torch's own policy class are read alike."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy

    limit = 64 * 1024
    bf16 = fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    half = plan_auto_shard(ManySmall(), min_group_bytes=limit, mp_policy=bf16)
    full = plan_auto_shard(ManySmall(), min_group_bytes=limit)
    alone = plan_auto_shard(ManySmall(), min_group_bytes=0)
    assert [b for c in half.calls for b in c.nbytes] == [c.nbytes[0] // 2 for c in alone.calls]
    assert [c.fqns for c in half.calls] == [
        c.fqns for c in plan_auto_shard(ManySmall(), min_group_bytes=2 * limit).calls
    ]
    assert len(half.calls) < len(full.calls)
    assert "(66 to 1,980 bytes gathered in bfloat16 each)" in str(half)
    torch_half = plan_auto_shard(
        ManySmall(), min_group_bytes=limit, mp_policy=TorchPolicy(param_dtype=torch.bfloat16)
    )
    assert [c.fqns for c in torch_half.calls] == [c.fqns for c in half.calls]
    reduce_only = fsdp2.MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)
    same = plan_auto_shard(ManySmall(), min_group_bytes=limit, mp_policy=reduce_only)
    assert [c.fqns for c in same.calls] == [c.fqns for c in full.calls]


def test_plan_on_meta_groups_alike() -> None:
    with torch.device("meta"):
        meta = plan_auto_shard(ManySmall())
    assert len(meta.calls) == 4  # 3 groups and the root, decided from shapes and dtypes alone
    assert list(meta) == list(plan_auto_shard(ManySmall()))


class TestGroupingPrinted(expecttest.TestCase):
    def test_str(self) -> None:
        self.assertExpectedInline(
            str(plan_auto_shard(ManySmall(), min_group_bytes=64 * 1024)),
            """\
auto_shard: 11 fully_shard calls, bottom-up
  module                             params  options
  [layers.l0 .. layers.l33] (34)     16,863  reshard_after_forward=True
  [layers.l34 .. layers.l65] (32)    16,500  reshard_after_forward=True
  [layers.l66 .. layers.l97] (32)    16,434  reshard_after_forward=True
  [layers.l98 .. layers.l130] (33)   16,731  reshard_after_forward=True
  [layers.l131 .. layers.l162] (32)  16,764  reshard_after_forward=True
  [layers.l163 .. layers.l196] (34)  16,995  reshard_after_forward=True
  [layers.l197 .. layers.l228] (32)  16,566  reshard_after_forward=True
  [layers.l229 .. layers.l260] (32)  16,500  reshard_after_forward=True
  [layers.l261 .. layers.l292] (32)  16,434  reshard_after_forward=True
  [layers.l293 .. layers.l299] (7)    3,663  reshard_after_forward=False
  <root>                                 17  -
grouped: 300 blocks under min_group_bytes=65,536 (132 to 3,960 bytes gathered each) in 10 fully_shard([...]) calls, consecutive blocks of a run until a call holds min_group_bytes: below that, a collective costs the backend's latency whatever its size (min_group_bytes=None: one call per block)""",
        )

    def test_bad_min_group_bytes(self) -> None:
        self.assertExpectedInline(
            raised(lambda: plan_auto_shard(ManySmall(4), min_group_bytes=-1)),
            """ValueError: auto_shard: min_group_bytes must be >= 0, got -1; pass a size in bytes, or None (or 0) to shard each block alone""",
        )
        self.assertExpectedInline(
            raised(lambda: plan_auto_shard(ManySmall(4), min_group_bytes=1.5e6)),  # type: ignore[arg-type]
            """TypeError: auto_shard: min_group_bytes must be an int (bytes gathered) or None, got 1500000.0; e.g. min_group_bytes=1 << 20, or None to shard each block alone""",
        )


@per_group_collectives  # counts each group's own gathers: grouping, not coalescing
def _train_many_small(min_group_bytes: int | None) -> dict[str, Any]:
    """ManySmall auto-sharded (grouped or not) trained beside its unsharded twin for 4 AdamW
    steps (train_side_by_side raises on any loss, gradient or parameter mismatch)."""
    torch.manual_seed(0)
    model = ManySmall()
    ref = ManySmall()
    ref.load_state_dict(model.state_dict())
    result = fsdp2.auto_shard(model, min_group_bytes=min_group_bytes)
    out = train_side_by_side(
        model,
        ref,
        many_small_batch,
        dp_rank=dist.get_rank(),
        dp_size=dist.get_world_size(),
        num_steps=4,
    )
    return {
        "num_block_calls": len(result.calls) - 1,
        "losses": out.losses,
        "params": [full(p).detach() for p in model.parameters()],
        "gathers": [sum(count(r, "all_gather").values()) for r in out.records],
        "reduces": [sum(count(r, "reduce_scatter").values()) for r in out.records],
    }


def test_many_small_layers_train_grouped_with_fewer_collectives() -> None:
    grouped = run_on_ranks(2, _train_many_small, 256 * 1024, timeout=240)[0]
    alone = run_on_ranks(2, _train_many_small, None, timeout=240)[0]
    assert grouped["num_block_calls"] == 3 and alone["num_block_calls"] == 300
    # Per step: each block call's all-gather in forward and again in backward (but the last,
    # kept gathered), the root's; one reduce-scatter per call, the root's included.
    for run in (grouped, alone):
        n = run["num_block_calls"]
        assert run["gathers"] == [2 * n - 1 + 1] * 4, run["gathers"]
        assert run["reduces"] == [n + 1] * 4, run["reduces"]
    # 2 ranks: each element's average is (a + b) / 2 however the flat buffers are laid out, the
    # same operation on the same values, so grouping changes no bit.
    assert grouped["losses"] == alone["losses"]
    for g, a in zip(grouped["params"], alone["params"], strict=True):
        assert torch.equal(g, a)


def _real_records() -> list[tuple[Any, ...]]:
    """The second step's collectives (the plan's steady state: the first forward has no
    recorded order to coalesce by)."""
    from fsdp2.engine.collectives import record_collectives

    torch.manual_seed(0)
    model = ManySmall()
    fsdp2.auto_shard(model)
    x, y = many_small_batch(torch.Generator().manual_seed(dist.get_rank()), 4)
    model(x, y).backward()
    with record_collectives() as records:
        model(x, y).backward()
    return [(r.kind, r.label, r.input_nbytes, r.output_nbytes, r.world_size) for r in records]


def test_planner_predicts_the_grouped_collectives() -> None:
    """fsdp2.plan without a shard function uses auto_shard: its collectives per step are
    exactly what a real step of the grouped model records, in order."""
    plan = fsdp2.plan(ManySmall, world_size=2, device="cpu")
    predicted = [
        (c.kind, c.label, c.input_nbytes, c.output_nbytes, c.world_size) for c in plan.collectives
    ]
    real = run_on_ranks(2, _real_records, timeout=120)[0]
    assert predicted == real
    assert sum(kind == "all_gather" for kind, *_ in real) == 2 * 3 - 1 + 1
