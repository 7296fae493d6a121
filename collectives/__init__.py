"""Collectives of neocomm: the API, algorithms as plug-ins, chunking, selection, cost model.

Every collective takes its buffers first and keyword-only options, runs on
any process group (``group=None``: the world group of :func:`neocomm.init`),
on NumPy or CuPy buffers, blocking or (``async_op=True``) returning a
handle whose ``wait()`` returns the result. The algorithm is the cheapest
one the cost model finds for the message size and the group's topology,
unless ``algo=`` or ``NEOCOMM_ALGO_<OP>`` names one.

Importing this package does not initialise MPI.
"""
from __future__ import annotations

from collectives import settings  # noqa: F401 - declares the NEOCOMM_* settings
from collectives.api import all_gather, all_reduce, all_to_all, broadcast, reduce_scatter
from collectives.api_v import all_to_all_v
from collectives.api_sparse import many_to_many, one_to_many
from collectives.cost import estimate
from collectives.persistent import (PreparedCollective, prepare_all_gather, prepare_all_reduce,
                                    prepare_all_to_all, prepare_all_to_all_v,
                                    prepare_broadcast, prepare_reduce_scatter)
from collectives.state import state_of
from collectives.types import CollectiveOp, FabricModel, LinkCost

__all__ = ["all_to_all", "all_to_all_v", "reduce_scatter", "all_reduce", "all_gather",
           "broadcast", "one_to_many", "many_to_many", "estimate", "CollectiveOp",
           "FabricModel", "LinkCost", "PreparedCollective", "prepare_all_to_all",
           "prepare_all_to_all_v", "prepare_all_reduce", "prepare_reduce_scatter",
           "prepare_all_gather", "prepare_broadcast", "state_of"]
