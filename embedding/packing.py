"""Table packing: many small tables of one kind stored, placed and looked up as one.

A :class:`~embedding.types.PackedTable` of a plan lays its member tables end
to end: member ``k``'s id ``i`` reads row ``row_offset[k] + i`` of the packed
table. The collection builds one store for it, so one fused kernel call and one
collective per step serve every member, and the planner places one larger table
(row-wise over every rank, say) instead of many whole small ones. Each member
keeps its features, pooled output columns, id policy, initial weights and its
own tensors in checkpoints.

:func:`choose_packs` is the planner's rule: tables of at most ``max_rows`` rows
that share dim, dtype, optimizer, pooling and rounding are packed, one packed
table per such kind with two or more of them. :func:`packed_tables` turns the
model's tables into the physical ones a plan places.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Mapping, Sequence

from embedding.types import PackedTable, PackMember, ShardingPlan, TableConfig

__all__ = ["DEFAULT_PACK_ROWS", "PACK_SAME", "packed_tables", "choose_packs", "row_offsets",
           "feature_offsets"]

#: Default ``max_rows`` of :func:`choose_packs`, rows: a table of at most this many rows is
#: small enough to pack (at dim 128 in float32 with row-wise AdaGrad, 64 MiB of weights).
DEFAULT_PACK_ROWS = 131072

#: What the members of one packed table share (TableConfig fields).
PACK_SAME = ("dim", "dtype", "optimizer", "pooling", "rounding", "rounding_seed",
             "state_dtype")


def _kind(t: TableConfig) -> tuple:
    return tuple(getattr(t, f) for f in PACK_SAME)


def packed_tables(tables: Sequence[TableConfig],
                  plan: ShardingPlan | Sequence[PackedTable]) -> tuple[TableConfig, ...]:
    """The physical tables of ``tables`` under ``plan`` (a plan, or its packed tables): each
    packed table (in the place of its first member) as one :class:`TableConfig` of its
    members' rows together, reading every member's features in member order; unpacked
    tables as they are.

    ValueError naming the packed table, the member and the value when a member is not
    one of ``tables``, is dynamic, has other rows than the plan records, or differs
    from the first member in dim, dtype, optimizer, pooling or rounding; or when a
    packed table's name is a table's name.
    """
    packs = tuple(plan.packs if isinstance(plan, ShardingPlan) else plan)
    if not packs:
        return tuple(tables)
    by_name = {t.name: t for t in tables}
    of = {m: p for p in packs for m in p.tables}
    out, done = [], set()
    for t in tables:
        p = of.get(t.name)
        if p is None:
            if t.name in {q.name for q in packs}:
                raise ValueError(f"packs: packed table {t.name!r} has the name of a table")
            out.append(t)
            continue
        if p.name in done:
            continue
        done.add(p.name)
        first = None
        for m in p.members:
            mt = by_name.get(m.table)
            if mt is None:
                raise ValueError(f"packs: member {m.table!r} of packed table {p.name!r} is not "
                                 f"a table (tables: {sorted(by_name)})")
            if mt.dynamic:
                raise ValueError(f"packs: member {m.table!r} of packed table {p.name!r} is "
                                 f"dynamic; only fixed tables are packed")
            if mt.num_rows != m.num_rows:
                raise ValueError(f"packs: member {m.table!r} of packed table {p.name!r} has "
                                 f"{mt.num_rows} rows, the plan records num_rows={m.num_rows}")
            first = first or mt
            for f in PACK_SAME:
                if getattr(mt, f) != getattr(first, f):
                    raise ValueError(f"packs: member {m.table!r} of packed table {p.name!r} "
                                     f"has {f}={getattr(mt, f)!r}, member {first.name!r} has "
                                     f"{getattr(first, f)!r}")
        members = [by_name[m.table] for m in p.members]
        out.append(replace(first, name=p.name, num_rows=p.num_rows,
                           features=tuple(f for mt in members for f in mt.features)))
    return tuple(out)


def choose_packs(tables: Sequence[TableConfig], max_rows: int = DEFAULT_PACK_ROWS, *,
                 keep: Sequence[str] = (), group_by: Callable[[str], object] | None = None
                 ) -> tuple[PackedTable, ...]:
    """The packed tables the planner makes of ``tables``: fixed tables of at most
    ``max_rows`` rows (not named in ``keep``) grouped by dim, dtype, optimizer, pooling and
    rounding (and ``group_by(name)``, when given: the planner's other per-table settings),
    in table order; each group of two or more becomes ``packed_d<dim>`` (with
    ``_<k>`` for a second group of one dim, and ``_`` added while the name is a table's).
    """
    if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1:
        raise ValueError(f"max_rows: expected a row count >= 1, got {max_rows!r}")
    keep = set(keep)
    groups: dict[tuple, list[TableConfig]] = {}
    for t in tables:
        if not t.dynamic and t.num_rows <= max_rows and t.name not in keep:
            key = _kind(t) + ((group_by(t.name),) if group_by is not None else ())
            groups.setdefault(key, []).append(t)
    names = {t.name for t in tables}
    per_dim: dict[int, int] = {}
    out = []
    for members in groups.values():
        if len(members) < 2:
            continue
        dim = members[0].dim
        k = per_dim[dim] = per_dim.get(dim, 0) + 1
        name = f"packed_d{dim}" + (f"_{k}" if k > 1 else "")
        while name in names:
            name += "_"
        names.add(name)
        out.append(PackedTable(name, tuple(
            PackMember(t.name, off, t.num_rows)
            for t, off in zip(members, row_offsets([t.num_rows for t in members])))))
    return tuple(out)


def row_offsets(rows: Sequence[int]) -> list[int]:
    """Exclusive prefix sums of ``rows``: where each member starts in its packed table."""
    out, acc = [], 0
    for r in rows:
        out.append(acc)
        acc += int(r)
    return out


def feature_offsets(tables: Sequence[TableConfig], plan: ShardingPlan) -> Mapping[str, int]:
    """``{feature: row offset}`` of every feature whose table is a packed member (the
    offset its ids are moved by in the packed table)."""
    out = {}
    for t in tables:
        p = plan.pack_of(t.name)
        if p is not None:
            off = p.member(t.name).row_offset
            for f in t.features:
                out[f] = off
    return out
