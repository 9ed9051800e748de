"""Structured forward inputs and outputs: dataclasses (frozen too), namedtuples, dicts, HF-style
``ModelOutput`` (an ``OrderedDict`` that is also a dataclass, with and without the pytree
registration transformers adds), nested containers, and non-tensor leaves next to the tensors.

Each tensor in a sharded module's output needs the pre-backward hook that gathers the module's
parameters again for backward, and each floating-point tensor in its input the mixed-precision
cast. Blocks pass these structures to each other while training next to an unsharded
reference; the casts are compared with torch's own ``fully_shard`` on the same structures.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._pytree import register_pytree_node

from tests.harness import fsdp_api, run_on_ranks
from tests.models import Batch
from tests.parity import Lockstep

DIM, NUM_BLOCKS, NUM_STEPS = 8, 2, 3


@dataclasses.dataclass
class Plain:
    h: torch.Tensor
    note: str = "plain"


@dataclasses.dataclass(frozen=True)
class Frozen:
    h: torch.Tensor
    ids: torch.Tensor | None = None
    depth: int = 0


class Pair(NamedTuple):
    h: torch.Tensor
    mask: torch.Tensor | None


class ModelOutputLike(OrderedDict):  # type: ignore[type-arg]
    """Stand-in for ``transformers.utils.ModelOutput``: a dataclass whose fields that are not
    None are also its items, kept in sync both ways."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if value is not None:
                self[f.name] = value

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, value)
        super().__setattr__(key, value)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.keys() and value is not None:
            super().__setitem__(name, value)
        super().__setattr__(name, value)


@dataclasses.dataclass
class BlockOutput(ModelOutputLike):
    h: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: torch.Tensor | None = None


@dataclasses.dataclass
class RegisteredBlockOutput(ModelOutputLike):
    """Registered with pytree, as transformers registers every ``ModelOutput`` subclass."""

    h: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None


register_pytree_node(
    RegisteredBlockOutput,
    lambda out: (list(out.values()), list(out.keys())),
    lambda values, keys: RegisteredBlockOutput(**dict(zip(keys, values, strict=True))),
)


def wrap(kind: str, h: torch.Tensor) -> Any:
    """``h`` (and tensors derived from it) inside a structure of ``kind``."""
    ids = torch.arange(h.shape[0])
    if kind == "dataclass":
        return Plain(h)
    if kind == "frozen_dataclass":
        return Frozen(h, ids, depth=1)
    if kind == "namedtuple":
        return Pair(h, None)
    if kind == "dict":
        return {"h": h, "ids": ids, "name": "block"}
    if kind == "model_output":
        return BlockOutput(h=h, hidden_states=(h * 2,))
    if kind == "registered_model_output":
        return RegisteredBlockOutput(h=h, hidden_states=(h * 2,))
    if kind == "nested":
        return [{"inner": (Plain(h), 3, None)}, "tail"]
    raise ValueError(kind)


def unwrap(kind: str, obj: Any) -> torch.Tensor:
    if kind in ("dict", "model_output", "registered_model_output"):
        h = obj["h"]
        extra = obj.get("hidden_states")
        return h if extra is None else h + 0.5 * extra[0]  # both tensors feed the loss
    if kind == "nested":
        return obj[0]["inner"][0].h  # type: ignore[no-any-return]
    return obj.h  # type: ignore[no-any-return]


KINDS = [
    "dataclass",
    "frozen_dataclass",
    "namedtuple",
    "dict",
    "model_output",
    "registered_model_output",
    "nested",
]


class Block(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.lin1, self.lin2 = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)

    def forward(self, inp: Any) -> Any:
        # lin2's weight is needed in backward (for the gradient of its input): the block must
        # be gathered again, through the hook on a tensor inside the structure it returns.
        return wrap(self.kind, self.lin2(torch.tanh(self.lin1(unwrap(self.kind, inp)))))


class StructStack(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.inp = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList(Block(kind) for _ in range(NUM_BLOCKS))
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = wrap(self.kind, self.inp(x))
        for block in self.blocks:
            h = block(h)
        return F.mse_loss(self.head(unwrap(self.kind, h)), y)


def _batch(gen: torch.Generator, n: int) -> Batch:
    return torch.randn(n, DIM, generator=gen), torch.randn(n, DIM, generator=gen)


def _train(kind: str, impl: str) -> None:
    fully_shard = fsdp_api(impl).fully_shard
    t = Lockstep(lambda: StructStack(kind), _batch)
    for block in t.model.blocks:  # type: ignore[union-attr]
        fully_shard(block, reshard_after_forward=True)
    fully_shard(t.model)
    t.make_optimizers()
    t.train(NUM_STEPS)


@pytest.mark.parametrize("kind", KINDS)
def test_structured_activations_between_sharded_blocks(kind: str) -> None:
    """Blocks that reshard after forward exchange ``kind`` structures: backward gathers each
    again through the hook on a tensor inside, and training matches the reference."""
    from tests.harness import IMPL_UNDER_TEST

    run_on_ranks(2, _train, kind, IMPL_UNDER_TEST)


# ---------------------------------------------------------------------------------------------
# Mixed-precision casts of structured inputs and outputs
# ---------------------------------------------------------------------------------------------


def _describe(obj: Any) -> Any:
    """The structure with each tensor replaced by its dtype: what a cast must change."""
    if isinstance(obj, torch.Tensor):
        return str(obj.dtype)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = {f.name: _describe(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        items = {k: _describe(v) for k, v in obj.items()} if isinstance(obj, dict) else None
        return (type(obj).__name__, fields, items)
    if isinstance(obj, dict):
        return (type(obj).__name__, {k: _describe(v) for k, v in obj.items()})
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, [_describe(v) for v in obj])
    return obj


class Probe(nn.Module):
    """Records what its forward receives; returns the input structure with ``h`` transformed."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(DIM, DIM)
        self.seen: Any = None

    def forward(self, inp: Any) -> Any:
        self.seen = _describe(inp)
        return wrap(self.kind, self.lin(unwrap(self.kind, inp)))


def _casts(impl: str) -> dict[str, Any]:
    api = fsdp_api(impl)
    policy = api.MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float16)
    found = {}
    for kind in KINDS:
        probe = Probe(kind)
        api.fully_shard(probe, mp_policy=policy)
        out = probe(wrap(kind, torch.randn(4, DIM)))
        found[kind] = {"input": probe.seen, "output": _describe(out)}
    return found


def test_mixed_precision_casts_structures_like_torch(fsdp2_only: None) -> None:
    """Floating tensors inside every structure are cast to ``param_dtype`` on the way in and to
    ``output_dtype`` on the way out, integer tensors and other leaves untouched, and the
    containers keep their types: exactly what torch's ``fully_shard`` does."""
    ours, torchs = run_on_ranks(2, _casts, "fsdp2")[0], run_on_ranks(2, _casts, "torch")[0]
    for kind in KINDS:
        assert ours[kind] == torchs[kind], kind
    assert ours["frozen_dataclass"] == {
        "input": ("Frozen", {"h": "torch.bfloat16", "ids": "torch.int64", "depth": 1}, None),
        "output": ("Frozen", {"h": "torch.float16", "ids": "torch.int64", "depth": 1}, None),
    }
