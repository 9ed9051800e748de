"""Optimizers that need each weight's whole matrix, on sharded parameters.

:class:`Muon` (momentum + Newton–Schulz orthogonalisation, AdamW for the rest) and
:class:`MatrixOptimizer`, the base that other matrix optimizers (Shampoo-, SOAP-, Dion-style)
subclass to get the same owner-per-matrix exchange: see [Note: the matrix optimizer protocol]
in fsdp2/optim/matrix.py and [Note: owner per matrix] in fsdp2/optim/owners.py.
"""

from fsdp2.optim.matrix import MatrixOptimizer
from fsdp2.optim.muon import Muon, newton_schulz

__all__ = ["MatrixOptimizer", "Muon", "newton_schulz"]
