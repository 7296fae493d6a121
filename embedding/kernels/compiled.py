"""Compiled CPU kernels: the NumPy kernels' inner loops, compiled by numba.

The NumPy kernels (:mod:`embedding.kernels.cpu`) loop in Python over tables
and in NumPy over ids; with many ids per bag their cost is the temporaries
(a gathered ``[ids, dim]`` block per positional pass, a sort-order scatter)
rather than the bytes of the rows. The compiled loops
(:mod:`embedding.kernels._jit`) read each row once:

- the pooled lookup sums a bag's rows in registers (one vector of the
  row's values, for rows up to ``_jit.VECTOR_ROW_BYTES``; wider rows through
  a ``dim``-long buffer) or takes their maximum, prefetching rows a few ids
  ahead, and writes the bag's output row once; when every bag holds one id
  it is one gather of the rows in output order;
- the backward sorts the occurrences by row (a counting sort over a table
  of few rows per id, else a radix sort of the ids: its cost follows the
  ids), then, for each touched row, sums its gradients where they lie in
  the output gradient (in registers, as the lookup sums a bag, for rows up
  to ``_jit.VECTOR_ROW_BYTES``) and applies the optimizer to the row in place (SGD,
  row-wise AdaGrad, Adam): FBGEMM's CPU scheme, with no ``[rows, dim]``
  gradient written out and nothing copied before the sum;
- the common dims (``_jit.FIXED_DIMS``) get kernels compiled with the dim
  fixed, whose row loops LLVM unrolls whole.

numba is picked over a C extension because it compiles for the host's own
vector units at run time and needs no compiler on the user's machine (the
wheel brings LLVM); the compiled functions are cached next to the module, so
only the first run on a machine pays the compile (a few seconds).

The results are bitwise those of the NumPy kernels (same operations, same
order, no contraction); ``NEOCOMM_EMBEDDING_KERNELS=numpy`` selects the NumPy
kernels, ``compiled`` requires the compiled ones. ``auto`` (the default) rents
before it buys: loading numba and the cached kernels costs a process about a
second of CPU, more than a short job (a few steps, a small prediction) spends in
its embedding work, so the NumPy kernels serve a process's calls for its first
:data:`RENT_S` seconds of embedding work and the compiled ones from then on. A
process that stops before then never pays the load; one that goes on pays it
once, and spends at most :data:`RENT_S` seconds on the slower kernels first.
The compiled kernels serve float32 and float64 tables; half tables (float16,
bfloat16, whose rounding modes the NumPy path implements) and optimizer state
stored narrower than the compute dtype take the NumPy path.
"""
from __future__ import annotations

import time

import numpy as np

from neocomm import config

__all__ = ["kernels", "info", "unique", "MODES", "RENT_S"]

from embedding.settings import KERNEL_MODES as MODES


_COMPUTE = (np.dtype(np.float32), np.dtype(np.float64))
_loaded = None       # the _jit module once imported
_why = None          # why it could not be imported
#: seconds after a process's first call for kernels during which ``auto`` keeps to the
#: NumPy kernels (about what loading the compiled ones costs)
RENT_S = 1.0
_first_call = None   # time.monotonic() of this process's first call in auto mode


def _load():
    global _loaded, _why
    if _loaded is None and _why is None:
        try:
            from embedding.kernels import _jit
            _loaded = _jit
        except Exception as exc:  # numba missing or broken: the NumPy kernels serve
            _why = f"{type(exc).__name__}: {exc}"
    return _loaded


def info() -> tuple[str, str]:
    """``(title, state)`` for ``neocomm info``: which kernels run the CPU embedding work."""
    title = "embedding kernels (CPU)"
    if config.get("EMBEDDING_KERNELS") == "numpy":
        return title, "NumPy (NEOCOMM_EMBEDDING_KERNELS=numpy)"
    if _load() is None:
        return title, f"NumPy (numba does not load: {_why})"
    import numba

    return title, f"compiled (numba {numba.__version__}; half tables use NumPy)"


def kernels(dtype):
    """The compiled module for tables of ``dtype``, or None where the NumPy kernels serve."""
    global _first_call
    mode = config.get("EMBEDDING_KERNELS")
    if mode == "numpy":
        return None
    if mode == "auto" and _loaded is None and _why is None:
        now = time.monotonic()
        if _first_call is None:
            _first_call = now
        if now - _first_call < RENT_S:
            return None
    jit = _load()
    if jit is None and mode == "compiled":
        raise RuntimeError(f"NEOCOMM_EMBEDDING_KERNELS=compiled, but the compiled kernels do not "
                           f"load ({_why}); install numba or set NEOCOMM_EMBEDDING_KERNELS=numpy")
    if jit is None or np.dtype(dtype) not in _COMPUTE:
        return None
    return jit


def unique(ids):
    """``np.unique(ids, return_inverse=True, return_counts=True)`` (inverse flat) of host
    int64 ids, by the compiled hash dedup where it serves (the same arrays), else by NumPy."""
    ids = np.asarray(ids, np.int64).reshape(-1)
    jit = kernels(np.float32)
    if jit is None or ids.size == 0:
        u, inv, n = np.unique(ids, return_inverse=True, return_counts=True)
        return u, inv.reshape(-1), n
    return jit.unique_inverse(ids)
