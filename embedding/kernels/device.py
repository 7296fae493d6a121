"""The kernel functions of a device: the NumPy reference or its CuPy CUDA twin."""
from __future__ import annotations

__all__ = ["kernel_module"]


def kernel_module(device: str = "cpu"):
    """The kernel functions for ``device``: :mod:`~embedding.kernels.cpu` or its CUDA twin."""
    if device == "cuda":
        from embedding.kernels import cuda

        return cuda
    if device != "cpu":
        raise ValueError(f"device: expected 'cpu' or 'cuda', got {device!r}")
    from embedding.kernels import cpu

    return cpu
