"""Row-wise int8 quantization in FBGEMM's FUSED8BIT layout (NumPy).

Each row of ``dim`` float values becomes ``dim + 8`` bytes: ``dim`` uint8
codes, then the row's ``scale`` and ``bias`` as little-endian float32 —
byte for byte what FBGEMM's ``FloatToFused8BitRowwiseQuantized`` writes::

    bias  = min(row)                               (float32)
    scale = (max(row) - min(row)) / 255            (float32)
    code  = rint((x - bias) * (255 / (max - min + 1e-8)))   (round half to even)
    x'    = code * scale + bias                    (dequantized, one float32 rounding)

All arithmetic is float32, as FBGEMM's; every dequantized value lies within
half a step (``scale / 2``, plus float32 rounding) of the value it came from,
and a row of equal values comes back exactly. Float16 and bfloat16 rows are
widened to float32 first (exactly).
"""
from __future__ import annotations

import numpy as np

__all__ = ["FUSED8BIT", "FORMATS", "SCALE_BIAS_BYTES", "fused_width", "check_format",
           "quantize_rows", "dequantize_rows", "scale_bias", "encode_into"]

#: The name of the layout, as export manifests and ``--format`` spell it.
FUSED8BIT = "fused8bit_rowwise"
#: Formats this code writes and reads.
FORMATS = (FUSED8BIT,)
#: Bytes after each row's codes: a float32 scale, then a float32 bias.
SCALE_BIAS_BYTES = 8
#: Added to a row's range before its reciprocal is taken (FBGEMM's ``kEpsilon``).
_EPSILON = np.float32(1e-8)
#: Rows quantized at a time (bounds the float32 temporaries: 64 Ki rows).
_CHUNK = 1 << 16


def fused_width(dim: int) -> int:
    """Bytes of one fused row of ``dim`` values: ``dim`` codes and 8 bytes of scale and bias."""
    return int(dim) + SCALE_BIAS_BYTES


def check_format(fmt: str, what: str = "format") -> str:
    """``fmt`` when this code supports it; else ValueError naming ``what``, the value and
    the formats supported."""
    if fmt not in FORMATS:
        raise ValueError(f"{what}: unsupported row format {fmt!r}; supported: "
                         f"{', '.join(FORMATS)}")
    return fmt


def quantize_rows(rows) -> np.ndarray:
    """``[n, dim]`` float rows -> ``[n, dim + 8]`` uint8 fused rows (C order).

    Raises ValueError for a non-2-D or empty-width input and for NaN or inf
    values (their codes would mean nothing), naming the first such row.
    """
    x = np.asarray(rows)
    if x.ndim != 2 or x.shape[1] == 0:
        raise ValueError(f"rows: expected a 2-D array of at least one column, got shape "
                         f"{x.shape}")
    if x.dtype.kind not in "fiu" and x.dtype.name != "bfloat16":
        raise TypeError(f"rows: expected float values, got {x.dtype}")
    n, dim = x.shape
    out = np.empty((n, fused_width(dim)), np.uint8)
    for r0 in range(0, n, _CHUNK):
        r1 = min(n, r0 + _CHUNK)
        rows = np.asarray(x[r0:r1], np.float32)
        bad = ~np.isfinite(rows).all(axis=1)
        if bad.any():
            raise ValueError(f"rows: row {r0 + int(np.argmax(bad))} holds NaN or inf; it "
                             f"cannot be quantized")
        encode_into(rows, out[r0:r1])
    return out


def encode_into(x, out, xp=np) -> None:
    """Write the fused rows of float32 ``x`` (``[..., dim]``) into uint8 ``out``
    (``[..., dim + 8]``, may be a strided view), on any array module ``xp`` (NumPy, CuPy);
    no checks: a row holding NaN or inf gets meaningless codes (:func:`quantize_rows`
    refuses them)."""
    dim = x.shape[-1]
    if not x.size:
        return
    lo = x.min(axis=-1)
    span = x.max(axis=-1) - lo
    inverse = np.float32(255.0) / (span + _EPSILON)
    codes = xp.rint((x - lo[..., None]) * inverse[..., None])
    xp.clip(codes, 0, 255, out=codes)
    out[..., :dim] = codes.astype(np.uint8)
    tail = xp.empty(x.shape[:-1] + (2,), np.float32)  # scale, bias
    tail[..., 0] = span / np.float32(255.0)
    tail[..., 1] = lo
    out[..., dim:] = tail.view(np.uint8)


def scale_bias(fused) -> tuple[np.ndarray, np.ndarray]:
    """``(scale, bias)`` float32 ``[n]`` of ``[n, dim + 8]`` fused rows."""
    f = _fused(fused)
    tail = np.ascontiguousarray(f[:, f.shape[1] - SCALE_BIAS_BYTES:]).view("<f4")
    return tail[:, 0].astype(np.float32), tail[:, 1].astype(np.float32)


def dequantize_rows(fused) -> np.ndarray:
    """``[n, dim + 8]`` uint8 fused rows -> ``[n, dim]`` float32 rows (``code * scale + bias``)."""
    f = _fused(fused)
    n, width = f.shape
    dim = width - SCALE_BIAS_BYTES
    out = np.empty((n, dim), np.float32)
    for r0 in range(0, n, _CHUNK):
        r1 = min(n, r0 + _CHUNK)
        scale, bias = scale_bias(f[r0:r1])
        # code * scale is exact in float64 (8 + 24 significant bits); adding the bias there
        # and rounding once to float32 gives FBGEMM's fused multiply-add result.
        wide = f[r0:r1, :dim] * scale[:, None].astype(np.float64)
        wide += bias[:, None]
        out[r0:r1] = wide
    return out


def _fused(fused) -> np.ndarray:
    f = np.asarray(fused)
    if f.dtype != np.uint8 or f.ndim != 2 or f.shape[1] <= SCALE_BIAS_BYTES:
        raise ValueError(f"fused: expected uint8 rows of dim + {SCALE_BIAS_BYTES} bytes "
                         f"(dim >= 1), got {f.dtype} of shape {f.shape}")
    return f
