"""What a checkpoint of the trainer holds, and putting it back.

Arrays (through :mod:`embedding.checkpoint`, one ``.npy`` each, checksummed):

* ``emb/<table>/<shard>/weight`` and ``emb/<table>/<shard>/<state>``: each
  local shard (``<shard>`` indexes the plan's shards of the table) and its
  sparse optimizer state (``momentum``, ``exp_avg`` …), written with the
  :class:`~embedding.checkpoint.TensorSlice` of the global tensor it holds,
  so any plan on any world size can read it back (a data-parallel replica
  is written by rank 0 only);
* ``dyn/<table>/<rank>/<part>``: a dynamic table's live entries on ``rank``
  (ids ascending): ``ids``, ``weight``, each optimizer state, the usage
  counters ``count`` and ``last``, and the map's ``tick`` (``[1]``), whole
  arrays without a slice; a load reads every rank's and keeps the ids its
  shard owns (every id table-wise, ``splitmix64(id) % N == rank`` cyclic),
  so they too come back under any plan and world size;
* a packed table (:mod:`embedding.packing`) is written as its members: each
  shard's rows of member ``m`` as ``emb/<m>/<packed table>.<shard>/<tensor>``
  with a slice of ``m``'s own tensor, so a packed checkpoint loads into an
  unpacked plan, and the reverse, element for element (the manifest's plan
  records the packing it was written with);
* ``dense/params``, ``dense/opt/<state>`` and ``dense/opt/steps`` (rank 0):
  the dense model's flat parameters and its optimizer's flat state.

The manifest's ``state`` holds the step, the data reader's position (the
next global batch; with the seed it fixes the data order, the only
randomness training draws after initialisation), the dense architecture
and the optimizer kinds, which a resume checks before loading.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from embedding.collection import assign
from embedding.checkpoint import (CheckpointError, CheckpointMismatchError, read_box,
                                  read_for_plan, shard_box, shard_slice)
from embedding.dense._xp import to_numpy
from embedding.optim import state_specs
from embedding.types import Rounding, ShardingType

__all__ = ["shard_arrays", "dense_arrays", "load_shards", "load_dense", "check_state",
           "checkpoint_bytes", "dynamic_entries", "shard_pieces"]


def _shard_index(plan, table: str, shard) -> int:
    shards = plan.table(table).shards
    for i, s in enumerate(shards):
        if s == shard:
            return i
    raise ValueError(f"shard {shard} of table {table!r} is not in the plan")


def shard_pieces(plan, s):
    """``(table, local rows, table shard, array name prefix)`` of local shard ``s``: the shard
    itself, or for a packed table's shard its part of each member (module doc)."""
    i = _shard_index(plan, s.table, s.shard)
    pack = next((p for p in plan.packs if p.name == s.table), None)
    if pack is None:
        return [(s.table, slice(None), s.shard, f"emb/{s.table}/{i}")]
    return [(m.table, local, sub, f"emb/{m.table}/{pack.name}.{i}")
            for m, local, sub in pack.parts(s.shard)]


def shard_arrays(collection, plan, rank: int) -> tuple[dict, dict]:
    """``(arrays, slices)`` of this rank's embedding shards and their optimizer state."""
    tables = {t.name: t for t in collection.tables}
    arrays, slices = {}, {}
    for s in collection.local_shards():
        tp = plan.table(s.table)
        if tp.sharding is ShardingType.DATA_PARALLEL and rank != min(tp.ranks):
            continue  # replicas are equal: the lowest rank writes the table
        if s.table in tables and tables[s.table].dynamic:
            for part, arr in s.tables.entries(s.index).items():
                arrays[f"dyn/{s.table}/{rank}/{part}"] = _portable(arr)
            continue
        master = _master(s)  # a table with a master copy saves it: the float32 rows
        rows = s.weight if master is None else master
        for name, local, shard, base in shard_pieces(plan, s):
            t = tables[name]
            arrays[f"{base}/weight"] = _portable(to_numpy(rows[local]))
            slices[f"{base}/weight"] = shard_slice(name, "weight", shard, (t.num_rows, t.dim))
            for spec in state_specs(s.tables.optimizers[s.index].kind):
                gshape = (t.num_rows,) if spec.per_row else (t.num_rows, t.dim)
                arrays[f"{base}/{spec.name}"] = _portable(
                    to_numpy(s.tables.state_view(s.index, spec.name)[local]))
                slices[f"{base}/{spec.name}"] = shard_slice(name, spec.name, shard, gshape)
    return arrays, slices


