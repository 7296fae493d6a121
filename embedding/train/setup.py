"""Building a training job: tables, the sharding plan, readers — and failing together.

Everything here runs on every rank. A step that can fail on one rank only
(a file one rank cannot read, a plan file that does not fit) goes through
:func:`fail_together`: the verdict is agreed across the group before
anyone moves on, and every rank raises the same error.
"""
from __future__ import annotations

import logging
import os
import zlib
from typing import Sequence

from embedding.train.types import ConfigError, TrainConfig, TrainingError
from embedding.types import IdPolicy, Pooling, ShardingPlan, TableConfig

__all__ = ["fail_together", "problem_kind", "build_tables", "tables_of", "make_plan", "plan_for",
           "apply_tiers", "check_host_memory",
           "make_reader", "ranks_per_node_of", "read_plan", "planner_inputs",
           "host_memory", "check_disk_room"]

_log = logging.getLogger(__name__)


def problem_kind(exc: BaseException) -> str:
    """The tag an error travels under in an agreement: ``config`` or the offending tensor."""
    if isinstance(exc, ConfigError):
        return "config"
    return str(getattr(exc, "tensor", "") or getattr(exc, "field", "") or "") or "error"


def fail_together(group, what: str, exc: BaseException | None = None, *, step: int = -1,
                  tag: str | None = None, signature: Sequence[tuple[str, int]] = ()) -> None:
    """Agree across ``group`` whether any rank failed ``what``; if so raise on every rank.

    ``exc`` is this rank's error (None when fine). The rank whose error it
    was re-raises it when it is a :class:`ConfigError`; every other case
    becomes a :class:`TrainingError` (``ConfigError`` when the first failing
    rank's was one) naming the step and the ranks. ``signature`` holds named
    integers that must be equal on every rank (a plan's digest). Errors
    raised here carry ``agreed = True``.
    """
    from neocomm.agree import Problem, agree
    from neocomm.errors import CollectiveArgumentError

    if exc is not None and getattr(exc, "agreed", False):
        raise exc  # agreed already: every rank holds it, none is waiting for this agreement
    problem = None
    if exc is not None:
        message = str(exc)
        if step >= 0 and not message.startswith(f"step {step}"):
            message = f"step {step}: {message}"
        problem = Problem(tag or problem_kind(exc), message)
    try:
        agree(group.comm, what, problem, list(signature))
        return
    except CollectiveArgumentError as agreed:
        per_rank = dict(agreed.per_rank)
        if isinstance(exc, ConfigError):
            exc.agreed = True
            raise exc from None
        if not per_rank:  # the signatures differ
            err = TrainingError(str(agreed), step=step, tensor=agreed.field,
                                ranks=agreed.ranks)
        else:
            def bare(m: str) -> str:
                return m[len(f"step {step}: "):] if step >= 0 and m.startswith(
                    f"step {step}: ") else m

            first = min(per_rank)
            where = f"rank {first}" if len(per_rank) == 1 else f"ranks {sorted(per_rank)}"
            head = f"{what} failed at step {step}" if step >= 0 else what
            text = f"{head}: {bare(per_rank[first])} (on {where})"
            others = {r: m for r, m in per_rank.items()
                      if r != first and bare(m) != bare(per_rank[first])}
            if others:
                text += "; " + "; ".join(f"rank {r}: {bare(m)}"
                                         for r, m in sorted(others.items()))
            if agreed.field == "config":
                err = ConfigError("", "", text)
            else:
                err = TrainingError(text, step=step, tensor=agreed.field,
                                    ranks=tuple(sorted(per_rank)), per_rank=per_rank)
        err.agreed = True
        raise err from (exc if exc is not None else None)


def build_tables(cfg: TrainConfig, table_sizes, feature_names, feature_tables=(),
                 feature_pooling=()) -> list[TableConfig]:
    """The tables the features read, of the model's dimension and sparse optimizer.

    ``table_sizes`` has one entry per feature (its table's rows). A feature
    reads the table named in ``feature_tables`` (default: a table of its own,
    named after it); features naming one table share it. ``feature_pooling``
    is per feature (default ``tables.pooling``).
    """
    if len(table_sizes) != len(feature_names):
        raise ConfigError(cfg.source, "tables.rows", f"the data has {len(feature_names)} sparse "
                          f"features, the tables are {len(table_sizes)}")
    names = tuple(feature_tables) or tuple(feature_names)
    pooling = tuple(feature_pooling) or (cfg.tables.pooling,) * len(feature_names)
    grouped: dict[str, list] = {}
    for f, t, n, p in zip(feature_names, names, table_sizes, pooling):
        grouped.setdefault(t, []).append((f, int(n), p))
    if cfg.tables.dynamic and cfg.tables.tier != "device":
        raise ConfigError(cfg.source, "tables.dynamic", f"dynamic tables live in device memory; "
                          f"tables.tier is {cfg.tables.tier!r}")
    out = []
    for t, feats in grouped.items():
        out.append(TableConfig(name=t, num_rows=feats[0][1], dim=cfg.model.embedding_dim,
                               pooling=Pooling(feats[0][2]),
                               features=tuple(f for f, _, _ in feats),
                               dtype=cfg.tables.dtype or cfg.model.dtype,
                               optimizer=cfg.sparse_optimizer, dynamic=cfg.tables.dynamic,
                               eviction=cfg.tables.eviction, rounding=cfg.tables.rounding,
                               rounding_seed=cfg.tables.rounding_seed,
                               state_dtype=cfg.tables.state_dtype or None))
    return out


