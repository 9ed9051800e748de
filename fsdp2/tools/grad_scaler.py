"""``ShardedGradScaler``: loss scaling whose step-or-skip decision every rank shares.

[Note: found_inf across ranks]
``torch.amp.GradScaler`` looks for inf/NaN in each rank's gradients. For DTensor gradients,
DTensor's handler of that check max-reduces the flag over the mesh of the *first* gradient of
each (device, dtype) bucket, skipping its ``Replicate()`` mesh dims. That is only right when every
gradient in the bucket is laid out like the first. Under fsdp2 it often is not: a 0-d parameter
is ``Replicate()`` (the flag then stays local), and with tensor parallelism the first gradient
may live on the data-parallel mesh while later ones are split over tp as well. An overflow in one
rank's shard then makes that rank skip the step while its peers take it, and the copies that
should stay identical drift apart. This scaler checks each rank's local shards itself
(DTensor's handler never runs, nor its per-bucket all-reduces) and max-reduces the flag over one
process group that spans every rank of the model (default: the world): one scalar all-reduce
per ``unscale_``.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fsdp2.debug import checks
from fsdp2.engine import collectives

__all__ = ["ShardedGradScaler"]


class ShardedGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` for sharded models: an inf or NaN in any rank's gradient shard
    makes every rank skip the step and back off the scale. Use it as ``torch.amp.GradScaler``.

    Args:
        device: the device type of the scale (default: the current accelerator, else
            ``"cpu"``).
        init_scale: the initial loss scale.
        growth_factor: the scale is multiplied by it after ``growth_interval`` steps without
            an inf or NaN.
        backoff_factor: the scale is multiplied by it when a step is skipped.
        growth_interval: steps without an inf or NaN before the scale grows.
        enabled: ``False`` makes every method a pass-through, as in ``torch.amp.GradScaler``.
        process_group: must contain every rank holding a piece of the optimizer's parameters
            (default: the world); the skip-or-step decision is max-reduced over it.
    """

    def __init__(
        self,
        device: str | None = None,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        if device is None:
            # check_available: a CUDA build on a machine without a GPU would name cuda, and
            # GradScaler then disables itself; the device the job really runs on is wanted.
            accelerator = torch.accelerator.current_accelerator(check_available=True)
            device = accelerator.type if accelerator is not None else "cpu"
        super().__init__(
            device,
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=enabled,
        )
        self.process_group = process_group

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        # Each rank checks and unscales its own shards (the local tensors), so DTensor's handler
        # never issues its per-bucket all-reduce; the one all-reduce below decides for all.
        buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        for group in optimizer.param_groups:
            for param in group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                if grad.dtype == torch.float16 and not allow_fp16:
                    raise ValueError("Attempting to unscale FP16 gradients.")
                if isinstance(grad, DTensor):
                    grad = grad.to_local()
                elif grad.is_sparse:
                    if grad.dtype == torch.float16:  # summing duplicate indices may overflow
                        param.grad = grad = grad.coalesce()
                    grad = grad._values()
                buckets[(grad.device, grad.dtype)].append(grad)
        flags: dict[torch.device, torch.Tensor] = {}
        inv_scales: dict[torch.device, torch.Tensor] = {}
        with torch.no_grad():
            for (device, _), grads in buckets.items():
                if device not in flags:
                    flags[device] = found_inf.to(device, copy=True)
                    inv_scales[device] = inv_scale.to(device)
                torch._amp_foreach_non_finite_check_and_unscale_(
                    grads, flags[device], inv_scales[device]
                )
        if dist.is_initialized():
            self._agree(flags, found_inf)
        return flags

    def _agree(self, flags: dict[torch.device, torch.Tensor], found_inf: torch.Tensor) -> None:
        """Every rank's flags become the max over ``process_group``: all step, or all skip."""
        # One flag per rank, on the scale's device (the one the collective backend serves).
        mine = [flag.to(found_inf.device) for flag in flags.values()]
        found = torch.stack(mine).amax() if mine else torch.zeros_like(found_inf)
        # Through fsdp2's seam, as every fsdp2 collective: a rank that skipped this step's
        # unscale_ (its data ran out) ends in the hang report, and the opt-in checks see it.
        group = self.process_group or dist.group.WORLD
        if group is None:  # the default group exists: dist.is_initialized()
            raise AssertionError("ShardedGradScaler: no process group, though dist is initialized")
        collectives.all_reduce(found, group, checks.SCALER_LABEL, dist.ReduceOp.MAX).wait()
        for flag in flags.values():
            flag.copy_(found)
        if not flags:  # no gradient here, but a peer may have found an inf
            flags[found_inf.device] = found
