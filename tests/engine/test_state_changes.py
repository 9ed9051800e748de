"""State users change after ``fully_shard``: ``requires_grad``, the parameters themselves, hooks
on them, their dtype. Each change made between iterations must count from the next forward, so
the sharded model keeps training exactly like a plain model changed the same way (parity on the
same global batch, as in ``tests/parity/``): a frozen weight never trains, an unfrozen one does,
an assigned parameter is the one trained, an optimizer stepped in a post-accumulate-grad hook
steps once per backward, and a cast model trains on in its new dtype.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable

import expecttest
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from tests.engine import test_mixed_dtypes as mixed
from tests.errors import error_text
from tests.harness import IMPL_UNDER_TEST, fsdp_api, per_group_collectives, run_on_ranks
from tests.models import MLP_DIM, MLP_IN, MLP_OUT, build_model, make_batch
from tests.parity import (
    GLOBAL_BATCH,
    MODEL_SEED,
    adamw,
    close,
    compare_buffers,
    compare_grads,
    compare_params,
    global_batch,
    rank_rows,
    shard_model,
    train_side_by_side,
    twins,
)
from tests.tolerance import FP32, FP32_ATOL, FP32_RTOL, SGD_FP32, Tolerance

impls = pytest.mark.parametrize(
    "impl", sorted({IMPL_UNDER_TEST, "torch"}), ids=lambda impl: f"impl={impl}"
)


def _step(
    model: nn.Module,
    ref: nn.Module,
    step: int,
    tol: Tolerance,
    after_forward: Callable[[nn.Module], None] = lambda m: None,
    input_dtype: torch.dtype | None = None,
) -> None:
    """One forward and backward of both models on the step's global batch; compares the loss
    and every gradient (a missing or extra one included), before any optimizer step.
    ``after_forward`` changes each model between its forward and its backward."""
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = global_batch("mlp", step, 0, GLOBAL_BATCH)
    if input_dtype is not None:
        batch = tuple(t.to(input_dtype) for t in batch)
    loss = model(*rank_rows(batch, rank, world))
    after_forward(model)
    loss.backward()
    loss = loss.detach().clone()
    dist.all_reduce(loss)
    ref_loss = ref(*batch)
    after_forward(ref)
    ref_loss.backward()
    close(f"step {step} loss", loss / world, ref_loss.detach(), tol)
    compare_grads(model, ref, f"step {step}", tol, check_layout=True)


def _compare_params_and_buffers(
    model: nn.Module, ref: nn.Module, what: str, tol: Tolerance
) -> None:
    compare_params(model, ref, what, tol, check_layout=True)
    compare_buffers(model, ref, what)


# ---------------------------------------------------------------------------------------------
# requires_grad_ after fully_shard
# ---------------------------------------------------------------------------------------------

# step -> (when, {parameter name prefix: requires_grad}). The "frozen" model starts with
# blocks.0.0.weight frozen and all of blocks.1 frozen (a group with nothing to reduce).
SCHEDULE = {
    1: ("before", {"blocks.1.": True, "head.weight": False}),  # unfreeze a frozen group
    2: ("before", {"blocks.0.0.weight": True, "blocks.2.": False}),  # frozen at fully_shard
    # Changed between forward and backward: counts from the next forward, and a weight frozen
    # after its forward gets no gradient, as in plain PyTorch (head: the root's group).
    3: ("after", {"blocks.0.0.bias": False, "head.weight": True, "head.bias": False}),
    4: ("before", {"blocks.2.": True, "blocks.0.0.bias": True, "head.bias": True}),
    5: ("before", {"blocks.": False, "head.weight": False}),  # all but one frozen
    6: ("before", {"": True}),
}


def _set_requires_grad(model: nn.Module, changes: dict[str, bool]) -> None:
    for name, param in model.named_parameters():
        for prefix, value in changes.items():
            if name.startswith(prefix):
                param.requires_grad_(value)


def _requires_grad_schedule(impl: str, reshard_after_forward: bool | None) -> None:
    model, ref = twins("frozen")
    shard_model(model, "frozen", impl, reshard_after_forward=reshard_after_forward)
    optim, ref_optim = adamw(model.parameters()), adamw(ref.parameters())
    for step in range(8):
        when, changes = SCHEDULE.get(step, ("", {}))
        change = functools.partial(_set_requires_grad, changes=changes)
        if when == "before":
            change(model)
            change(ref)
        _step(model, ref, step, FP32, after_forward=change if when == "after" else lambda m: None)
        for opt in (optim, ref_optim):
            opt.step()
            opt.zero_grad()
        # Every step, not only at the end: a frozen weight that moved once would show here.
        _compare_params_and_buffers(model, ref, f"after step {step}", FP32)
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert p.requires_grad == r.requires_grad, name


@pytest.mark.parametrize("reshard_after_forward", [None, True, False])
@impls
def test_requires_grad_changed_between_steps(impl: str, reshard_after_forward: bool | None) -> None:
    """Progressive unfreezing and freezing (embeddings after N steps, LoRA setups) on
    ``model.parameters()`` of a sharded model, between steps and between forward and backward."""
    if impl == "torch" and reshard_after_forward is not True:
        pytest.skip(
            "torch loses a requires_grad_ change made between forward and backward on the "
            "unsharded parameters its root keeps gathered (they are what the module holds)"
        )
    run_on_ranks(2, _requires_grad_schedule, impl, reshard_after_forward)


def test_requires_grad_changed_between_steps_4_ranks() -> None:
    run_on_ranks(4, _requires_grad_schedule, IMPL_UNDER_TEST, None)


@per_group_collectives  # pins one group's reduce-scatter size; coalescing would merge groups
def _unfreeze_in_mixed_dtype_group() -> list[dict[str, int]]:
    """A group holding fp32 and fp64 parameters reduces in the widest dtype of those that
    train: fp32 while the fp64 ones are frozen, fp64 once they are unfrozen."""
    model, ref = mixed.build("fp64"), mixed.build("fp64")
    frozen = ("proj", "gain")  # used in backward before lin's gradients: see test_mixed_dtypes
    for net in (model, ref):
        _set_requires_grad(net, {f"blocks.{i}.{n}": False for i in (0, 1) for n in frozen})
    mixed.shard(model)

    def unfreeze(step: int, micro: int) -> None:
        if step == 1:
            for net in (model, ref):
                _set_requires_grad(net, {"blocks.": True})

    result = train_side_by_side(
        model,
        ref,
        mixed.make_batch,
        dp_rank=dist.get_rank(),
        dp_size=dist.get_world_size(),
        num_steps=3,
        tol=mixed.TOLERANCES["fp64"],
        before_micro=unfreeze,
    )
    return [
        {r.label: r.input_nbytes for r in records if r.kind == "reduce_scatter"}
        for records in result.records
    ]


def test_unfreeze_in_mixed_dtype_group_reduces_in_the_wider_dtype(fsdp2_only: None) -> None:
    per_step = run_on_ranks(2, _unfreeze_in_mixed_dtype_group)[0]
    # Per rank, chunks of 4 of 7 rows, both ranks' sent: lin.weight (7x7) and lin.bias (7) in
    # fp32 at first; then also proj (7x7) and gain (7), all reduced in fp64. And a flag per
    # trained parameter ([Note: gradients on some ranks only] in fsdp2/engine/reduce.py).
    fp32_only, with_fp64 = 2 * (28 + 4 + 2) * 4, 2 * (28 + 4 + 28 + 4 + 4) * 8
    assert per_step[0]["blocks.0"] == fp32_only, per_step
    assert per_step[1]["blocks.0"] == per_step[2]["blocks.1"] == with_fp64, per_step


# ---------------------------------------------------------------------------------------------
# Post-accumulate-grad hooks: optimizer in backward
# ---------------------------------------------------------------------------------------------


def _optimizer_in_backward(impl: str, accumulate: bool) -> dict[str, int]:
    """torchtune's optimizer-in-backward loop: one optimizer per parameter, stepped (and its
    gradient dropped) in the parameter's post-accumulate-grad hook; against a plain model with
    one optimizer stepped after backward."""
    model, ref = twins("mlp")
    shard_model(model, "mlp", impl)
    optims = {p: adamw([p]) for p in model.parameters()}
    calls: collections.Counter[str] = collections.Counter()
    names = {id(p): n for n, p in model.named_parameters()}

    def step_in_backward(param: nn.Parameter) -> None:
        assert isinstance(param.grad, DTensor), names[id(param)]  # the reduced gradient is there
        calls[names[id(param)]] += 1
        optims[param].step()
        optims[param].zero_grad()

    for param in model.parameters():
        param.register_post_accumulate_grad_hook(step_in_backward)
    ref_optim = adamw(ref.parameters())
    for step in range(4):
        if accumulate:  # a micro-step without gradient sync: nothing reduced, no hook runs
            before = dict(calls)
            model.set_requires_gradient_sync(False)
            _step_without_grads(model, ref, 100 + step)
            assert dict(calls) == before, "a hook ran without a reduced gradient"
            model.set_requires_gradient_sync(True)
        _step_without_grads(model, ref, step)
        assert all(p.grad is None for p in model.parameters()), "hooks ran zero_grad"
        ref_optim.step()
        ref_optim.zero_grad()
        _compare_params_and_buffers(model, ref, f"after step {step}", FP32)
    return dict(calls)


def _step_without_grads(model: nn.Module, ref: nn.Module, step: int) -> None:
    """``_step`` when the sharded gradients were consumed in backward: compare the losses."""
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = global_batch("mlp", step, 0, GLOBAL_BATCH)
    loss = model(*rank_rows(batch, rank, world))
    loss.backward()
    loss = loss.detach().clone()
    dist.all_reduce(loss)
    ref_loss = ref(*batch)
    ref_loss.backward()
    close(f"step {step} loss", loss / world, ref_loss.detach())


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("accumulate", [False, True], ids=["", "accumulate"])
@impls
def test_optimizer_in_backward(impl: str, world_size: int, accumulate: bool) -> None:
    calls = run_on_ranks(world_size, _optimizer_in_backward, impl, accumulate)
    steps = 4
    names = [n for n, _ in build_model("mlp", 0).named_parameters()]
    for per_rank in calls:
        assert per_rank == dict.fromkeys(names, steps), per_rank


# ---------------------------------------------------------------------------------------------
# Parameters assigned after fully_shard
# ---------------------------------------------------------------------------------------------


class Chain(nn.Module):
    """Four linear layers; ``fully_shard`` on ``layers[0]``, then on the root (which holds two
    16x16 weights, so they can be swapped)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(MLP_IN, MLP_DIM),
            nn.ReLU(),
            nn.Linear(MLP_DIM, MLP_DIM),
            nn.ReLU(),
            nn.Linear(MLP_DIM, MLP_DIM),
            nn.ReLU(),
            nn.Linear(MLP_DIM, MLP_OUT),
        )

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.layers(x), y)


