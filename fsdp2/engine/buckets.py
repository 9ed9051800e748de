"""Buckets: runs of consecutive members moved by one collective, cut by one rule.

[Note: one bucketing]
Coalesced all-gathers (coalesce.py), coalesced reduce-scatters (coalesce_reduce.py), the
full-weights stream (tools/weight_plan.py), the safetensors files it writes, and the planner's
replay of the first two (tools/planner/estimate.py) all cut a sequence the same way: a bucket
takes the next member while the member's key is the bucket's (same process group, dtype, ...;
``None``: it joins any) and the sizes still fit the capacity; the first member that does not
closes it. What differs between them is only what a member is, its size and key, and what
happens to a member that cannot start a bucket (gathered or reduced alone; a tensor larger than
a file is a file of its own). And where ranks must issue a coalesced collective of one size
whatever its members ([Note: coalesced gathers]), that size is :func:`fixed_size`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

__all__ = ["Run", "cut", "fill", "fixed_size", "hold"]

T = TypeVar("T")


class Run(Generic[T]):
    """One bucket being filled: its members, the bytes they use of ``capacity``, and its key
    (the first keyed member's)."""

    def __init__(self, capacity: int = 0) -> None:
        self.capacity = capacity
        self.members: list[T] = []
        self.used = 0
        self.key: object = None

    def takes(self, size: int, key: object = None) -> bool:
        """Whether a member of ``size`` bytes and ``key`` may join: it fits what is left, and
        its key is the bucket's (``None`` on either side: no constraint)."""
        if self.used + size > self.capacity:
            return False
        return key is None or self.key is None or key == self.key

    def add(self, member: T, size: int, key: object = None) -> None:
        self.members.append(member)
        self.used += size
        if self.key is None:
            self.key = key

    def take(self) -> list[T]:
        """The members, leaving the bucket empty (its capacity kept)."""
        members, self.members, self.used, self.key = self.members, [], 0, None
        return members


def cut(
    items: Iterable[T],
    size_of: Callable[[T], int],
    capacity: int,
    key_of: Callable[[T], object] = lambda _: None,
) -> list[list[T]]:
    """``items`` in consecutive buckets of at most ``capacity`` bytes each, one key each; an item
    larger than ``capacity`` is a bucket of its own (nothing to hand it to otherwise)."""
    runs: list[list[T]] = []
    run: Run[T] = Run(capacity)
    for item in items:
        size, key = size_of(item), key_of(item)
        if run.members and not run.takes(size, key):
            runs.append(run.take())
        run.add(item, size, key)
    if run.members:
        runs.append(run.take())
    return runs


def fill(
    run: Run[T], first: T, size: int, key: object, rest: Iterable[tuple[T, int, object] | None]
) -> bool:
    """Start ``run`` (empty) with ``first``, then take ``(member, size, key)`` from ``rest``
    (lazily: finding one may have effects) until one is ``None`` (it cannot join) or does not fit
    or match. False, taking nothing, when ``first`` alone does not fit: it goes alone."""
    if not run.takes(size, key):
        return False
    run.add(first, size, key)
    for found in rest:
        if found is None or not run.takes(found[1], found[2]):
            break
        run.add(*found)
    return True


def hold(
    run: Run[T],
    size: int | None,
    key: object,
    flush: Callable[[], None],
    start: Callable[[], int],
) -> bool:
    """The held bucket's rule (reduce-scatters reach it one at a time): whether a member of
    ``size`` bytes and ``key`` (``size`` None: it cannot join any) joins ``run``; the caller then
    adds it. A member that cannot join the bucket held has it issued first (``flush``, which
    takes the members); then it starts a new one, of ``start()``'s capacity, unless it cannot
    join or is larger than that: False, it goes alone."""
    if run.members and (size is None or not run.takes(size, key)):
        flush()
    if size is None:
        return False
    if not run.members:
        run.capacity = start()
    return run.takes(size, key)


def fixed_size(sizes: Iterable[int], header: int, share: int) -> int:
    """The one size of every rank's part in a coalesced collective: ``share`` (the budget's, per
    rank), or less where the ``header`` and every member that could ever join (``sizes``: all of
    the root's, a fact every rank shares) fit in less, so that a small model's collectives carry
    no padding it cannot use."""
    return min(share, header + sum(n for n in sizes if header + n <= share))
