"""Starting MPI in this process, as a launched rank or as a singleton."""
from __future__ import annotations

import os as _os

__all__ = ["start_mpi"]

#: variables a process started by an MPI launcher (mpirun/prterun, Hydra, srun) inherits
_LAUNCHED_BY = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE", "SLURM_PROCID")


def start_mpi() -> None:
    """Initialise MPI (import ``mpi4py.MPI``). A process started without a launcher is
    an MPI singleton: Open MPI's shared-memory transport would create a /dev/shm segment
    that nothing cleans up (no launcher to register its removal) and that a lone process
    never uses, so it is turned off for the moment of the initialisation only — a job
    this process launches later must keep it (its ranks talk through shared memory)."""
    import sys

    if "mpi4py.MPI" in sys.modules or any(key in _os.environ for key in _LAUNCHED_BY) \
            or "OMPI_MCA_btl" in _os.environ:
        from mpi4py import MPI  # noqa: F401
        return
    _os.environ["OMPI_MCA_btl"] = "^sm"
    try:
        from mpi4py import MPI  # noqa: F401,F811
    finally:
        del _os.environ["OMPI_MCA_btl"]
