"""Errors of the embedding layer that a user's data or call can cause.

(:mod:`embedding.types` re-exports them with the layer's vocabulary.)
"""
from __future__ import annotations

from neocomm.errors import NeocommError

__all__ = ["BatchError"]


class BatchError(NeocommError, ValueError):
    """A batch holds values a model must not see (a label outside {0, 1}, an id out of range).

    ``step`` is the training step (-1 when unknown), ``tensor`` the offending
    array's name and ``index`` the first offending position (flat, -1 if none).
    """

    def __init__(self, message: str, *, step: int = -1, tensor: str = "", index: int = -1):
        prefix = f"step {step}: " if step >= 0 else ""
        super().__init__(prefix + message)
        self.step = int(step)
        self.tensor = tensor
        self.index = int(index)
