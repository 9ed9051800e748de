"""The tokenizer and dataset torchtitan's debug config expects, made from our own corpus
(examples/data/fables.txt): torchtitan's wheel ships neither."""

from __future__ import annotations

import json
import re
from pathlib import Path

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
