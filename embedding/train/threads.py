"""Threads per rank: several ranks on one host must not each start a thread per core.

NumPy's BLAS (OpenBLAS) starts one thread per core in every process; with
four ranks on two cores the dense layers then spend their time switching
threads. :func:`limit_blas_threads` sets the thread count of the OpenBLAS
already loaded into this process through its C API (the variables
``OPENBLAS_NUM_THREADS``/``OMP_NUM_THREADS`` only act before NumPy loads).
"""
from __future__ import annotations

import ctypes
import logging
import os

from embedding.kernels.pool import host_cores

__all__ = ["default_threads", "rank_threads", "limit_blas_threads", "ranks_on_host"]

_log = logging.getLogger(__name__)
_SETTERS = ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
            "openblas_set_num_threads64_", "openblas_set_num_threads")


def ranks_on_host(default: int = 1) -> int:
    """Ranks the MPI launcher started on this host (its environment), else ``default``."""
    for key in ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "PMI_LOCAL_SIZE"):
        value = os.environ.get(key)
        if value and value.isdigit() and int(value) > 0:
            return int(value)
    return max(1, int(default))


def default_threads(local_ranks: int) -> int:
    """This host's cores shared out over ``local_ranks`` ranks (at least 1)."""
    return max(1, host_cores() // max(1, int(local_ranks)))


def rank_threads(requested: int, local_ranks: int) -> int:
    """The threads a rank uses: ``requested`` (0: :func:`default_threads`), never more than
    the cores it may run on (a larger request is lowered, with a warning)."""
    if not requested:
        return default_threads(local_ranks)
    cores = host_cores()
    if requested > cores:
        _log.warning("threads = %d, but this rank may run on %d cores: using %d", requested,
                     cores, cores)
        return cores
    return int(requested)


def limit_blas_threads(n: int) -> bool:
    """Set the loaded OpenBLAS to ``n`` threads; False when no OpenBLAS was found."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as fh:
            paths = {line.split()[-1] for line in fh if line.strip()}
        libs = sorted(p for p in paths
                      if "openblas" in os.path.basename(p).lower() and ".so" in p)
    except OSError:
        libs = []
    for path in libs:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in _SETTERS:
            fn = getattr(lib, name, None)
            if fn is not None:
                fn(ctypes.c_int(int(n)))
                _log.debug("BLAS threads set to %d through %s", n, name)
                return True
    _log.debug("no OpenBLAS found to set to %d threads", n)
    return False
