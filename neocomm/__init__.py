"""neocomm: communication and topology runtime for recommendation-model training.

``neocomm.init()`` bootstraps from MPI and returns the :class:`World`: this
rank's place in the job and its process groups (world, intra-node, rail).
"""
from __future__ import annotations

__version__ = "0.1.0"


from neocomm.mpistart import _LAUNCHED_BY  # noqa: F401 - the launcher variables

from neocomm.errors import (BackendUnavailableError, CollectiveArgumentError, NeocommError,
                            GroupGoneError)

__all__ = [
    "__version__", "init", "World", "ProcessGroup", "ReduceOp", "BackendKind", "GroupKind",
    "NeocommError", "CollectiveArgumentError", "BackendUnavailableError", "GroupGoneError",
]


def __getattr__(name):
    # lazy: importing neocomm neither starts MPI nor loads NumPy (the launcher and the
    # process that watches each rank import only what they use)
    if name in ("ReduceOp", "BackendKind", "GroupKind"):
        from neocomm import types

        return getattr(types, name)
    if name in ("init", "World", "current_world"):
        from neocomm import world

        return getattr(world, name)
    if name == "ProcessGroup":
        from neocomm.group import ProcessGroup

        return ProcessGroup
    raise AttributeError(f"module 'neocomm' has no attribute {name!r}")
