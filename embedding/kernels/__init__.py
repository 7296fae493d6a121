"""Fused embedding kernels: multi-table pooled lookup and backward + sparse optimizer.

Each kernel has a NumPy implementation (:mod:`~embedding.kernels.cpu`, the
reference semantics and the CPU path) and a CuPy CUDA twin
(:mod:`~embedding.kernels.cuda`, sources in :mod:`~embedding.kernels.cuda_src`).
:class:`FusedTables` owns packed local tables and their optimizer state and
dispatches to either.
"""
from embedding.kernels.device import kernel_module
from embedding.kernels.fused import FusedTables
from embedding.kernels.layout import Bags, TableLayout

__all__ = ["FusedTables", "Bags", "TableLayout", "kernel_module"]

