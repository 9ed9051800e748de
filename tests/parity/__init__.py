"""Parity, the suite's one framework: a sharded model trains exactly like a plain copy trained on
the whole global batch.

Every parity test builds the same pair and data and compares it the same way:

- `build`: the pair (`twins`: one seed, the reference a copy), the data (one formula: the global
  batch of ``(step, micro)`` seeded by `batch_seed`, each rank training on its `rank_rows`),
  the optimizers (`adamw`, `sgd`) and sharding (`shard_model`, with ``impl`` "fsdp2" or
  "torch" to run the same test against torch's ``fully_shard``).
- `compare`: `close` and the `compare_*` functions, with a `tests.tolerance.Tolerance`.
- `run`: `run_parity`, the standard run of a model of `tests.models.MODELS` (also under
  ``torchrun``: ``tests/parity/__main__.py``).
- `lockstep`: `train_side_by_side` for a whole schedule on any data-parallel layout, `Lockstep`
  for tests that step both copies by hand, and collective counters.

Every model here returns the mean loss over its batch, so the mean over ranks of the local
losses is the reference's loss, and averaged gradients are the reference's gradients.
"""

from tests.parity.build import (
    ADAM_EPS,
    GLOBAL_BATCH,
    LOCAL_BATCH,
    LR,
    MODEL_SEED,
    SGD_LR,
    WEIGHT_DECAY,
    MakeBatch,
    PlannedGroup,
    adamw,
    batch_seed,
    fsdp_modules,
    global_batch,
    local_batch,
    plan_groups,
    rank_rows,
    sgd,
    shard_model,
    train_global_batches,
    twins,
)
from tests.parity.compare import (
    Margin,
    check_sharded_layout,
    close,
    compare_buffers,
    compare_grads,
    compare_params,
    expected_local_shape,
    full,
    mean_over_ranks,
    padded_shard_numel,
    params_close_after_adamw,
    step_both,
)
from tests.parity.lockstep import (
    CollectiveCounter,
    Lockstep,
    SideBySide,
    backward_counts,
    cast_forward,
    count,
    kinds,
    labels,
    same_on_all_ranks,
    train_side_by_side,
)
from tests.parity.run import ParityConfig, ParityResult, run_parity

__all__ = [
    "ADAM_EPS",
    "GLOBAL_BATCH",
    "LOCAL_BATCH",
    "LR",
    "MODEL_SEED",
    "SGD_LR",
    "WEIGHT_DECAY",
    "CollectiveCounter",
    "Lockstep",
    "MakeBatch",
    "Margin",
    "ParityConfig",
    "ParityResult",
    "PlannedGroup",
    "SideBySide",
    "adamw",
    "backward_counts",
    "batch_seed",
    "cast_forward",
    "check_sharded_layout",
    "close",
    "compare_buffers",
    "compare_grads",
    "compare_params",
    "count",
    "expected_local_shape",
    "fsdp_modules",
    "full",
    "global_batch",
    "kinds",
    "labels",
    "local_batch",
    "mean_over_ranks",
    "padded_shard_numel",
    "params_close_after_adamw",
    "plan_groups",
    "rank_rows",
    "run_parity",
    "same_on_all_ranks",
    "sgd",
    "shard_model",
    "step_both",
    "train_global_batches",
    "train_side_by_side",
    "twins",
]
