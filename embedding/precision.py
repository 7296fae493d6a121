"""Table storage precision: float32, float16 and bfloat16 rows, and how updates round.

A table stores its rows in ``dtype`` (:data:`STORAGE_DTYPES`; bfloat16 is
``ml_dtypes.bfloat16`` on NumPy and CuPy). Half tables (float16, bfloat16)
are *computed* in float32 (:func:`compute_dtype`): lookups accumulate the
rows in float32 and return float32, and the fused backward+optimizer forms
the new row in float32, then rounds it into storage by the table's
:class:`Rounding`:

- ``NEAREST``: round to nearest, ties to even (IEEE; what ``astype`` does);
- ``STOCHASTIC``: round up with probability equal to the distance from the
  lower neighbour in units of the gap, so the rounded value is unbiased
  (its expectation is the float32 value). The random bits come from a
  counter-based hash of ``(seed, step, table, row, column)``
  (:func:`random_bits`), so a run is reproducible bit for bit, and the
  NumPy and CUDA kernels draw the same bits. ``row`` is the row's number
  in its local table (shard): a host-resident table's cached row hashes its
  host row, not its cache slot; a dynamic table hashes the id a row holds
  in place of the row (``FusedTables.row_keys``);
- ``MASTER``: the store keeps a float32 master copy of the rows; the
  optimizer updates the master and the stored row is its nearest rounding.

Rounding works on the float32 bit pattern with integer operations only
(:func:`round_bits`): add a rounding increment below the kept bits and drop
them. For nearest-even the increment is ``2**(s-1) - 1 + lsb``; for
stochastic rounding it is ``s`` random bits, which makes the probability of
a carry exactly the dropped fraction. Values whose float16 rounding drops
more than 32 bits (``|x| < 2**-32``) round to zero under either mode.

What rounding costs in quality: an update is rounded against the row's
magnitude, so once the optimizer's steps shrink (row-wise AdaGrad's like
``lr / sqrt(updates)``) and the rows grow, a step is a few units in the last
place or less. ``NEAREST`` then drops every step below half a unit (the row
stops learning in those directions); ``STOCHASTIC`` keeps them on average
but adds a rounding noise of up to half a unit per step, as large as the
step itself; ``MASTER`` rounds only the copy that lookups read. Settings
measured to cost AUC beyond float32's seed-to-seed spread warn at start-up
(:func:`quality_warning`; the measurements are in docs/training.md).
"""
from __future__ import annotations

import enum

import numpy as np

from neocomm.types import HALF_DTYPES, is_half

__all__ = ["STORAGE_DTYPES", "Rounding", "storage_dtype", "compute_dtype", "random_bits",
           "round_bits", "round_to", "narrow_to_float32", "encode_half", "quality_warning"]

#: Storage dtypes of a table (float64 for tests and references).
STORAGE_DTYPES = ("float32", "float16", "bfloat16", "float64")

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


class Rounding(enum.Enum):
    """How an update's float32 result is rounded into a half table's storage (module doc)."""

    NEAREST = "nearest"
    STOCHASTIC = "stochastic"
    MASTER = "master"


#: (optimizer state dtype, sparse optimizer kind) -> why tables with that state cost AUC, as
#: measured by scripts/bench_precision.py (docs/training.md, "Precision settings side by side").
#: Half tables with float32 state were measured within float32's seed spread: none is here.
_QUALITY = {
    ("float16", "rowwise_adagrad"):
        "row-wise AdaGrad adds each step's mean squared gradient to its accumulator, and "
        "increments below 3e-8 (half float16's smallest step) round to zero: accumulators stay "
        "near zero, so the steps stop shrinking (on the ratings data most rows' accumulators "
        "were still 0 after 468 steps; held-out AUC 0.006 to 0.05 below float32 on three data "
        "sets); "
        "state_dtype = \"float32\" (the default) costs 2 more bytes per row",
}


