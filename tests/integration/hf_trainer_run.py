"""One rank of Hugging Face ``Trainer`` with FSDP2 on a peft LoRA model, run by ``torchrun``.

A tiny Llama (``LlamaConfig``, nothing downloaded) with LoRA adapters on its attention
projections (``get_peft_model``), trained by ``Trainer`` with ``fsdp="full_shard auto_wrap"`` and
``fsdp_config={"fsdp_version": 2, ...}``: accelerate shards each decoder layer and the root,
frozen base weights and trainable adapters in the same groups. ``--impl fsdp2`` calls
``fsdp2.patch_torch_fsdp()`` first; ``--impl torch`` runs torch's ``fully_shard``.

``Trainer`` takes accelerate's FSDP path only on accelerators (on CPU its ``Accelerator`` is
MULTI_CPU, i.e. DDP); everything FSDP2 does is device-agnostic, so ``CPUFSDPTrainer`` opts in by
hand once the accelerator exists, as ``accelerate_run.py`` does.

Printed lines (rank 0 only), parsed by ``test_hf_trainer.py``:

    MODEL <module>.<class>                          the prepared model's class: whose FSDP it is
    LOSS step=<i> value=<float> grad_norm=<float>   Trainer's logged loss (mean over ranks) and
                                                    gradient norm (before clipping), step i
    ADAPTER <path>                                  the LoRA weights after training (full)
    DONE                                            the script finished
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as a script by torchrun: make `fsdp2` and `tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.integration.assets import fsdp_on_cpu

VOCAB, SEQ, ROWS = 96, 16, 32
LR = 2e-2


def build_model() -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    base = LlamaForCausalLM(config).float()
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = get_peft_model(base, lora)
    torch.manual_seed(1)
    with torch.no_grad():  # peft starts lora_B at zero: make both adapters learn from step 0
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.02)
    return model


class Counting(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Counting sequences from random starts: learnable, so the loss falls within a few steps."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(1000)
        starts = torch.randint(0, VOCAB, (ROWS, 1), generator=gen)
        self.ids = (starts + torch.arange(SEQ)) % VOCAB

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=("fsdp2", "torch"), required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.impl == "fsdp2":
        import fsdp2

        fsdp2.patch_torch_fsdp()  # the one-line switch a framework needs

    from transformers import Trainer, TrainerCallback, TrainingArguments

    class CPUFSDPTrainer(Trainer):
        def create_accelerator_and_postprocess(self) -> None:
            super().create_accelerator_and_postprocess()
            fsdp_on_cpu(self)

    def say(line: str) -> None:
        if dist.get_rank() == 0:
            print(line, flush=True)

    class Report(TrainerCallback):
        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if logs and "loss" in logs and "grad_norm" in logs:
                step = state.global_step - 1
                say(
                    f"LOSS step={step} value={logs['loss']:.10f} grad_norm={logs['grad_norm']:.10f}"
                )

    training_args = TrainingArguments(
        output_dir=str(args.out),
        use_cpu=True,
        max_steps=args.steps,
        per_device_train_batch_size=2,
        learning_rate=LR,
        lr_scheduler_type="constant",
        weight_decay=0.1,
        adam_epsilon=1e-5,  # as in tests/parity/build.py: bounds Adam's amplification of rounding
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,  # its bar would share LOSS lines
        seed=0,
        dataloader_num_workers=0,
        fsdp="full_shard auto_wrap",
        fsdp_config={
            "fsdp_version": 2,
            "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
            "reshard_after_forward": True,
        },
    )
    trainer = CPUFSDPTrainer(
        model=build_model(),
        args=training_args,
        train_dataset=Counting(),
        callbacks=[Report()],
    )
    trainer.train()
    say(
        f"MODEL {type(trainer.model_wrapped).__module__}.{type(trainer.model_wrapped).__qualname__}"
    )
    state = trainer.accelerator.get_state_dict(trainer.model)  # full, on rank 0
    if dist.get_rank() == 0:
        path = args.out / "adapter.pt"
        torch.save({k: v for k, v in state.items() if "lora_" in k}, path)
        say(f"ADAPTER {path}")
    dist.barrier()
    say("DONE")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