def _chain(impl: str, **kwargs: object) -> tuple[Chain, Chain]:
    torch.manual_seed(MODEL_SEED)
    model = Chain()
    torch.manual_seed(MODEL_SEED)
    ref = Chain()
    api = fsdp_api(impl)
    api.fully_shard(model.layers[0], **kwargs)
    api.fully_shard(model, **kwargs)
    return model, ref


def _assign(model: nn.Module, ref: nn.Module, name: str, full: torch.Tensor, grad: bool) -> None:
    """``<name> = nn.Parameter(full)`` on the reference, and as a DTensor laid out like the old
    parameter on the sharded model."""
    module_name, _, attr = name.rpartition(".")
    old = getattr(model.get_submodule(module_name), attr)
    new = distribute_tensor(full.clone(), old.device_mesh, old.placements)
    setattr(model.get_submodule(module_name), attr, nn.Parameter(new, requires_grad=grad))
    setattr(ref.get_submodule(module_name), attr, nn.Parameter(full.clone(), requires_grad=grad))


def _train(model: nn.Module, ref: nn.Module, steps: range, tol: Tolerance = FP32) -> None:
    """``_step`` and an AdamW step, from a fresh optimizer on each model."""
    optims = (adamw(model.parameters()), adamw(ref.parameters()))
    for step in steps:
        _step(model, ref, step, tol)
        for optim in optims:
            optim.step()
            optim.zero_grad()


