"""The trainer on every world size: the same loss curve as one rank, exact resume, overlap off.

    mpirun -n 4 python -m pytest --with-mpi tests/mpi/test_train.py

A global batch of 48 splits over 1, 2, 3 and 4 ranks; each rank also trains
the same model alone (on a group of its own) as the one-rank reference.
"""
from __future__ import annotations

import numpy as np
import pytest

from embedding.train import Trainer, parse_config

pytestmark = pytest.mark.training

STEPS = 6


def small_config(out, **sections):
    """A model that trains in well under a second: 4 small tables, dim 8, batch 48."""
    doc = {"tables": {"rows": [50, 70, 30, 200]},
           "model": {"embedding_dim": 8, "bottom_mlp": [16, 8], "top_mlp": [16, 1]},
           "data": {"records": 4800, "eval_records": 96},
           "train": {"steps": STEPS, "batch_size": 48, "eval_every": 0, "log_every": 1},
           "output": {"dir": str(out)}}
    for name, body in sections.items():
        doc.setdefault(name, {}).update(body)
    return parse_config(doc, "test")


def shared_dir(world, tmp_path) -> str:
    """Rank 0's temporary directory, the same path on every rank."""
    return world.comm.bcast(str(tmp_path) if world.rank == 0 else None, root=0)


def own_group(world):
    """A group of this rank alone (every rank calls split for every rank: collective)."""
    mine = None
    for r in range(world.size):
        g = world.world.split([r], name=f"alone{r}")
        if g is not None:
            mine = g
    return mine


def train(cfg, group, resume=""):
    t = Trainer(cfg, group)
    if resume:
        t.resume(resume)
    t.train()
    t.close()
    return t


def state_of(t) -> dict:
    """Every array a resume must restore: local shards, their optimizer state, dense model."""
    out = {"dense": t.model.flat_params.copy()}
    for k, v in t.optimizer.state_dict().items():
        out[f"dense_opt/{k}"] = np.asarray(v).copy()
    for s in t.coll.local_shards():
        key = f"{s.table}/{s.shard.row_offset}/{s.shard.col_offset}"
        out[key] = np.array(s.weight)
        for name, arr in s.tables.state.items():
            out[f"{key}/{name}"] = np.array(arr)
    return out


def test_loss_curve_matches_one_rank(world, tmp_path, all_ranks):
    base = shared_dir(world, tmp_path)
    many = train(small_config(f"{base}/many"), world.world)
    alone = train(small_config(f"{tmp_path}/alone{world.rank}"), own_group(world))
    a = np.array([l for _, l in many.losses])
    b = np.array([l for _, l in alone.losses])
    all_ranks(len(a) == STEPS and len(b) == STEPS, f"{len(a)} and {len(b)} losses")
    all_ranks(np.allclose(a, b, rtol=2e-5, atol=1e-6), f"{a} vs one rank {b}")
    all_ranks(a[-1] < a[0], f"the loss did not go down: {a}")
    ev_many, ev_alone = many.last_eval, alone.last_eval
    all_ranks(ev_many["records"] == ev_alone["records"] == 96, f"{ev_many} {ev_alone}")
    all_ranks(abs(ev_many["auc"] - ev_alone["auc"]) < 1e-4, f"{ev_many} vs {ev_alone}")


def test_evaluation_scores_every_held_out_record_once(world, tmp_path, all_ranks):
    """100 held-out records in batches of 48: the last 4 count too, once each, and the
    result is the one-rank result (and the planted model's AUC is taken on the same 100)."""
    base = shared_dir(world, tmp_path)
    opts = dict(data={"records": 4800, "eval_records": 100}, train={"steps": 2})
    many = train(small_config(f"{base}/many", **opts), world.world)
    alone = train(small_config(f"{tmp_path}/alone{world.rank}", **opts), own_group(world))
    ev_many, ev_alone = many.last_eval, alone.last_eval
    all_ranks(ev_many["records"] == ev_alone["records"] == 100, f"{ev_many} {ev_alone}")
    all_ranks(abs(ev_many["auc"] - ev_alone["auc"]) < 1e-4
              and abs(ev_many["log_loss"] - ev_alone["log_loss"]) < 1e-6,
              f"{ev_many} vs one rank {ev_alone}")
    # the same records as the whole batches plus the last 4, scored one by one
    from embedding.train.evaluate import planted_auc

    want = many.data.planted.read_with_probabilities(many.data.eval_offset,
                                                     many.data.eval_offset + 100)
    from embedding.dense import auc

    all_ranks(planted_auc(many) == auc(want[0].labels, want[1]))


def test_overlap_off_trains_the_same(world, tmp_path, all_ranks):
    base = shared_dir(world, tmp_path)
    on = train(small_config(f"{base}/on", train={"bucket_kib": 1}), world.world)
    off = train(small_config(f"{base}/off", train={"overlap": False}), world.world)
    a = np.array([l for _, l in on.losses])
    b = np.array([l for _, l in off.losses])
    all_ranks(len(on.model.buckets) > 1, "the small buckets should cut the model in several")
    all_ranks(np.allclose(a, b, rtol=2e-5, atol=1e-6), f"overlap on {a} vs off {b}")


