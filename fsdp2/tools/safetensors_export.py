"""``save_hf_safetensors``: a sharded model's weights as Hugging Face safetensors files, streamed.

[Note: streamed safetensors]
A safetensors file is the length of its header (8 bytes, little-endian), the header (JSON: each
tensor's dtype, shape and byte range, in file order), then the tensors' bytes. Everything in the
headers is known before any byte is gathered (names, global shapes, dtypes: the plan every rank
shares), so each file's header is written first and each tensor appended as its bucket arrives:
no rank ever holds a file, let alone the model, only the bucket being written. Files are cut as
Hugging Face's ``save_pretrained`` cuts them: in ``state_dict()`` order, a tensor never split,
a new file when the next tensor would pass ``max_shard_size``; named
``model-00001-of-0000N.safetensors`` beside ``model.safetensors.index.json``, or
``model.safetensors`` alone when one file holds everything. Tied weights are written once, under
their first key, and ``from_pretrained`` ties them again, as it does for ``save_pretrained``.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp2.engine.buckets import cut
from fsdp2.tools.full_weights import walk
from fsdp2.tools.weight_plan import Bucket, WeightItem, plan_buckets

__all__ = ["save_hf_safetensors"]

INDEX_NAME = "model.safetensors.index.json"
_SINGLE_NAME = "model.safetensors"
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")

_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}

_UNITS = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9}


@dataclass
class _File:
    """One output file: its tensors in order, and while it is being written, its handle."""

    name: str
    items: list[WeightItem] = field(default_factory=list)
    nbytes: int = 0
    handle: IO[bytes] | None = None
    written: int = 0  # tensors written so far


def save_hf_safetensors(
    module: nn.Module,
    directory: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    bucket_bytes: int | None = None,
    parallel: bool = True,
) -> list[str]:
    """Write a sharded ``module``'s full weights as Hugging Face safetensors files that
    ``from_pretrained`` loads: call it on every rank. Returns the files written, on every rank.

    The weights stream from :func:`iter_full_weights`, each file's header first and each tensor
    as its bucket arrives (see [Note: streamed safetensors]): no rank holds more than a bucket.
    The keys are the module's ``state_dict()`` keys, so shard the Hugging Face model itself
    (``LlamaForCausalLM``, not its inner ``model``). ``config.json`` (and the tokenizer) are
    yours to save beside them, e.g. ``model.config.save_pretrained(directory)`` on rank 0.

    Args:
        module: a module holding fsdp2 modules.
        directory: where the files go (created if missing); with ``parallel``, a file system
            every rank sees. Earlier shard files and index of another save there are removed.
        dtype: floating-point weights are written in this dtype (``torch.bfloat16`` for most
            checkpoints); ``None`` keeps each tensor's own.
        max_shard_size: the most bytes per file (a larger tensor gets a file of its own), an
            int or a string such as ``"5GB"`` or ``"500MiB"``, as ``save_pretrained`` takes it.
        bucket_bytes: the most bytes gathered at once; ``None``: the backend's default (see
            :func:`iter_full_weights`).
        parallel: file ``k`` is written by rank ``k`` modulo the world size; ``False``: rank 0
            writes every file and the other ranks only take part in the gathers.
    """
    if sys.byteorder != "little":
        raise NotImplementedError("save_hf_safetensors writes little-endian bytes only")
    limit = _size_in_bytes(max_shard_size)
    buckets = plan_buckets(module, dtype, bucket_bytes, buffers=True)
    files = _cut_files([item for bucket in buckets for item in bucket.items], limit)
    world = dist.get_world_size() if dist.is_initialized() else 1
    me = dist.get_rank() if dist.is_initialized() else 0
    file_of = {item.name: file for file in files for item in file.items}
    writer = {id(file): (k % world if parallel else 0) for k, file in enumerate(files)}
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    if me == 0:
        _remove_stale(directory, {file.name for file in files})
        if len(files) > 1:  # known from the plan; the gathers' closing exchange follows it
            _write_index(directory, files)
    _write(buckets, file_of, directory, lambda item: writer[id(file_of[item.name])] == me)
    return [file.name for file in files]


def _write(
    buckets: list[Bucket],
    file_of: dict[str, _File],
    directory: str,
    mine: Callable[[WeightItem], bool],
) -> None:
    """Every rank takes part in every gather; each writes the tensors of its own files."""
    current: _File | None = None
    try:
        for bucket in walk(buckets, torch.device("cpu"), mine):
            for name, tensor in bucket:
                file = file_of[name]
                if file.handle is None:
                    current = file
                    file.handle = open(os.path.join(directory, file.name), "wb")
                    file.handle.write(_header(file))
                _write_bytes(file.handle, tensor)
                file.written += 1
                if file.written == len(file.items):
                    file.handle.close()
            del bucket
    finally:
        if current is not None and current.handle is not None:
            current.handle.close()


def _cut_files(items: list[WeightItem], limit: int) -> list[_File]:
    """Hugging Face's cut: in order, a new file when the next tensor would pass ``limit``."""
    runs = cut(items, lambda i: i.nbytes, limit)
    files = [_File("", run, sum(item.nbytes for item in run)) for run in runs]
    if len(files) == 1:
        files[0].name = _SINGLE_NAME
    for k, file in enumerate(files if len(files) > 1 else []):
        file.name = f"model-{k + 1:05d}-of-{len(files):05d}.safetensors"
    return files


def _header(file: _File) -> bytes:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    start = 0
    for item in file.items:
        if item.dtype not in _DTYPES:
            raise NotImplementedError(f"{item.name}: safetensors has no dtype {item.dtype}")
        shape = list(item.source.shape)
        header[item.name] = {
            "dtype": _DTYPES[item.dtype],
            "shape": shape,
            "data_offsets": [start, start + item.nbytes],
        }
        start += item.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)  # the data starts 8-byte aligned, as safetensors does
    return len(text).to_bytes(8, "little") + text


def _write_bytes(handle: IO[bytes], tensor: torch.Tensor) -> None:
    flat = tensor.detach().reshape(-1).contiguous().cpu()
    nbytes = flat.numel() * flat.element_size()
    if nbytes:  # the tensor's memory as a buffer, without a copy (flat is alive meanwhile)
        handle.write((ctypes.c_char * nbytes).from_address(flat.data_ptr()))


def _write_index(directory: str, files: list[_File]) -> None:
    index = {
        "metadata": {"total_size": sum(file.nbytes for file in files)},
        "weight_map": {item.name: file.name for file in files for item in file.items},
    }
    with open(os.path.join(directory, INDEX_NAME), "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)
        f.write("\n")


def _remove_stale(directory: str, keep: set[str]) -> None:
    """An earlier save's shard files and index, which ``from_pretrained`` would read instead
    of (or mix with) these ones; never a file of this save (another rank may be writing it)."""
    for name in os.listdir(directory):
        stale = name in (INDEX_NAME, _SINGLE_NAME) or _SHARD_NAME.fullmatch(name)
        if stale and name not in keep:
            os.remove(os.path.join(directory, name))


def _size_in_bytes(size: int | str) -> int:
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    if isinstance(size, str):
        found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B)\s*", size.upper())
        if found:
            return int(float(found.group(1)) * _UNITS[found.group(2)])
    raise ValueError(
        f"save_hf_safetensors expects max_shard_size to be a positive int (bytes) or a string "
        f"such as '5GB' or '500MiB', got {size!r}"
    )
