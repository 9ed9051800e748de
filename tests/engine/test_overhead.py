"""Per-forward bookkeeping stays cheap: what runs at every forward call of every sharded module
(finding the inputs' tensors, checking for replaced parameters) must leave no reference cycles
behind, which only the garbage collector frees (it ran ~3 times a step with 96 blocks), and must
agree with pytree on which tensors it finds, in which order."""

from __future__ import annotations

import collections
import dataclasses
import gc
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from fsdp2.engine.tree import tensors_in

Pair = collections.namedtuple("Pair", "a b")


@dataclasses.dataclass
class Holder:
    x: Any
    y: Any = None


def _structures() -> list[Any]:
    t = [torch.tensor(float(i)) for i in range(8)]
    return [
        (t[0], t[1]),
        ((t[0],), {}),
        {"b": t[2], "a": (t[3], [t[4], None, "s", 3])},
        Pair(t[5], {"z": t[6]}),
        collections.OrderedDict(k=t[7], j=t[0]),
        collections.defaultdict(list, {"q": [t[1]]}),
        ([t[0]], {"x": Holder(t[1], [t[2], Pair(t[3], Holder(t[4]))])}),
    ]


def _pytree_tensors(tree: Any) -> list[torch.Tensor]:
    """pytree's leaves, with dataclasses it does not know walked field by field."""
    found = []
    for leaf in tree_flatten(tree, is_leaf=dataclasses.is_dataclass)[0]:
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        elif dataclasses.is_dataclass(leaf):
            for f in dataclasses.fields(leaf):
                found.extend(_pytree_tensors(getattr(leaf, f.name)))
    return found


def test_tensors_in_matches_pytree_order() -> None:
    for tree in _structures():
        got, want = tensors_in(tree), _pytree_tensors(tree)
        assert [id(t) for t in got] == [id(t) for t in want], tree


def test_tensors_in_plain_containers_leave_no_cycles() -> None:
    args = ((torch.ones(2), {"mask": torch.ones(1), "n": 3}), {"labels": [torch.ones(1)]})
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        for _ in range(50):
            tensors_in(args)
        assert gc.collect() == 0  # tree_flatten's recursive closure: 6 objects per call
    finally:
        if was:
            gc.enable()
