"""``ShardedGradScaler``: loss scaling whose step-or-skip decision every rank shares.

[Note: found_inf across ranks]
``torch.amp.GradScaler`` looks for inf/NaN in each rank's gradients. For DTensor gradients,
DTensor's handler of that check max-reduces the flag over the mesh of the *first* gradient of
each (device, dtype) bucket, skipping its ``Replicate()`` mesh dims. That is only right when every
gradient in the bucket is laid out like the first. Under fsdp2 it often is not: a 0-d parameter
is ``Replicate()`` (the flag then stays local), and with tensor parallelism the first gradient
may live on the data-parallel mesh while later ones are split over tp as well. An overflow in one
rank's shard then makes that rank skip the step while its peers take it, and the copies that
should stay identical drift apart. This scaler max-reduces the flag over one process group that
spans every rank of the model (default: the world) after the local check: one scalar
all-reduce per ``unscale_``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["ShardedGradScaler"]


class ShardedGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` for sharded models: an inf or NaN in any rank's gradient shard
    makes every rank skip the step and back off the scale. Use it as ``torch.amp.GradScaler``.

    ``device`` defaults to the current accelerator, else ``"cpu"``. ``process_group`` must
    contain every rank holding a piece of the optimizer's parameters (default: the world).
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
            accelerator = torch.accelerator.current_accelerator()
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
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        if not dist.is_initialized():
            return per_device
        # One flag per rank, on the scale's device (the one the collective backend serves).
        flags = [flag.to(found_inf.device) for flag in per_device.values()]
        found = torch.stack(flags).amax() if flags else torch.zeros_like(found_inf)
        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.process_group)
        for flag in per_device.values():
            flag.copy_(found)
        if not per_device:  # no gradient here, but a peer may have found an inf
            per_device[found_inf.device] = found
        return per_device
