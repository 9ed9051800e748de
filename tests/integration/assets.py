"""The tokenizer and dataset torchtitan's debug config expects, made from our own corpus
(examples/data/fables.txt): torchtitan's wheel ships neither."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

CORPUS = Path(__file__).resolve().parents[2] / "examples" / "data" / "fables.txt"
VOCAB_SIZE = 512  # the debug model's embedding has 2048 rows
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def make_assets(root: Path) -> tuple[Path, Path]:
    """Write ``root/tokenizer`` (a byte-level BPE ``tokenizer.json`` trained on the corpus, and
    its ``tokenizer_config.json``) and ``root/data/train.jsonl`` (one fable per
    ``{"text": ...}`` line). Returns the two folders."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    fables = [f.strip() for f in re.split(r"\n(?=\d+\. )", CORPUS.read_text()) if f.strip()]
    tokenizer_dir, data_dir = root / "tokenizer", root / "data"
    tokenizer_dir.mkdir(parents=True, exist_ok=True)
    data_dir.mkdir(parents=True, exist_ok=True)
    with open(data_dir / "train.jsonl", "w") as out:
        for fable in fables:
            out.write(json.dumps({"text": fable}) + "\n")

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(fables, trainer=trainer)
    tokenizer.save(str(tokenizer_dir / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": EOS, "add_bos_token": True, "add_eos_token": True}
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps(config))
    return tokenizer_dir, data_dir


def tiny_llama(tied: bool, vocab: int = 64, seq: int = 8) -> Any:
    """A tiny ``LlamaForCausalLM`` from a config (nothing downloaded), seeded: 2 layers, width
    32; ``tied``: ``tie_word_embeddings``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq,
        tie_word_embeddings=tied,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def fsdp_on_cpu(trainer: Any) -> None:
    """Take accelerate's FSDP path on CPU for a Hugging Face ``Trainer`` (or a subclass: TRL's)
    whose accelerator was just made: accelerate takes it only on accelerators. Call it from the
    trainer's ``create_accelerator_and_postprocess``, after ``super()``'s."""
    from accelerate import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(**trainer.args.fsdp_plugin_args)
    PartialState().distributed_type = DistributedType.FSDP
    trainer.accelerator.state.distributed_type = DistributedType.FSDP
    trainer.accelerator.state.fsdp_plugin = plugin
    trainer.is_fsdp_enabled = True
