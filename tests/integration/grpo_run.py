"""One rank of TRL's ``GRPOTrainer`` with FSDP2, run by ``torchrun``.

A tiny Llama (``assets.tiny_llama``, nothing downloaded) and a byte-level BPE tokenizer trained on
our own corpus (``assets.make_assets``) learn from a reward computed in Python: the share of the
letter "e" in each sampled completion. ``GRPOTrainer`` samples a group of completions per prompt
with ``generate``, scores them, and takes a policy-gradient step; ``fsdp_config={"fsdp_version":
2, ...}`` makes accelerate shard each decoder layer and the root. ``--impl fsdp2`` calls
``fsdp2.patch_torch_fsdp()`` first; ``--impl torch`` runs torch's ``fully_shard``.

Two things hold for both implementations alike:

- accelerate takes its FSDP path only on accelerators (on CPU its ``Accelerator`` is MULTI_CPU,
  i.e. DDP), so ``CPUFSDPGRPOTrainer`` opts in by hand once the accelerator exists, as
  ``hf_trainer_run.py`` does.
- ``generate`` keeps the ranks in step (``synced_gpus``) only for models that transformers
  sharded itself. Every forward of a sharded model all-gathers, so every rank must run the same
  number of them: completions have a fixed length (``min_new_tokens`` = ``max_new_tokens``, and
  the end-of-text token cannot stop a completion before that).

Printed lines (rank 0 only), parsed by ``test_grpo.py``:

    MODEL <module>.<class>                          the prepared model's class: whose FSDP it is
    LOSS step=<i> value=<float> grad_norm=<float>   Trainer's logged loss (mean over ranks) and
                                                    gradient norm (before clipping), step i,
                                                    printed exactly (``repr`` of the float)
    REWARDS <float> ...                             the mean reward of each step's completions
    WEIGHTS <path>                                  the full parameters after training
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

from tests.integration.assets import VOCAB_SIZE, fsdp_on_cpu, make_assets, tiny_llama

COMPLETION = 6  # tokens sampled per completion, on every rank alike
SEQ = 32  # positions: prompt and completion
GROUP = 4  # completions per prompt, compared with each other for the advantage
PROMPTS = [
    "The fox",
    "A crow sat",
    "The lion and",
    "Once a wolf",
    "The ant",
    "An old dog",
    "The hare said",
    "A frog",
]


def share_of_e(completions: list[str], **kwargs: Any) -> list[float]:
    """The reward: how much of each completion is the letter "e"."""
    return [text.count("e") / max(len(text), 1) for text in completions]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=("fsdp2", "torch"), required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.impl == "fsdp2":
        import fsdp2

        fsdp2.patch_torch_fsdp()  # the one-line switch a framework needs

    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    class CPUFSDPGRPOTrainer(GRPOTrainer):
        def create_accelerator_and_postprocess(self) -> None:
            super().create_accelerator_and_postprocess()
            fsdp_on_cpu(self)

    def say(line: str) -> None:
        if dist.get_rank() == 0:
            print(line, flush=True)

    rewards: list[float] = []

    class Report(TrainerCallback):
        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if logs and "loss" in logs and "grad_norm" in logs:
                step = state.global_step - 1
                say(f"LOSS step={step} value={logs['loss']!r} grad_norm={logs['grad_norm']!r}")
                rewards.append(logs["reward"])

    # Each torchrun launch has its own --out, so each trains its own tokenizer: the same corpus
    # and settings give the same merges.
    tokenizer_dir, _ = make_assets(args.out / "assets")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(tokenizer_dir))
    tokenizer.padding_side = "left"  # prompts end where the completions start
    model = tiny_llama(False, vocab=VOCAB_SIZE, seq=SEQ).float()
    model.config.bos_token_id = tokenizer.bos_token_id
    model.config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id

    config = GRPOConfig(
        output_dir=str(args.out),
        use_cpu=True,
        max_steps=args.steps,
        per_device_train_batch_size=GROUP,  # 2 ranks x 4 completions: 2 prompts a step
        num_generations=GROUP,
        max_completion_length=COMPLETION,
        generation_kwargs={"min_new_tokens": COMPLETION},
        beta=0.0,  # no reference model
        learning_rate=2e-2,
        lr_scheduler_type="constant",
        adam_epsilon=1e-5,  # as in hf_trainer_run.py: bounds Adam's amplification of rounding
        max_grad_norm=1.0,
        gradient_checkpointing=False,
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
    trainer = CPUFSDPGRPOTrainer(
        model=model,
        reward_funcs=share_of_e,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=tokenizer,
        callbacks=[Report()],
    )
    trainer.train()
    say(f"REWARDS {' '.join(repr(r) for r in rewards)}")
    say(
        f"MODEL {type(trainer.model_wrapped).__module__}.{type(trainer.model_wrapped).__qualname__}"
    )
    state = trainer.accelerator.get_state_dict(trainer.model)  # full, on rank 0
    if dist.get_rank() == 0:
        path = args.out / "weights.pt"
        torch.save(dict(state), path)
        say(f"WEIGHTS {path}")
    dist.barrier()
    say("DONE")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
