"""auto_shard: it picks what a careful hand-written sharding picks, and trains like it.

For each model in tests/auto_shard_models.py (the examples' GPT, a Llama nested as Hugging Face
nests it, an encoder-decoder, cross-layer weight sharing; HF's own LlamaForCausalLM in
tests/integration/test_auto_shard_hf.py):
- the plan is exactly the expected list of (fqn, kwargs);
- on 2 gloo ranks the auto-sharded model trains with parity against a single-process reference
  on the same global batch, and bitwise like the hand-written ``fully_shard`` calls (the same
  calls in the same order: the same arithmetic), with the same collectives per group.
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
from tests.harness import run_on_ranks
from tests.parity import count, full, train_side_by_side

NUM_STEPS = 3


def check_plan(case: Case) -> None:
    result = plan_auto_shard(case.build())
    assert list(result) == case.expected
    assert tuple(fqn for fqn, _ in result.skipped) == case.skipped


@pytest.mark.parametrize("name", sorted(CASES))
def test_plan_is_the_hand_written_sharding(name: str) -> None:
    check_plan(CASES[name])


def test_plan_on_the_meta_device_allocates_nothing() -> None:
    with torch.device("meta"):
        model = build_gpt()
    assert list(plan_auto_shard(model)) == CASES["gpt"].expected


def test_block_types_by_class_or_name_nested_bottom_up() -> None:
    from examples.model import Block, CausalSelfAttention

    model = build_gpt(num_layers=2)
    by_class = plan_auto_shard(model, block_types={Block, CausalSelfAttention})
    by_name = plan_auto_shard(model, block_types=["Block", "CausalSelfAttention"])
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
    result = plan_auto_shard(build_gpt(num_layers=2), reshard_after_forward=2, mp_policy=policy)
    kwargs = {"reshard_after_forward": 2, "mp_policy": policy}
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
    ids=["run_inside_a_block", "module_dict", "sequential_of_mixed_children"],
)
def test_plan_structures(build: Any, expected: list[tuple[str, dict[str, Any]]]) -> None:
    assert list(plan_auto_shard(build())) == expected


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
    result = fsdp2.auto_shard(model, mesh=mesh)
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


def _train(name: str, how: str) -> dict[str, Any]:
    """Shard a copy of ``CASES[name]`` (``how``: auto / hand / torch) and train it beside an
    unsharded reference (which raises on any mismatch); return what the others must equal."""
    case = ALL_CASES[name]
    torch.manual_seed(0)
    model, ref = case.build(), case.build()
    ref.load_state_dict(model.state_dict())
    calls = None
    if how == "auto":
        calls = list(fsdp2.auto_shard(model))
    elif how == "hand":
        case.hand(model, fsdp2.fully_shard)
    else:  # the same plan through torch's fully_shard
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        plan_auto_shard(ref).apply(model, fully_shard=torch_fully_shard)
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


def check_training(name: str) -> None:
    """auto_shard's calls, parity with the reference (inside _train) and bitwise equality with
    the hand-written sharding."""
    auto = run_on_ranks(2, _train, name, "auto", timeout=120)[0]
    hand = run_on_ranks(2, _train, name, "hand", timeout=120)[0]
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


def test_replayed_through_torch_fully_shard() -> None:
    auto = run_on_ranks(2, _train, "gpt", "auto", timeout=120)[0]
    torch_run = run_on_ranks(2, _train, "gpt", "torch", timeout=120)[0]
    # Losses are bitwise equal to torch's on the same grouping (see README: Performance).
    assert auto["losses"] == torch_run["losses"]
