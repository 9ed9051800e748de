"""The hang report: where every rank is when one of fsdp2's collectives does not finish.

[Note: the hang report]
Every collective fsdp2 issues is noted as an :class:`Event` (op, module label, size, the
per-process-group sequence number) in a short ring: a few attribute writes, no I/O. A daemon
thread publishes this rank's latest events, and the collectives its threads are blocked in, to the
job's c10d store (the default process group's store, which every job already has) at most every
``FSDP2_COLLECTIVE_TIMEOUT / 4`` seconds (30 at most), only when something changed: the default
path writes nothing per collective and issues no extra collective.

Waiting on one of fsdp2's collectives (``Pending.wait``) is bounded by ``FSDP2_COLLECTIVE_TIMEOUT``
seconds (default 300). When it expires, the rank publishes its own state, asks every peer for a
fresh entry, reads their entries without blocking (``store.check`` first, so a dead rank costs
nothing) and raises :class:`CollectiveTimeoutError`: per rank, whether it issued the collective,
what it issued instead, and what it was last seen doing. See [Note: fresh entries].

[Note: fresh entries]
An entry is only as new as its publisher's last run, and that depends on the machine: a loaded
machine schedules the thread late, a long call holding the GIL stops it, and a store client
serves one request at a time, so a rank whose main thread blocks in the store (the next
``new_group``'s rendezvous, a barrier, a user's ``store.wait``) would hold its publisher behind
that request for as long as it lasts. An old entry read as current names a rank that issued the
collective as MISSING from it. So a report does not trust an entry's age: it adds one to the
store's counter ``_ASKED`` and waits (at most ``_answer_wait()``) until every peer's entry says
it answered that ask or a later one; each publisher reads the counter every ``_poll_period()``
and republishes at once when it grew, through a store client of its own (``Store.clone``) that
nothing else queues behind. An entry that answered was taken after the deadline passed, so what
it says a rank issued is all it had issued by then. A rank that does not answer in time is
reported as such, with what its older entry knew and how old that is, never as MISSING. A rank
that exited wrote its last entry then: it needs no answer. The cost: one small store read per
rank per poll period, nothing per collective.

A rank's state is per rank, not per process: on torch's multi-threaded process group the ranks
are threads of one process, each with its own ring, counts and store entry. A rank's waits are
per thread: a thread taking state off the training thread (``consistent_state``) may wait in a
collective of its own while the training thread waits in the step's. At interpreter exit
a rank publishes that it exited, so a peer still waiting for it can say so.

Backends without a deadline (``waiting.py``): where a process group's works reject a finite
``wait(timeout)`` (torch's threaded process group, many out-of-tree backends), fsdp2 waits
without one; the publisher thread then logs the report once a wait passes the deadline, and the
backend's own timeout ends it. The same holds for DTensor's redistributions, whatever the backend:
DTensor waits on them (``collectives.redistribute``). Any error the backend raises from a wait
(gloo's "Connection closed by peer" when a rank exited) becomes :class:`CollectiveFailedError`,
with the same per-rank lines.

CUDA: NCCL's ``work.wait()`` only makes the current stream wait; the host never blocks there,
so no deadline applies and the report is not raised (NCCL's own watchdog ends the job at the
process group's timeout). The entries are still published, and :func:`describe_ranks` reads them.
"""

from __future__ import annotations

import atexit
import json
import logging
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Store

from fsdp2.debug import report
from fsdp2.debug import waiting as waits
from fsdp2.debug.waiting import timeout_s

__all__ = [
    "CollectiveFailedError",
    "CollectiveTimeoutError",
    "Event",
    "blocked_in",
    "describe_ranks",
    "note",
    "timeout_s",
    "wait",
]

logger = logging.getLogger("fsdp2")

_RING = 8  # events kept per rank
_PUBLISHED = 4  # of which the newest are published
_KEY = "fsdp2/debug/hang/rank{}"
_ASKED = "fsdp2/debug/hang/asked"  # how many reports asked for fresh entries: [Note: fresh entries]


