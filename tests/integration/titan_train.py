"""One torchtitan 0.3.0 training run on CPU/gloo, launched by torchrun from test_torchtitan.py.

    torchrun --nproc-per-node N titan_train.py IMPL ASSETS DUMP_DIR KEY=VALUE...

IMPL is ``fsdp2`` (torchtitan's FSDP names replaced by fsdp2's) or ``torch`` (torchtitan as
shipped). Rank 0 prints ``LOSS <step> <loss>`` per step with every digit, and ``DONE`` at the end.
Everything here that is not the swap adapts torchtitan's CUDA assumptions to a CPU machine; none
of it touches sharding.
"""

from __future__ import annotations

import sys
import types
from typing import Any, NoReturn

import torch
import torch._utils
import torch.distributed as dist
import torch.nn.functional as F

# torchtitan picks its device at import (`_get_available_device_type() or "cuda"`): say "cpu".
torch._utils._get_available_device_type = lambda: "cpu"  # type: ignore[assignment]


def _stub_gpu_kernels() -> None:
    """torchtitan imports its expert-parallel Triton kernels unconditionally, and Triton is not
    installed on CPU machines: stand in a module whose kernels raise if ever called (llama3
    never calls them)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        pass
    else:
        return
    name = "torchtitan.distributed.minimal_async_ep.kernels"
    stub = types.ModuleType(name)

    def absent(attr: str) -> Any:
        if attr.startswith("__"):  # __file__, __path__...: what a plain module lacks
            raise AttributeError(attr)

        def unavailable(*_args: Any, **_kwargs: Any) -> NoReturn:
            raise RuntimeError(f"{name}.{attr} needs Triton, which is not installed")

        return unavailable

    stub.__getattr__ = absent  # type: ignore[method-assign]
    sys.modules[name] = stub


_stub_gpu_kernels()


def adapt_to_cpu() -> None:
    """torchtitan on a CPU-only machine with gloo."""
    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.models.common.attention as attention
    from torch.nn.attention.flex_attention import create_block_mask, create_mask

    # After step 1 torchtitan shortens the collective timeouts, through a barrier on
    # device_ids=[torch.cpu.current_device()] (a string on CPU) and torch.distributed.set_timeout
    # (newer than torch 2.13). Timeouts change no number: keep the launch's.
    dist_utils.set_pg_timeouts = lambda timeout, parallel_dims: None

    class NoMemoryStats:  # torch.cpu has no memory statistics
        device_name = "cpu"
        device_capacity_gib = 0.0

        def get_peak_stats(self) -> metrics.DeviceMemStats:
            return metrics.DeviceMemStats(0.0, 0.0, 0.0, 0.0, 0, 0)

        def reset_peak_stats(self) -> None:
            pass

    metrics.build_device_memory_monitor = NoMemoryStats

    # FlexAttention's backward does not run on CPU: compute the same attention densely, with
    # the BlockMask's mask_mod made a boolean mask; and build BlockMasks without compiling.
    def dense_flex_attn(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        score_mod: Any,
        block_mask: Any,
        scale: float | None,
        enable_gqa: bool,
        return_aux: Any,
        kernel_options: dict[str, Any],
    ) -> tuple[torch.Tensor, None]:
        assert score_mod is None and not return_aux.lse, "the dense stand-in has no score_mod/lse"
        batch, _, q_len, _ = q.shape
        mask = create_mask(block_mask.mask_mod, batch, 1, q_len, k.shape[2], device=q.device)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
        )
        return out, None

    attention.FlexAttention.compiled_flex_attn = staticmethod(dense_flex_attn)  # type: ignore[method-assign]
    attention._compiled_create_block_mask = create_block_mask


def sum_reductions_for_torch() -> None:
    """torch 2.13's fully_shard implements torchtitan's set_gradient_divide_factor(1.0) with
    PREMUL_SUM, which gloo lacks; SUM then divide by 1 (force_sum_reduction) is the same sum."""
    import torchtitan.distributed.fsdp as titan_fsdp

    disable_division = titan_fsdp.disable_fsdp_gradient_division

    def disable_division_with_sum(model: Any) -> None:
        disable_division(model)
        for module in model.modules():
            if isinstance(module, titan_fsdp.FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    titan_fsdp.disable_fsdp_gradient_division = disable_division_with_sum


def log_losses() -> None:
    """Print each step's global loss and gradient norm (rank 0) with every digit."""
    import torchtitan.components.metrics as metrics

    log = metrics.MetricsProcessor.log

    def log_and_print(
        self: Any, step: int, loss: float, max_loss: float, grad_norm: float, **kw: Any
    ) -> Any:
        if dist.get_rank() == 0:
            print(f"LOSS {step} {loss!r} {grad_norm!r}", flush=True)
        return log(self, step, loss, max_loss, grad_norm, **kw)

    metrics.MetricsProcessor.log = log_and_print  # type: ignore[method-assign]


