"""fsdp2: per-parameter fully sharded data parallelism, a drop-in for ``torch.distributed.fsdp``."""

from fsdp2.api import (
    FSDPModule,
    UnshardHandle,
    fully_shard,
    register_fsdp_forward_method,
    replicate,
    share_comm_ctx,
)
from fsdp2.debug.checks import CollectiveMismatchError
from fsdp2.debug.hang import CollectiveFailedError, CollectiveTimeoutError
from fsdp2.debug.switches import set_collective_checks
from fsdp2.engine.policies import (
    CPUOffloadPolicy,
    DataParallelMeshDims,
    MixedPrecisionPolicy,
    OffloadPolicy,
)
from fsdp2.tools.auto import AutoShardResult, auto_shard
from fsdp2.tools.full_params import summon_full_params
from fsdp2.tools.grad_scaler import ShardedGradScaler
from fsdp2.tools.planner import Plan, plan
from fsdp2.tools.swap import patch_torch_fsdp

__all__ = [
    "AutoShardResult",
    "CPUOffloadPolicy",
    "CollectiveFailedError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "DataParallelMeshDims",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "Plan",
    "ShardedGradScaler",
    "UnshardHandle",
    "auto_shard",
    "fully_shard",
    "patch_torch_fsdp",
    "plan",
    "register_fsdp_forward_method",
    "replicate",
    "set_collective_checks",
    "share_comm_ctx",
    "summon_full_params",
]

for _name in __all__:
    globals()[_name].__module__ = "fsdp2"
