"""Quantized communication: the precision pooled rows and their gradients travel in.

TorchRec's qcomm codecs (``QCommsConfig``: ``forward_precision``,
``backward_precision``, ``backward_loss_scale``) for neocomm's output dists.
A :class:`QComms` says, per direction, how the pooled embeddings (forward)
and their gradients (backward) cross ranks, and (``dense``) how the
gradients of data-parallel tables are AllReduced:

* ``fp32``: as they are (the table dtype; no encoding);
* ``fp16`` / ``bf16``: 2 bytes a value, rounded to nearest even; a reducing
  collective (row-wise's ReduceScatter) sums them in 16 bits;
* ``int8`` (forward only): FBGEMM's FUSED8BIT row-wise layout, each row of
  ``g`` values sent as ``g`` uint8 codes then its float32 scale and bias
  (``g + 8`` bytes, :mod:`embedding.checkpoint.fused8bit`); a value comes back
  within half a step (``(max - min) / 510`` of its row) of what was sent.
  Rows never straddle two features: ``g`` is the greatest common divisor of
  the column widths a strategy moves. A reducing collective cannot take it.

``backward_loss_scale`` (fp16 backward only) multiplies the gradients
before they are rounded to fp16 and divides them after, keeping small
gradients out of fp16's subnormal range; a scaled gradient beyond fp16's
largest value (65504) is an error (the collection checks it on every rank
before any gradient moves).

``dense`` (fp32, fp16, bf16) and ``dense_loss_scale`` (fp16 only): data-parallel
tables have no output dist; their gradients are AllReduced like the dense
model's (in TorchRec, DDP syncs them with the dense parameters, and its
fp16/bf16 compression hooks apply), so they take the trainer's ``[comms] dense``
setting. The gradient values travel in 16 bits (summed in 16 bits); the
touched-row flags beside them are never scaled, so a 16-bit sum of them
counts the ranks exactly (up to 2048 ranks in fp16, 256 in bf16) and is
nonzero exactly where a rank touched the row, at any size. A loss-scaled
fp16 sum that overflows stops the step on every rank before any update.

A :class:`Wire` encodes a flat send buffer on the array module of the
shards (NumPy or CuPy: the codes are made where the rows are, no host copy)
and decodes the receive buffer into the table dtype. Where the send buffer is
the pooled output, the fused lookup kernel writes it in the wire format
itself (``FusedTables.lookup(bags, wire=...)``), and where received gradients
feed the fused backward, the kernel reads them as they came
(``backward_update(bags, grad, wire=...)``): the same bytes and values as
:meth:`Wire.encode` and :meth:`Wire.decode`, without their pass over memory.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import numpy as np

from embedding.checkpoint.fused8bit import SCALE_BIAS_BYTES, encode_into
from embedding.precision import encode_half
from embedding.types import enum_arg
from neocomm.types import check_array_bfloat16

__all__ = ["CommPrecision", "QComms", "Wire", "FP16_MAX", "ROW_TAIL_BYTES", "wire_dtype",
           "encode_int8_rows", "decode_int8_rows", "check_loss_scale"]

#: float16's largest finite value (IEEE 754 binary16).
FP16_MAX = 65504.0
#: Bytes after each int8 row's codes: its float32 scale, then its float32 bias (FUSED8BIT).
ROW_TAIL_BYTES = SCALE_BIAS_BYTES


class CommPrecision(enum.Enum):
    """How values travel in an output dist (module doc)."""

    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"
    INT8 = "int8"


#: Precisions a direction takes: int8 codes pooled rows only.
_FORWARD = tuple(CommPrecision)
_BACKWARD = (CommPrecision.FP32, CommPrecision.FP16, CommPrecision.BF16)


def _names(precisions) -> str:
    return ", ".join(p.value for p in precisions)


def check_loss_scale(scale, precision: CommPrecision, key: str, precision_key: str):
    """``scale`` as a float (None stays None); ValueError naming ``key`` unless it is a
    finite number > 0 set with an fp16 ``precision`` (named ``precision_key``)."""
    if scale is None:
        return None
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) \
            or not math.isfinite(scale) or not scale > 0:
        raise ValueError(f"{key}: expected a finite number > 0, got {scale!r}")
    if precision is not CommPrecision.FP16:
        raise ValueError(f"{key}: {scale!r} scales an fp16 exchange only; {precision_key} is "
                         f"{precision.value!r} (set it to \"fp16\" or drop {key})")
    return float(scale)


@dataclass(frozen=True)
class QComms:
    """The precision of each direction of the output dists (module doc).

    ``forward``: pooled rows (fp32, fp16, bf16, int8); ``backward``: their
    gradients (fp32, fp16, bf16); ``backward_loss_scale``: a static scale of
    an fp16 backward (None: 1); ``dense``: the gradient AllReduce of
    data-parallel tables (fp32, fp16, bf16); ``dense_loss_scale``: a static
    scale of an fp16 ``dense`` (None: 1).
    """

    forward: CommPrecision = CommPrecision.FP32
    backward: CommPrecision = CommPrecision.FP32
    backward_loss_scale: float | None = None
    dense: CommPrecision = CommPrecision.FP32
    dense_loss_scale: float | None = None

    def __post_init__(self):
        fwd = enum_arg(CommPrecision, self.forward, "forward")
        bwd = enum_arg(CommPrecision, self.backward, "backward")
        dense = enum_arg(CommPrecision, self.dense, "dense")
        if bwd not in _BACKWARD:
            raise ValueError(f"backward: {bwd.value!r} codes pooled rows only (forward); "
                             f"gradients take {_names(_BACKWARD)}")
        if dense not in _BACKWARD:
            raise ValueError(f"dense: {dense.value!r} codes pooled rows only (forward); the "
                             f"gradients of data-parallel tables take {_names(_BACKWARD)}")
        object.__setattr__(self, "forward", fwd)
        object.__setattr__(self, "backward", bwd)
        object.__setattr__(self, "dense", dense)
        object.__setattr__(self, "backward_loss_scale", check_loss_scale(
            self.backward_loss_scale, bwd, "backward_loss_scale", "backward"))
        object.__setattr__(self, "dense_loss_scale", check_loss_scale(
            self.dense_loss_scale, dense, "dense_loss_scale", "dense"))

    def used_by(self, data_parallel: bool) -> "QComms":
        """The settings a strategy uses, the others at fp32: ``dense`` and its loss scale
        for data-parallel tables (no output dist), ``forward`` and ``backward`` with its
        loss scale for every other sharding (so tables that differ only in what they do not
        use share one strategy, and an int8 ``forward`` never refuses a data-parallel table)."""
        if data_parallel:
            return QComms(dense=self.dense, dense_loss_scale=self.dense_loss_scale)
        return QComms(self.forward, self.backward, self.backward_loss_scale)

    @property
    def quantized(self) -> bool:
        """True when any exchange is not fp32."""
        return any(p is not CommPrecision.FP32 for p in (self.forward, self.backward,
                                                         self.dense))

    def describe(self) -> str:
        """``forward=fp16, backward=bf16`` (then each loss scale when set, and ``dense``
        when not fp32), for messages."""
        text = f"forward={self.forward.value}, backward={self.backward.value}"
        if self.backward_loss_scale is not None:
            text += f", backward_loss_scale={self.backward_loss_scale:g}"
        if self.dense is not CommPrecision.FP32:
            text += f", dense={self.dense.value}"
        if self.dense_loss_scale is not None:
            text += f", dense_loss_scale={self.dense_loss_scale:g}"
        return text


def wire_dtype(precision: CommPrecision, dtype) -> np.dtype:
    """The dtype a buffer of ``precision`` travels in (``dtype``, the table's, for fp32)."""
    if precision is CommPrecision.FP16:
        return np.dtype(np.float16)
    if precision is CommPrecision.BF16:
        from neocomm.types import bfloat16  # ml_dtypes: imported only where bf16 is asked for

        if bfloat16 is None:
            raise ValueError("bf16: communication in bfloat16 needs the ml_dtypes package")
        return np.dtype(bfloat16)
    if precision is CommPrecision.INT8:
        return np.dtype(np.uint8)
    return np.dtype(dtype)


# -- int8 rows (FUSED8BIT) ---------------------------------------------------------------
def encode_int8_rows(x, xp=np):
    """``[n, g]`` float rows -> ``[n, g + 8]`` uint8: codes, float32 scale, float32 bias."""
    x = x.astype(np.float32, copy=False)
    n, g = x.shape
    out = xp.empty((n, g + ROW_TAIL_BYTES), np.uint8)
    encode_into(x, out, xp)
    return out


def decode_int8_rows(buf, dtype, xp=np):
    """``[n, g + 8]`` uint8 rows of :func:`encode_int8_rows` -> ``[n, g]`` of ``dtype``."""
    n, width = buf.shape
    g = width - ROW_TAIL_BYTES
    tail = xp.ascontiguousarray(buf[:, g:]).view(np.float32)
    out = buf[:, :g].astype(np.float32)
    out *= tail[:, 0:1]
    out += tail[:, 1:2]
    return out.astype(dtype, copy=False)


# -- bfloat16 bits (encoded by embedding.precision.encode_half on either array module) --
def _to_bf16(x, xp):
    from neocomm.types import bfloat16

    return encode_half(x, bfloat16, xp)


def _from_bf16(buf, dtype, xp):
    if xp is np:
        return buf.astype(dtype)
    bits = buf.view(np.uint16).astype(np.uint32) << np.uint32(16)
    return bits.view(np.float32).astype(dtype, copy=False)


class Wire:
    """One direction's codec on one strategy: encodes flat send buffers, decodes receive
    buffers, and converts element counts into wire elements (module doc).

    ``row``: the width of an int8 row (it divides every block the strategy
    moves); ``scale``: the loss scale of an fp16 backward (None: 1); ``key``: the
    setting that chose ``precision``, named when ``xp`` cannot hold bfloat16.
    """

    def __init__(self, precision: CommPrecision, xp, dtype, *, row: int = 1,
                 scale: float | None = None, key: str = "comms"):
        if precision is CommPrecision.BF16:
            check_array_bfloat16(xp, f"{key} = 'bf16'")
        self.precision = precision
        self.xp = xp
        self.value_dtype = np.dtype(dtype)
        self.dtype = wire_dtype(precision, dtype)
        self.row = int(row) if precision is CommPrecision.INT8 else 1
        self.scale = scale

    @property
    def identity(self) -> bool:
        """True when buffers travel as they are (fp32)."""
        return self.precision is CommPrecision.FP32

    @property
    def tail(self) -> tuple[int, ...]:
        """The trailing shape of one wire unit: ``(row + 8,)`` for int8, ``()`` otherwise."""
        return (self.row + ROW_TAIL_BYTES,) if self.precision is CommPrecision.INT8 else ()

    def units(self, cols: int) -> int:
        """Wire units of ``cols`` columns (int8: rows of ``row`` columns; else columns)."""
        return int(cols) // self.row

    def count(self, n):
        """Wire elements of ``n`` values (an int or an int64 array of counts)."""
        if self.precision is CommPrecision.INT8:
            return n // self.row * (self.row + ROW_TAIL_BYTES)
        return n

    def encode(self, flat):
        """The send buffer of the values ``flat`` (1-D, a multiple of ``row`` long)."""
        xp = self.xp
        if self.identity:
            return xp.ascontiguousarray(flat)
        if self.precision is CommPrecision.INT8:
            return encode_int8_rows(flat.reshape(-1, self.row), xp).reshape(-1)
        if self.scale is not None:
            flat = flat * flat.dtype.type(self.scale)
        if self.precision is CommPrecision.FP16:
            return encode_half(flat, np.float16, xp)
        return _to_bf16(flat, xp)

    def decode(self, buf):
        """The values (table dtype, 1-D) of a received buffer."""
        xp = self.xp
        if self.identity:
            return buf
        if self.precision is CommPrecision.INT8:
            return decode_int8_rows(buf.reshape(-1, self.row + ROW_TAIL_BYTES),
                                    self.value_dtype, xp).reshape(-1)
        if self.precision is CommPrecision.FP16:
            out = buf.astype(self.value_dtype)
        else:
            out = _from_bf16(buf, self.value_dtype, xp)
        if self.scale is not None:
            out *= out.dtype.type(1.0 / self.scale)
        return out

    def empty(self, shape):
        """An uninitialised wire buffer of ``shape`` values (``shape[-1]`` in units)."""
        return self.xp.empty(tuple(shape) + self.tail, self.dtype)