class CollectiveTimeoutError(RuntimeError):
    """One of fsdp2's collectives did not finish within ``FSDP2_COLLECTIVE_TIMEOUT`` seconds."""


class CollectiveFailedError(CollectiveTimeoutError):
    """One of fsdp2's collectives failed before its deadline: the backend raised while this rank
    waited (gloo's "Connection closed by peer": a peer rank exited or crashed)."""


class Event:
    """One collective this rank issued."""

    __slots__ = ("dtype", "group", "label", "name", "numel", "op", "rank", "seq", "time")

    def __init__(
        self, op: str, label: str, tensor: torch.Tensor, group: dist.ProcessGroup, rank: _Rank
    ) -> None:
        self.op = op
        self.label = label  # comma-joined FQNs of the group's modules ("" for the root)
        # An all-to-all's splits may differ between ranks: its size is no fact to compare.
        self.numel = tensor.numel() if op != "all_to_all" else -1
        self.dtype = tensor.dtype
        self.group = group
        # Named now, while a collective is issued on it: a report may come after it was destroyed.
        self.name: str = group.group_name
        self.rank = rank  # the issuing rank's state
        # This rank's collectives on ``group`` before this one:
        self.seq = rank.counts.get(self.name, 0)
        rank.counts[self.name] = self.seq + 1
        self.time = time.time()

    def as_dict(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "label": self.label,
            "numel": self.numel,
            "dtype": str(self.dtype).removeprefix("torch."),
            "group": self.name,
            "seq": self.seq,
            "time": self.time,
        }


# A thread's wait: the collective, since when, whether it is another library's (untimed), and
# when it raised (0.0: still waiting).
_Wait = tuple[Event, float, bool, float]


class _Rank:
    """One rank's recent collectives and where it publishes them. One per process; one per
    thread on torch's multi-threaded process group, whose ranks are threads of one process (a
    module-level ring there would mix the ranks' collectives and their sequence numbers)."""

    __slots__ = (
        "__weakref__", "answered", "counts", "exited", "last", "own_store", "polled",
        "published", "rank", "ring", "store", "waits", "warned",
    )  # fmt: skip

    def __init__(self, rank: int, store: Store | None) -> None:
        self.rank = rank
        self.store = store  # its world's store, kept: a report may outlive the default group
        self.ring: deque[Event] = deque(maxlen=_RING)
        # Collectives issued per process group, by name: keyed by the group itself, this would
        # keep every destroyed group alive.
        self.counts: dict[str, int] = {}
        # Per thread (its ident): the collective it is blocked in, since when, and whether the
        # wait is another library's (blocked_in: no deadline of ours). Per thread, since a
        # thread taking state (consistent_state) may wait while the training thread does.
        self.waits: dict[int, _Wait] = {}
        self.exited: dict[str, Any] | None = None  # set at interpreter exit
        self.published: tuple[int, int] | None = None  # what was last published (marker), when
        self.last = 0.0
        self.warned: set[int] = set()  # ids of the untimed waits logged (_watch), while they last
        # The publisher's client of the store (a clone, made on first use), which no request
        # of this rank's main thread holds up: [Note: fresh entries].
        self.own_store: Store | None = None
        self.answered = 0  # the latest ask (the value of _ASKED) an entry of it answered
        self.polled = 0.0  # when the publisher last read _ASKED (monotonic)

    def blocked(self) -> list[_Wait]:
        """Every thread's wait, the longest first. One that raised, for a deadline more: a peer
        reporting about then reads the same line, and a thread that goes on (a taker whose
        agreement failed) is not named blocked for good."""
        now, limit = time.time(), timeout_s()
        live = [w for w in list(self.waits.values()) if not w[3] or now - w[3] < limit]
        return sorted(live, key=lambda w: w[1])

    def entry(self) -> dict[str, Any]:
        return {
            "time": time.time(),
            "counts": dict(self.counts),
            "recent": [e.as_dict() for e in list(self.ring)[-_PUBLISHED:]],
            "waiting": [{**e.as_dict(), "since": since} for e, since, _, _ in self.blocked()],
            "exited": self.exited,
            "answered": self.answered,
        }

    def marker(self) -> tuple[int, int]:
        """What was last published, by identity only: holding the event itself would keep its
        process group alive after ``destroy_process_group`` until the next publish (up to
        ``_interval()`` later)."""
        return (id(self.ring[-1]) if self.ring else 0, hash(tuple(map(id, self.blocked()))))

    def publish(self, store: Store | None = None) -> None:
        """Write this rank's entry, through ``store`` (the publisher's own client) or the
        world's."""
        self.published = self.marker()
        self.last = time.monotonic()
        try:
            store = store or self.store
            if store is not None:
                store.set(_KEY.format(self.rank), json.dumps(self.entry()))
        except Exception:  # the store is gone (its host exited): nothing to tell
            pass

    def serve(self) -> None:
        """One round of the publisher for this rank: answer a report's ask at once, else
        publish what changed, at most once an interval ([Note: fresh entries])."""
        if self.store is None:
            return
        store = self.publisher_store()
        now = time.monotonic()
        if now - self.polled >= _poll_period():
            self.polled = now
            try:
                # A read, not add(_ASKED, 0): a FileStore appends a record per add.
                asked = int(store.get(_ASKED)) if store.check([_ASKED]) else 0
            except Exception:  # the store is gone: nobody left to ask
                asked = 0
            if asked > self.answered:
                self.answered = asked
                self.publish(store)
                return
        if self.marker() != self.published and now - self.last >= _interval():
            self.publish(store)

    def publisher_store(self) -> Store:
        if self.own_store is None:
            shared = self.store
            if shared is None:
                raise AssertionError(f"rank {self.rank}: expected a store to clone, found none")
            clone = getattr(shared, "clone", None)  # not in every Store's stubs
            try:
                self.own_store = shared if clone is None else clone()
            except Exception:  # a store that cannot be cloned: share the rank's client
                self.own_store = shared
        return self.own_store