def quality_warning(dtype, rounding, state_dtype=None, optimizer="rowwise_adagrad"
                    ) -> str | None:
    """The start-up warning of a table of storage ``dtype`` rounded by ``rounding``, its
    optimizer state in ``state_dtype`` (None: the compute dtype) of sparse optimizer kind
    ``optimizer`` (a name or an enum whose value is one), when that setting was measured
    to lose AUC against float32 beyond float32's seed-to-seed spread (module doc), else
    None."""
    name = storage_dtype(dtype).name
    state = compute_dtype(storage_dtype(dtype)).name if state_dtype is None else \
        storage_dtype(state_dtype, "state_dtype").name
    kind = str(getattr(optimizer, "value", optimizer))
    why = _QUALITY.get((state, kind))
    if why is None:
        return None
    return (f"tables.dtype {name} (rounding {_as_rounding(rounding).value!r}) with {kind} "
            f"state in {state}: {why} (docs/training.md, \"Precision settings side by side\")")


def _as_rounding(value) -> Rounding:
    """``value`` (a :class:`Rounding` or its name) as a :class:`Rounding`."""
    return value if isinstance(value, Rounding) else Rounding(str(value))


def storage_dtype(name, what: str = "dtype") -> np.dtype:
    """The NumPy dtype of storage dtype ``name`` (a name or a dtype).

    ValueError naming ``what`` and listing :data:`STORAGE_DTYPES` for any
    other value; bfloat16 needs the ``ml_dtypes`` package.
    """
    try:
        key = np.dtype(name).name
    except TypeError:
        key = str(name)
    if key not in STORAGE_DTYPES:
        raise ValueError(f"{what}: expected one of {list(STORAGE_DTYPES)}, got {name!r:.80}")
    if key == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise ValueError(f"{what}: bfloat16 needs the ml_dtypes package "
                             f"(pip install 'neocomm[bf16]')") from None
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(key)


def compute_dtype(dtype) -> np.dtype:
    """The dtype the kernels compute a table of storage ``dtype`` in: float32 for half
    tables, the storage dtype otherwise."""
    return np.dtype(np.float32) if is_half(dtype) else np.dtype(dtype)


def _mix(h, v):
    """One splitmix64 step of ``h`` absorbing ``v`` (uint64 arrays, wrapping arithmetic)."""
    z = (h ^ v) + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def random_bits(seed: int, step: int, table: int, rows, dim: int) -> np.ndarray:
    """``[len(rows), dim]`` uint32: the random bits of stochastic rounding for columns
    ``0 .. dim-1`` of ``rows`` of local table ``table`` at update ``step``.

    ``h = mix(mix(mix(mix(mix(0, seed), step), table), row), column)``, where
    ``mix(h, v)`` is splitmix64's finaliser of ``(h ^ v) + 0x9E3779B97F4A7C15``
    in wrapping uint64 arithmetic; the bits are ``h >> 32``. The CUDA kernel
    computes the same function.
    """
    with np.errstate(over="ignore"):
        h = np.zeros(1, np.uint64)
        for v in (seed, step, table):
            h = _mix(h, np.asarray([int(v) & (2 ** 64 - 1)], np.uint64))
        h = _mix(h, np.asarray(rows, np.int64).astype(np.uint64))[:, None]
        h = _mix(h, np.arange(int(dim), dtype=np.uint64)[None, :])
    return (h >> np.uint64(32)).astype(np.uint32)


