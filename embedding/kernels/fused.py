"""Local embedding shards in one flat buffer with their optimizer state.

:class:`FusedTables` owns the weights of several local tables (or shards of
tables) packed by a :class:`~embedding.kernels.layout.TableLayout`, and the
sparse optimizer's state laid out the same way. Its methods dispatch to the
NumPy kernels (``device="cpu"``) or their CuPy twins (``device="cuda"``).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from embedding.kernels.device import kernel_module
from embedding.kernels.layout import Bags, TableLayout, encode_after, per_table_configs
from embedding.optim import state_specs
from embedding.precision import Rounding, compute_dtype, storage_dtype
from embedding.types import OptimizerConfig, enum_arg
from neocomm.hostmem import keep_freed_memory
from neocomm.types import check_array_bfloat16, is_half

__all__ = ["FusedTables", "adopt_layout"]


def adopt_layout(store, inner: "FusedTables", device: str) -> None:
    """Give ``store`` (a store wrapping ``inner``) ``inner``'s layout, optimizers, names,
    precision (dtype, rounding, seeds, state dtype) and threads, and ``device``: what
    strategies and checkpoints read of a store."""
    store.layout = inner.layout
    store.optimizers = inner.optimizers
    store.names = inner.names
    store.dtype = inner.dtype
    store.compute_dtype = inner.compute_dtype
    store.rounding = inner.rounding
    store.seeds = inner.seeds
    store.state_dtype = inner.state_dtype
    store.device = device
    store.threads = inner.threads


class FusedTables:
    """Several local tables of ``rows[t] × dims[t]``, each with its optimizer config.

    Weights start at zero; fill them through :meth:`weight` views (or the
    ``init`` helpers of the collection). ``device`` is ``"cpu"`` (NumPy) or
    ``"cuda"`` (CuPy, current device). The process keeps the host memory its
    steps free for the next ones (:func:`neocomm.hostmem.keep_freed_memory`).

    ``dtype`` is the storage dtype of every table here (float32, float16,
    bfloat16, float64); half tables compute in float32
    (:mod:`embedding.precision`): lookups return float32, gradients are taken
    as float32, and ``rounding`` (one :class:`~embedding.precision.Rounding`
    or one per table) with ``seeds`` (one int per table) says how updates go
    back into storage. :attr:`step` counts updates (the stochastic rounding
    counter). ``state_dtype``: the optimizer's float state (default: the
    compute dtype). A ``MASTER`` table keeps float32 master rows in
    :attr:`master` (call :meth:`sync_master` after writing weights directly).
    Stochastic rounding hashes a row's local row number, or :attr:`row_keys`
    where a store that renumbers rows sets it (a cache slot rounds as its
    host row).
    """

    def __init__(self, rows: Sequence[int], dims: Sequence[int],
                 optimizer: OptimizerConfig | Sequence[OptimizerConfig],
                 dtype: str = "float32", device: str = "cpu",
                 names: Sequence[str] | None = None, threads: int = 1,
                 rounding: Rounding | str | Sequence = Rounding.NEAREST,
                 seeds: Sequence[int] | None = None, state_dtype: str | None = None):
        self.layout = TableLayout(tuple(rows), tuple(dims))
        keep_freed_memory()   # the step's temporaries reuse memory instead of page-faulting
        n = self.layout.num_tables
        self.optimizers = per_table_configs(optimizer, n)
        self.dtype = storage_dtype(dtype)
        self.compute_dtype = compute_dtype(self.dtype)
        self.state_dtype = (self.compute_dtype if state_dtype is None
                            else storage_dtype(state_dtype, "state_dtype"))
        if isinstance(rounding, (Rounding, str)):
            rounding = [rounding] * n
        self.rounding = tuple(enum_arg(Rounding, r, "rounding") for r in rounding)
        self.seeds = tuple(int(x) for x in (seeds if seeds is not None else [0] * n))
        if len(self.rounding) != n or len(self.seeds) != n:
            raise ValueError(f"rounding/seeds: expected one per table ({n}), got "
                             f"{len(self.rounding)} and {len(self.seeds)}")
        if not is_half(self.dtype) and any(r is not Rounding.NEAREST for r in self.rounding):
            raise ValueError(f"rounding: {[r.value for r in self.rounding]} needs float16 or "
                             f"bfloat16 storage, got dtype {self.dtype.name}")
        self.step = 0
        #: calls of the fused kernels (lookup, aggregate, update, backward_update) so far
        self.kernel_calls = 0
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device: expected 'cpu' or 'cuda', got {device!r}")
        if device == "cuda" and self.compute_dtype == np.float64 and is_half(self.state_dtype):
            raise ValueError(f"state_dtype: the device kernels keep {self.state_dtype.name} "
                             f"optimizer state for float32, float16 and bfloat16 tables, not "
                             f"{self.dtype.name}; use device 'cpu' or a wider state_dtype")
        self.device = device
        if int(threads) < 1:
            raise ValueError(f"threads: expected >= 1, got {threads}")
        self.threads = int(threads)
        self._impl = kernel_module(device)
        if device == "cuda":
            ok, why = self._impl.available()
            if not ok:
                raise RuntimeError(f"device 'cuda' is not usable here: {why}")
            import cupy

            self.xp = cupy
        else:
            self.xp = np
        self.names = tuple(names) if names is not None else tuple(
            f"table{i}" for i in range(self.layout.num_tables))
        if len(self.names) != self.layout.num_tables:
            raise ValueError(f"names: expected {self.layout.num_tables}, got {len(self.names)}")
        for key, dt in (("dtype", self.dtype), ("state_dtype", self.state_dtype)):
            if dt.name == "bfloat16":
                check_array_bfloat16(self.xp, f"{key} of table {self.names[0]!r}")
        lay = self.layout
        self.weights = self.xp.zeros(lay.total_elements, self.dtype)
        self._specs = {spec.name: spec for c in self.optimizers for spec in state_specs(c.kind)}
        # State of every kind in use spans the whole layout (simple flat indexing on device).
        self.state = {
            spec.name: self.xp.zeros(lay.total_rows if spec.per_row else lay.total_elements,
                                     spec.dtype or self.state_dtype)
            for spec in self._specs.values()}
        self.master = (self.xp.zeros(lay.total_elements, np.float32)
                       if Rounding.MASTER in self.rounding else None)
        #: int64 ``[total_rows]`` (this store's array module): the number stochastic
        #: rounding hashes for each row, by global row (``layout.row_base[t] + row``);
        #: None: the row number itself
        self.row_keys = None

    def master_weight(self, t: int):
        """Table ``t``'s ``[rows, dim]`` float32 master rows (a view), or None when the table
        keeps no master copy (its rounding is not ``master``)."""
        if self.master is None or self.rounding[t] is not Rounding.MASTER:
            return None
        lay = self.layout
        off = lay.weight_offsets[t]
        return self.master[off:off + lay.rows[t] * lay.dims[t]].reshape(lay.rows[t],
                                                                         lay.dims[t])

    def sync_master(self) -> None:
        """Set the float32 master rows of ``MASTER`` tables from the stored weights."""
        if self.master is not None:
            self.master[...] = self.weights.astype(np.float32)

    def __repr__(self) -> str:
        kinds = sorted({c.kind.value for c in self.optimizers})
        return (f"FusedTables({len(self.names)} tables, {self.layout.total_rows} rows, "
                f"{self.dtype.name}, {'/'.join(kinds)}, {self.device})")

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
        spec = {s.name: s for s in state_specs(self.optimizers[t].kind)}.get(name)
        if spec is None:
            raise KeyError(f"optimizer {self.optimizers[t].kind.value} of table {t} keeps no "
                           f"state {name!r}")
        lay = self.layout
        if spec.per_row:
            base = lay.row_base[t]
            return self.state[name][base:base + lay.rows[t]]
        off = lay.weight_offsets[t]
        return self.state[name][off:off + lay.rows[t] * lay.dims[t]].reshape(lay.rows[t],
                                                                            lay.dims[t])

    def take_kernel_calls(self) -> int:
        """:attr:`kernel_calls` so far, then zero it."""
        n, self.kernel_calls = self.kernel_calls, 0
        return n

    # -- kernels --------------------------------------------------------
    def prefetch(self, bags: Bags) -> None:
        """Nothing to do: every row is in this store's memory (see ``TieredTables``)."""

    def gather(self, pairs) -> list:
        """Rows ``ids`` of table ``t`` (``[len(ids), dim]``) for each ``(t, ids)``."""
        return [self.weight(t)[self.xp.asarray(ids)] for t, ids in pairs]

    def lookup(self, bags: Bags, out=None, wire=None):
        """Pooled lookup of every bag (``[G * B, out_dim]``).

        ``wire`` (a :class:`~embedding.sharding.qcomm.Wire` of this store's
        array module): the rows come out in its format, encoded by the
        lookup kernel itself (``[G * B, wire.count(out_dim)]`` of
        ``wire.dtype``, the bytes ``wire.encode`` makes of the pooled rows);
        a fp32 wire changes nothing.
        """
        self.kernel_calls += 1
        kw = self._kw()
        if self._fuses(wire):
            return self._impl.pooled_lookup(self.layout, self.weights, bags, out, wire=wire,
                                            **kw)
        if wire is None or wire.identity:
            return self._impl.pooled_lookup(self.layout, self.weights, bags, out, **kw)
        return encode_after(self._impl.pooled_lookup(self.layout, self.weights, bags, None,
                                                     **kw), wire, out)

    def aggregate(self, bags: Bags, grad_out, wire=None):
        """Per table ``(rows, grads)`` of the bags' summed gradients (no update); ``wire``:
        ``grad_out`` as received in its format (fp16, bf16), decoded by the kernel."""
        self.kernel_calls += 1
        if self._fuses(wire):
            return self._impl.aggregate_grads(self.layout, bags, self.xp.asarray(grad_out),
                                              weights=self.weights, wire=wire, **self._kw())
        return self._impl.aggregate_grads(self.layout, bags, self._cast(grad_out, wire),
                                          weights=self.weights, **self._kw())

    def update(self, sparse, unique: bool = True, row_terms=None) -> None:
        """Optimizer step on per-table ``(rows, grads)``; ``unique=False`` sums duplicates first.

        ``row_terms[t]`` (unique rows only) replaces row-wise AdaGrad's
        ``mean(g * g)`` for table t's rows (column slices of a wider row).
        """
        sparse = [(rows, self._cast(grads)) for rows, grads in sparse]
        self.kernel_calls += 1
        kw = self._kw(update=True)
        if row_terms is not None:
            kw["row_terms"] = row_terms
        self._impl.apply_updates(self.layout, self.optimizers, self.weights, self.state, sparse,
                                 unique, **kw)

    def backward_update(self, bags: Bags, grad_out, wire=None) -> None:
        """Fused backward + optimizer: only the rows the bags read change. ``wire``:
        ``grad_out`` as received in its format (fp16, bf16), decoded by the kernel as it
        reads it."""
        self.kernel_calls += 1
        kw = self._kw(update=True)
        if self._fuses(wire):
            self._impl.backward_update(self.layout, self.optimizers, self.weights, self.state,
                                       bags, self.xp.asarray(grad_out), wire=wire, **kw)
            return
        self._impl.backward_update(self.layout, self.optimizers, self.weights, self.state, bags,
                                   self._cast(grad_out, wire), **kw)

    def _kw(self, update: bool = False) -> dict:
        kw = {"threads": self.threads} if self.device == "cpu" and self.threads > 1 else {}
        if update and is_half(self.dtype):
            kw["rounding"] = (self.rounding, self.seeds, self.step, self.master,
                              self.row_keys)
        if update:
            self.step += 1
        return kw

    def _fuses(self, wire) -> bool:
        """Whether the kernels take ``wire`` themselves: a quantized codec on this store's
        array module whose values are in the compute dtype (else the store encodes after
        the lookup, or decodes before the backward)."""
        return (wire is not None and not wire.identity and wire.xp is self.xp
                and np.dtype(wire.value_dtype) == self.compute_dtype)

    def _cast(self, arr, wire=None):
        """``arr`` (decoded by ``wire`` when given) in the compute dtype on this device."""
        arr = self.xp.asarray(arr)
        if wire is not None and not wire.identity:
            arr = wire.decode(arr.reshape(-1)).reshape(arr.shape[0], -1)
        cdt = self.compute_dtype
        return arr if arr.dtype == cdt else arr.astype(cdt)