def _swap(model: nn.Module, a: str, b: str) -> None:
    mod_a, mod_b = model.get_submodule(a), model.get_submodule(b)
    mod_a.weight, mod_b.weight = mod_b.weight, mod_a.weight


def _replaced_parameters(impl: str, after_training: bool) -> None:
    model, ref = _chain(impl)
    gen = torch.Generator().manual_seed(7)
    # Before the first forward (torch takes these up at lazy init): new values in both groups,
    # a new frozen parameter, and two weights of one group swapped.
    _assign(model, ref, "layers.0.weight", torch.randn(MLP_DIM, MLP_IN, generator=gen), True)
    _assign(model, ref, "layers.6.bias", torch.randn(MLP_OUT, generator=gen), False)
    for m in (model, ref):
        _swap(m, "layers.2", "layers.4")
    _train(model, ref, range(3))
    if after_training:  # fsdp2 only: torch ignores these (its modules keep the old ones)
        _assign(model, ref, "layers.4.weight", torch.randn(MLP_DIM, MLP_DIM, generator=gen), True)
        _assign(model, ref, "layers.0.bias", torch.randn(MLP_DIM, generator=gen), True)
        for m in (model, ref):
            _swap(m, "layers.2", "layers.4")
        # As with a plain model, the old optimizer holds the replaced objects: make a new one.
        _train(model, ref, range(3, 6))
    _compare_params_and_buffers(model, ref, "after training", FP32)
    assert ref.layers[6].bias.grad is None and model.layers[6].bias.grad is None


