"""One rank of PyTorch Lightning's ``Trainer`` with ``ModelParallelStrategy`` (FSDP2), run by
``torchrun``.

A tiny MLP (a few Linear blocks and a head) in a ``LightningModule`` whose ``configure_model()``
shards each block, then the model, on ``self.device_mesh["data_parallel"]``, as Lightning's docs
do. ``Trainer(accelerator="cpu", devices=2, strategy=ModelParallelStrategy(data_parallel_size=2,
tensor_parallel_size=1), gradient_clip_val=...)`` trains it with AdamW; Lightning sees
torchrun's environment and launches nothing itself. ``--impl fsdp2`` calls
``fsdp2.patch_torch_fsdp()`` first, so the user's ``from torch.distributed.fsdp import
fully_shard`` inside ``configure_model()`` is fsdp2's; ``--impl torch`` runs torch's.

After ``--steps - 2`` steps ``trainer.save_checkpoint`` writes Lightning's distributed (DCP)
checkpoint; a second ``Trainer`` fits a differently initialised model with ``ckpt_path=`` that
checkpoint, to ``--steps``: its parameters at the start must be the saved ones, and its steps
continue the numbering.

Printed lines (rank 0 only), parsed by ``test_lightning.py``:

    BLOCK <module>.<class> <isinstance of fsdp2.FSDPModule>   a sharded block: whose FSDP it is
    LOSS step=<i> value=<float> grad_norm=<float>   the loss (mean over ranks) and the gradient
                                                    norm before Lightning clips it, step i
    CLIPPED step=<i> norm=<float>                   the gradient norm the optimizer stepped with
    PARAMS <tag> <path>                             full parameters, saved (tag saved, loaded)
    DONE                                            the script finished
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

if __package__ in (None, ""):  # run as a script by torchrun: make `fsdp2` and `tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

DIM, BLOCKS, ROWS, BATCH = 16, 3, 96, 8
LR = 1e-2
CLIP = 0.5  # below the first steps' gradient norms, so Lightning's clipping really scales


def say(line: str) -> None:
    if dist.get_rank() == 0:
        print(line, flush=True)


def full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def grad_norm(module: nn.Module) -> float:
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    return float(full(torch.nn.utils.get_total_norm(grads)))


class Regression(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """y = tanh(x @ w): learnable, so the loss falls within a few steps."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(1000)
        self.x = torch.randn(ROWS, DIM, generator=gen)
        self.y = torch.tanh(self.x @ torch.randn(DIM, DIM, generator=gen))

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def build_module(seed: int) -> Any:
    import lightning.pytorch as pl

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = nn.Linear(DIM, 2 * DIM)
            self.down = nn.Linear(2 * DIM, DIM)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(torch.relu(self.up(x)))

    class MLP(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = nn.Sequential(*(Block() for _ in range(BLOCKS)), nn.Linear(DIM, DIM))
            self.step_loss = torch.zeros(())
            self.stepping = False  # in a training step (not DCP's optimizer-state init step)
            self.meta_at_shard = False

        def configure_model(self) -> None:
            # The user's import, inside the hook as Lightning's docs write it: patched or not.
            from torch.distributed.fsdp import fully_shard

            self.meta_at_shard = any(p.is_meta for p in self.parameters())
            mesh = self.device_mesh["data_parallel"]
            for block in self.model[:BLOCKS]:
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.mse_loss(self.model(x), y)
            self.step_loss = loss.detach().clone()
            dist.all_reduce(self.step_loss)  # gloo has no AVG
            self.step_loss /= dist.get_world_size()
            return loss

        def on_before_optimizer_step(self, optimizer: Any) -> None:  # before Lightning clips
            self.stepping = True
            norm = grad_norm(self)
            say(f"LOSS step={self.global_step} value={self.step_loss:.10f} grad_norm={norm:.10f}")

        def configure_optimizers(self) -> torch.optim.Optimizer:
            opt = torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.1, eps=1e-5)
            opt.register_step_post_hook(self.report_clipped)
            return opt

        def report_clipped(self, *_: Any) -> None:
            # After the step the gradients are still the clipped ones the update used.
            if self.stepping:
                say(f"CLIPPED step={self.global_step} norm={grad_norm(self):.10f}")
                self.stepping = False

        def train_dataloader(self) -> torch.utils.data.DataLoader[Any]:
            return torch.utils.data.DataLoader(Regression(), batch_size=BATCH, shuffle=False)

    torch.manual_seed(seed)
    return MLP()


def save_params(module: nn.Module, path: Path) -> None:
    params = {name: full(p.detach()).clone() for name, p in module.named_parameters()}
    if dist.get_rank() == 0:
        torch.save(params, path)


def make_trainer(max_steps: int, callbacks: list[Any]) -> Any:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy

    return pl.Trainer(
        accelerator="cpu",
        devices=2,
        num_nodes=1,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_steps=max_steps,
        gradient_clip_val=CLIP,
        gradient_clip_algorithm="norm",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        deterministic=True,
        callbacks=callbacks,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=("fsdp2", "torch"), required=True)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    import fsdp2

    if args.impl == "fsdp2":
        fsdp2.patch_torch_fsdp()  # the one-line switch a framework needs

    import lightning.pytorch as pl

    class Report(pl.Callback):
        def __init__(self, tag: str) -> None:
            self.tag = tag

        def on_fit_start(self, trainer: Any, module: Any) -> None:  # after materialization
            meta = any(p.is_meta for p in module.parameters())
            say(f"INIT {self.tag} meta_at_shard={module.meta_at_shard} meta_after_setup={meta}")

        def on_train_start(self, trainer: Any, module: Any) -> None:
            block = module.model[0]
            kind = f"{type(block).__module__}.{type(block).__qualname__}"
            say(f"BLOCK {kind} {isinstance(block, fsdp2.FSDPModule)}")
            if self.tag == "loaded":  # the checkpoint is restored before training starts
                save_params(module, args.out / "loaded.pt")
                say(f"PARAMS loaded {args.out / 'loaded.pt'}")

    pl.seed_everything(0, verbose=False)
    first, ckpt = args.steps - 2, args.out / "ckpt"
    trainer = make_trainer(first, [Report("first")])
    module = build_module(seed=0)
    trainer.fit(module)
    trainer.save_checkpoint(ckpt)  # ModelParallelStrategy's default: a DCP folder
    save_params(module, args.out / "saved.pt")
    say(f"PARAMS saved {args.out / 'saved.pt'}")

    # Built on the meta device, sharded there, materialized by Lightning (`to_empty` and
    # `reset_parameters`), then the checkpoint must replace those weights.
    trainer = make_trainer(args.steps, [Report("loaded")])
    with trainer.init_module(empty_init=True):
        resumed = build_module(seed=1)
    trainer.fit(resumed, ckpt_path=ckpt)
    dist.barrier()
    say("DONE")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
