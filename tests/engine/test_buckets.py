"""The one bucketing rule (fsdp2/engine/buckets.py) that coalesced gathers and reduce-scatters,
the full-weights stream, the safetensors files and the planner share; the collectives it leads
to are checked end to end in test_coalesce.py and tests/tools/planner (plans against runs)."""

from __future__ import annotations

from collections.abc import Iterator

from fsdp2.engine.buckets import Run, cut, fill, fixed_size, hold


def test_cut_fills_to_the_capacity_and_never_past_it() -> None:
    sizes = [3, 4, 3, 5, 5, 1]
    assert cut(sizes, lambda n: n, 10) == [[3, 4, 3], [5, 5], [1]]  # 10 fits exactly


def test_cut_gives_a_larger_item_a_bucket_of_its_own() -> None:
    assert cut([2, 30, 2, 2], lambda n: n, 10) == [[2], [30], [2, 2]]


def test_cut_splits_at_a_new_key_and_lets_unkeyed_items_ride_along() -> None:
    items = [("a", 1), (None, 1), ("a", 1), ("b", 1), (None, 1), ("a", 1)]
    runs = cut(items, lambda item: 1, 100, key_of=lambda item: item[0])
    assert [[key for key, _ in run] for run in runs] == [["a", None, "a"], ["b", None], ["a"]]


def test_cut_keys_a_bucket_by_its_first_keyed_item() -> None:
    items = [None, None, "x", "y"]
    assert cut(items, lambda item: 1, 100, key_of=lambda item: item) == [[None, None, "x"], ["y"]]


def _lazy(found: list[tuple[str, int, object] | None], seen: list[str]) -> Iterator:
    for item in found:
        seen.append(item[0] if item else "None")
        yield item


def test_fill_takes_followers_until_one_cannot_join_and_looks_no_further() -> None:
    seen: list[str] = []
    run: Run[str] = Run(10)
    rest = [("b", 3, "k"), None, ("c", 1, "k")]
    assert fill(run, "a", 4, "k", _lazy(rest, seen))
    assert run.members == ["a", "b"] and run.used == 7
    assert seen == ["b", "None"]  # "c" never computed (the engine takes up changes as it walks)


def test_fill_stops_at_another_key_or_an_overflow() -> None:
    run: Run[str] = Run(10)
    assert fill(run, "a", 4, "k", iter([("b", 1, "other"), ("c", 1, "k")]))
    assert run.members == ["a"]
    run = Run(10)
    assert fill(run, "a", 4, "k", iter([("b", 6, "k"), ("c", 1, "k")]))
    assert run.members == ["a", "b"]
    run = Run(10)
    assert fill(run, "a", 4, "k", iter([("b", 7, "k"), ("c", 1, "k")]))
    assert run.members == ["a"]


def test_fill_refuses_a_first_member_larger_than_the_capacity() -> None:
    run: Run[str] = Run(10)
    assert not fill(run, "a", 11, "k", iter([("b", 1, "k")]))
    assert run.members == []


class _Held:
    """A caller of ``hold`` as coalesce_reduce.Reductions is: it records what was issued."""

    def __init__(self, capacity: int) -> None:
        self.run: Run[str] = Run()
        self.capacity = capacity
        self.issued: list[list[str]] = []
        self.alone: list[str] = []
        self.started = 0

    def flush(self) -> None:
        self.issued.append(self.run.take())

    def start(self) -> int:
        self.started += 1
        return self.capacity

    def offer(self, name: str, size: int | None, key: object = "k") -> None:
        if hold(self.run, size, key, self.flush, self.start) and size is not None:
            self.run.add(name, size, key)
        else:
            self.alone.append(name)


def test_hold_issues_the_held_bucket_before_a_member_that_cannot_join_it() -> None:
    held = _Held(capacity=10)
    held.offer("a", 4)
    held.offer("b", 6)  # fills it exactly
    held.offer("c", 1)  # does not fit: a+b issued, c starts the next
    held.offer("d", 1, key="other")  # another process group or dtype: c issued, d starts one
    held.offer("e", None)  # cannot join any (an all-reduce hook...): d issued, e alone
    held.offer("f", 11)  # larger than a bucket: alone, nothing held to issue
    assert held.issued == [["a", "b"], ["c"], ["d"]]
    assert held.alone == ["e", "f"]
    assert held.started == 4  # a, c, d, f each found no bucket held
    held.flush()
    assert held.issued[-1] == []  # f was not held


def test_fixed_size_is_the_share_or_what_every_member_that_fits_needs() -> None:
    assert fixed_size([100, 200], header=16, share=1024) == 316
    assert fixed_size([100, 2000], header=16, share=1024) == 116  # 2000 never joins
    assert fixed_size([600, 600], header=16, share=1024) == 1024
    assert fixed_size([], header=16, share=1024) == 16
