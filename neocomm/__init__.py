"""neocomm: communication and topology runtime for recommendation-model training.

``neocomm.init()`` bootstraps from MPI and returns the :class:`World`: this
rank's place in the job and its process groups (world, intra-node, rail).
"""
from __future__ import annotations

__version__ = "0.1.0"

import os as _os

#: variables a process started by an MPI launcher (mpirun/prterun, Hydra, srun) inherits
_LAUNCHED_BY = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE", "SLURM_PROCID")


def _start_mpi() -> None:
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


from neocomm.errors import (BackendUnavailableError, CollectiveArgumentError, NeocommError,
                            GroupGoneError, RankFailureError, StallError)
from neocomm.types import BackendKind, GroupKind, ReduceOp

__all__ = [
    "__version__", "init", "World", "ProcessGroup", "ReduceOp", "BackendKind", "GroupKind",
    "NeocommError", "CollectiveArgumentError", "BackendUnavailableError", "StallError",
    "RankFailureError", "GroupGoneError",
]


def __getattr__(name):  # lazy: importing neocomm must not initialise MPI
    if name in ("init", "World", "current_world"):
        from neocomm import world

        return getattr(world, name)
    if name == "ProcessGroup":
        from neocomm.group import ProcessGroup

        return ProcessGroup
    raise AttributeError(f"module 'neocomm' has no attribute {name!r}")