def sharded_by(model: Any) -> str:
    """Which implementation's FSDPModule the model really is: the swap must not be a no-op."""
    import torch.distributed.fsdp._fully_shard._fully_shard as torch_impl

    import fsdp2

    # fsdp2's module classes also list torch's FSDPModule as a base (torch's pipeline stage
    # tests it), so a module is torch's only if it is not fsdp2's.
    found = {
        "fsdp2" if isinstance(module, fsdp2.FSDPModule) else "torch"
        for module in model.modules()
        if isinstance(module, (fsdp2.FSDPModule, torch_impl.FSDPModule))
    }
    return ",".join(sorted(found)) or "nothing"


def configure(config: Any, assets: str, dump: str, options: dict[str, str]) -> None:
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    config.hf_assets_path = f"{assets}/tokenizer"  # made by assets.make_assets
    config.dump_folder = dump
    config.dataloader.dataset_path = f"{assets}/data"
    config.training.seq_len = int(options.get("seq_len", "32"))
    config.training.local_batch_size = int(options.get("local_batch_size", "2"))
    config.training.steps = int(options["steps"])
    config.training.disable_cuda_graphs = True
    config.lr_scheduler.warmup_steps = 1
    config.validator.enable = False
    config.metrics.log_freq = 1
    config.parallelism.data_parallel_shard_degree = -1
    config.parallelism.tensor_parallel_degree = int(options.get("tp", "1"))
    # The default, "spmd_types", needs a torch newer than 2.13 (its fully_shard must turn SPMD
    # type annotations into DTensors); "partial_dtensor" is the DTensor-for-TP-only path.
    config.parallelism.spmd_backend = options.get("spmd_backend", "partial_dtensor")
    config.activation_checkpoint = {
        "none": None,
        "full": FullAC.Config(),
        "selective": SelectiveAC.Config(),
    }[options.get("ac", "none")]
    config.checkpoint.enable = "ckpt_interval" in options
    if config.checkpoint.enable:
        config.checkpoint.interval = int(options["ckpt_interval"])
        config.checkpoint.folder = "checkpoint"
        config.checkpoint.last_save_model_only = False
        config.checkpoint.load_step = int(options.get("load_step", "-1"))
    config.debug.seed = 0
    config.debug.deterministic = True


def main() -> None:
    impl, assets, dump, *rest = sys.argv[1:]
    options = dict(item.split("=", 1) for item in rest)
    import torchtitan.trainer  # noqa: F401  (loads what the swap must reach)
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    adapt_to_cpu()
    log_losses()
    if impl == "fsdp2":
        import fsdp2

        fsdp2.patch_torch_fsdp()  # the one-line switch a framework needs
    elif impl == "torch":
        sum_reductions_for_torch()
    else:
        raise ValueError(f"IMPL must be fsdp2 or torch, got {impl!r}")
    config = llama3_debugmodel()
    configure(config, assets, dump, options)
    trainer = config.build()
    if dist.get_rank() == 0:
        print(f"SHARDED_BY {sharded_by(trainer.model_parts[0])}", flush=True)
    try:
        trainer.train()
    finally:
        trainer.close()
    if dist.get_rank() == 0:
        print("DONE", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