def tables_of(cfg: TrainConfig, data) -> list[TableConfig]:
    """:func:`build_tables` for a :class:`~embedding.train.data.TrainData`'s features."""
    return build_tables(cfg, data.table_sizes, data.feature_names, data.feature_tables,
                        data.feature_pooling)


def id_policy_of(cfg: TrainConfig) -> IdPolicy:
    return IdPolicy(cfg.tables.id_policy)


def host_memory() -> int:
    """Bytes of physical memory of this host."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        return 16 << 30


_physical_memory = host_memory  # planner_inputs has a parameter of that name


def make_plan(cfg: TrainConfig, tables: Sequence[TableConfig], group,
              ids_per_sample: dict | None = None) -> ShardingPlan:
    """The plan of ``cfg.plan.file``, else the planner's plan for this group (agreed)."""
    plan, exc = None, None
    try:
        plan = _plan_locally(cfg, tables, group, ids_per_sample)
        check_host_memory(cfg, plan, tables, [tuple(n) for n in group.nodes])
    except (ConfigError, TrainingError, ValueError, OSError) as e:
        exc = e
    digest = zlib.crc32(plan.to_json().encode()) & 0x7FFFFFFF if plan is not None else 0
    fail_together(group, "sharding plan", exc, signature=[("plan", digest)] if exc is None
                  else [])
    return plan


def check_host_memory(cfg: TrainConfig, plan: ShardingPlan, tables, nodes) -> None:
    """ConfigError when the host-resident shards of some node need more than
    ``plan.host_memory`` (default: this host's memory); names the node, its ranks and the
    largest tables. The same verdict on every rank: every node is checked."""
    from embedding.optim import row_bytes
    from topology.sizes import format_size, parse_size

    from embedding.packing import packed_tables

    by_name = {t.name: t for t in packed_tables(tables, plan)}
    per_rank: dict[int, dict[str, int]] = {}
    for tp in plan.tables:
        if not tp.memory.tiered:
            continue
        t = by_name[tp.table]
        for sh in tp.shards:
            n = sh.num_rows * row_bytes(t.optimizer.kind, sh.num_cols, t.dtype)
            mine = per_rank.setdefault(sh.rank, {})
            mine[t.name] = mine.get(t.name, 0) + n
    if not per_rank:
        return
    budget = parse_size(cfg.plan.host_memory) if cfg.plan.host_memory else host_memory()
    for i, ranks in enumerate(nodes):
        need: dict[str, int] = {}
        for r in ranks:
            for name, n in per_rank.get(r, {}).items():
                need[name] = need.get(name, 0) + n
        total = sum(need.values())
        if total > budget:
            top = sorted(need.items(), key=lambda kv: -kv[1])[:3]
            what = ", ".join(f"{k} {format_size(v)}" for k, v in top)
            key = "plan.host_memory" if cfg.plan.host_memory else "tables.tier"
            raise ConfigError(cfg.source, key,
                              f"the host-resident tables need {format_size(total)} of host "
                              f"memory on node {i} (ranks {list(ranks)}; {what}), more than "
                              f"the {format_size(budget)} there by {format_size(total - budget)}"
                              f"; keep more tables in device memory (tables.tier_min_rows), "
                              f"shard over more nodes or "
                              f"{'raise' if cfg.plan.host_memory else 'set'} plan.host_memory")


def ranks_per_node_of(group) -> int:
    """The group's ranks per node when they divide its size, else 1 (nodes of one rank)."""
    rpn = group.ranks_per_node
    return rpn if rpn and group.size % rpn == 0 else 1


def read_plan(path: str) -> ShardingPlan:
    """The sharding plan in the JSON file ``path``; ValueError saying why it cannot be read
    or is not a plan."""
    try:
        with open(path, encoding="utf-8") as fh:
            return ShardingPlan.from_json(fh.read())
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path} is not a sharding plan: {exc}") from None


