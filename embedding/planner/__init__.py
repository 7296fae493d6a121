"""The sharding planner: which ranks hold which rows and columns of each table.

Stages: enumerate the candidate shardings of every table
(:mod:`~embedding.planner.enumerate`), estimate their memory and time
(:mod:`~embedding.planner.estimate`, collectives priced by
:func:`collectives.cost.estimate`), place the shards with greedy or
Karmarkar–Karp partitioning under the devices' memory
(:mod:`~embedding.planner.partition`, :mod:`~embedding.planner.placement`)
and score the plan (:mod:`~embedding.planner.search`). Given host memory
(``Hardware.host_memory``), tables may live in host memory behind a device
cache (:mod:`~embedding.planner.tiers`).

>>> from embedding.planner import Hardware, plan_sharding
>>> from embedding.presets import preset
>>> report = plan_sharding(preset("criteo-1tb"), Hardware(8, 8, 80 << 30))
>>> report.plan.world_size
8
"""
from __future__ import annotations

from embedding.planner.partition import greedy_partition, karmarkar_karp
from embedding.planner.search import baseline_plan, evaluate_plan, plan_sharding
from embedding.planner.types import (Hardware, PartitionMethod, PlanDoesNotFitError, PlanError,
                                     PlanMismatchError, PlanReport, TableConstraints, Workload)
from embedding.planner.validate import validate_plan

__all__ = ["plan_sharding", "baseline_plan", "evaluate_plan", "validate_plan", "greedy_partition",
           "karmarkar_karp", "Hardware", "Workload", "TableConstraints", "PartitionMethod",
           "PlanReport", "PlanError", "PlanDoesNotFitError", "PlanMismatchError"]
