"""Numerical guards of a training step: non-finite tensors and bad labels.

Each check names the step and the offending tensor, so a NaN that appears at
step 81 233 in the top MLP's output is reported as such rather than as a bad
AUC three hours later. The checks work on NumPy and CuPy arrays alike.
"""
from __future__ import annotations

import numpy as np

from embedding.dense._xp import array_module, to_numpy
from embedding.types import BatchError
from neocomm.errors import NeocommError

__all__ = ["NonFiniteError", "check_finite", "check_loss", "check_labels"]


class NonFiniteError(NeocommError, FloatingPointError):
    """A tensor holds NaN or ±inf.

    ``step`` is the training step (-1 when unknown), ``tensor`` its name,
    ``count`` how many elements are not finite and ``index`` the first one
    (flat index).
    """

    def __init__(self, message: str, *, step: int = -1, tensor: str = "", count: int = 0,
                 index: int = -1):
        super().__init__(message)
        self.step = int(step)
        self.tensor = tensor
        self.count = int(count)
        self.index = int(index)


def check_finite(step: int = -1, /, **tensors) -> None:
    """Raise :class:`NonFiniteError` for the first of ``tensors`` holding NaN or inf.

    Example: ``check_finite(step, dense=batch.dense, logits=logits)``.
    """
    for name, value in tensors.items():
        xp = array_module(value)
        arr = xp.asarray(value)
        if arr.dtype.kind not in "fc":
            continue
        finite = xp.isfinite(arr)
        if bool(finite.all()):
            continue
        bad = to_numpy(~finite).reshape(-1)
        first = int(np.flatnonzero(bad)[0])
        sample = to_numpy(arr).reshape(-1)[first]
        where = f"step {step}: " if step >= 0 else ""
        raise NonFiniteError(f"{where}{name} holds {int(bad.sum())} non-finite value(s) of "
                             f"{bad.size}; the first is {sample} at flat index {first}",
                             step=step, tensor=name, count=int(bad.sum()), index=first)


def check_loss(loss, step: int = -1) -> float:
    """The loss as a Python float; :class:`NonFiniteError` naming ``step`` when it is NaN or inf."""
    check_finite(step, loss=loss)
    flat = np.asarray(to_numpy(loss)).reshape(-1)
    if flat.size != 1:
        raise ValueError(f"loss: expected a scalar, got {flat.size} elements")
    return float(flat[0])


def check_labels(labels, step: int = -1, name: str = "labels") -> None:
    """Raise :class:`BatchError` naming ``step`` when a label is not exactly 0 or 1."""
    xp = array_module(labels)
    arr = xp.asarray(labels)
    ok = (arr == 0) | (arr == 1)
    if bool(ok.all()):
        return
    bad = to_numpy(~ok).reshape(-1)
    first = int(np.flatnonzero(bad)[0])
    value = to_numpy(arr).reshape(-1)[first]
    raise BatchError(f"{name}: {int(bad.sum())} label(s) outside {{0, 1}}; the first is "
                     f"{value} at index {first}", step=step, tensor=name, index=first)
