"""Error text to pin: what a call raises, as one ``"<ExceptionType>: <message>"`` string.

The tests compare these strings with expected text (``assertExpectedInline`` or ``==``), so an
error's type is pinned together with its message.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

NO_ERROR = "no error"
TRIPWIRE = "tripwire fired"


class Tripwire(torch.autograd.Function):
    """Forward: identity. Backward: raises, as a failing op in the middle of backward would."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"{TRIPWIRE} in backward")


def error_text(fn: Callable[[], Any]) -> str:
    """``"<ExceptionType>: <message>"`` of what ``fn`` raises, or ``NO_ERROR`` if it returns."""
    try:
        fn()
    except Exception as e:  # any type: the caller pins which
        return f"{type(e).__name__}: {e}"
    return NO_ERROR


def raised(fn: Callable[[], Any]) -> str:
    """Like ``error_text``, for a call that must raise: the type is part of the contract."""
    text = error_text(fn)
    if text == NO_ERROR:
        raise AssertionError(f"{fn} did not raise")
    return text
