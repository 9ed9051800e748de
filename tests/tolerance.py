"""The suite's rule for comparing floating-point results: tolerances follow from the arithmetic.

A sharded run and a single-process reference compute the same fp32 values in a different order:
each rank sums over its part of the batch and the collective sums the ranks' partial results
(a reduce-scatter, an all-reduce of the loss), where one process sums everything in one kernel.
The CPU kernels add in a different order again on another machine: AVX-512 kernels keep 16
partial sums per vector where AVX2 keeps 8, and blocking depends on the kernel set. So no fp32
comparison between a sharded run and a reference may rely on what one CPU happened to round.

fp32 carries 24 bits (unit roundoff u = 2**-24 ~ 6e-8). Two orderings of a sum of n terms differ
by at most ~2 n u sum|x_i| and in practice by ~sqrt(n) u sum|x_i|. The tests' sums have up to
~10^4 terms (batch x sequence x width) with sum|x_i| within ~10x of |sum x_i| (losses and
gradients of small, well-conditioned models), which gives ~100 x 6e-8 x 10 ~ 6e-6 relative:
``FP32_RTOL = 1e-5``. A value that cancels to ~0 (a gradient entry) has no relative accuracy,
only ~n u max|x_i| absolute: ``FP32_ATOL = 1e-6``. Python floats compared with
``torch.testing.assert_close`` would otherwise get float64's defaults (rtol 1e-7), far below
fp32's own precision; that is how a loss 1.4e-7 off on an AVX2 machine failed a test.

On an AVX-512 machine, AVX2's kernels run with ``ATEN_CPU_CAPABILITY=avx2
MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2`` (and a fresh ``TORCHINDUCTOR_CACHE_DIR``:
inductor's cache does not key on the capability). CI runs the suite that way too.

Optimizer steps carry these differences into the parameters; see ``tests.parity.build`` for the
Adam slack (``param_atol``). `Tolerance` bundles one comparison's bounds; the parity framework
(``tests.parity``) takes one per check. Bitwise comparisons (``torch.equal``, ``rtol=0, atol=0``) are right only
where both sides run the same operations on the same values in the same process (a resumed run
against the uninterrupted one, a copy against its original, a shard against the slice of a full
tensor); each such check says why in a comment.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

__all__ = [
    "BF16_TOL",
    "FP32",
    "FP32_ATOL",
    "FP32_RTOL",
    "PARAM_ATOL",
    "SAME_ARITHMETIC",
    "SGD_FP32",
    "Tolerance",
    "assert_fp32_close",
]

FP32_RTOL = 1e-5
FP32_ATOL = 1e-6
# Parameters after AdamW steps: Adam turns a gradient difference into a parameter difference
# up to lr / eps times as large (near g = 0). With the suite's lr 1e-2 and ADAM_EPS 1e-3
# (tests.parity) that is 10 x FP32_ATOL.
PARAM_ATOL = 1e-5


@dataclass(frozen=True, kw_only=True)
class Tolerance:
    rtol: float = FP32_RTOL
    atol: float = FP32_ATOL
    """For losses and gradients."""
    param_atol: float = PARAM_ATOL
    """For parameters after training: Adam turns gradient rounding noise into update noise."""
    normwise: bool = False
    """Compare ``|actual - expected| <= atol + rtol |expected|`` over whole tensors (2-norms)
    rather than per element: low-precision sums with cancellation have large per-element
    relative errors that say nothing about the computation as a whole."""

    def for_params(self) -> Tolerance:
        """The bound for parameters after optimizer steps."""
        return replace(self, atol=self.param_atol)


FP32 = Tolerance()
# SGD moves each parameter by lr * g, exact per element: parameters compare as tightly as
# gradients.
SGD_FP32 = Tolerance(param_atol=FP32_ATOL)
# bf16 keeps 8 significant bits: per-rank partial sums rounded to bf16 differ from one sum over
# the global batch by a few bf16 ulps, and sums with cancellation (a LayerNorm weight's gradient)
# have large per-element relative errors: compare whole tensors. Parameters after AdamW: an
# element whose gradient cancels to within bf16's rounding of 0 may take its step of size lr
# (the suite's 1e-2, tests.parity.build) in the other direction: 2 lr of slack, for one such
# flip (the gradients themselves are compared before every step at rtol).
BF16_TOL = Tolerance(rtol=2e-2, atol=1e-6, param_atol=2e-2, normwise=True)
# A reference that does the very same arithmetic (see tests.parity.cast_forward) must match
# exactly. Only with 2 data-parallel ranks: a sum of two gradients is the same in either order,
# and halving (the mean) is exact in binary; with more ranks the collective's summation order is
# its own.
SAME_ARITHMETIC = Tolerance(rtol=0, atol=0, param_atol=0)


def assert_fp32_close(
    actual: Any, expected: Any, *, atol: float = FP32_ATOL, msg: Any = None
) -> None:
    """``assert_close`` at the fp32 reordering tolerance above; for tensors, lists of them, and
    Python floats (losses), which must not get float64's tolerance. ``atol=PARAM_ATOL`` for
    parameters after optimizer steps."""
    torch.testing.assert_close(actual, expected, rtol=FP32_RTOL, atol=atol, msg=msg)
