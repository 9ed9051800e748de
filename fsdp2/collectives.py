"""Deprecated path: ``fsdp2.collectives.record_collectives`` was documented before the layout of
issue 23 moved the seam into ``fsdp2/engine/``. Kept working, with a warning; use
``fsdp2.record_collectives`` and ``fsdp2.CollectiveRecord``."""

import warnings

from fsdp2.engine.collectives import CollectiveRecord, record_collectives

__all__ = ["CollectiveRecord", "record_collectives"]

warnings.warn(
    "fsdp2.collectives is deprecated: use fsdp2.record_collectives and fsdp2.CollectiveRecord",
    DeprecationWarning,
    stacklevel=2,
)
