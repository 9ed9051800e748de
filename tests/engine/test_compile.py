"""torch.compile over fsdp2 (docs/compile.md): per-block compile in every order, whole-model
compile over the eager hooks, and traced mode, where the collectives are ops in the graph.

Every test trains a compiled fsdp2 model next to an eager one built from the same seed, on the
same batches, and compares losses, gradient shards and final parameters (`tests.parity.close`
at ``SGD_FP32``); eager fsdp2 itself is held to the unsharded reference by test_parity.py. It
also pins what dynamo did: how many graph breaks, how many graphs, and that nothing compiled
again after the first step.

Most tests compile with ``aot_eager`` (dynamo and AOTAutograd: graph capture, guards, the
forward/backward split, DTensor and functional collectives), which is where fsdp2 meets the
compiler; the ``slow`` tests add inductor's C++ code generation, which costs tens of seconds
the first time on a cold cache. Inductor's kernels add in an order of their own, which is the
fp32 reordering that ``tests.tolerance.FP32_RTOL`` bounds: the ``slow`` tests hold the same
tolerance.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from typing import Any

import expecttest
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

import fsdp2
from fsdp2.engine.traced import set_traced
from tests.errors import raised
from tests.harness import init_local_process_group, run_on_ranks
from tests.models import MODELS, build_model, make_batch
from tests.parity import close
from tests.tolerance import SGD_FP32, Tolerance, assert_fp32_close

pytestmark = pytest.mark.usefixtures("fsdp2_only")

MODEL_SEED, NUM_STEPS, LOCAL_BATCH = 1234, 3, 2
COMPILE_TIMEOUT_S = 300.0  # a cold compile on a loaded 2-core machine
BLOCK_ORDERS = [
    "compile_then_shard",
    "method_then_shard",
    "shard_then_method",
    "shard_then_compile",
]
_c10d = torch.ops._c10d_functional


# -- rank side ----------------------------------------------------------------------------------


def _shard(model: nn.Module, name: str, order: str | None, backend: str, **kwargs: Any) -> None:
    """``fully_shard`` each unit and the root; compile each unit before or after, per ``order``."""
    for i, unit in enumerate(MODELS[name].shard_units(model)):
        if order == "compile_then_shard":  # torchtitan: the wrapper replaces the block
            unit = torch.compile(unit, backend=backend, fullgraph=True)
            model.blocks[i] = unit
            fsdp2.fully_shard(unit, **kwargs)
        elif order == "method_then_shard":
            unit.compile(backend=backend, fullgraph=True)
            fsdp2.fully_shard(unit, **kwargs)
        elif order == "shard_then_method":
            fsdp2.fully_shard(unit, **kwargs)
            unit.compile(backend=backend, fullgraph=True)
        elif order == "shard_then_compile":  # dynamo meets the hooks: no fullgraph (see docs)
            fsdp2.fully_shard(unit, **kwargs)
            model.blocks[i] = torch.compile(unit, backend=backend)
        else:
            fsdp2.fully_shard(unit, **kwargs)
    fsdp2.fully_shard(model, **kwargs)


def _set_divide_factor(model: nn.Module, factor: float | None) -> None:
    for module in model.modules():
        if factor is not None and isinstance(module, fsdp2.FSDPModule):
            module.set_gradient_divide_factor(factor)


def _fqn(name: str) -> str:
    return name.replace("_orig_mod.", "")  # a torch.compile wrapper's prefix


class _Trainer:
    """One model and its optimizer; ``step`` returns the loss and this rank's gradient shards."""

    def __init__(self, model: nn.Module, name: str, run: Callable[..., torch.Tensor]) -> None:
        self.model, self.name, self.run = model, name, run
        # Plain SGD: a zero gradient and no gradient move a parameter alike (see _close).
        self.opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(self, step: int) -> tuple[float, dict[str, torch.Tensor | None]]:
        spec = MODELS[self.name]
        if spec.prepare_step is not None:
            spec.prepare_step(self.model, step)
        batch = make_batch(self.name, 100 * step + dist.get_rank(), LOCAL_BATCH)
        loss = self.run(*batch)
        loss.backward()
        grads = {
            _fqn(n): None if p.grad is None else p.grad.to_local().clone()
            for n, p in self.model.named_parameters()
        }
        self.opt.step()
        self.opt.zero_grad()
        return loss.item(), grads