def checkpoint_bytes(plan, tables, rank: int, dense_params: int = 0) -> int:
    """Bytes ``rank`` writes into each checkpoint (before any array exists): the shards
    and sparse optimizer state :func:`shard_arrays` would return, and on rank 0 the dense
    model of ``dense_params`` parameters with an optimizer state of at most twice that."""
    from embedding.packing import packed_tables

    by_name = {t.name: t for t in packed_tables(tables, plan)}
    total = 0
    for tp in plan.tables:
        t = by_name[tp.table]
        item = _portable_itemsize(t.dtype)
        for shard in tp.shards:
            if shard.rank != rank or (tp.sharding is ShardingType.DATA_PARALLEL
                                      and rank != min(tp.ranks)):
                continue
            master = t.rounding is Rounding.MASTER  # saved as its float32 master rows
            total += shard.num_rows * shard.num_cols * (4 if master else item)
            for spec in state_specs(t.optimizer.kind):
                size = _portable_itemsize(spec.dtype or t.optimizer_state_dtype)
                total += shard.num_rows * (1 if spec.per_row else shard.num_cols) * size
            if t.dynamic:  # at most: ids, count and last of every row, and the tick
                total += shard.num_rows * 3 * 8 + 8
    if rank == 0:
        total += 3 * dense_params * 4
    return total


def dense_arrays(model, optimizer) -> dict:
    """The dense model's parameters and optimizer state (rank 0 writes them)."""
    out = {"dense/params": to_numpy(model.flat_params)}
    for name, value in optimizer.state_dict().items():
        out[f"dense/opt/{name}"] = np.asarray(value)
    return out


def vocabulary_arrays(vocabularies: dict | None) -> dict:
    """The data's vocabularies as checkpoint arrays ``data/vocabulary/<table>/<part>``."""
    out = {}
    for table, vocab in (vocabularies or {}).items():
        for part, arr in vocab.to_arrays().items():
            out[f"data/vocabulary/{table}/{part}"] = arr
    return out


def read_vocabularies(ckpt) -> dict:
    """The vocabularies a checkpoint holds (``{}`` when its data had none)."""
    from embedding.data.parquet import Vocabulary

    parts: dict[str, dict] = {}
    for name in ckpt.names():
        if name.startswith("data/vocabulary/"):
            table, part = name[len("data/vocabulary/"):].rsplit("/", 1)
            parts.setdefault(table, {})[part] = ckpt.read_array(name)
    return {t: Vocabulary.from_arrays(t, p) for t, p in parts.items()}


def check_vocabularies(ckpt, vocabularies: dict | None) -> None:
    """Refuse a checkpoint whose vocabularies differ from the data's: its rows would mean
    other values (the training files changed between the runs)."""
    saved = read_vocabularies(ckpt)
    mine = dict(vocabularies or {})
    for table in sorted(set(saved) | set(mine)):
        a, b = saved.get(table), mine.get(table)
        same = (a is not None and b is not None and a.num_rows == b.num_rows
                and a.values.equals(b.values.cast(a.values.type)))
        if not same:
            told = (f"{a.num_rows} rows" if a is not None else "none")
            now = (f"{b.num_rows} rows" if b is not None else "none")
            raise CheckpointMismatchError(
                f"table {table!r}: the checkpoint's vocabulary ({told}) is not the one of the "
                f"training data ({now}); its rows would stand for other values. Train from "
                f"the same files, or start afresh", path=str(ckpt.path),
                field=f"{table}.vocabulary")