@pytest.mark.parametrize("broadcast", [False, True])
def test_resume_continues_exactly(world, tmp_path, all_ranks, broadcast):
    base = shared_dir(world, tmp_path)
    opts = dict(checkpoint={"every": 3}, data={"broadcast": broadcast, "shuffle": True},
                sparse_optimizer={"kind": "adam", "lr": 0.01})
    straight = train(small_config(f"{base}/straight", **opts), world.world)
    first = small_config(f"{base}/cut", train={"steps": 4}, **opts)
    train(first, world.world)  # checkpoints at steps 3 and 4
    again = train(small_config(f"{base}/cut", **opts), world.world,
                  resume=f"{base}/cut/checkpoints/step-000000000003")
    all_ranks(again.losses[0][0] == 4, f"resumed at {again.losses[0]}")
    a, b = state_of(straight), state_of(again)
    all_ranks(a.keys() == b.keys(), f"{sorted(a)} vs {sorted(b)}")
    diff = [k for k in a if not np.array_equal(a[k], b[k])]
    all_ranks(not diff, f"not bitwise equal after resume: {diff}")
    la = dict(straight.losses)
    all_ranks(all(la[s] == v for s, v in again.losses), f"{straight.losses} vs {again.losses}")


def test_resume_auto_without_checkpoint_starts_fresh(world, tmp_path, all_ranks):
    base = shared_dir(world, tmp_path)
    t = Trainer(small_config(f"{base}/fresh", train={"steps": 2}), world.world)
    all_ranks(t.resume("auto") == 0)
    r = t.train()
    t.close()
    all_ranks(r.step == 2 and r.steps_run == 2, f"{r}")
    again = Trainer(small_config(f"{base}/fresh", train={"steps": 2}), world.world)
    all_ranks(again.resume("auto") == 2)
    r2 = again.train()  # nothing left to do
    again.close()
    all_ranks(r2.steps_run == 0 and r2.step == 2, f"{r2}")


def _criteo_line(i: int) -> str:
    label = str((i * 7919) % 5 == 0 and 1 or 0)
    ints = [str((i * (j + 3)) % 50 - 1) for j in range(13)]
    cats = [f"{(i % (11 + f)) * 2654435761 % (1 << 32):08x}" for f in range(26)]
    return "\t".join([label] + ints + cats) + "\n"


def test_criteo_text_and_binary_files_train(world, tmp_path, all_ranks):
    from embedding.data import BinaryWriter, SyntheticConfig, SyntheticDataset

    base = shared_dir(world, tmp_path)
    if world.rank == 0:
        with open(f"{base}/day.txt", "w") as fh:
            fh.writelines(_criteo_line(i) for i in range(600))
        with open(f"{base}/held.txt", "w") as fh:
            fh.writelines(_criteo_line(i) for i in range(600, 700))
        ds = SyntheticDataset(SyntheticConfig(table_sizes=(50, 70, 30, 200), seed=1), 600)
        with BinaryWriter(f"{base}/day.bin", (50, 70, 30, 200)) as w:
            w.write_batch(ds.read(0, 600))
    world.comm.Barrier()
    text = train(small_config(f"{base}/text", tables={"rows": [], "preset": "tiny"},
                              data={"source": "criteo", "path": f"{base}/day.txt",
                                    "eval_path": f"{base}/held.txt"},
                              train={"steps": 3}), world.world)
    all_ranks(text.step == 3 and len(text.tables) == 26, f"{text.step} {len(text.tables)}")
    all_ranks(text.last_eval["records"] == 100, f"{text.last_eval}")  # every held-out line
    binary = train(small_config(f"{base}/bin", data={"source": "binary",
                                                     "path": f"{base}/day.bin"},
                                train={"steps": 3}), world.world)
    all_ranks(binary.step == 3 and binary.data.train.num_records == 504,
              f"{binary.data.train.num_records}")
    all_ranks(np.isfinite([l for _, l in binary.losses]).all(), f"{binary.losses}")


@pytest.mark.parametrize("overlap", [True, False])
def test_the_next_input_dist_starts_before_the_dense_work(world, tmp_path, overlap, all_ranks):
    import collectives

    base = shared_dir(world, tmp_path)
    t = Trainer(small_config(f"{base}/order{overlap}", train={"overlap": overlap,
                                                              "bucket_kib": 1}), world.world)
    events = []

    def spy(obj, name, label):
        original = getattr(obj, name)

        def call(*a, **k):
            if label != "async all_reduce" or k.get("async_op"):
                events.append(label)
            return original(*a, **k)

        setattr(obj, name, call)
        return original

    spy(t.stages, "start", "input_dist")
    spy(t.stages, "forward", "lookup")
    spy(t.model, "forward", "dense")
    spy(t.optimizer, "step", "optimizer")
    all_reduce = spy(collectives, "all_reduce", "async all_reduce")
    try:
        t.run(3)
    finally:
        collectives.all_reduce = all_reduce
    t.close()
    # The second step, from its lookup to its optimizer.
    i = events.index("lookup", events.index("lookup") + 1)
    second = events[i:events.index("optimizer", i) + 1]
    n = len(t.model.buckets)
    all_ranks(n > 1, f"{n} buckets")
    if overlap:
        all_ranks(second[:3] == ["lookup", "input_dist", "dense"], f"{second}")
        asyncs = second.count("async all_reduce")
        all_ranks(asyncs == (n if world.size > 1 else 0), f"{n} buckets: {second}")
    else:
        all_ranks(second == ["lookup", "dense", "optimizer"], f"{second}")
        all_ranks(events[events.index("optimizer", i) + 1] == "input_dist", f"{events}")