def _close(
    what: str,
    actual: torch.Tensor | None,
    expected: torch.Tensor | None,
    tol: Tolerance,
    traced: bool,
) -> None:
    if traced and expected is None and actual is not None and not actual.any():
        return  # traced mode: a group that ran gives its unused parameters zero gradients
    if actual is None or expected is None:
        if actual is not expected:
            raise AssertionError(f"{what}: one run has no gradient (rank {dist.get_rank()})")
        return
    close(what, actual, expected, tol)


def _train_side_by_side(
    name: str,
    compiled: _Trainer,
    tol: Tolerance,
    traced: bool = False,
    divide_factor: float | None = None,
    **shard_kwargs: Any,
) -> dict[str, Any]:
    """Train ``compiled`` and an eager fsdp2 copy (sharded with ``shard_kwargs``) in lockstep;
    compare (``tol`` for losses and gradients, ``tol.for_params()`` for the parameters after
    training); report dynamo's work."""
    eager_model = build_model(name, MODEL_SEED)
    _shard(eager_model, name, None, "", **shard_kwargs)
    _set_divide_factor(eager_model, divide_factor)
    eager = _Trainer(eager_model, name, eager_model)
    counters = _dynamo_counters()
    seen: list[tuple[int, int]] = []
    for step in range(NUM_STEPS):
        loss, grads = compiled.step(step)
        ref_loss, ref_grads = eager.step(step)
        _close(f"loss at step {step}", torch.tensor(loss), torch.tensor(ref_loss), tol, traced)
        if grads.keys() != ref_grads.keys():
            raise AssertionError(f"parameter names differ: {sorted(grads)} vs {sorted(ref_grads)}")
        for fqn, grad in grads.items():
            _close(f"grad of {fqn} at step {step}", grad, ref_grads[fqn], tol, traced)
        seen.append((counters["stats"]["unique_graphs"], counters["frames"]["total"]))
    ref_params = dict(eager_model.named_parameters())
    for fqn, param in compiled.model.named_parameters():
        expected = ref_params[_fqn(fqn)].to_local()
        _close(f"{fqn} after training", param.to_local(), expected, tol.for_params(), traced)
    return {
        "graphs": seen[0][0],
        "recompiled_after_first_step": seen[-1] != seen[0],
        "graph_breaks": sum(counters["graph_break"].values()),
        "break_sites": sorted({_break_site(reason) for reason in counters["graph_break"]}),
    }


def _break_site(reason: str) -> str:
    """The fsdp2 hook a graph break happened at, or the reason's first line."""
    for hook in ("FSDPState.pre_forward", "FSDPState.post_forward"):
        if hook in reason:
            return hook
    return reason.splitlines()[0]


def _dynamo_counters() -> Any:
    # Imported here, not at the top: importing dynamo costs every pytest run a second.
    from torch._dynamo.utils import counters

    return counters


def _fresh_dynamo() -> None:
    torch._dynamo.reset()  # rank processes outlive tests: no cache or counter carries over
    _dynamo_counters().clear()


def _compile_blocks(order: str, backend: str, name: str) -> dict[str, Any]:
    _fresh_dynamo()
    model = build_model(name, MODEL_SEED)
    _shard(model, name, order, backend)
    return _train_side_by_side(name, _Trainer(model, name, model), SGD_FP32)


def _compile_whole(name: str) -> dict[str, Any]:
    _fresh_dynamo()
    model = build_model(name, MODEL_SEED)
    _shard(model, name, None, "")
    compiled = torch.compile(model, backend="aot_eager")
    return _train_side_by_side(name, _Trainer(model, name, compiled), SGD_FP32)


def _collective_counts(gm: torch.fx.GraphModule) -> tuple[int, int]:
    """(all-gathers, reduce-scatters) among a captured graph's ops."""
    ops = Counter(node.target for node in gm.graph.nodes if node.op == "call_function")
    return ops[_c10d.all_gather_into_tensor.default], ops[_c10d.reduce_scatter_tensor.default]


