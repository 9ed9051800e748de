"""The public surface as users see it: class names, printed model, containers, error messages.

Runs in the test process on a 1-rank gloo group, so expecttest can rewrite the inline
expectations: regenerate with ``EXPECTTEST_ACCEPT=1 python -m pytest tests/test_api.py``. Every
pinned error message must name the module (or parameter) and say how to fix it.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import unittest
from collections.abc import Callable
from typing import Any

import expecttest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from tests.errors import raised
from tests.harness import IMPL_UNDER_TEST, fsdp_api, init_local_process_group
from tests.models import build_model

api = fsdp_api(IMPL_UNDER_TEST)
fsdp2_only = unittest.skipIf(
    IMPL_UNDER_TEST != "fsdp2", "pins fsdp2's messages; torch's differ (or it accepts the input)"
)


class ClaimsDevice(torch.Tensor):
    """A data-less tensor that reports ``device``: a "GPU parameter" on a machine without one."""

    @staticmethod
    def __new__(cls, shape: torch.Size, device: torch.device) -> ClaimsDevice:
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.float32, device=device)  # type: ignore[attr-defined]

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten.detach.default:  # nn.Parameter() detaches
            return ClaimsDevice(args[0].shape, args[0].device)
        raise NotImplementedError(f"{func} on a data-less tensor")


def small_sequential() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


def _same_default(mine: Any, theirs: Any) -> bool:
    """Equal defaults; a policy dataclass's by torch's fields (fsdp2's may have a field a newer
    torch added, such as 2.15's ``param_dtype_override_fn``, at its own default)."""
    if dataclasses.is_dataclass(theirs) and not isinstance(theirs, type):
        if type(mine).__name__ != type(theirs).__name__:
            return False
        extra = {f.name for f in dataclasses.fields(mine)} - {
            f.name for f in dataclasses.fields(theirs)
        }
        return all(
            repr(getattr(mine, f.name, None)) == repr(getattr(theirs, f.name))
            for f in dataclasses.fields(theirs)
        ) and all(getattr(mine, name) is None for name in extra)
    return repr(mine) == repr(theirs)


def _signature_problems(what: str, theirs: Any, ours: Any) -> list[str]:
    if not callable(theirs) or isinstance(theirs, type):
        theirs = getattr(theirs, "__init__", None) if isinstance(theirs, type) else None
        ours = getattr(ours, "__init__", None)
        if theirs is None or theirs is object.__init__:
            return []  # no constructor of its own: any is a superset
    try:
        want = inspect.signature(theirs).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return []
    have = inspect.signature(ours).parameters
    problems = []
    for i, (pname, param) in enumerate(want.items()):
        mine = have.get(pname)
        if mine is None:
            problems.append(f"{what}: no parameter {pname!r}")
        elif mine.kind != param.kind or not _same_default(mine.default, param.default):
            problems.append(f"{what}({pname}): {mine} where torch has {param}")
        elif param.kind is param.POSITIONAL_OR_KEYWORD and list(have).index(pname) != i:
            problems.append(f"{what}({pname}): at position {list(have).index(pname)}, not {i}")
    for pname, mine in have.items():
        if (
            pname not in want
            and mine.default is mine.empty
            and mine.kind
            in (
                mine.POSITIONAL_OR_KEYWORD,
                mine.KEYWORD_ONLY,
                mine.POSITIONAL_ONLY,
            )
        ):
            problems.append(f"{what}: extra required parameter {pname!r}")
    return problems


class TestAPI(expecttest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        init_local_process_group()

    def assertErrorInline(self, fn: Callable[[], Any], module_name: str, expect: str) -> None:
        """Pin ``fn``'s error, then require it to name the module it is about."""
        message = raised(fn)
        self.assertExpectedInline(message, expect, skip=1)
        self.assertIn(module_name, message, "an error message must name the module concerned")

    def test_public_names(self) -> None:
        expected = {
            "fully_shard",
            "FSDPModule",
            "MixedPrecisionPolicy",
            "OffloadPolicy",
            "CPUOffloadPolicy",
            "UnshardHandle",
            "register_fsdp_forward_method",
        }
        self.assertLessEqual(expected, set(dir(api)))

    def test_signatures_match_torch(self) -> None:
        """Every public name of torch's FSDP2, every public member of its classes, with
        signatures that accept every call torch's accept (same parameter names, kinds and
        defaults; any extra parameter optional)."""
        import torch.distributed.fsdp._fully_shard as torch_fsdp2

        problems = []
        for name in torch_fsdp2.__all__:
            theirs, ours = getattr(torch_fsdp2, name), getattr(api, name, None)
            if ours is None:
                problems.append(f"{name}: missing")
                continue
            problems += _signature_problems(name, theirs, ours)
            if not isinstance(theirs, type):
                continue
            for member in sorted(m for m in dir(theirs) if not m.startswith("_")):
                if not hasattr(ours, member):
                    problems.append(f"{name}.{member}: missing")
                    continue
                problems += _signature_problems(
                    f"{name}.{member}", getattr(theirs, member), getattr(ours, member)
                )
        self.assertEqual(problems, [])

    def test_printed_model(self) -> None:
        model = small_sequential()
        api.fully_shard(model[0])
        api.fully_shard(model[2])
        api.fully_shard(model)
        self.assertExpectedInline(
            repr(model),
            """\
FSDPSequential(
  (0): FSDPLinear(in_features=4, out_features=3, bias=True)
  (1): ReLU()
  (2): FSDPLinear(in_features=3, out_features=2, bias=True)
)""",
        )

    def test_class_swap_keeps_the_original_class(self) -> None:
        model = small_sequential()
        returned = api.fully_shard(model[0])
        self.assertIs(returned, model[0])
        self.assertEqual(type(model[0]).__name__, "FSDPLinear")
        self.assertIsInstance(model[0], api.FSDPModule)
        self.assertIsInstance(model[0], nn.Linear)
        self.assertNotIsInstance(model, api.FSDPModule)
        api.fully_shard(model)
        self.assertIsInstance(model, api.FSDPModule)
        self.assertIsInstance(model, nn.Sequential)
        self.assertNotIsInstance(model[1], api.FSDPModule)
        # One FSDP class per original class, shared by all its instances.
        other = api.fully_shard(nn.Linear(2, 2))
        self.assertIs(type(other), type(model[0]))

    def test_indexing_and_slicing_containers(self) -> None:
        model = small_sequential()
        api.fully_shard(model[0])
        api.fully_shard(model)
        self.assertIsInstance(model[0], api.FSDPModule)
        self.assertIsInstance(model[-1], nn.Linear)
        # Slicing builds a new container: a plain Sequential holding the same modules.
        head = model[:2]
        self.assertIs(type(head), nn.Sequential)
        self.assertIs(head[0], model[0])
        self.assertEqual(len(head), 2)
        self.assertEqual(len(model), 3)
        self.assertEqual([type(m).__name__ for m in model], ["FSDPLinear", "ReLU", "Linear"])

        gpt = build_model("gpt", 0)
        for block in gpt.blocks:
            api.fully_shard(block)
        api.fully_shard(gpt)
        blocks = gpt.blocks
        self.assertIs(type(blocks), nn.ModuleList)
        self.assertEqual(len(blocks), 2)
        self.assertIs(type(blocks[:1]), nn.ModuleList)
        self.assertIs(blocks[:1][0], blocks[0])
        self.assertEqual([type(b).__name__ for b in blocks], ["FSDPGPTBlock", "FSDPGPTBlock"])

    def test_parameter_names_unchanged(self) -> None:
        gpt = build_model("gpt", 0)
        names = [n for n, _ in gpt.named_parameters()]
        all_names = [n for n, _ in gpt.named_parameters(remove_duplicate=False)]
        self.assertIn("lm_head.weight", all_names)  # the tied weight, listed twice
        for block in gpt.blocks:
            api.fully_shard(block)
        api.fully_shard(gpt)
        self.assertEqual([n for n, _ in gpt.named_parameters()], names)
        self.assertEqual([n for n, _ in gpt.named_parameters(remove_duplicate=False)], all_names)
        self.assertEqual(list(gpt.state_dict()), list(build_model("gpt", 0).state_dict()))
        # Still tied after sharding: one parameter object under both names.
        self.assertIs(gpt.lm_head.weight, gpt.wte.weight)

    @fsdp2_only
    def test_error_fully_shard_twice(self) -> None:
        model = small_sequential()
        api.fully_shard(model[0])
        self.assertErrorInline(
            lambda: api.fully_shard(model[0]),
            "Linear",
            """ValueError: fully_shard was already applied to this FSDPLinear; apply it once per module (bottom-up: submodules first, then their parent)""",
        )

    @fsdp2_only
    def test_error_container_without_forward(self) -> None:
        blocks = nn.ModuleList([nn.Linear(2, 2)])
        self.assertErrorInline(
            lambda: api.fully_shard(blocks),
            "ModuleList",
            """ValueError: fully_shard does not take a ModuleList: it has no forward to hook. Apply it to each module inside, or pass them as a list: fully_shard(list(...))""",
        )

    @fsdp2_only
    def test_error_module_dict_without_forward(self) -> None:
        self.assertErrorInline(
            lambda: api.fully_shard(nn.ModuleDict({"a": nn.Linear(2, 2)})),
            "ModuleDict",
            """ValueError: fully_shard does not take a ModuleDict: it has no forward to hook. Apply it to each module inside, or pass them as a list: fully_shard(list(...))""",
        )

    @fsdp2_only
    def test_error_container_subclass_without_forward(self) -> None:
        """A subclass is refused only while its class keeps ``nn.Module.forward`` (one that
        defines ``forward`` trains: tests/engine/test_container_subclasses.py)."""

        class Blocks(nn.ModuleList):
            pass

        self.assertErrorInline(
            lambda: api.fully_shard(Blocks([nn.Linear(2, 2)])),
            "Blocks",
            """ValueError: fully_shard does not take a Blocks: it has no forward to hook. Apply it to each module inside, or pass them as a list: fully_shard(list(...))""",
        )

    @fsdp2_only
    def test_error_3d_mesh_without_dp_mesh_dims(self) -> None:
        mesh = init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("pp", "data", "tp"))
        model = small_sequential()
        self.assertErrorInline(
            lambda: api.fully_shard(model, mesh=mesh),
            "Sequential",
            """ValueError: fully_shard(Sequential) expects a 1-D mesh (FSDP) or a 2-D mesh (HSDP: replicate, shard), got a 3-D mesh of shape (1, 1, 1). Pass its data-parallel slice (mesh[name], name one of ('pp', 'data', 'tp')), or name the data-parallel dims of the full mesh with dp_mesh_dims=DataParallelMeshDims(shard=..., replicate=...)""",
        )

    @fsdp2_only
    def test_error_parameters_on_another_device(self) -> None:
        model = small_sequential()
        model[2].weight = nn.Parameter(ClaimsDevice(model[2].weight.shape, torch.device("cuda", 0)))
        mesh = init_device_mesh("cpu", (1,))
        self.assertErrorInline(
            lambda: api.fully_shard(model, mesh=mesh),
            "Sequential",
            """ValueError: 2.weight of Sequential is on cuda:0, but the mesh's device is cpu. Move the module to cpu (or keep it on CPU: fully_shard moves it) before calling fully_shard, or pass a mesh on the parameters' device""",
        )

    @fsdp2_only
    def test_error_deepcopy(self) -> None:
        model = small_sequential()
        api.fully_shard(model[0])
        api.fully_shard(model)
        self.assertErrorInline(
            lambda: copy.deepcopy(model),
            "Sequential",
            """RuntimeError: cannot deepcopy FSDPSequential: its parameters are shards of a model spread over ranks. Deepcopy the model before calling fully_shard, or build a new one""",
        )

    @fsdp2_only
    def test_error_reshard_after_forward_not_a_divisor(self) -> None:
        model = small_sequential()
        self.assertErrorInline(
            lambda: api.fully_shard(model, reshard_after_forward=3),
            "Sequential",
            """ValueError: fully_shard(Sequential): reshard_after_forward=3 must be a bool, None, or a divisor of the shard world size 1: one of [1] (1 means False)""",
        )


if __name__ == "__main__":
    unittest.main()
