"""The tensors the seam (collectives.py) hands a backend, and when the backend lets go of them.

[Note: a backend thread's last reference]
A backend's work holds the tensors it was given, and a backend thread may hold the work after
``wait()`` returned: gloo's worker drops a finished work a moment later, NCCL's watchdog when it
next polls. A tensor with a Python object keeps that object alive while C++ holds the tensor
too, and lets go of it when the last C++ holder goes (c10/util/intrusive_ptr.h, torch 2.13),
which takes the GIL on whichever thread that holder lives. If the interpreter began to finalize meanwhile, taking the
GIL ends that thread (pthread_exit) in the middle of a ``noexcept`` destructor: the process
aborts ("terminate called without an active exception") after the script's work is done, about
one run in four for a script whose last act is ``iter_full_weights`` on a busy machine.

So a backend gets its own tensors from :func:`hand`: a ``detach()`` of the caller's tensor (the
same memory and version counter, no view tracking, so it keeps no base alive) that only the
backend holds once the seam let go of it. Then that tensor dies exactly when the backend's last
holder drops it, and its Python object with it: the GIL work is done once it is dead. That holds
only while the backend holds nothing else on the same memory: gloo's all_gather_into_tensor cuts
its output into views of its own, the last of which lets go of the memory after the handed
tensor died, and with it the memory's Python object (``untyped_storage()`` makes one; the
engine's buffers have one), on gloo's thread, after exit may have stopped waiting. So the seam
issues each collective in a form whose work holds only what it was handed
(``collectives._gather``: gloo's list form, handed the rows). Once a
collective was waited on, :func:`settle_later` watches its tensors weakly, and an ``atexit``
hook (run before finalization begins) waits for the watched ones to die, napping so that the
backend's thread can take the GIL. A work never waited on is not watched (a rank that raised
mid-step must not wait at exit for a gather it left in flight), nor are the pluggable
collectives' (comm.py), whose tensors are the plugin's own. fsdp2's own thread that calls into
C++ with the GIL released, the hang report's publisher, is stopped and joined at exit for the
same reason (debug/hang.py).
"""

from __future__ import annotations

import atexit
import time
import weakref
from collections.abc import Iterable

import torch

__all__ = ["alias", "drop", "hand", "settle", "settle_later", "unsettled"]

# The most seconds exit waits for the backend's threads: they let go within milliseconds, this
# bounds a wedged backend.
SETTLE_TIMEOUT_S = 10.0

# Tensors handed to a backend whose work was waited on and that are still alive, by their
# weakref's id (Tensor's own ``__eq__`` is elementwise: no set of weakrefs to tensors).
_watched: dict[int, weakref.ref[torch.Tensor]] = {}


def hand(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor for the backend to hold: ``tensor``'s memory and version counter, and nothing
    else (see [Note: a backend thread's last reference])."""
    return tensor.detach()


def alias(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor on ``tensor``'s memory that keeps nothing else alive (a view keeps its base),
    with a version counter of its own: :func:`drop` may empty it without touching ``tensor``."""
    new = tensor.new_empty(0)
    return new.set_(
        tensor.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride()
    )


def drop(tensor: torch.Tensor) -> None:
    """Let go of ``tensor``'s memory (whoever still holds the tensor sees it empty)."""
    tensor.set_()  # type: ignore[call-overload]


def settle_later(tensors: Iterable[torch.Tensor]) -> None:
    """Watch ``tensors`` (handed to a collective that was waited on; the caller lets go of
    them) until the backend drops them; exit waits for them (see :func:`settle`)."""
    for tensor in tensors:
        ref = weakref.ref(tensor, _forget)
        _watched[id(ref)] = ref


def _forget(ref: weakref.ref[torch.Tensor]) -> None:
    # Called on the thread that dropped the tensor (a backend's, holding the GIL).
    _watched.pop(id(ref), None)


def unsettled() -> int:
    """How many watched tensors a backend still holds."""
    return len(_watched)


def settle(timeout_s: float = SETTLE_TIMEOUT_S) -> bool:
    """Wait until the backends let go of every watched tensor (napping: their threads need the
    GIL to let go); whether they did within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while _watched:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


atexit.register(settle)