def round_bits(x, dtype, rnd=None) -> np.ndarray:
    """The uint16 bit patterns of float32 ``x`` rounded to half ``dtype``.

    ``rnd`` None rounds to nearest, ties to even (bit for bit what NumPy's and
    ml_dtypes' ``astype`` give, NaN aside: NaN becomes the quiet NaN of its
    sign); ``rnd`` (uint32, shaped like ``x``) rounds stochastically with those
    random bits (module doc).
    """
    name = np.dtype(dtype).name
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.int64)
    sign = (u >> 16) & 0x8000
    a = u & 0x7FFFFFFF
    nan = a > 0x7F800000
    if name == "bfloat16":
        s = np.full(a.shape, 16, np.int64)
        base = a
    elif name == "float16":
        e = (a >> 23) - 127
        normal = e >= -14
        s = np.where(normal, 13, np.minimum(-1 - e, 33))
        base = np.where(normal, a - (112 << 23), (a & 0x7FFFFF) | 0x800000)
    else:
        raise ValueError(f"dtype: expected one of {list(HALF_DTYPES)}, got {dtype!r}")
    if rnd is None:
        inc = (np.int64(1) << (s - 1)) - 1 + ((base >> s) & 1)
    else:
        inc = np.asarray(rnd, np.uint32).astype(np.int64) & ((np.int64(1) << s) - 1)
    out = (base + inc) >> s
    if name == "float16":
        out = np.where(s > 32, 0, out)                       # |x| < 2**-32: zero
        out = np.where(a >= 0x47800000, 0x7C00, out)        # |x| >= 2**16 (and inf): inf
        out = np.where(nan, 0x7E00, out)
    else:
        out = np.where(nan, 0x7FC0, out)
    return (out | sign).astype(np.uint16)


def round_to(x, dtype, rounding: Rounding = Rounding.NEAREST, *, seed: int = 0,
             step: int = 0, table: int = 0, rows=None) -> np.ndarray:
    """Float32 ``x`` (``[len(rows), dim]``) rounded into storage ``dtype``.

    A non-half ``dtype`` is a plain cast. ``STOCHASTIC`` draws its bits with
    :func:`random_bits` for ``(seed, step, table, rows)``; ``NEAREST`` and
    ``MASTER`` round to nearest.
    """
    dt = np.dtype(dtype)
    if not is_half(dt):
        return np.asarray(x).astype(dt, copy=False)
    rnd = None
    if rounding is Rounding.STOCHASTIC:
        x = np.asarray(x)
        rnd = random_bits(seed, step, table, rows, x.shape[1])
    return round_bits(x, dt, rnd).view(dt)


def narrow_to_float32(x, xp=np):
    """``x`` as float32 ready for one more rounding to a half type.

    float64 rounds toward zero with the last bit set when inexact ("round to
    odd"): float32 keeps 13 more bits than float16 and 16 more than bfloat16, so
    rounding the result to nearest once more gives the nearest half value of
    ``x`` itself, one rounding, as the CUDA codec does (``narrow_for_half``).
    Other dtypes are a plain cast.
    """
    if x.dtype != np.float64:
        return x.astype(np.float32, copy=False)
    with np.errstate(over="ignore"):                 # inf is stepped back below
        f = x.astype(np.float32)
    back = f.astype(np.float64)
    u = f.view(np.uint32)
    u = u - (xp.abs(back) > xp.abs(x)).astype(np.uint32)
    u = u | ((back != x) & (x == x)).astype(np.uint32)
    return u.view(np.float32)


def encode_half(x, dtype, xp=np):
    """``x`` (any float dtype, NumPy or CuPy) rounded to nearest, ties to even, into
    float16 or bfloat16 ``dtype``, with one rounding whatever the input's width
    (:func:`narrow_to_float32`); NaN becomes the quiet NaN of its sign.

    The project's one definition of half encoding: the wire codecs on the host
    and the device and the CUDA kernels agree with it bit for bit, whichever
    ``ml_dtypes`` release is installed (its float64 cast has rounded once or
    through float32, depending on the release).
    """
    dt = np.dtype(dtype)
    f = narrow_to_float32(x, xp)
    if dt == np.float16:
        return f.astype(np.float16)              # float32 -> float16 is one IEEE rounding
    if dt.name != "bfloat16":
        raise ValueError(f"dtype: expected one of {list(HALF_DTYPES)}, got {dtype!r}")
    bits = f.view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
    nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    rounded = xp.where(nan, (bits & np.uint32(0x80000000)) | np.uint32(0x7FC00000), rounded)
    return (rounded >> np.uint32(16)).astype(np.uint16).view(dt)
