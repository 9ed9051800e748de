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

Optimizer steps carry these differences into the parameters; see ``tests.parity`` for the Adam
slack (``param_atol``). Bitwise comparisons (``torch.equal``, ``rtol=0, atol=0``) are right only
where both sides run the same operations on the same values in the same process (a resumed run
against the uninterrupted one, a copy against its original, a shard against the slice of a full
tensor); each such check says why in a comment.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["FP32_ATOL", "FP32_RTOL", "PARAM_ATOL", "assert_fp32_close"]

FP32_RTOL = 1e-5
FP32_ATOL = 1e-6
# Parameters after AdamW steps: Adam turns a gradient difference into a parameter difference
# up to lr / eps times as large (near g = 0). With the suite's lr 1e-2 and ADAM_EPS 1e-3
# (tests.parity) that is 10 x FP32_ATOL.
PARAM_ATOL = 1e-5


def assert_fp32_close(
    actual: Any, expected: Any, *, atol: float = FP32_ATOL, msg: Any = None
) -> None:
    """``assert_close`` at the fp32 reordering tolerance above; for tensors, lists of them, and
    Python floats (losses), which must not get float64's tolerance. ``atol=PARAM_ATOL`` for
    parameters after optimizer steps."""
    torch.testing.assert_close(actual, expected, rtol=FP32_RTOL, atol=atol, msg=msg)
