"""Local embedding shards in one flat buffer with their optimizer state.

:class:`FusedTables` owns the weights of several local tables (or shards of
tables) packed by a :class:`~embedding.kernels.layout.TableLayout`, and the
sparse optimizer's state laid out the same way. Its methods dispatch to the
NumPy kernels (``device="cpu"``) or their CuPy twins (``device="cuda"``).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from embedding.kernels.layout import SUPPORTED_DTYPES, Bags, TableLayout
from embedding.optim import state_specs
from embedding.types import OptimizerConfig

__all__ = ["FusedTables"]


class FusedTables:
    """Several local tables of ``rows[t] × dims[t]`` sharing one optimizer config.

    Weights start at zero; fill them through :meth:`weight` views (or the
    ``init`` helpers of the collection). ``device`` is ``"cpu"`` (NumPy) or
    ``"cuda"`` (CuPy, current device).
    """

    def __init__(self, rows: Sequence[int], dims: Sequence[int], optimizer: OptimizerConfig,
                 dtype: str = "float32", device: str = "cpu",
                 names: Sequence[str] | None = None):
        self.layout = TableLayout(tuple(rows), tuple(dims))
        if not isinstance(optimizer, OptimizerConfig):
            raise TypeError(f"optimizer: expected an OptimizerConfig, got "
                            f"{type(optimizer).__name__}")
        self.optimizer = optimizer
        if np.dtype(dtype).name not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype: expected one of {list(SUPPORTED_DTYPES)}, got {dtype}")
        self.dtype = np.dtype(dtype)
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device: expected 'cpu' or 'cuda', got {device!r}")
        self.device = device
        if device == "cuda":
            from embedding.kernels import cuda

            ok, why = cuda.available()
            if not ok:
                raise RuntimeError(f"device 'cuda' is not usable here: {why}")
            import cupy

            self.xp = cupy
            self._impl = cuda
        else:
            from embedding.kernels import cpu

            self.xp = np
            self._impl = cpu
        self.names = tuple(names) if names is not None else tuple(
            f"table{i}" for i in range(self.layout.num_tables))
        if len(self.names) != self.layout.num_tables:
            raise ValueError(f"names: expected {self.layout.num_tables}, got {len(self.names)}")
        lay = self.layout
        self.weights = self.xp.zeros(lay.total_elements, self.dtype)
        self.state = {
            spec.name: self.xp.zeros(lay.total_rows if spec.per_row else lay.total_elements,
                                     spec.dtype or self.dtype)
            for spec in state_specs(optimizer.kind)}

    def __repr__(self) -> str:
        return (f"FusedTables({len(self.names)} tables, {self.layout.total_rows} rows, "
                f"{self.dtype.name}, {self.optimizer.kind.value}, {self.device})")

    @property
    def num_tables(self) -> int:
        return self.layout.num_tables

    def weight(self, t: int):
        """Table ``t``'s ``[rows, dim]`` weights (a view: writes go to the buffer)."""
        lay = self.layout
        off = lay.weight_offsets[t]
        return self.weights[off:off + lay.rows[t] * lay.dims[t]].reshape(lay.rows[t],
                                                                          lay.dims[t])

    def state_view(self, t: int, name: str):
        """Table ``t``'s view of optimizer state ``name`` (``[rows]`` or ``[rows, dim]``)."""
        spec = {s.name: s for s in state_specs(self.optimizer.kind)}.get(name)
        if spec is None:
            raise KeyError(f"optimizer {self.optimizer.kind.value} keeps no state {name!r}")
        lay = self.layout
        if spec.per_row:
            base = lay.row_base[t]
            return self.state[name][base:base + lay.rows[t]]
        off = lay.weight_offsets[t]
        return self.state[name][off:off + lay.rows[t] * lay.dims[t]].reshape(lay.rows[t],
                                                                            lay.dims[t])

    # -- kernels --------------------------------------------------------
    def lookup(self, bags: Bags, out=None):
        """Pooled lookup of every bag (``[G * B, out_dim]``)."""
        return self._impl.pooled_lookup(self.layout, self.weights, bags, out)

    def aggregate(self, bags: Bags, grad_out):
        """Per table ``(rows, grads)`` of the bags' summed gradients (no update)."""
        return self._impl.aggregate_grads(self.layout, bags, self._cast(grad_out))

    def update(self, sparse, unique: bool = True) -> None:
        """Optimizer step on per-table ``(rows, grads)``; ``unique=False`` sums duplicates first."""
        sparse = [(rows, self._cast(grads)) for rows, grads in sparse]
        self._impl.apply_updates(self.layout, self.optimizer, self.weights, self.state, sparse,
                                 unique)

    def backward_update(self, bags: Bags, grad_out) -> None:
        """Fused backward + optimizer: only the rows the bags read change."""
        self._impl.backward_update(self.layout, self.optimizer, self.weights, self.state, bags,
                                   self._cast(grad_out))

    def _cast(self, arr):
        arr = self.xp.asarray(arr)
        return arr if arr.dtype == self.dtype else arr.astype(self.dtype)
