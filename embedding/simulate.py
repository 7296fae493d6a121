"""One DLRM training step, predicted: the planner's embedding estimates plus the dense part.

:func:`estimate_step` takes a :class:`~embedding.planner.PlanReport` (the
planner's per-rank time of each step part, from the same cost model that
selects the collectives) and adds what the plan does not hold:

- ``input_dist``, ``output_dist``, ``emb_backward``: the plan's bandwidth
  terms plus one collective latency per call the runtime makes (an id
  AlltoAll, a pooled-row collective and its reverse, per sharding type);
- ``dense``: the bottom and top MLPs and the dot interaction, forward and
  backward (3 x the forward's ``2 x multiply-adds``) of the rank's samples at
  the device's ``flop_rate``;
- ``sync``: the step's small loss-and-health AllReduce;
- ``grad_sync``: the AllReduce of the dense gradients (and of data-parallel
  tables, from the plan);
- ``optimizer``: the dense optimizer streaming its parameters, gradients and
  state through memory at the lookup rate.

With ``overlap`` (the trainer's default), the input dist of the next batch
runs behind the dense compute, the embedding backward and the optimizer, and
the dense AllReduce behind the dense backward: only the part that sticks out
counts. The step is the slowest rank's sum of the visible parts.
"""
from __future__ import annotations

from dataclasses import dataclass

from collectives.cost import call_overhead, estimate
from collectives.types import CollectiveOp, Request
from embedding.dense.types import (DenseConfig, DenseOptimizerKind,  # noqa: F401 (re-export)
                                   dense_flops_per_sample)
from embedding.planner.estimate import CostModel, Scope
from embedding.planner.types import STEP_PARTS, Hardware, PlanReport
from embedding.types import ShardingType

__all__ = ["StepEstimate", "estimate_step", "dense_flops_per_sample", "measure_flop_rate",
           "WorkloadPrediction", "predict_workload",
           "PARTS"]

#: the parts of a predicted step: reading the batch (measured on CPU fabrics only, where
#: the reader shares the rank's core), then the planner's parts
PARTS = ("data",) + STEP_PARTS

#: bytes one dense parameter streams per optimizer step (float32): parameter and gradient
#: read, parameter written, plus each state array read and written
_OPTIMIZER_BYTES = {DenseOptimizerKind.SGD: 3 * 4, DenseOptimizerKind.ADAGRAD: 5 * 4,
                    DenseOptimizerKind.ADAM: 7 * 4}

_A2A, _RS, _AG, _AR = (CollectiveOp.ALL_TO_ALL, CollectiveOp.REDUCE_SCATTER,
                       CollectiveOp.ALL_GATHER, CollectiveOp.ALL_REDUCE)
_W, _N = Scope.WORLD, Scope.NODE
#: per sharding type, the collectives of its (input, output, backward) dists
_CALLS = {ShardingType.TABLE_WISE: ((_A2A, _W), (_A2A, _W), (_A2A, _W)),
          ShardingType.COLUMN_WISE: ((_A2A, _W), (_A2A, _W), (_A2A, _W)),
          ShardingType.TABLE_COLUMN_WISE: ((_A2A, _W), (_A2A, _W), (_A2A, _W)),
          ShardingType.ROW_WISE: ((_A2A, _W), (_RS, _W), (_AG, _W)),
          ShardingType.CYCLIC_ROW_WISE: ((_A2A, _W), (_RS, _W), (_AG, _W)),
          ShardingType.TABLE_ROW_WISE: ((_A2A, _W), (_RS, _N), (_AG, _N))}