def _traced(
    name: str,
    reshard_after_forward: bool | None,
    use_compile: bool,
    shard_last_dim: bool = False,
    divide_factor: float | None = None,
    mixed_precision: bool = False,
    hsdp: bool = False,
) -> dict[str, Any]:
    """Traced mode, compiled with ``fullgraph=True`` (or run eagerly): parity, and the
    collectives that the forward and backward graphs hold."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    _fresh_dynamo()
    model = build_model(name, MODEL_SEED)
    kwargs: dict[str, Any] = {"reshard_after_forward": reshard_after_forward}
    if shard_last_dim:
        kwargs["shard_placement_fn"] = lambda param: Shard(param.dim() - 1)
    if hsdp:  # 2 replicas x 2 shards: reduce-scatter, then all-reduce across replicas
        kwargs["mesh"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    if mixed_precision:  # bf16 gathers, inputs and compute; fp32 reduction
        kwargs["mp_policy"] = fsdp2.MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    _shard(model, name, None, "", **kwargs)
    _set_divide_factor(model, divide_factor)
    set_traced(model)
    graphs: list[tuple[str, int, int]] = []

    gathered_dtypes: set[str] = set()
    saved_shapes: set[tuple[int, ...]] = set()  # the forward graph's outputs: loss + saved

    all_reduces: list[int] = []

    def capture(kind: str, gm: torch.fx.GraphModule, inputs: Any) -> Callable[..., Any]:
        graphs.append((kind, *_collective_counts(gm)))
        all_reduces.append(sum(node.target == _c10d.all_reduce.default for node in gm.graph.nodes))
        for node in gm.graph.nodes:
            if node.target == _c10d.all_gather_into_tensor.default:
                gathered_dtypes.add(str(node.meta["val"].dtype))
            if kind == "forward" and node.op == "output":
                for value in node.args[0]:
                    if isinstance(value, torch.fx.Node) and "val" in value.meta:
                        saved_shapes.add(tuple(value.meta["val"].shape))
        return make_boxed_func(gm.forward)

    run: Callable[..., torch.Tensor] = model
    if use_compile:
        # Inductor's partitioner: it recomputes views of the gathered parameters (e.g. a
        # Linear's transposed weight) rather than saving them, which is what lets a group
        # reshard after forward (docs/compile.md).
        backend = aot_autograd(
            fw_compiler=functools.partial(capture, "forward"),
            bw_compiler=functools.partial(capture, "backward"),
            partition_fn=min_cut_rematerialization_partition,
        )
        run = torch.compile(model, backend=backend, fullgraph=True)
    trainer = _Trainer(model, name, run)
    report = _train_side_by_side(
        name, trainer, SGD_FP32, traced=True, divide_factor=divide_factor, **kwargs
    )
    report["collectives"] = graphs  # (graph, all-gathers, reduce-scatters), in compile order
    report["gathered_dtypes"] = sorted(gathered_dtypes)
    report["saved_shapes"] = sorted(saved_shapes)
    report["all_reduces"] = all_reduces
    return report


def _traced_inductor(name: str) -> dict[str, Any]:
    """Traced mode through inductor: the generated code of forward and backward, and parity."""
    from torch._inductor.utils import run_and_get_code

    _fresh_dynamo()
    model = build_model(name, MODEL_SEED)
    _shard(model, name, None, "")
    set_traced(model)
    trainer = _Trainer(model, name, torch.compile(model, fullgraph=True))
    codes: list[str] = []
    step = trainer.step

    def step_capturing_code(i: int) -> tuple[float, dict[str, torch.Tensor | None]]:
        if i:
            return step(i)
        result, code = run_and_get_code(step, i)  # backward compiles lazily, inside step 0
        codes.extend(code)
        return result

    trainer.step = step_capturing_code  # type: ignore[method-assign]
    report = _train_side_by_side(name, trainer, SGD_FP32, traced=True)
    report["all_gather_in_code"] = ["all_gather_into_tensor" in code for code in codes]
    report["reduce_scatter_in_code"] = ["reduce_scatter_tensor" in code for code in codes]
    return report


# -- tests --------------------------------------------------------------------------------------


@pytest.mark.parametrize("order", BLOCK_ORDERS)
def test_compile_blocks(order: str) -> None:
    """Each GPT block compiled, before or after ``fully_shard``; the hooks stay eager. Only the
    ``torch.compile`` wrapper applied after ``fully_shard`` lets dynamo meet the hooks: it breaks
    its graph once at ``pre_forward`` and once at ``post_forward``."""
    expected_breaks = 2 if order == "shard_then_compile" else 0
    for report in run_on_ranks(
        2, _compile_blocks, order, "aot_eager", "gpt", timeout=COMPILE_TIMEOUT_S
    ):
        assert report["graph_breaks"] == expected_breaks, report
        assert report["graphs"] == 1, report  # both blocks share one graph
        assert not report["recompiled_after_first_step"], report
        if expected_breaks:
            assert report["break_sites"] == ["FSDPState.post_forward", "FSDPState.pre_forward"]


def test_compile_whole_model() -> None:
    """``torch.compile(model)`` over the eager hooks: every break is at a hook. The blocks'
    bodies compile (one graph, shared); the root's forward runs eagerly, because its loop over the
    blocks holds a break, and dynamo gives up on a frame whose loop breaks."""
    for report in run_on_ranks(2, _compile_whole, "gpt", timeout=COMPILE_TIMEOUT_S):
        assert report["break_sites"] == ["FSDPState.post_forward", "FSDPState.pre_forward"]
        assert report["graph_breaks"] == 5, report
        assert report["graphs"] == 1, report
        assert not report["recompiled_after_first_step"], report


@pytest.mark.parametrize(
    ("name", "reshard_after_forward", "expected"),
    [
        # Root (wte, wpe, ln_f, tied lm_head) keeps its parameters; both blocks reshard, so the
        # backward graph gathers them again.
        ("gpt", None, [("forward", 3, 0), ("backward", 2, 3)]),
        # Blocks 1 and 2 gather again for their input gradients; block 0 needs no weight in
        # backward (its input needs no gradient), so it is not gathered there.
        ("mlp", None, [("forward", 4, 0), ("backward", 2, 4)]),
        ("mlp", False, [("forward", 4, 0), ("backward", 0, 4)]),
        # A 0-d parameter rides in its group's gather and reduce-scatter (replicated).
        ("odd_shapes_scalar", None, [("forward", 3, 0), ("backward", 2, 3)]),
    ],
)
def test_traced_fullgraph(
    name: str, reshard_after_forward: bool | None, expected: list[tuple[str, int, int]]
) -> None:
    """Traced mode: one graph for the whole forward, one all-gather per group in it, one
    reduce-scatter per group in the backward graph; training matches the eager hooks."""
    for report in run_on_ranks(
        2, _traced, name, reshard_after_forward, True, timeout=COMPILE_TIMEOUT_S
    ):
        assert report["collectives"] == expected, report
        assert report["graph_breaks"] == 0, report
        assert report["graphs"] == 1, report
        assert not report["recompiled_after_first_step"], report
        if name == "mlp":  # blocks 1 and 2 hold 16x16 weights: saved only if not resharded
            assert ((16, 16) in report["saved_shapes"]) == (reshard_after_forward is False)


@pytest.mark.parametrize(
    "name", ["odd_shapes", "odd_shapes_scalar", "frozen", "unused", "buffers", "no_own_params"]
)
def test_traced_eager(name: str) -> None:
    """Traced mode without compiling: the same functional collectives run eagerly, and uneven
    shards, a 0-d parameter, frozen and unused parameters, buffers and empty groups train as
    with the hooks."""
    run_on_ranks(2, _traced, name, None, False)


def test_traced_eager_shard_last_dim() -> None:
    """``shard_placement_fn`` picks the last dim (uneven over 2 ranks for these shapes)."""
    run_on_ranks(2, _traced, "odd_shapes", None, False, shard_last_dim=True)


def test_traced_eager_divide_factor() -> None:
    """``set_gradient_divide_factor(1.0)``: summed gradients instead of the mean."""
    run_on_ranks(2, _traced, "mlp", None, False, divide_factor=1.0)


def test_traced_eager_mixed_precision() -> None:
    """bf16 parameters and inputs, fp32 reduction: the same numbers as the hooks, which cast
    once per group before the gather and reduce in fp32."""
    run_on_ranks(2, _traced, "mlp", None, False, mixed_precision=True)


def test_traced_hsdp() -> None:
    """HSDP on a 2x2 mesh: one gather over the shard ranks per group in the forward graph; in
    the backward graph one reduce-scatter and one all-reduce across replicas per group."""
    for report in run_on_ranks(4, _traced, "gpt", None, True, hsdp=True, timeout=COMPILE_TIMEOUT_S):
        assert report["collectives"] == [("forward", 3, 0), ("backward", 2, 3)], report
        assert report["all_reduces"] == [0, 3], report
        assert report["graph_breaks"] == 0, report


def test_traced_fullgraph_mixed_precision() -> None:
    """The casts compile into the same single graph; its gathers move bf16."""
    for report in run_on_ranks(
        2, _traced, "gpt", None, True, mixed_precision=True, timeout=COMPILE_TIMEOUT_S
    ):
        assert report["collectives"] == [("forward", 3, 0), ("backward", 2, 3)], report
        assert report["gathered_dtypes"] == ["torch.bfloat16"], report
        assert report["graph_breaks"] == 0, report


@pytest.mark.slow
def test_compile_blocks_inductor() -> None:
    """Inductor-compiled blocks: its backward reads the parameters that the hooks freed after
    forward and gathered again before backward."""
    for report in run_on_ranks(
        2, _compile_blocks, "compile_then_shard", "inductor", "mlp", timeout=COMPILE_TIMEOUT_S
    ):
        assert report["graph_breaks"] == 0, report
        assert report["graphs"] == 2, report  # block 0 maps 8 -> 16 features, the others 16 -> 16
        assert not report["recompiled_after_first_step"], report


@pytest.mark.slow
def test_traced_inductor() -> None:
    """Inductor lowers the traced collectives: the generated forward gathers, the generated
    backward reduce-scatters, and training matches the eager hooks."""
    for report in run_on_ranks(2, _traced_inductor, "mlp", timeout=COMPILE_TIMEOUT_S):
        assert report["all_gather_in_code"] == [True, True], report
        assert report["reduce_scatter_in_code"] == [False, True], report
        assert report["graph_breaks"] == 0, report
        assert not report["recompiled_after_first_step"], report


def _memory_mode_refused(mode: str) -> str:
    """What ``set_traced`` says of a model sharded with ``mode`` (hfsdp: a 2 x 2 mesh)."""
    kwargs: dict[str, Any] = {"memory_mode": mode}
    if mode == "hfsdp":
        kwargs["mesh"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = build_model("mlp", MODEL_SEED)
    _shard(model, "mlp", None, "", **kwargs)
    return raised(lambda: set_traced(model))


@pytest.mark.parametrize("mode, world", [("zero2", 2), ("hfsdp", 4)])
def test_memory_modes_are_refused_by_name_on_every_rank(mode: str, world: int) -> None:
    """Traced mode gathers inside the graph at every forward: zero2's copy kept between steps
    and hfsdp's two-level gather would be silently dropped, so ``set_traced`` refuses them."""
    for rank, said in enumerate(run_on_ranks(world, _memory_mode_refused, mode)):
        assert f"traced mode does not support memory_mode='{mode}'" in said, (rank, said)


