"""Putting fsdp2 where a framework looks for torch's FSDP2: ``patch_torch_fsdp()``.

A user's own script switches by changing one import. A framework (torchtitan, accelerate,
Lightning) imports ``fully_shard`` and friends from ``torch.distributed.fsdp`` itself, some at
module load (``from torch.distributed.fsdp import fully_shard``, which copies the object into
the importing module) and some inside functions (which read the attribute when called). So the
swap replaces the names in torch's public modules, for imports still to come, and every
reference to torch's objects in modules already loaded, for imports already made.
``isinstance(m, FSDPModule)`` checks in those modules then test for fsdp2's class.

torch's own implementation (``torch.distributed.fsdp._fully_shard``) is left alone, so it keeps
working for anyone who reaches it directly.
"""

from __future__ import annotations

import importlib
import sys

from fsdp2.api import (
    FSDPModule,
    GradientReductionHandle,
    UnshardHandle,
    fully_shard,
    register_fsdp_forward_method,
    replicate,
    share_comm_ctx,
)
from fsdp2.engine.policies import (
    CPUOffloadPolicy,
    DataParallelMeshDims,
    MixedPrecisionPolicy,
    OffloadPolicy,
)

__all__ = ["TORCH_NAMES", "patch_torch_fsdp", "unpatch_torch_fsdp"]

# fsdp2's objects under the names torch's FSDP2 uses: each replaces the object of that name in
# torch's public modules, where those have one (replicate: where a torch release adds it there).
TORCH_NAMES: dict[str, object] = {
    "CPUOffloadPolicy": CPUOffloadPolicy,
    "DataParallelMeshDims": DataParallelMeshDims,
    "FSDPModule": FSDPModule,
    "GradientReductionHandle": GradientReductionHandle,  # torch 2.15+
    "MixedPrecisionPolicy": MixedPrecisionPolicy,
    "OffloadPolicy": OffloadPolicy,
    "UnshardHandle": UnshardHandle,
    "fully_shard": fully_shard,
    "register_fsdp_forward_method": register_fsdp_forward_method,
    "replicate": replicate,
    "share_comm_ctx": share_comm_ctx,
}

_PUBLIC_MODULES = ("torch.distributed.fsdp", "torch.distributed._composable.fsdp")
_LEFT_ALONE = ("torch.distributed.fsdp._fully_shard", "fsdp2")
# (module, attribute, torch's object) for every reference the swap replaced, oldest first.
_replaced: list[tuple[object, str, object]] = []


def patch_torch_fsdp() -> None:
    """Make ``torch.distributed.fsdp``'s FSDP2 names fsdp2's, everywhere in this process.

    ``fully_shard``, ``FSDPModule``, ``MixedPrecisionPolicy`` and the other names of
    :data:`TORCH_NAMES` are replaced in ``torch.distributed.fsdp`` and
    ``torch.distributed._composable.fsdp`` (for imports still to come) and in every module
    already loaded that holds torch's objects (for ``from torch.distributed.fsdp import ...``
    already run), so a framework that imports torch's FSDP2 itself runs fsdp2. torch's own
    implementation (``torch.distributed.fsdp._fully_shard``) is left alone.

    Call it once, on every rank, before the model is built; calling it again does nothing more.
    Takes no arguments. :func:`unpatch_torch_fsdp` undoes it.
    """
    public = [importlib.import_module(name) for name in _PUBLIC_MODULES]
    # torch's object (by id) -> ours, collected before anything is replaced.
    ours = {
        id(getattr(module, name)): obj
        for module in public
        for name, obj in TORCH_NAMES.items()
        if hasattr(module, name)
    }
    for mod_name, module in list(sys.modules.items()):
        if module is None or mod_name.startswith(_LEFT_ALONE):
            continue
        try:
            attrs = list(vars(module).items())
        except TypeError:  # a stand-in without __dict__ put in sys.modules by some package
            continue
        for attr, value in attrs:
            replacement = ours.get(id(value))
            if replacement is not None and replacement is not value:
                _replaced.append((module, attr, value))
                setattr(module, attr, replacement)


def unpatch_torch_fsdp() -> None:
    """Undo :func:`patch_torch_fsdp`: put torch's objects back wherever it replaced them (for
    tests sharing one process). A module first imported while patched keeps fsdp2's names,
    and modules already sharded stay fsdp2's."""
    while _replaced:
        module, attr, original = _replaced.pop()
        setattr(module, attr, original)