def _plan_locally(cfg: TrainConfig, tables, group, ids_per_sample=None) -> ShardingPlan:
    from embedding.planner import PlanError, validate_plan

    rpn = ranks_per_node_of(group)
    if cfg.plan.file:
        try:
            plan = read_plan(cfg.plan.file)
        except ValueError as exc:
            raise ConfigError(cfg.source, "plan.file", str(exc)) from None
        try:
            validate_plan(plan, group.size, ranks_per_node=rpn, tables=tables)
        except PlanError as exc:
            raise ConfigError(cfg.source, "plan.file", f"{cfg.plan.file} does not fit this job: "
                              f"{exc}") from None
        return apply_tiers(cfg, plan, tables)
    from embedding.planner import PlanDoesNotFitError

    try:
        report = plan_for(cfg, tables, group.size, rpn, ids_per_sample)[0]
    except PlanDoesNotFitError as exc:
        raise TrainingError(f"the planner found no plan: {exc}", tensor="plan") from None
    return apply_tiers(cfg, report.plan, tables)


def apply_tiers(cfg: TrainConfig, plan: ShardingPlan, tables) -> ShardingPlan:
    """``plan`` with ``[tables]``'s memory tier on the tables it covers (see
    :class:`~embedding.train.types.TablesConfig`); ConfigError naming the key and table."""
    import dataclasses

    from embedding.optim import row_bytes
    from embedding.train.types import cache_rows
    from embedding.types import ShardingType, TableMemory, Tier

    tc = cfg.tables
    tier = Tier(tc.tier)
    if tier is Tier.CACHED and not tc.cache:
        raise ConfigError(cfg.source, "tables.cache", "tier \"cached\" needs a cache size "
                          "(\"5%\", \"4096\" rows or \"64MiB\")")
    if tier is not Tier.CACHED and tc.cache:
        raise ConfigError(cfg.source, "tables.cache", f"only tier \"cached\" has a cache; "
                          f"tier is {tc.tier!r}")
    if tier is Tier.DEVICE:
        return plan
    from embedding.packing import packed_tables

    by_name = {t.name: t for t in packed_tables(tables, plan)}
    out = []
    for tp in plan.tables:
        t = by_name[tp.table]
        if (tp.memory.tiered or tp.sharding is ShardingType.DATA_PARALLEL
                or t.num_rows < tc.tier_min_rows):
            out.append(tp)
            continue
        rows = 0
        if tier is Tier.CACHED:
            shard_rows = max(s.num_rows for s in tp.shards)
            try:
                rows = cache_rows(tc.cache, shard_rows,
                                  row_bytes(t.optimizer.kind, t.dim, t.dtype))
            except ValueError as exc:
                raise ConfigError(cfg.source, "tables.cache", str(exc)) from None
            if rows > t.num_rows:
                raise ConfigError(cfg.source, "tables.cache",
                                  f"{tc.cache!r} is {rows} rows, more than table {t.name!r} "
                                  f"has ({t.num_rows}); lower it or raise tables.tier_min_rows")
            rows = min(rows, shard_rows)
        mem = TableMemory(tier, rows, tc.cache_policy, tc.admit_after)
        out.append(dataclasses.replace(tp, memory=mem))
    return dataclasses.replace(plan, tables=tuple(out))


def plan_for(cfg: TrainConfig, tables, world_size: int, ranks_per_node: int,
             ids_per_sample: dict | None = None, memory: int | None = None,
             host_memory: int | None = None):
    """The planner's ``(report, hardware, workload)`` for ``cfg``'s tables on ``world_size``
    ranks: what ``neocomm train`` plans, and what ``neocomm plan --config`` prints.

    The target is ``plan.fabric``; memory per rank ``memory``, else
    ``plan.memory``, else the fabric's device memory on a multi-GPU host,
    else this host's memory over its ranks. Host memory per node for tables
    the planner keeps in host memory: ``host_memory``, else ``plan.host_memory``,
    else none (every table in device memory). ``ids_per_sample`` is each
    table's pooling factor as the data gives it (default 1). ``plan.pack``: small tables
    are packed (``plan.pack_rows``).
    """
    from embedding.planner import plan_sharding

    hardware, workload, constraints = planner_inputs(cfg, tables, world_size, ranks_per_node,
                                                     ids_per_sample, memory, host_memory)
    report = plan_sharding(tables, hardware, workload, constraints=constraints or None,
                           pack_rows=cfg.plan.pack_rows if cfg.plan.pack else None)
    return report, hardware, workload


