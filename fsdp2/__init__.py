"""fsdp2: per-parameter fully sharded data parallelism, a drop-in for ``torch.distributed.fsdp``.

The public surface is this module's ``__all__`` and the :mod:`fsdp2.optim` subpackage's
``__all__``; ``python -m fsdp2.plan`` is the planner's command line. Everything under
``fsdp2.engine``, ``fsdp2.debug`` and ``fsdp2.tools`` is internal and may change without notice:
import the names from here.
"""

from fsdp2.api import (
    FSDPModule,
    GradientReductionHandle,
    UnshardHandle,
    fully_shard,
    register_fsdp_forward_method,
    replicate,
    share_comm_ctx,
)
from fsdp2.debug.checks import CollectiveMismatchError
from fsdp2.debug.hang import CollectiveFailedError, CollectiveTimeoutError
from fsdp2.debug.switches import set_collective_checks
from fsdp2.engine.coalesce import set_coalesce_bytes
from fsdp2.engine.collectives import CollectiveRecord, record_collectives
from fsdp2.engine.comm import AllGather, Comm, LowPrecisionReduceScatter, ReduceScatter
from fsdp2.engine.policies import (
    CPUOffloadPolicy,
    DataParallelMeshDims,
    MixedPrecisionPolicy,
    OffloadPolicy,
)
from fsdp2.engine.steps import consistent_state
from fsdp2.engine.traced import set_traced
from fsdp2.tools.auto import AutoShardResult, auto_shard
from fsdp2.tools.clip import clip_grad_norm_
from fsdp2.tools.full_params import summon_full_params
from fsdp2.tools.full_weights import iter_full_weights
from fsdp2.tools.grad_scaler import ShardedGradScaler
from fsdp2.tools.planner import Plan, plan
from fsdp2.tools.safetensors_export import save_hf_safetensors
from fsdp2.tools.swap import patch_torch_fsdp

__all__ = [
    "AllGather",
    "AutoShardResult",
    "CPUOffloadPolicy",
    "CollectiveFailedError",
    "CollectiveMismatchError",
    "CollectiveRecord",
    "CollectiveTimeoutError",
    "Comm",
    "DataParallelMeshDims",
    "FSDPModule",
    "GradientReductionHandle",
    "LowPrecisionReduceScatter",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "Plan",
    "ReduceScatter",
    "ShardedGradScaler",
    "UnshardHandle",
    "auto_shard",
    "clip_grad_norm_",
    "consistent_state",
    "fully_shard",
    "iter_full_weights",
    "patch_torch_fsdp",
    "plan",
    "record_collectives",
    "register_fsdp_forward_method",
    "replicate",
    "save_hf_safetensors",
    "set_coalesce_bytes",
    "set_collective_checks",
    "set_traced",
    "share_comm_ctx",
    "summon_full_params",
]

for _name in __all__:
    globals()[_name].__module__ = "fsdp2"


def __getattr__(name: str) -> object:
    # The two module paths the README documented before the layout of issue 23
    # (fsdp2.collectives.record_collectives, fsdp2.traced.set_traced): imported on first use,
    # with a DeprecationWarning, so that code written against them keeps running.
    if name in ("collectives", "traced"):
        import importlib

        return importlib.import_module(f"fsdp2.{name}")
    raise AttributeError(f"module 'fsdp2' has no attribute {name!r}")