def _layout_problems(kind: str, tables, held, size: int) -> list[str]:
    """What in ``held`` (each rank's list of (table, row, rows, col, cols)) is not a layout
    of sharding ``kind``: whole tables on one rank, row blocks covering the table on
    distinct ranks, or a whole replica on every rank."""
    bad = []
    split = False
    for t in tables:
        boxes = [(r, b[1:]) for r, mine in enumerate(held) for b in mine if b[0] == t.name]
        whole = (0, t.num_rows, 0, t.dim)
        if kind == "table_wise" and [b for _, b in boxes] != [whole]:
            bad.append(f"{t.name}: {boxes}, not one whole table")
        elif kind == "data_parallel" and (sorted(r for r, _ in boxes) != list(range(size))
                                          or any(b != whole for _, b in boxes)):
            bad.append(f"{t.name}: {boxes}, not a whole replica on every rank")
        elif kind == "row_wise":
            rows = sorted((b[0], b[1]) for _, b in boxes)
            ends = [0] + [lo + n for lo, n in rows]
            if [lo for lo, _ in rows] != ends[:-1] or ends[-1] != t.num_rows \
                    or any(b[2:] != (0, t.dim) for _, b in boxes) \
                    or len({r for r, _ in boxes}) != len(boxes):
                bad.append(f"{t.name}: {boxes}, not row blocks on distinct ranks")
            split |= len(boxes) > 1
    if kind == "row_wise" and size > 1 and not split:
        bad.append("no table is split over several ranks")
    return bad


def test_planner_takes_the_allowed_shardings(world, tmp_path, all_ranks):
    """plan.shardings limits the planner: the shards the ranks actually hold are laid out
    as that sharding lays them out, and every layout trains the same model alike."""
    base = shared_dir(world, tmp_path)
    kinds = ("row_wise", "data_parallel", "table_wise") if world.size > 1 else ("table_wise",)
    curves = {}
    for kind in kinds:
        t = Trainer(small_config(f"{base}/p-{kind}", plan={"shardings": [kind]}), world.world)
        mine = [(s.table, s.shard.row_offset, s.shard.num_rows, s.shard.col_offset,
                 s.shard.num_cols) for s in t.coll.local_shards()]
        bad = _layout_problems(kind, t.tables, world.comm.allgather(mine), world.size)
        all_ranks(not bad, f"{kind}: {bad}")
        curves[kind] = np.array(t.run(3))
        t.close()
    first = curves[kinds[0]]
    all_ranks(all(np.allclose(c, first, rtol=2e-5, atol=1e-6) for c in curves.values()),
              f"losses differ between shardings: {curves}")


def test_steps_after_the_first_replay_their_calls_without_agreeing_each(world, tmp_path,
                                                                       all_ranks, agreements):
    """The trainer agrees each step's shape once: from the second step on, its
    collectives run their plans unagreed (only the AlltoAllvs, which agree the sizes
    their algorithm is chosen for, and the step itself agree), and it trains as a
    trainer that checks every call does."""
    from collectives import control as control_mod

    count = agreements
    base = shared_dir(world, tmp_path)

    def per_step(t):
        out = []
        for _ in range(STEPS):
            before = count[0]
            t.run(1)
            out.append(count[0] - before)
        t.close()
        return out

    fast = Trainer(small_config(f"{base}/trusted"), world.world)
    trusted = per_step(fast)

    class Checked(control_mod.StepControl):  # every step as if its shape were new
        def step(self, **shape):
            self._last = None
            return super().step(**shape)

    slow = Trainer(small_config(f"{base}/checked"), world.world)
    slow.control = Checked(world.world, "training step")
    checked = per_step(slow)
    a = np.array([l for _, l in fast.losses])
    b = np.array([l for _, l in slow.losses])
    all_ranks(fast.control.trusted == STEPS - 1 and slow.control.trusted == 0,
              f"{fast.control.trusted} {slow.control.trusted}")
    all_ranks(all(t < c for t, c in zip(trusted[1:], checked[1:])),
              f"agreements per step: trusted {trusted}, checked {checked}")
    all_ranks(np.array_equal(a, b), f"trusted {a} vs checked {b}")
