"""Collective checks (opt-in): before each collective, the ranks compare what they are about to do.

With ``FSDP2_CHECK_COLLECTIVES=1`` (or :func:`set_collective_checks`), every fsdp2 collective is
preceded by an all-gather of a 128-byte fingerprint over the same process group: the op, the
element count, the dtype, the group's sequence number and the module label (a hash of the whole
label, and its first bytes as text so every rank can print every other rank's). The fingerprints
pair up even when the collectives behind them would not (they all have the same size), so the
first disagreement is seen by every rank of the group, before the mismatched collective is
issued, and every rank raises :class:`CollectiveMismatchError` naming each rank's module. The
exchange is bounded by the hang report's deadline (``FSDP2_COLLECTIVE_TIMEOUT``), so a rank that
never arrives ends in :class:`~fsdp2.debug.hang.CollectiveTimeoutError` instead.

Enable it on every rank (the environment variable does): a rank without checks would pair its
real collective with the others' fingerprints. On CUDA the comparison copies 128 bytes per rank
to the host, a synchronisation per collective: this is a debugging mode.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from functools import lru_cache

import torch
import torch.distributed as dist

from fsdp2.debug import hang, report

__all__ = [
    "FINGERPRINT_BYTES",
    "CollectiveMismatchError",
    "verify",
]

FINGERPRINT_BYTES = 128
_HEADER = struct.Struct("<qqq8s16s")  # op, numel, seq, label hash, dtype name: 48 bytes
_LABEL_BYTES = FINGERPRINT_BYTES - _HEADER.size
_OPS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "redistribute")


class CollectiveMismatchError(RuntimeError):
    """The ranks of a process group were about to issue different collectives."""


@lru_cache(maxsize=4096)
def _label_bytes(label: str) -> tuple[bytes, bytes]:
    text = label.encode()
    return hashlib.blake2b(text, digest_size=8).digest(), text[:_LABEL_BYTES]


def _fingerprint(event: hang.Event) -> bytes:
    digest, text = _label_bytes(event.label)
    dtype = str(event.dtype).removeprefix("torch.").encode()
    header = _HEADER.pack(_OPS.index(event.op), event.numel, event.seq, digest, dtype)
    return header + text.ljust(_LABEL_BYTES, b"\0")


def _decode(row: bytes) -> dict[str, object]:
    op, numel, seq, _, dtype = _HEADER.unpack(row[: _HEADER.size])
    label = row[_HEADER.size :].rstrip(b"\0").decode(errors="replace")
    name = dtype.rstrip(b"\0").decode()
    return {"op": _OPS[op], "label": label, "numel": numel, "dtype": name, "seq": seq}


def verify(
    event: hang.Event,
    device: torch.device,
    all_gather: Callable[..., dist.Work | None],
) -> None:
    """All-gather ``event``'s fingerprint over its group; raise on every rank if any differs."""
    group = event.group
    mine = _fingerprint(event)
    inp = torch.frombuffer(bytearray(mine), dtype=torch.uint8).to(device)
    out = torch.empty(group.size() * FINGERPRINT_BYTES, dtype=torch.uint8, device=device)
    work = all_gather(out, inp, group=group, async_op=True)
    if work is not None:
        hang.wait(work, event, device, phase="fingerprint exchange before")
    rows = out.cpu().numpy().tobytes()
    found = [rows[i * FINGERPRINT_BYTES : (i + 1) * FINGERPRINT_BYTES] for i in range(group.size())]
    if any(row != mine for row in found):
        raise CollectiveMismatchError(_message(group, [_decode(row) for row in found]))


def _message(group: dist.ProcessGroup, found: list[dict[str, object]]) -> str:
    ranks = dist.get_process_group_ranks(group)
    lines = "\n".join(
        f"  rank {r}: {report.describe(f)}" for r, f in zip(ranks, found, strict=True)
    )
    return (
        f"fsdp2: the ranks of the process group of ranks {ranks} were about to issue different "
        f"collectives (FSDP2_CHECK_COLLECTIVES):\n{lines}\n{_cause(found)}\n"
        "Nothing was issued: every rank of the group raises this error."
    )


SCALER_LABEL = "ShardedGradScaler"  # the label of its found-inf all-reduce (grad_scaler.py)


def _cause(found: list[dict[str, object]]) -> str:
    def differ(key: str) -> bool:
        return len({str(f[key]) for f in found}) > 1

    if any(f["label"] == SCALER_LABEL for f in found):
        return (
            "Likely cause: an optimizer step ran on some ranks only: ShardedGradScaler's "
            "unscale_ (in scaler.step) decides skip-or-step with every rank. Fix: call "
            "scaler.step/unscale_ on every rank each step (a rank out of data must stop the "
            "job on every rank, not skip a step alone)."
        )
    if differ("op") and any(f["op"] == "redistribute" for f in found):
        return (
            "Likely cause: some ranks load a state dict, or lay out a gradient, that others do "
            "not (a DTensor redistribution; a load on rank 0 only, a model that differs between "
            "ranks). Fix: load on every rank, and build the model alike on every rank."
        )
    if differ("op"):
        return (
            "Likely cause: some ranks are in forward (all-gather) while others are in backward "
            "(reduce-scatter): a rank skipped a module, ran an extra forward, or skipped "
            "backward. Fix: run the same modules, forward and backward, on every rank each step."
        )
    if differ("label"):
        return (
            "Likely cause: a module, or a whole forward, ran on some ranks only (control flow "
            "that depends on the rank or the data: MoE routing, a layer skipped for some inputs "
            "or input shapes, an evaluation forward on rank 0 only). Fix: run every fully_shard "
            "module on every rank each step (e.g. call an unused expert on an empty batch), or "
            "decide the control flow from facts every rank shares."
        )
    if differ("numel") and found[0]["op"] == "reduce_scatter":
        return (
            "Likely cause: this module's trainable parameters differ between ranks "
            "(requires_grad_ changed on some ranks only). Fix: freeze and unfreeze parameters "
            "alike on every rank."
        )
    if differ("numel") or differ("dtype"):
        return (
            "Likely cause: the module's parameters differ between ranks (shapes, dtypes or a "
            "mixed-precision policy decided per rank). Fix: build and shard the model the same "
            "way on every rank."
        )
    return (
        "Likely cause: collective checks are on in some ranks only (enable them on every rank: "
        "FSDP2_CHECK_COLLECTIVES=1 in the job's environment)."
    )