@dataclass(frozen=True)
class StepEstimate:
    """A predicted step: ``parts`` the visible seconds of each part on the slowest rank (in
    :data:`STEP_PARTS` order), ``hidden`` the seconds overlap took off each part."""

    parts: tuple[tuple[str, float], ...]
    hidden: tuple[tuple[str, float], ...]
    step_seconds: float
    global_batch: int
    slowest_rank: int

    @property
    def samples_per_second(self) -> float:
        return self.global_batch / self.step_seconds if self.step_seconds > 0 else 0.0

    @property
    def communication_seconds(self) -> float:
        """Visible seconds of the parts that wait on collectives."""
        comm = ("input_dist", "output_dist", "emb_backward", "sync", "grad_sync")
        return sum(t for p, t in self.parts if p in comm)

    @property
    def bound(self) -> str:
        """``"communication"`` when collectives take most of the step, else ``"compute"``."""
        return "communication" if 2 * self.communication_seconds > self.step_seconds \
            else "compute"

    def to_dict(self) -> dict:
        return {"parts": dict(self.parts), "hidden": dict(self.hidden),
                "step_seconds": self.step_seconds, "samples_per_second": self.samples_per_second,
                "global_batch": self.global_batch, "slowest_rank": self.slowest_rank,
                "bound": self.bound}


def _call_overhead(fabric, op: CollectiveOp) -> float:
    """What one API call of ``op`` costs beyond its algorithm on ``fabric``."""
    return call_overhead(Request(op, 0, 4, fabric.size), fabric)


def estimate_step(report: PlanReport, hardware: Hardware, dense: DenseConfig,
                  global_batch: int, *, flop_rate: float,
                  optimizer: DenseOptimizerKind = DenseOptimizerKind.SGD,
                  overlap: bool = True,
                  profile: dict[int, dict[str, float]] | None = None) -> StepEstimate:
    """The step of ``report``'s plan on ``hardware`` (module doc). ``flop_rate``: the dense
    compute's floating-point operations per second on one rank. ``profile``: per rank,
    the seconds of each compute part measured on this host (:func:`embedding.profile.
    profile_step`, which runs them beside the job's other ranks on a host); they replace the
    priced lookups, dense and optimizer."""
    if not flop_rate > 0:
        raise ValueError(f"flop_rate: expected operations per second > 0, got {flop_rate}")
    cost = CostModel(hardware)
    fabric = cost.fabric
    w = hardware.world_size
    local = global_batch / w
    kinds = {t.sharding for t in report.tables}
    latency = {"input_dist": 0.0, "output_dist": 0.0, "emb_backward": 0.0}
    for kind in kinds:
        for part, (op, scope) in zip(("input_dist", "output_dist", "emb_backward"),
                                     _CALLS.get(kind, ())):
            latency[part] += cost.latency(op, scope) + _call_overhead(fabric, op)
    dense_bytes = dense.num_parameters * 4
    common = {
        "sync": estimate(_AR, 16, fabric) + _call_overhead(fabric, _AR) if w > 1 else 0.0,
        "grad_sync": (cost.seconds(_AR, _W, dense_bytes) + cost.latency(_AR, _W) +
                      _call_overhead(fabric, _AR)) if w > 1 else 0.0,
    }
    if profile is None:
        common["dense"] = 3.0 * local * dense_flops_per_sample(dense) / flop_rate
        common["optimizer"] = (dense.num_parameters * _OPTIMIZER_BYTES[optimizer] /
                               hardware.lookup_rate)
    best = None
    for rank in report.ranks:
        raw = {p: 0.0 for p in PARTS}
        for part, secs in rank.parts:
            raw[part] += secs
        if profile is not None:  # the measured compute replaces the priced lookups
            update = rank.lookup_seconds - raw["lookup"]
            raw["emb_backward"] = max(0.0, raw["emb_backward"] - update)
            raw["lookup"] = 0.0
            for part, secs in profile[rank.rank].items():
                raw[part] += secs
        for table in (latency, common):
            for part, secs in table.items():
                raw[part] += secs
        hidden = {p: 0.0 for p in PARTS}
        if overlap:
            backward = raw["dense"] * 2.0 / 3.0
            hidden["grad_sync"] = min(raw["grad_sync"], backward)
            behind = raw["dense"] + raw["sync"] + raw["emb_backward"] + \
                (raw["grad_sync"] - hidden["grad_sync"]) + raw["optimizer"]
            own = profile[rank.rank]["input_dist"] if profile is not None else 0.0
            hidden["input_dist"] = min(raw["input_dist"] - own, behind)
        visible = {p: raw[p] - hidden[p] for p in PARTS}
        total = sum(visible.values())
        if best is None or total > best[0]:
            best = (total, rank.rank, visible, hidden)
    total, slowest, visible, hidden = best
    return StepEstimate(tuple((p, visible[p]) for p in PARTS),
                        tuple((p, hidden[p]) for p in PARTS), total, int(global_batch),
                        slowest)


