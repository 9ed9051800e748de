"""``fsdp2.save_hf_safetensors``: a sharded model written as Hugging Face safetensors files.

The files are read back by a reader written here from the format's definition (so the test runs
without the ``safetensors`` package) and, where it is installed, by ``safetensors`` itself; each
tensor equals ``full_tensor()`` of its parameter bit for bit (copies of the same values, cast
elementwise). Files are cut at ``max_shard_size`` with Hugging Face's names and index; rank 0
alone or every rank in parallel writes them. ``from_pretrained`` of transformers loads them:
tests/integration/test_full_weights_hf.py. fsdp2-only.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_on_ranks
from tests.models import build_model
from tests.tools.test_full_weights import SEED, _expected, _shard

pytestmark = pytest.mark.usefixtures("fsdp2_only")

_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I64": torch.int64}


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """The format by its definition: header length, JSON header, contiguous bytes."""
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    assert header.pop("__metadata__") == {"format": "pt"}
    assert (8 + length) % 8 == 0
    body = data[8 + length :]
    tensors, end = {}, 0
    for name, entry in header.items():
        start, stop = entry["data_offsets"]
        assert start == end, (name, start, end)  # contiguous, in header order
        raw = torch.frombuffer(bytearray(body[start:stop]), dtype=torch.uint8)
        dtype = _DTYPES[entry["dtype"]]
        tensors[name] = raw.view(dtype).reshape(entry["shape"])
        end = stop
    assert end == len(body)
    return tensors


def _export(directory: str, options: dict[str, Any]) -> list[str]:
    from fsdp2 import save_hf_safetensors

    model = _shard(build_model("gpt", SEED))
    # A file from an earlier save that this one must not leave behind.
    if dist.get_rank() == 0:
        Path(directory, "model-00009-of-00009.safetensors").write_bytes(b"stale")
    dist.barrier()
    files = save_hf_safetensors(model, directory, **options)
    expected = _expected(model)
    if dist.get_rank() == 0:
        _check_directory(Path(directory), files, expected, options.get("dtype"))
    return files


def _check_directory(
    directory: Path, files: list[str], expected: dict[str, torch.Tensor], dtype: Any
) -> None:
    assert sorted(os.listdir(directory)) == sorted(
        files + (["model.safetensors.index.json"] if len(files) > 1 else [])
    ), os.listdir(directory)
    found: dict[str, torch.Tensor] = {}
    for name in files:
        found.update(read_safetensors(directory / name))
    try:
        from safetensors.torch import load_file
    except ImportError:
        load_file = None
    if load_file is not None:
        for name in files:
            for key, tensor in load_file(directory / name).items():
                assert torch.equal(tensor, found[key]), key
    assert list(found) == list(expected), (list(found), list(expected))
    for key, want in expected.items():
        want = want.to(dtype) if dtype is not None else want
        assert found[key].dtype == want.dtype and torch.equal(found[key], want), key
    if len(files) > 1:
        index = json.loads((directory / "model.safetensors.index.json").read_text())
        nbytes = sum(t.numel() * t.element_size() for t in found.values())
        assert index["metadata"] == {"total_size": nbytes}, index["metadata"]
        owner = {k: n for n in files for k in read_safetensors(directory / n)}
        assert index["weight_map"] == owner


@pytest.mark.parametrize(
    "options",
    [
        {},  # one file: model.safetensors
        {"max_shard_size": 30_000, "bucket_bytes": 20_000},
        {"max_shard_size": "25KB", "dtype": torch.bfloat16, "parallel": False},
    ],
    ids=["one-file", "sharded-parallel", "sharded-rank0-bf16"],
)
def test_export_reads_back(options: dict[str, Any]) -> None:
    with tempfile.TemporaryDirectory() as directory:
        files = run_on_ranks(2, _export, directory, options)[0]
    if options:
        assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    else:
        assert files == ["model.safetensors"]


def _bad_size() -> None:
    from fsdp2 import save_hf_safetensors

    model = _shard(build_model("gpt", SEED))
    with pytest.raises(ValueError, match="max_shard_size to be a positive int"):
        save_hf_safetensors(model, "/nonexistent", max_shard_size="5 parsecs")


def test_bad_max_shard_size() -> None:
    run_on_ranks(2, _bad_size)