@impls
def test_parameters_assigned_before_first_forward(impl: str) -> None:
    run_on_ranks(2, _replaced_parameters, impl, False)


@pytest.mark.parametrize("world_size", [2, 4])
def test_parameters_assigned_between_steps(world_size: int, fsdp2_only: None) -> None:
    run_on_ranks(world_size, _replaced_parameters, "fsdp2", True)


class WeightNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer1 = nn.Linear(3, 3, bias=False)
        self.layer2 = nn.Linear(3, 3, bias=False)
        self.weight_norm = nn.Parameter(torch.empty(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer2(self.layer1(x)).sum() + self.weight_norm.sum()


def _meta_init_then_assign(impl: str) -> list[float]:
    """DoRA-style init (torch's test_reset_sharded_param_in_lazy_init): built on meta, sharded,
    materialised, and a parameter of the root computed from the sharded weights and assigned."""
    api = fsdp_api(impl)
    with torch.device("meta"):
        model = WeightNorm()
    for module in (model.layer1, model.layer2, model):
        api.fully_shard(module)
    model.layer1.to_empty(device="cpu")
    model.layer2.to_empty(device="cpu")
    torch.manual_seed(0)
    for layer in (model.layer1, model.layer2):
        layer.reset_parameters()
    with torch.no_grad():
        norm = sum(torch.linalg.norm(layer.weight, dim=1) for layer in (model.layer1, model.layer2))
    model.weight_norm = nn.Parameter(norm)
    plain = WeightNorm()
    plain.load_state_dict({k: v.full_tensor() for k, v in model.state_dict().items()})
    x = torch.randn(3, 3, generator=torch.Generator().manual_seed(1))
    out, expected = model(x), plain(x)
    out.backward()
    expected.backward()
    torch.testing.assert_close(out, expected)
    for (name, p), (_, r) in zip(model.named_parameters(), plain.named_parameters(), strict=True):
        assert isinstance(p.grad, DTensor), name
        torch.testing.assert_close(p.grad.full_tensor(), r.grad, msg=name)
    return [out.item()]


@impls
def test_parameter_assigned_after_meta_init(impl: str) -> None:
    run_on_ranks(2, _meta_init_then_assign, impl)


# ---------------------------------------------------------------------------------------------
# dtype changed after training started
# ---------------------------------------------------------------------------------------------

# Tolerances for the low-precision runs: the two runs differ only in where rounding happens
# (sums split over ranks, the reduce-scatter's own rounding). Allow about ten roundings of the
# dtype's unit roundoff u (2^-11 for float16, 2^-8 for bfloat16) relative to the values, and
# absolute ones of the same relative size on the values' scale (~0.1: weights of an 8- or
# 16-wide Linear, and their gradients). The SGD steps below (lr 0.5) move parameters by
# ~1e-2, above those tolerances: a skipped or stale update still fails.
CASTS: dict[str, tuple[Callable[[nn.Module], object], torch.dtype, float]] = {
    "float64": (lambda m: m.to(torch.float64), torch.float64, 2**-53),
    "half": (lambda m: m.half(), torch.float16, 2**-11),
    "bfloat16": (lambda m: m.to(torch.bfloat16), torch.bfloat16, 2**-8),
}


def _cast_after_training(impl: str, cast: str) -> None:
    apply, dtype, unit = CASTS[cast]
    atol = max(unit, FP32_ATOL)
    low = Tolerance(rtol=max(10 * unit, FP32_RTOL), atol=atol, param_atol=atol)
    model, ref = twins("mlp")
    shard_model(model, "mlp", impl)
    _train(model, ref, range(2))  # gathered and reduced in float32 first
    for m in (model, ref):
        apply(m)
    for name, param in model.named_parameters():
        assert param.dtype == dtype and isinstance(param, DTensor), name
    sgds = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, ref)]
    for step in range(2, 5):
        _step(model, ref, step, low, input_dtype=dtype)
        for name, param in model.named_parameters():
            assert param.grad is not None and param.grad.dtype == dtype, name
        for sgd in sgds:
            sgd.step()
            sgd.zero_grad()
        _compare_params_and_buffers(model, ref, f"after step {step}", low)