# Each rank's state per process group it issued on, and per world (its default group); weakly,
# so that a destroyed group goes. ``_states``: every live one, for the publisher.
_by_group: weakref.WeakKeyDictionary[dist.ProcessGroup, _Rank] = weakref.WeakKeyDictionary()
_by_world: weakref.WeakKeyDictionary[dist.ProcessGroup, _Rank] = weakref.WeakKeyDictionary()
_states: weakref.WeakSet[_Rank] = weakref.WeakSet()
_unpublished = _Rank(-1, None)  # a group outside any default group's world: nowhere to publish
_thread: threading.Thread | None = None
# Set at exit: the publisher stops before finalization begins. A daemon thread still inside a
# store call then (the call releases the GIL) would take the GIL back in a C++ destructor after
# finalization began, which ends the thread there: SIGABRT at exit.
_stopping = threading.Event()


def _rank_of(group: dist.ProcessGroup) -> _Rank:
    """The state of the rank issuing on ``group`` (asked per collective: one dict look-up)."""
    state = _by_group.get(group)
    if state is None:
        state = _by_group[group] = _world_rank()
    return state


def _world_rank() -> _Rank:
    try:  # thread-local on the multi-threaded process group
        world = dist.distributed_c10d._get_default_group()
        state = _by_world.get(world)
        if state is None:
            store = dist.distributed_c10d._get_default_store()
            state = _by_world[world] = _Rank(dist.get_rank(), store)
            _states.add(state)
    except Exception:  # no default group: a group built by hand
        return _unpublished
    return state


def note(op: str, label: str, tensor: torch.Tensor, group: dist.ProcessGroup) -> Event:
    """Record a collective about to be issued on ``group``."""
    state = _rank_of(group)
    event = Event(op, label, tensor, group, state)
    state.ring.append(event)
    if _thread is None:
        _start_publisher()
    return event


