"""Deprecated path: ``fsdp2.traced.set_traced`` was documented before the layout of issue 23
moved traced mode into ``fsdp2/engine/``. Kept working, with a warning; use ``fsdp2.set_traced``."""

import warnings

from fsdp2.engine.traced import set_traced

__all__ = ["set_traced"]

warnings.warn("fsdp2.traced is deprecated: use fsdp2.set_traced", DeprecationWarning, stacklevel=2)
