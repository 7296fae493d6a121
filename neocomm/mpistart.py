"""Starting MPI in this process, as a launched rank or as a singleton."""
from __future__ import annotations

import os as _os

__all__ = ["start_mpi", "mpi", "without_shared_memory"]

#: variables a process started by an MPI launcher (mpirun/prterun, Hydra, srun) inherits
_LAUNCHED_BY = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE", "SLURM_PROCID")


def without_shared_memory(btl: str | None) -> str:
    """Open MPI's transport list ``btl`` (``OMPI_MCA_btl``: None for its default, a list
    such as ``self,sm,tcp``, or an exclusion such as ``^ofi``) with the shared-memory
    transport ``sm`` left out, every other choice kept.

    >>> without_shared_memory(None), without_shared_memory("^ofi")
    ('^sm', '^ofi,sm')
    >>> without_shared_memory("self,sm,tcp"), without_shared_memory("self,tcp")
    ('self,tcp', 'self,tcp')
    """
    if not btl or not btl.strip():
        return "^sm"
    btl = btl.strip()
    if btl.startswith("^"):
        names = [n.strip() for n in btl[1:].split(",") if n.strip()]
        return btl if "sm" in names else "^" + ",".join(names + ["sm"])
    return ",".join(n.strip() for n in btl.split(",") if n.strip() and n.strip() != "sm")


def start_mpi() -> None:
    """Initialise MPI (import ``mpi4py.MPI``). A process started without a launcher is
    an MPI singleton: Open MPI's shared-memory transport would create a /dev/shm segment
    that nothing cleans up (no launcher to register its removal) and that a lone process
    never uses, so it is left out of the transports (the user's ``OMPI_MCA_btl``, if
    any, with ``sm`` taken from it) for the moment of the initialisation only: a job
    this process launches later must keep it (its ranks talk through shared memory), and
    the user's own setting is put back as it was. Likewise a singleton's Open MPI session
    directory (``ompi.<host>.<uid>/jf.0/<job>``, which it leaves in the temporary directory
    at exit) is made in a directory of the process's own, removed when it ends."""
    import atexit
    import importlib
    import shutil
    import sys
    import tempfile

    if "mpi4py.MPI" in sys.modules or any(key in _os.environ for key in _LAUNCHED_BY):
        importlib.import_module("mpi4py.MPI")
        return
    session = tempfile.mkdtemp(prefix="neocomm-mpi-")
    # registered before MPI starts, so it runs after MPI has finalised
    atexit.register(shutil.rmtree, session, ignore_errors=True)
    saved = {key: _os.environ.get(key) for key in ("OMPI_MCA_btl", "TMPDIR")}
    _os.environ["OMPI_MCA_btl"] = without_shared_memory(saved["OMPI_MCA_btl"])
    _os.environ["TMPDIR"] = session
    try:
        importlib.import_module("mpi4py.MPI")
    finally:
        for key, value in saved.items():
            if value is None:
                del _os.environ[key]
            else:
                _os.environ[key] = value


def mpi():
    """The ``mpi4py.MPI`` module, MPI started by :func:`start_mpi`: what any code that may be
    the first in its process to touch MPI imports it through (a command run without a
    launcher, an availability check), so that a singleton never leaves a segment behind."""
    start_mpi()
    from mpi4py import MPI

    return MPI