def wait(work: dist.Work, event: Event, device: torch.device, phase: str = "") -> None:
    """``work.wait()``, bounded by the deadline where the host blocks (not on CUDA) and the
    backend's works accept one; a failure in the backend raises :class:`CollectiveFailedError`."""
    if device.type != "cpu":  # an accelerator: wait() only orders streams, never blocks
        work.wait()
        return
    state, me = event.rank, threading.get_ident()
    started = time.time()
    state.waits[me] = (event, started, False, 0.0)
    # A wait that ends in our error leaves the thread "blocked in" the collective for its peers'
    # reports, for a deadline more (``_Rank.blocked``): the group is unusable after it, and a
    # peer whose deadline passes a moment later reads the same line whether this rank has
    # raised yet or not (its answer is fresh).
    try:
        finished = waits.wait(work, event.group)
    except Exception as e:
        failure = CollectiveFailedError(_failure(event, phase, e))
        state.waits[me] = (event, started, False, time.time())
        raise failure from e
    except BaseException:  # interrupted (KeyboardInterrupt): no longer in it
        state.waits.pop(me, None)
        raise
    if not finished:
        state.publish()
        report = _report(event, phase, time.time() - started)  # asks the peers: fresh entries
        state.waits[me] = (event, started, False, time.time())
        raise CollectiveTimeoutError(report)
    state.waits.pop(me, None)


@contextmanager
def blocked_in(event: Event, device: torch.device) -> Iterator[None]:
    """The rank is blocked in ``event`` while the block runs: a collective another library
    waits on (DTensor's), where fsdp2 sets no deadline. The publisher logs the report once the
    wait passes ``FSDP2_COLLECTIVE_TIMEOUT`` (``_watch``); the backend's own timeout ends it. On
    an accelerator the host does not block there: nothing to watch."""
    if device.type != "cpu":
        yield
        return
    state, me = event.rank, threading.get_ident()
    state.waits[me] = (event, time.time(), True, 0.0)
    try:
        yield
    finally:
        state.waits.pop(me, None)


# ---------------------------------------------------------------------------------------------
# Publishing
# ---------------------------------------------------------------------------------------------


def _start_publisher() -> None:
    global _thread
    _thread = threading.Thread(target=_publish_loop, name="fsdp2-hang-report", daemon=True)
    _thread.start()
    atexit.register(_at_exit)


def _publish_loop() -> None:
    # Short naps, so that a timeout lowered at run time (tests) takes effect at once; the
    # event ends the loop at exit (see _at_exit).
    while not _stopping.wait(min(_poll_period(), 0.5)):
        for state in _live_states():
            state.serve()
            _watch(state)


def _live_states() -> list[_Rank]:
    try:
        return list(_states)
    except RuntimeError:  # a rank thread added one meanwhile: then, next time
        return []


def _watch(state: _Rank) -> None:
    """A wait without a deadline (its backend rejects one) that has passed it: log the hang
    report, once per wait. The wait itself goes on, until the backend's own timeout."""
    blocked = state.blocked()
    state.warned &= {id(w) for w in blocked}  # forget the waits that ended
    for w in blocked:
        event, since, untimed, _ = w
        if id(w) in state.warned or (not untimed and waits.is_timed(event.group)):
            continue
        if time.time() - since < timeout_s():
            continue
        state.warned.add(id(w))
        try:
            report = _report(event, "")
        except Exception:  # the rank's world is thread-local (threaded process group): not ours
            return
        whose = "DTensor waits" if untimed else "This backend's works reject a finite timeout"
        logger.error(
            "%s\n%s: fsdp2 cannot end the wait, which goes on until the backend's own timeout.",
            report,
            whose,
        )


def _at_exit() -> None:
    """The interpreter is exiting (the script ended, or raised): tell the peers, which may still
    wait for this rank in a collective (its data loader ran out a batch before theirs)."""
    _stopping.set()
    if _thread is not None:
        _thread.join(timeout=_EXIT_JOIN_S)
    error = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)  # uncaught
    how = "normally" if error is None else f"after an uncaught {type(error).__name__}"
    for state in list(_states):
        if state.ring:
            state.exited = {"time": time.time(), "how": how}
            state.publish()


_EXIT_JOIN_S = 5.0  # a publisher blocked on a store whose host is gone is left behind