def _portable(arr: np.ndarray) -> np.ndarray:
    """``arr`` as the checkpoint stores it: bfloat16 as float32 (exact; ``.npy`` files have
    no bfloat16), every other dtype as it is."""
    return arr.astype(np.float32) if arr.dtype.name == "bfloat16" else arr


def _portable_itemsize(dtype) -> int:
    """Bytes per element of ``dtype`` in a checkpoint (see :func:`_portable`)."""
    return 4 if str(dtype) == "bfloat16" else np.dtype(dtype).itemsize


def load_shards(ckpt, collection, plan, rank: int) -> int:
    """Fill this rank's shards (weights and sparse optimizer state) from ``ckpt``.

    The checkpoint may come from any plan and world size: each shard is
    assembled from whichever files overlap it. Returns the elements loaded.
    Weights and state of any float dtype load into a table of any storage
    precision, rounded to nearest; a table with a float32 master copy takes
    it from the loaded rows.
    """
    dynamic = {t.name: t for t in collection.tables if t.dynamic}
    kinds = {s.tables.optimizers[s.index].kind for s in collection.local_shards()}
    kinds |= {t.optimizer.kind for t in collection.tables}
    names = ["weight"] + sorted({spec.name for k in kinds for spec in state_specs(k)})
    packed = {p.name for p in plan.packs}
    fixed = dataclasses.replace(plan, packs=(), tables=tuple(
        tp for tp in plan.tables if tp.table not in dynamic and tp.table not in packed))
    parts = read_for_plan(ckpt, fixed, rank, tensors=names) if fixed.tables else {}
    loaded = 0
    masters, dynamic_shards = [], []
    for s in collection.local_shards():
        if s.table in packed:
            loaded += _load_packed(ckpt, plan, s, masters)
            continue
        if s.table in dynamic:
            dynamic_shards.append(s)
            continue
        i = _shard_index(plan, s.table, s.shard)
        assign(s.weight, parts[(s.table, "weight", i)])
        masters.append((s, slice(None), parts[(s.table, "weight", i)]))
        loaded += int(s.weight.size)
        for spec in state_specs(s.tables.optimizers[s.index].kind):
            view = s.tables.state_view(s.index, spec.name)
            assign(view, parts[(s.table, spec.name, i)])
            loaded += int(view.size)
    collection.sync_masters()
    for s, local, rows in masters:  # the master copy takes the saved rows at full precision
        master = _master(s)
        if master is not None:
            assign(master[local], np.asarray(rows, np.float32))
    for s in dynamic_shards:  # after sync_masters: entries set their master rows themselves
        entries = _dynamic_entries(ckpt, plan, s.table, rank)
        try:
            s.tables.load_entries(s.index, entries)
        except ValueError as exc:
            raise CheckpointMismatchError(f"table {s.table!r}: {exc}", path=str(ckpt.path),
                                          field=f"{s.table}.num_rows") from None
        loaded += sum(int(a.size) for a in entries.values())
    collection.set_update_step(int(ckpt.step))
    return loaded


def _master(shard):
    """The float32 master rows of local ``shard``, or None (no master copy)."""
    get = getattr(shard.tables, "master_weight", None)
    return None if get is None else get(shard.index)


