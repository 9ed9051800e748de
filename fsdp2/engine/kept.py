"""``KeptCopy``: a buffer gathered from the shards and kept across reshards, and the one test of
whether it may still be used (``memory_mode="zero2"``'s gathered parameters, hfsdp's 1/S).

[Note: when a kept copy is current]
A kept copy is current exactly when every rank's shard holds the bytes it held when the copy
was gathered: a gather now would give the same buffer. No counter sees every write to a shard:
autograd's version counters miss what a ``DTensor`` runs below autograd (an optimizer's local
update, ``torch._foreach_*`` ops on a list of DTensors, ``dcp.load`` into a state dict taken
earlier) and ``.data`` writes. So the test is on the bytes themselves:

- a key that moves with the writes every rank is known to make alike (optimizer steps counted
  in steps.py; version counters) drops the copy at once, without looking: the first
  micro-batch after an optimizer step gathers without a check;
- otherwise this rank compares its shard with a snapshot taken at the gather (bitwise, so a NaN
  or ``-0.0`` compares as itself), and the ranks of the gather's group agree on "some shard
  changed" with one small MAX all-reduce: a write that changed one rank's bytes and not
  another's (an empty shard, a gradient zero on some rows) must make them all gather, or the
  gather would hang.

Every public write path is then covered, ``.data`` included, at the price of the snapshot
(this rank's shard once more, 1/W of the group) and, per reuse, a read of the shard and one
all-reduce of 4 bytes in place of the all-gather it saves.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fsdp2.engine.collectives import all_reduce

__all__ = ["KeptCopy"]

Key = tuple[int, int]


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1).view(torch.uint8)


class KeptCopy:
    """``buffer``, gathered when this rank's shard was ``shard`` and the shards' key ``key``."""

    def __init__(self, buffer: torch.Tensor, shard: torch.Tensor, key: Key) -> None:
        self.buffer = buffer
        self._snapshot = _bits(shard).clone()  # this rank's shard bytes at the gather
        self._key = key
        # ``checked_at``: the reshard count when every rank last agreed the copy is current;
        # a second question before the next reshard (coalescing asks, then unshard) is free.
        self.checked_at = -1

    def snapshot_nbytes(self) -> int:
        return self._snapshot.numel()

    def current(
        self,
        shard: torch.Tensor,
        key: Key,
        group: dist.ProcessGroup | None,
        label: str,
        reshards: int,
    ) -> bool:
        """Whether no rank of ``group`` wrote its shard since the gather ([Note: when a kept
        copy is current]). Every rank of ``group`` calls this at the same point."""
        if key != self._key:
            return False
        if self.checked_at == reshards:
            return True
        mine = _bits(shard)
        if mine.numel() != self._snapshot.numel():
            flag = torch.ones(1, dtype=torch.int32)
        else:  # on the shard's device: one host sync below, not two
            flag = torch.ne(mine, self._snapshot).any().to(torch.int32).reshape(1)
        flag = flag.to(self.buffer.device)
        if group is not None and group.size() > 1:
            all_reduce(flag, group, label, dist.ReduceOp.MAX).wait()
        changed = bool(flag.item())
        if not changed:
            self.checked_at = reshards
        return not changed