def _interval() -> float:
    """Seconds between two publications of what changed (a report asks for fresher ones)."""
    return min(timeout_s() / 4, 30.0)


def _poll_period() -> float:
    """Seconds between two reads of the ask counter by a publisher: several per
    ``_answer_wait()``, and no more than one per 2 s, the store's load on a large job."""
    return min(_interval() / 4, 2.0)


def _answer_wait() -> float:
    """How long a report waits for its peers' answers: a publishing interval (what it slept
    before it asked), at least a second, which a loaded machine may take to run a thread."""
    return max(_interval(), 1.0)


def _read(store: Store, ranks: list[int], entries: dict[int, dict[str, Any]]) -> None:
    """Every listed rank's published entry, into ``entries``; never blocks on a rank that
    published nothing."""
    try:
        for rank in ranks:
            key = _KEY.format(rank)
            if store.check([key]):
                entries[rank] = json.loads(store.get(key))
    except Exception:  # a dead store: report what was read
        pass


def _answered(entry: dict[str, Any] | None, asked: int) -> bool:
    """Whether ``entry`` is fresh: it answered ask ``asked`` or a later one, or its rank
    exited (its last entry, written at exit)."""
    return entry is not None and (
        entry.get("answered", 0) >= asked or entry.get("exited") is not None
    )


def _collect(state: _Rank, ranks: list[int]) -> tuple[dict[int, dict[str, Any]], set[int]]:
    """The peers' entries, fresh where they answer within ``_answer_wait()``, and which ranks
    did not answer ([Note: fresh entries])."""
    entries: dict[int, dict[str, Any]] = {}
    peers = [rank for rank in ranks if rank != state.rank]
    store = state.store
    if store is None:
        return entries, set(peers)
    try:
        asked = store.add(_ASKED, 1)
    except Exception:  # a dead store: nobody can answer
        _read(store, peers, entries)
        return entries, set(peers)
    deadline = time.monotonic() + _answer_wait()
    pending = peers
    while True:
        _read(store, pending, entries)
        pending = [rank for rank in pending if not _answered(entries.get(rank), asked)]
        if not pending or time.monotonic() >= deadline:
            return entries, set(pending)
        # On the threaded process group the peers are threads of this process, and their
        # publisher may be this very thread (_watch): answer for them here too.
        for local in _live_states():
            local.serve()
        time.sleep(min(_poll_period(), 0.5) / 2)


# ---------------------------------------------------------------------------------------------
# The report (its words: report.py)
# ---------------------------------------------------------------------------------------------


def describe_ranks(event: Event, ranks: list[int], own: str = "blocked in it") -> list[str]:
    """One line per rank of ``ranks``: where it is, relative to ``event`` (``own``: what to say
    of the rank that issued ``event``)."""
    state, target = event.rank, event.as_dict()
    entries, silent = _collect(state, ranks)
    now, answer_wait = time.time(), _answer_wait()
    return [
        f"rank {rank} (this rank): {own}"
        if rank == state.rank
        else report.rank_line(rank, entries.get(rank), target, now, rank not in silent, answer_wait)
        for rank in ranks
    ]


def _where(event: Event, phase: str, own: str = "blocked in it") -> tuple[list[int], str, str]:
    """The group's ranks, what ``event`` was, and every rank's line."""
    ranks = dist.get_process_group_ranks(event.group)
    target = report.describe(event.as_dict())
    what = f"the {phase} the {target}" if phase else f"the {target}"
    lines = "\n".join(f"  {line}" for line in describe_ranks(event, ranks, own))
    return ranks, what, f"Where each rank is (from the c10d store):\n{lines}\n"


def _report(event: Event, phase: str, waited: float | None = None) -> str:
    """The hang report; ``waited``: how long the wait lasted (see ``report.timed_out``)."""
    ranks, what, where = _where(event, phase)
    return report.timed_out(event.rank.rank, what, ranks, where, waited, timeout_s())


def _failure(event: Event, phase: str, error: Exception) -> str:
    ranks, what, where = _where(event, phase, own="waiting in it")
    return report.failed(event.rank.rank, what, ranks, where, error)
