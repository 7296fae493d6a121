"""The training job ``neocomm simulate`` prices, and what its subcommands share.

:class:`Job` is a training config's tables, dense model and optimizer, ready to
plan and price at any number of ranks (``simulate step``, ``scale`` and
``validate --step``).
"""
from __future__ import annotations

import json

__all__ = ["Job", "dump_json", "positive_counts"]


class Job:
    """A training config's tables, dense model and optimizer, ready to plan at any size."""

    def __init__(self, args):
        import dataclasses

        from embedding.dense.types import DenseConfig
        from embedding.train import ConfigError, load_config
        from embedding.train.data import open_data
        from embedding.train.setup import tables_of

        try:
            cfg = load_config(args.config)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        plan = dataclasses.replace(cfg.plan, fabric=args.fabric or cfg.plan.fabric, file="")
        self.cfg = dataclasses.replace(cfg, plan=plan)
        self.data = open_data(self.cfg)
        self.tables = tables_of(self.cfg, self.data)
        m = self.cfg.model
        self.dense = DenseConfig(num_dense=self.data.num_dense,
                                 num_sparse=len(self.data.feature_names),
                                 bottom_mlp=m.bottom_mlp, top_mlp=m.top_mlp, dtype=m.dtype)
        from embedding.train.batching import DEFAULT_BATCH_SIZE

        #: the global batch; a default one (no --batch-size, train.batch_size 0) is
        #: rounded down to a multiple of the ranks at each size
        self.batch = args.batch_size or self.cfg.train.batch_size or DEFAULT_BATCH_SIZE
        self.batch_given = bool(args.batch_size or self.cfg.train.batch_size)
        self.args = args
        from embedding.planner.hardware import load_target

        try:
            self.target = load_target(self.cfg.plan.fabric)
        except ValueError as exc:  # worded as the planner words it
            raise ValueError(str(ConfigError(self.cfg.source, "plan.fabric", str(exc)))) \
                from None
        #: on a fabric without GPUs (and no --flops) the step's compute is measured here
        self.profiled = not args.flops and not self.target.flop_rate
        self.flops, self.flops_source = self._dense_rate()

    def step(self, ranks: int, batch: int, *, nodes: int | None = None,
             emulated: bool = False, profile: dict | None = None):
        """``(StepEstimate, PlanReport, Hardware)`` of ``ranks`` ranks at global ``batch``,
        on ``nodes`` nodes (default: ``--ranks-per-node``, else the fabric's GPUs per node);
        ``emulated``: the nodes share this host (its cores and its threads); ``profile``:
        the compute measured earlier (else measured now on fabrics without GPUs; kept in
        :attr:`last_profile`)."""
        import dataclasses

        from embedding.simulate import estimate_step
        from embedding.train import ConfigError
        from embedding.train.setup import plan_for

        if nodes:
            rpn = ranks // nodes
        else:
            rpn = self.args.ranks_per_node or max(1, min(self.target.devices_per_host, ranks))
        if ranks % rpn or not rpn:
            raise ValueError(f"--ranks-per-node: {rpn} does not divide {ranks} ranks")
        if batch % ranks and not self.batch_given:
            from embedding.train.batching import global_batch

            batch = global_batch(0, ranks)
        if batch % ranks:
            from embedding.train.batching import nearest_multiples

            near = " or ".join(map(str, nearest_multiples(batch, ranks)))
            raise ValueError(f"batch size: {batch} samples do not split evenly over {ranks} "
                             f"ranks; use a multiple of {ranks} ({near})")
        cfg = dataclasses.replace(self.cfg, train=dataclasses.replace(self.cfg.train,
                                                                      batch_size=batch))
        given = getattr(self.args, "plan", None)
        try:
            if given:
                report, hardware = self._given_plan(cfg, given, ranks, rpn)
            else:
                report, hardware, _ = plan_for(cfg, self.tables, ranks, rpn,
                                               self.data.ids_per_sample,
                                               memory=self.args.memory)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        if self.profiled:
            from embedding.profile import profile_step

            if emulated:
                hardware = dataclasses.replace(hardware, fabric=hardware.fabric.emulated())
            if profile is None:
                profile = profile_step(cfg, self.data, self.tables, report.plan, batch,
                                       ranks_on_host=ranks if emulated else rpn)
        self.last_profile = profile or {}
        est = estimate_step(report, hardware, self.dense, batch, flop_rate=self.flops,
                            optimizer=self.cfg.dense_optimizer.kind,
                            overlap=not self.args.no_overlap and self.cfg.train.overlap,
                            profile=profile)
        return est, report, hardware

    def _given_plan(self, cfg, path: str, ranks: int, rpn: int):
        from embedding.planner import PlanMismatchError, evaluate_plan
        from embedding.train.setup import planner_inputs, read_plan

        try:
            plan = read_plan(path)
        except ValueError as exc:
            raise ValueError(f"--plan: {exc}") from None
        hardware, workload, constraints = planner_inputs(
            cfg, self.tables, ranks, rpn, self.data.ids_per_sample, self.args.memory)
        try:
            return evaluate_plan(plan, self.tables, hardware, workload,
                                 constraints=constraints), hardware
        except PlanMismatchError as exc:
            raise ValueError(f"--plan: {path}: {exc}") from None

    def _dense_rate(self) -> tuple[float, str]:
        """``(dense FLOP/s per rank, where the figure comes from)``."""
        if self.args.flops:
            return float(self.args.flops), "given (--flops)"
        if self.target.flop_rate:
            return self.target.flop_rate, "the GPU's peak FP32"
        from embedding.simulate import measure_flop_rate

        return measure_flop_rate(), ("a float32 matrix product measured on this host; "
                                     "the compute parts are the trainer's own, measured here")


def dump_json(path: str, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=1)
        fh.write("\n")


def positive_counts(text: str, what: str, expected: str) -> list[int]:
    """Positive counts written comma-separated; ValueError naming ``what`` otherwise."""
    try:
        counts = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise ValueError(f"{what}: expected {expected}, got {text!r}")
    return counts