@pytest.mark.parametrize("cast", list(CASTS))
@impls
def test_cast_after_training(impl: str, cast: str) -> None:
    if impl == "torch":
        pytest.skip("torch's fully_shard keeps all-gathering into its first dtype's buffers")
    run_on_ranks(2, _cast_after_training, impl, cast)


# ---------------------------------------------------------------------------------------------
# Conversions that leave some of a group's parameters as they were
# ---------------------------------------------------------------------------------------------
# ``module.to(...)`` hands back the very same tensor where there is nothing to convert: a bias
# under ``memory_format=torch.channels_last``, a parameter already of the target dtype. The group
# then holds replaced and untouched parameters side by side; both are good values.


class _ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(c, 6, 3, padding=1), nn.ReLU()) for c in (3, 6)
        )
        self.head = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return F.mse_loss(self.head(x.mean((2, 3))), y)


class _HalfDouble(nn.Module):
    """A float32 linear layer and a float64 gain: ``.double()`` converts only the first."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.gain = nn.Parameter(torch.rand(6, dtype=torch.float64) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x.to(self.lin.weight.dtype))) * self.gain


class _HalfDoubleNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_HalfDouble() for _ in range(2))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return F.mse_loss(x, y.to(x.dtype))


def _images(gen: torch.Generator, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(rows, 3, 5, 5, generator=gen), torch.randn(rows, 4, generator=gen)


CONVERSIONS = {
    # name: (model, batch of `rows` rows from `gen`, conversion, when it is applied)
    "channels_last_before_sharding": (
        _ConvNet,
        _images,
        lambda m: m.to(memory_format=torch.channels_last),
        "before",
    ),
    "channels_last_after_sharding": (
        _ConvNet,
        _images,
        lambda m: m.to(memory_format=torch.channels_last),
        "after",
    ),
    # QLoRA: a frozen int8 base weight stays int8 (.double() converts floating tensors only).
    "double_with_an_int8_base": (
        lambda: mixed.Net([mixed.LoRALinear(torch.int8) for _ in range(2)]),
        mixed.make_batch,
        lambda m: m.double(),
        "after",
    ),
    "double_with_a_double_already": (
        _HalfDoubleNet,
        lambda gen, rows: (
            torch.randn(rows, 6, generator=gen),
            torch.randn(rows, 6, generator=gen),
        ),
        lambda m: m.double(),
        "after",
    ),
}


def _convert_partly(name: str) -> None:
    build, make_batch_of, convert, when = CONVERSIONS[name]
    api = fsdp_api("fsdp2")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, ref = twins(build)
    if when == "before":
        model, ref = convert(model), convert(ref)
    for block in model.blocks:
        api.fully_shard(block)
    api.fully_shard(model)
    # Built before the conversion: it must still step the parameters the model computes with.
    sgds = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref)]
    params = list(model.parameters())
    for step in range(4):
        if step == 1 and when == "after":
            assert convert(model) is model and convert(ref) is ref
            assert list(model.parameters()) == params, "the optimizer's parameters were replaced"
        x, y = global_batch(make_batch_of, step, 0, GLOBAL_BATCH)
        if "channels_last" in name:
            x = x.to(memory_format=torch.channels_last)
        loss = model(*rank_rows((x, y), rank, world))
        loss.backward()
        loss = loss.detach().clone()
        dist.all_reduce(loss)
        ref_loss = ref(x, y)
        ref_loss.backward()
        close(f"step {step} loss", loss / world, ref_loss.detach())
        num_grads = compare_grads(model, ref, f"step {step}", check_layout=True)
        assert num_grads == sum(p.requires_grad for p in params)
        for sgd in sgds:
            sgd.step()
            sgd.zero_grad()
        _compare_params_and_buffers(model, ref, f"after step {step}", SGD_FP32)
    for pname, param in model.named_parameters():
        # fsdp2 keeps shards contiguous, whatever layout the parameter had.
        assert isinstance(param, DTensor) and param.to_local().is_contiguous(), pname
        assert param.stride() == torch.empty(param.shape, device="meta").stride(), pname
        assert param.dtype == dict(ref.named_parameters())[pname].dtype, pname


@pytest.mark.parametrize("name", list(CONVERSIONS))
def test_conversion_leaving_some_parameters_as_they_were(name: str, fsdp2_only: None) -> None:
    # torch's fully_shard refuses channels_last parameters ("does not support non-contiguous
    # parameters"), fails in .to(memory_format=) after sharding, and keeps gathering into its
    # first dtype's buffers after .double().
    run_on_ranks(2, _convert_partly, name)


# ---------------------------------------------------------------------------------------------
# Errors: changes fsdp2 cannot follow, raised on every rank
# ---------------------------------------------------------------------------------------------


def _forward_error(model: nn.Module, change: Callable[[nn.Module], None]) -> str:
    change(model)
    batch = make_batch("mlp", 0, 2)
    return error_text(lambda: model(*batch).backward())


def _error_messages() -> dict[str, str]:
    def new(model: nn.Module, name: str, placements: object = None) -> nn.Parameter:
        old = model.get_parameter(name)
        full = torch.zeros(old.shape)
        return nn.Parameter(distribute_tensor(full, old.device_mesh, placements or old.placements))

    cases: dict[str, Callable[[nn.Module], None]] = {
        "plain tensor": lambda m: setattr(m.layers[6], "weight", nn.Parameter(torch.zeros(4, 16))),
        "replicated": lambda m: setattr(
            m.layers[6], "weight", new(m, "layers.6.weight", [Replicate()])
        ),
        "tied after": lambda m: setattr(m.layers[4], "weight", m.layers[2].weight),
        "removed": lambda m: delattr(m.layers[6], "weight"),
        # layers.0 has a fully_shard call of its own: still named from the root
        "in a block": lambda m: setattr(
            m.layers[0], "weight", nn.Parameter(torch.zeros(m.layers[0].weight.shape))
        ),
    }
    messages = {name: _forward_error(_chain("fsdp2")[0], case) for name, case in cases.items()}

    # In the middle of an iteration: the root (reshard_after_forward=False) holds its gathered
    # parameters from forward to the end of backward.
    model = _chain("fsdp2", reshard_after_forward=False)[0]
    replacement = new(model, "layers.6.weight")
    loss = model(*make_batch("mlp", 0, 2))
    model.layers[6].weight = replacement
    messages["mid-iteration"] = error_text(loss.backward)

    torch.manual_seed(0)
    tied = Chain()
    tied.layers[4].weight = tied.layers[2].weight
    fsdp_api("fsdp2").fully_shard(tied)
    messages["tie partly replaced"] = _forward_error(
        tied, lambda m: setattr(m.layers[4], "weight", new(m, "layers.4.weight"))
    )
    return messages


@functools.cache
def error_messages() -> dict[str, str]:
    results = run_on_ranks(2, _error_messages)
    assert all(r == results[0] for r in results), results  # every rank raises alike
    return results[0]


@pytest.mark.skipif(IMPL_UNDER_TEST != "fsdp2", reason="pins fsdp2's messages")
class TestErrorMessages(expecttest.TestCase):
    def test_assigned_parameter_must_be_laid_out_like_the_old(self) -> None:
        msgs = error_messages()
        self.assertExpectedInline(
            msgs["plain tensor"],
            """ValueError: layers.6.weight was replaced after fully_shard by a plain Parameter; fsdp2 can adopt a parameter laid out like the one it replaces: a DTensor of shape (4, 16) over DeviceMesh((2,), 'cpu', stride=(1,)) as (Shard(dim=0),) on cpu. Build it as nn.Parameter(distribute_tensor(full, old.device_mesh, old.placements)), or copy into the old one in place (with torch.no_grad(): old.copy_(new))""",
        )
        self.assertExpectedInline(
            msgs["replicated"],
            """ValueError: layers.6.weight was replaced after fully_shard by a DTensor of shape (4, 16) over DeviceMesh((2,), 'cpu', stride=(1,)) as (Replicate(),) on cpu; fsdp2 can adopt a parameter laid out like the one it replaces: a DTensor of shape (4, 16) over DeviceMesh((2,), 'cpu', stride=(1,)) as (Shard(dim=0),) on cpu. Build it as nn.Parameter(distribute_tensor(full, old.device_mesh, old.placements)), or copy into the old one in place (with torch.no_grad(): old.copy_(new))""",
        )

    def test_tied_after_fully_shard(self) -> None:
        msgs = error_messages()
        self.assertExpectedInline(
            msgs["tied after"],
            """ValueError: layers.4.weight was assigned a parameter that fsdp2 already manages under another name: weights tied after fully_shard cannot be followed. Tie them before fully_shard, and shard the modules sharing one in one call, e.g. fully_shard([embedding, lm_head])""",
        )
        self.assertExpectedInline(
            msgs["tie partly replaced"],
            """ValueError: layers.2.weight is one parameter shared by 2 modules (tied weights), and only some of them were assigned a new one. Assign the same parameter to all of them (tie or untie weights before fully_shard)""",
        )

    def test_named_from_the_root(self) -> None:
        self.assertExpectedInline(
            error_messages()["in a block"],
            """ValueError: layers.0.weight was replaced after fully_shard by a plain Parameter; fsdp2 can adopt a parameter laid out like the one it replaces: a DTensor of shape (16, 8) over DeviceMesh((2,), 'cpu', stride=(1,)) as (Shard(dim=0),) on cpu. Build it as nn.Parameter(distribute_tensor(full, old.device_mesh, old.placements)), or copy into the old one in place (with torch.no_grad(): old.copy_(new))""",
        )

    def test_removed(self) -> None:
        self.assertExpectedInline(
            error_messages()["removed"],
            """ValueError: layers.6.weight was removed from its module (Linear) after fully_shard (as torch.nn.utils.parametrize and weight_norm do); fsdp2 cannot follow a parameter that moved. Apply them before fully_shard""",
        )

    def test_replaced_mid_iteration(self) -> None:
        self.assertExpectedInline(
            error_messages()["mid-iteration"],
            """RuntimeError: layers.6.weight was replaced (or removed) on its module in the middle of an iteration (after its forward began, or while unshard() kept it gathered); fsdp2 adopts a new parameter only when a forward starts with the module resharded. Assign parameters between iterations""",
        )


def _replaced_parameters_traced(compiled: bool) -> None:
    """Traced mode (``set_traced``) follows assigned parameters too: eagerly it adopts them as
    the hooks do; inside a compiled region (here layers.0, whose forward runs within the
    compiled root) it gathers from whatever parameter the module holds."""
    from fsdp2.engine.traced import set_traced

    model, ref = _chain("fsdp2")
    set_traced(model)
    if compiled:
        model.compile(backend="aot_eager")
    gen = torch.Generator().manual_seed(7)
    _train(model, ref, range(2))
    _assign(model, ref, "layers.0.weight", torch.randn(MLP_DIM, MLP_IN, generator=gen), True)
    _assign(model, ref, "layers.4.weight", torch.randn(MLP_DIM, MLP_DIM, generator=gen), True)
    _train(model, ref, range(2, 4))
    _compare_params_and_buffers(model, ref, "after training", FP32)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_parameters_assigned_in_traced_mode(compiled: bool, fsdp2_only: None) -> None:
    run_on_ranks(2, _replaced_parameters_traced, compiled)