def planner_inputs(cfg: TrainConfig, tables, world_size: int, ranks_per_node: int,
                   ids_per_sample: dict | None = None, memory: int | None = None,
                   host_memory: int | None = None):
    """``(hardware, workload, constraints)`` the planner gets for ``cfg`` (see
    :func:`plan_for`)."""
    from embedding.planner import TableConstraints, Workload
    from embedding.planner.hardware import hardware_for, load_target
    from topology.sizes import parse_size

    try:
        target = load_target(cfg.plan.fabric)
    except ValueError as exc:
        raise ConfigError(cfg.source, "plan.fabric", str(exc)) from None
    if memory is None and cfg.plan.memory:
        memory = parse_size(cfg.plan.memory)
    elif memory is None and target.device_memory and target.devices_per_host > 1:
        memory = target.device_memory
    elif memory is None:
        from embedding.train.threads import ranks_on_host

        memory = _physical_memory() // ranks_on_host(ranks_per_node)
    if host_memory is None and cfg.plan.host_memory:
        try:
            host_memory = parse_size(cfg.plan.host_memory)
        except ValueError as exc:
            raise ConfigError(cfg.source, "plan.host_memory", str(exc)) from None
    hardware = hardware_for(target, world_size, ranks_per_node=ranks_per_node,
                            device_memory=memory, reserve=0.1, host_memory=host_memory or 0)
    from embedding.types import DYNAMIC_SHARDINGS

    constraints = {}
    for t in tables:
        kw = {}
        if cfg.plan.shardings:
            kw["shardings"] = cfg.plan.shardings
        if t.dynamic:  # a hash map per owner: table-wise or cyclic row-wise only
            allowed = [s.value for s in DYNAMIC_SHARDINGS]
            kw["shardings"] = tuple(s for s in kw.get("shardings", allowed) if s in allowed)
            if not kw["shardings"]:
                raise ConfigError(cfg.source, "plan.shardings",
                                  f"dynamic tables are sharded {' or '.join(allowed)}; "
                                  f"plan.shardings allows {list(cfg.plan.shardings)}")
        if ids_per_sample and t.name in ids_per_sample:
            kw["ids_per_sample"] = max(float(ids_per_sample[t.name]), 1e-3)
        if kw:
            constraints[t.name] = TableConstraints(**kw)
    from embedding.train.batching import global_batch

    batch = global_batch(cfg.train.batch_size, world_size, source=cfg.source)
    return hardware, Workload(batch_size=batch), constraints


#: bytes kept free beside a checkpoint for the metrics log, manifests and the plot
OUTPUT_MARGIN = 1 << 20


def check_disk_room(group, dirs: Sequence, need: int) -> None:
    """Refuse to start, on every rank, before anything is allocated, when a directory the
    job writes (``dirs``, the checkpoint directory last) cannot be created or written, or
    when its file system has less free space than one checkpoint of the ranks of this host
    that write to it (``need``: this rank's bytes of a checkpoint)."""
    import socket

    from neocomm import watchdog
    from neocomm.room import free_bytes, probe_write
    from topology.sizes import format_size

    exc, where = None, None
    for d in dirs:
        try:
            os.makedirs(d, exist_ok=True)
            probe_write(d, 64 << 10)
        except OSError as e:
            exc = TrainingError(f"{d}: cannot write there ({e.strerror or e}); free some space "
                                f"or choose another output.dir / checkpoint.dir",
                                tensor="disk")
            break
    if exc is None:
        where = (socket.gethostname(), os.stat(dirs[-1]).st_dev, int(need))
    with watchdog.guard("the start-up check of the output directories"):
        everyone = group.comm.allgather(where)  # (and every rank's probe is gone)
    if where is not None:
        sharing = [w for w in everyone if w is not None and w[:2] == where[:2]]
        total = sum(w[2] for w in sharing) + OUTPUT_MARGIN
        free = free_bytes(dirs[-1])
        if free < total:
            exc = TrainingError(
                f"{dirs[-1]}: {format_size(free)} free; a checkpoint needs about "
                f"{format_size(total)} there ({len(sharing)} rank(s) of {where[0]} write to "
                f"this file system); "
                f"free some space or choose another checkpoint.dir", tensor="disk")
    fail_together(group, "checking the output directories", exc)


def make_reader(dataset, global_batch: int, group, *, broadcast: bool, shuffle: bool,
                seed: int, feature_names, shuffle_window: int = 0):
    """This rank's reader: rank-sliced, or rank 0 reading and sending each rank its slice."""
    from embedding.data import BroadcastReader, ShardedReader

    if broadcast and group.size > 1:
        from embedding.data.reader import one_to_many_transport

        return BroadcastReader(dataset if group.rank == 0 else None, global_batch, group.rank,
                               group.size, one_to_many_transport(group), root=0,
                               shuffle=shuffle, seed=seed, feature_names=feature_names,
                               shuffle_window=shuffle_window)
    return ShardedReader(dataset, global_batch, group.rank, group.size, shuffle=shuffle,
                         seed=seed, shuffle_window=shuffle_window)