def _load_packed(ckpt, plan, s, masters: list) -> int:
    """Fill local shard ``s`` of a packed table from its members' tensors in ``ckpt``
    (written packed or not); returns the elements loaded. ``(shard, local rows, saved
    rows)`` of each member's weights go to ``masters``."""
    available = ckpt.tensors()
    loaded = 0
    for name, local, shard, _ in shard_pieces(plan, s):
        views = [("weight", s.weight[local])] + [
            (spec.name, s.tables.state_view(s.index, spec.name)[local])
            for spec in state_specs(s.tables.optimizers[s.index].kind)]
        for tensor, view in views:
            if (name, tensor) not in available:
                raise CheckpointError(f"table {name!r}: tensor {tensor!r} is not in the "
                                      f"checkpoint", path=str(ckpt.path))
            gshape = available[(name, tensor)][0]
            box = read_box(ckpt, name, tensor, *shard_box(shard, gshape))
            assign(view, box)
            if tensor == "weight":
                masters.append((s, local, box))
            loaded += int(view.size)
    return loaded


def dynamic_entries(ckpt, table: str) -> dict:
    """Every live entry of dynamic ``table`` in ``ckpt``, gathered from every rank's
    ``dyn/<table>/<rank>/*`` arrays, ids ascending: ``ids``, ``weight``, each optimizer
    state, ``count``, ``last`` and ``tick`` (``[1]``, the largest of any rank)."""
    prefix = f"dyn/{table}/"
    by_part: dict[str, list] = {}
    for name in ckpt.names():
        if name.startswith(prefix):
            part = name[len(prefix):].split("/", 1)[1]
            by_part.setdefault(part, []).append(ckpt.read_array(name))
    if "ids" not in by_part:
        raise CheckpointMismatchError(f"table {table!r}: the checkpoint holds no entries of a "
                                      f"dynamic table", path=str(ckpt.path),
                                      field=f"{table}.dynamic")
    out = {p: np.concatenate(a) for p, a in by_part.items()}
    tick = np.array([max(int(a.max()) for a in by_part["tick"])], np.int64)
    del out["tick"]
    order = np.argsort(out["ids"], kind="stable")
    out = {p: a[order] for p, a in out.items()}
    out["tick"] = tick
    return out


def _dynamic_entries(ckpt, plan, table: str, rank: int) -> dict:
    """The entries of dynamic ``table`` that ``plan`` gives ``rank`` (every id table-wise,
    ``splitmix64(id) % N == rank`` cyclic), ids ascending."""
    from embedding.sharding.cyclic_row_wise import HashedIds

    out = dynamic_entries(ckpt, table)
    if plan.table(table).sharding is ShardingType.CYCLIC_ROW_WISE:
        tick = out.pop("tick")
        keep = HashedIds(plan.world_size)(out["ids"])[0] == rank
        out = {p: a[keep] for p, a in out.items()}
        out["tick"] = tick
    return out


def load_dense(ckpt, model, optimizer) -> None:
    """Restore the dense parameters and optimizer state from ``ckpt``."""
    model.load_state_dict({"params": ckpt.read_array("dense/params")})
    state = {}
    for name in ckpt.names():
        if name.startswith("dense/opt/"):
            key = name[len("dense/opt/"):]
            state[key] = ckpt.read_array(name)
    try:
        optimizer.load_state_dict(state, xp=model.xp)
    except ValueError as exc:
        raise CheckpointMismatchError(f"dense optimizer state: {exc}", path=str(ckpt.path),
                                      field="dense_optimizer") from None


def check_state(ckpt, expected: dict) -> None:
    """Refuse a checkpoint whose recorded architecture or optimizers differ from ``expected``.

    ``expected`` holds the keys ``dense`` (layer shapes and dtype),
    ``sparse_optimizer`` and ``dense_optimizer`` (kinds), as the trainer
    records them in the manifest state.
    """
    state = ckpt.state
    for key in ("dense", "sparse_optimizer", "dense_optimizer"):
        if key not in state:
            raise CheckpointMismatchError(f"the manifest records no {key!r}; it was not written "
                                          f"by the trainer", path=str(ckpt.path), field=key)
        if state[key] != expected[key]:
            raise CheckpointMismatchError(f"{key} is {state[key]} in the checkpoint, "
                                          f"{expected[key]} in this model",
                                          path=str(ckpt.path), field=key)