@dataclass(frozen=True)
class WorkloadPrediction:
    """A Neo workload's (:mod:`embedding.neo`) predicted step on ``ranks`` ranks: ``step``
    the :class:`StepEstimate`, ``host_bytes`` the host memory its
    host-resident tables take on the node that holds the most (0: every table in device
    memory), ``tiered`` how many tables live in host memory."""

    model: object
    ranks: int
    nodes: int
    global_batch: int
    step: object
    host_bytes: int
    tiered: int

    @property
    def samples_per_second(self) -> float:
        return self.step.samples_per_second

    def to_dict(self) -> dict:
        return {"workload": self.model.name, "ranks": self.ranks, "nodes": self.nodes,
                "global_batch": self.global_batch, "host_bytes_per_node": self.host_bytes,
                "tiered_tables": self.tiered, **self.step.to_dict()}


def predict_workload(m, ranks: int, *, fabric: str = "zionex", host_memory: int = 0,
                     reserve: float = 0.1) -> WorkloadPrediction:
    """Plan Neo workload ``m`` (:class:`~embedding.neo.NeoModel`) for ``ranks`` ranks of
    ``fabric`` (one per GPU, ``local_batch`` samples each) as ``neocomm plan`` does, with
    ``host_memory`` bytes per node for host-resident tables (0: none) and ``reserve`` of
    device memory kept for the dense model, then price the step with the GPU's peak FP32
    rate for the dense part. Raises :class:`~embedding.planner.PlanDoesNotFitError` when the
    tables fit nowhere."""
    from embedding.neo import dense_config
    from embedding.planner import Workload, plan_sharding
    from embedding.planner.hardware import hardware_for, load_target
    from embedding.planner.tables import preset_tables

    target = load_target(fabric)
    if not target.flop_rate:
        raise ValueError(f"fabric: {fabric!r} declares no GPU whose FLOP rate prices the "
                         f"dense layers")
    hardware = hardware_for(target, ranks, reserve=reserve, host_memory=int(host_memory))
    tables, constraints = preset_tables(m.preset)
    batch = m.local_batch * ranks
    report = plan_sharding(tables, hardware, Workload(batch_size=batch),
                           constraints=constraints)
    step = estimate_step(report, hardware, dense_config(m), batch, flop_rate=target.flop_rate,
                         optimizer=DenseOptimizerKind.SGD)
    tiered = sum(1 for t in report.tables if t.host_memory)
    host = max(report.node_host_bytes(hardware.ranks_per_node))
    return WorkloadPrediction(m, ranks, hardware.num_nodes, batch, step, host, tiered)


def measure_flop_rate(repeat: int = 5) -> float:
    """FLOP/s of a float32 matrix product of a DLRM layer's shape on this host (NumPy's BLAS,
    as the trainer's dense layers run on the CPU): the best of ``repeat`` timings."""
    import time

    import numpy as np

    rng = np.random.default_rng(0)
    a = rng.standard_normal((1024, 512), dtype=np.float32)
    b = rng.standard_normal((512, 512), dtype=np.float32)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2.0 * 1024 * 512 * 512 / best
