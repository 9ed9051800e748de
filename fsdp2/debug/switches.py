"""The debug layer's switch for the opt-in collective checks (``checks.py``).

Read by the seam (``engine/collectives.py``: whether to run the checks before a collective) and
by the hang report (``hang.py``: whether its message may say the ranks agreed so far); set from
``FSDP2_CHECK_COLLECTIVES`` at import and by :func:`set_collective_checks`.
"""

from __future__ import annotations

import os

__all__ = ["checks_enabled", "set_collective_checks"]

# Read on every collective: a module attribute, not a call.
checks_enabled = os.environ.get("FSDP2_CHECK_COLLECTIVES", "0") not in ("", "0")


def set_collective_checks(enabled: bool) -> None:
    """Turn the cross-rank collective checks on or off in this process.

    Before each of fsdp2's collectives the ranks of its process group then compare what they
    are about to issue, and all raise ``fsdp2.CollectiveMismatchError`` at the first difference
    (see docs/debugging.md). Costs one small all-gather per collective: a debugging mode.

    Args:
        enabled: ``True`` to check every collective from now on, ``False`` to stop. Call it on
            every rank at the same point of the program (a rank without checks pairs its real
            collective with the others' fingerprints); ``FSDP2_CHECK_COLLECTIVES=1`` in the
            job's environment switches them on from the start.
    """
    global checks_enabled
    checks_enabled = bool(enabled)