class TestTracedInProcess(expecttest.TestCase):
    """One rank, in the test process: switching modes, and the errors (pinned)."""

    @classmethod
    def setUpClass(cls) -> None:
        init_local_process_group()

    def test_switch_back_to_hooks(self) -> None:
        model = build_model("mlp", MODEL_SEED)
        _shard(model, "mlp", None, "")
        batch = make_batch("mlp", 0, LOCAL_BATCH)
        grads = []
        for traced in (True, False):
            set_traced(model, traced)
            model(*batch).backward()
            grads.append([p.grad.to_local().clone() for p in model.parameters()])
            model.zero_grad()
        for traced_grad, hooked_grad in zip(*grads, strict=True):
            assert_fp32_close(traced_grad, hooked_grad)

    def test_unsupported_feature(self) -> None:
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        fsdp2.fully_shard(model[0], offload_policy=fsdp2.CPUOffloadPolicy())
        fsdp2.fully_shard(model)
        with self.assertRaises(NotImplementedError) as caught:
            set_traced(model)
        self.assertExpectedInline(
            str(caught.exception),
            """fsdp2 traced mode does not support CPU offload, found in the fully_shard call on 0 (FSDPLinear); keep the eager hooks for this model and compile each block instead (see docs/compile.md)""",
        )

    def test_unsupported_mixed_dtypes(self) -> None:
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        model[0].requires_grad_(False).to(torch.bfloat16)
        fsdp2.fully_shard(model)
        with self.assertRaises(NotImplementedError) as caught:
            set_traced(model)
        self.assertExpectedInline(
            str(caught.exception),
            """fsdp2 traced mode does not support parameters of several dtypes in one group, found in the fully_shard call on <root> (FSDPSequential); keep the eager hooks for this model and compile each block instead (see docs/compile.md)""",
        )

    def test_unsupported_feature_set_later(self) -> None:
        model = build_model("mlp", MODEL_SEED)
        _shard(model, "mlp", None, "")
        set_traced(model)
        model.blocks[1].set_requires_gradient_sync(False)
        with self.assertRaises(NotImplementedError) as caught:
            model(*make_batch("mlp", 0, LOCAL_BATCH))
        self.assertExpectedInline(
            str(caught.exception),
            """fsdp2 traced mode does not support set_requires_gradient_sync(False), set on blocks.1 after set_traced; undo that, or call set_traced(model, False) for the eager hooks""",
        )

    def test_not_sharded(self) -> None:
        with self.assertRaises(ValueError) as caught:
            set_traced(nn.Linear(2, 2))
        self.assertExpectedInline(
            str(caught.exception),
            """set_traced expects a module that fully_shard was applied to (or one holding such modules), got a Linear with none; call fully_shard first""",
        )
