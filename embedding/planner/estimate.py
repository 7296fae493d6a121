"""Memory and time estimates of one shard.

Memory of a shard, bytes:

- weights: ``rows * cols * itemsize(dtype)``;
- optimizer state, in the table's ``optimizer_state_dtype`` (float32 unless
  set: ``OPTIMIZER_STATE_ITEMSIZE``): none for SGD, one float per row for
  row-wise AdaGrad, two moments per element for Adam; a half table with
  ``rounding = "master"`` adds its float32 master copy (4 bytes per element);
- buffers of one step: the ids the shard receives (``id_bytes`` each), its
  pooled output rows and their gradients (two ``rows_out * cols`` blocks of
  the table's dtype) and, for data-parallel tables, the dense gradient that
  is all-reduced.

Time of a shard, seconds: the lookup and fused update stream ``3 * cols *
itemsize`` bytes of weights per looked-up id (read forward, read and write
backward) plus the optimizer state read and written, at the device memory
throughput (:attr:`~embedding.planner.types.Hardware.lookup_rate`); the
collectives are priced by :func:`collectives.cost.estimate`, linearised per
operation into a latency and a cost per byte (the planner adds up bytes of
many tables that travel in one collective).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from collectives.cost import estimate
from collectives.types import CollectiveOp, FabricModel
from embedding.planner.types import Hardware, MemoryEstimate
from embedding.precision import STORAGE_DTYPES, Rounding, storage_dtype
from embedding.types import OptimizerKind, TableConfig, enum_arg

__all__ = ["OPTIMIZER_STATE_ITEMSIZE", "DTYPES", "itemsize", "weight_bytes", "optimizer_bytes",
           "state_bytes", "shard_memory", "touch_bytes_per_id", "CostModel", "Scope"]

#: Bytes of one optimizer state element: float32, as FBGEMM's fused optimizers keep it.
OPTIMIZER_STATE_ITEMSIZE = 4

#: Table dtypes the planner knows the width of: the storage dtypes of a table.
DTYPES = tuple(sorted(STORAGE_DTYPES))


def itemsize(dtype: str) -> int:
    """Bytes of one element of ``dtype`` (``"float32"``, ``"float16"``, ``"bfloat16"`` …)."""
    try:
        return _itemsize(dtype)
    except (ValueError, TypeError):  # TypeError: not even hashable
        raise ValueError(f"dtype: expected one of {list(DTYPES)}, got {dtype!r}") from None


@functools.lru_cache(maxsize=64)
def _itemsize(dtype) -> int:
    """:func:`itemsize`, looked up once per dtype (the planner asks for it per shard)."""
    return storage_dtype(dtype).itemsize


def weight_bytes(table: TableConfig, num_rows: int, num_cols: int) -> int:
    """Bytes of a ``num_rows`` × ``num_cols`` block of ``table``'s weights."""
    return int(num_rows) * int(num_cols) * itemsize(table.dtype)


def optimizer_bytes(kind: OptimizerKind, num_rows: int, num_cols: int,
                    state_itemsize: int = OPTIMIZER_STATE_ITEMSIZE) -> int:
    """Bytes of optimizer state for a ``num_rows`` × ``num_cols`` block, each state
    element ``state_itemsize`` bytes.

    >>> optimizer_bytes(OptimizerKind.ROWWISE_ADAGRAD, 1000, 64)
    4000
    >>> optimizer_bytes(OptimizerKind.ADAM, 1000, 64)
    512000
    """
    kind = enum_arg(OptimizerKind, kind, "kind")
    if kind is OptimizerKind.SGD:
        return 0
    if kind is OptimizerKind.ROWWISE_ADAGRAD:
        return int(num_rows) * int(state_itemsize)
    return 2 * int(num_rows) * int(num_cols) * int(state_itemsize)


def state_bytes(table: TableConfig, num_rows: int, num_cols: int) -> int:
    """Bytes of ``table``'s optimizer state (in its ``optimizer_state_dtype``) and, for a
    half table with ``master`` rounding, its float32 master copy, for a block."""
    n = optimizer_bytes(table.optimizer.kind, num_rows, num_cols,
                        itemsize(table.optimizer_state_dtype))
    if table.rounding is Rounding.MASTER:
        n += int(num_rows) * int(num_cols) * 4
    return n


def shard_memory(table: TableConfig, num_rows: int, num_cols: int, *,
                 buffers: int = 0) -> MemoryEstimate:
    """Weights and optimizer state of a block of ``table``, plus ``buffers`` bytes."""
    return MemoryEstimate(weights=weight_bytes(table, num_rows, num_cols),
                          optimizer=state_bytes(table, num_rows, num_cols),
                          buffers=int(buffers))


def touch_bytes_per_id(table: TableConfig, num_cols: int) -> int:
    """Bytes of device memory one looked-up id streams in a training step:
    the row slice read forward, read and written backward, and the optimizer
    state of the row read and written."""
    weights = 3 * int(num_cols) * itemsize(table.dtype)
    return weights + 2 * state_bytes(table, 1, num_cols)


class Scope:
    """Which ranks a collective spans."""

    WORLD = "world"  # every rank of the job
    NODE = "node"    # the ranks of one node


@dataclass(frozen=True)
class _Rate:
    latency: float   # seconds per call
    per_byte: float  # seconds per byte of nccl-tests' size


#: Size (bytes) at which collectives are linearised: large enough that the
#: bandwidth term dominates, as the fused per-step collectives of many tables do.
_LINEARISE_BYTES = 64 << 20


class CostModel:
    """Prices a shard's collectives and lookups on ``hardware``.

    Each collective is linearised from :func:`collectives.cost.estimate` at
    64 MiB and 128 MiB, so bytes of many tables can be added up and priced
    once: ``seconds(op, scope, n) = n * per_byte``; the per-call latency is
    :meth:`latency`, paid once per step per collective used.
    """

    def __init__(self, hardware: Hardware):
        self.hardware = hardware
        self.fabric: FabricModel = hardware.fabric
        self._node = self.fabric.with_shape(hardware.ranks_per_node, 1)
        self._rates: dict[tuple[CollectiveOp, str], _Rate] = {}

    def _rate(self, op: CollectiveOp, scope: str) -> _Rate:
        key = (op, scope)
        rate = self._rates.get(key)
        if rate is None:
            fabric = self.fabric if scope == Scope.WORLD else self._node
            if fabric.size == 1:
                rate = _Rate(0.0, 0.0)
            else:
                n = _LINEARISE_BYTES
                t1, t2 = estimate(op, n, fabric), estimate(op, 2 * n, fabric)
                per_byte = max(0.0, (t2 - t1) / n)
                rate = _Rate(max(0.0, t1 - per_byte * n), per_byte)
            self._rates[key] = rate
        return rate

    def seconds(self, op: CollectiveOp, scope: str, nbytes: float) -> float:
        """Bandwidth time of ``nbytes`` (nccl-tests' size) of ``op`` over ``scope``."""
        return self._rate(op, scope).per_byte * float(nbytes) if nbytes > 0 else 0.0

    def latency(self, op: CollectiveOp, scope: str) -> float:
        """Fixed time of one call of ``op`` over ``scope``, seconds."""
        return self._rate(op, scope).latency

    def lookup_seconds(self, nbytes: float) -> float:
        """Time to stream ``nbytes`` of embedding rows and state in device memory."""
        return float(nbytes) / self.hardware.lookup_rate
