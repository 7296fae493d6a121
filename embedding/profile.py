"""A training step's compute, measured on this host: the step model's compute on CPU fabrics.

On a fabric without GPUs the ranks run the trainer's own NumPy code, whose
time per call is set by Python and memory, not by a FLOP rate. So the step
model (:mod:`embedding.simulate`) takes those parts from a measurement of the
trainer's code on this host (a world of one rank), and prices only the
collectives with the calibrated link model:

- the trainer itself at one rank's batch (``global / ranks`` samples), in a process
  of its own as a rank runs it, for the parts every rank runs on its own samples:
  ``data`` (read and check a batch), the local work of ``input_dist`` and
  ``output_dist`` (bucketing ids, packing rows), ``dense``, ``sync`` (the loss and
  health checks), ``optimizer``;
- the embedding collection of the tables one rank holds under the plan, at the
  batch those tables see (the global batch for model-parallel shards), for
  ``lookup`` and the fused update of ``emb_backward``. A shard that is not a
  whole table (row- or column-wise, data-parallel) is measured as its whole
  table and scaled by the share of the table's lookups it serves.

Each rank runs as many threads as the job's ranks would (this host's cores
over the ranks on it), beside co-running trainers that fill the host's other
cores as the job's other ranks would. :func:`profile_step` returns the seconds per step of
each part, per rank: the mean over the measured steps, as the trainer's metrics log
reports a window's steps (a step that a collection pause or the scheduler stretches
counts).

The ranks of a job meet at every step (the loss and health AllReduce of ``sync``), so a
step lasts as long as its slowest rank's: with ``n`` ranks whose step times vary as the
measured steps do, the expected wait at the meeting point is the expected largest of
``n`` draws of a step time less their mean (:func:`expected_max`), which ``sync`` gains.
"""
from __future__ import annotations

import dataclasses
import io
from statistics import fmean, median

from embedding.types import ShardingType

__all__ = ["COMPUTE_PARTS", "profile_step", "rank_shares", "expected_max"]

#: the parts the profile measures; :mod:`embedding.simulate` adds the collectives
COMPUTE_PARTS = ("data", "input_dist", "lookup", "output_dist", "dense", "sync",
                 "emb_backward", "optimizer")
_TRAINER_PARTS = ("data", "input_dist", "output_dist", "dense", "sync", "optimizer")


def rank_shares(plan, tables) -> dict[int, dict[str, float]]:
    """``{rank: {table: share of the table's lookups that rank serves}}`` under ``plan``."""
    from embedding.packing import packed_tables

    rows = {t.name: (t.num_rows, t.dim) for t in packed_tables(tables, plan)}
    out: dict[int, dict[str, float]] = {r: {} for r in range(plan.world_size)}
    for tp in plan.tables:
        n, dim = rows[tp.table]
        for s in tp.shards:
            if tp.sharding is ShardingType.DATA_PARALLEL:
                share = 1.0 / plan.world_size
            else:
                share = (s.num_rows / n) * (s.num_cols / dim)
            held = out[s.rank]
            held[tp.table] = held.get(tp.table, 0.0) + share
    return out


def _one_rank_trainer(cfg, batch: int, threads: int, data=None):
    """A trainer of ``cfg`` in a world of one, at ``batch`` samples with ``threads`` threads,
    planning for itself, writing and evaluating nothing."""
    from embedding.train.loop import Trainer

    tr = dataclasses.replace(cfg.train, batch_size=batch, threads=threads, eval_every=0,
                             log_every=10 ** 9, steps=10 ** 9)
    plan = dataclasses.replace(cfg.plan, file="", shardings=[])
    return Trainer(dataclasses.replace(cfg, train=tr, plan=plan), data=data,
                   stream=io.StringIO(), outputs=False)


def expected_max(samples, n: int) -> float:
    """The expected largest of ``n`` independent draws from the empirical distribution of
    ``samples`` (order statistics: the ``i``-th smallest of ``m`` is the largest of ``n``
    draws with probability ``(i/m)^n - ((i-1)/m)^n``); ``mean(samples)`` for ``n = 1``."""
    xs = sorted(float(x) for x in samples)
    m = len(xs)
    if not m:
        raise ValueError("samples: expected at least one")
    if int(n) < 1:
        raise ValueError(f"n: expected a count >= 1, got {n}")
    return sum(x * ((i / m) ** n - ((i - 1) / m) ** n) for i, x in enumerate(xs, 1))


def _trainer_parts(cfg, data, batch: int, threads: int, steps: int, warmup: int,
                   ranks: int = 1) -> dict:
    """Mean seconds per step of the trainer's own parts at ``batch`` samples, one rank;
    ``sync`` adds the expected wait for the slowest of ``ranks`` ranks (module doc)."""
    trainer = _one_rank_trainer(cfg, batch, threads, data)
    trainer.run(warmup, horizon=warmup + steps)
    trainer.timer.reset()
    per_step = []
    for _ in range(steps):
        trainer.run(1, horizon=trainer.step + 2)
        per_step.append({k.value: v for k, v in trainer.timer.reset().items()})
    out = {p: fmean(s[p] for s in per_step) for p in _TRAINER_PARTS}
    totals = [sum(s[p] for p in _TRAINER_PARTS) for s in per_step]
    out["sync"] += expected_max(totals, ranks) - fmean(totals)
    return out


class _co_runners:
    """``count`` processes training ``cfg`` at ``batch`` samples with ``threads`` threads
    each (a world of one), for as long as the ``with`` block runs."""

    def __init__(self, cfg, batch: int, threads: int, count: int):
        self.args = (cfg, batch, threads, max(0, int(count)))
        self.procs: list = []

    def __enter__(self):
        import os
        import subprocess
        import sys

        from embedding.train.config import to_toml

        import tempfile

        cfg, batch, threads, count = self.args
        text = to_toml(cfg)
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("OMPI_", "PMIX_", "PMI_"))}  # each its own world
        # a co-runner is killed, so what it leaves in its temporary directory (an MPI
        # singleton's temporary folder) goes with a folder of ours, removed on exit
        self.tmp = tempfile.mkdtemp(prefix="neocomm-corun-")
        env["TMPDIR"] = self.tmp
        code = (f"import sys; from embedding.profile import co_run; "
                f"co_run(sys.stdin.read(), {int(batch)}, {int(threads)})")
        try:
            for _ in range(count):
                proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True, env=env)
                self.procs.append(proc)
                proc.stdin.write(text)
                proc.stdin.close()
            for proc in self.procs:
                if proc.stdout.readline().strip() != "ready":
                    raise RuntimeError("profile: a co-running trainer did not start: " +
                                       proc.stderr.read().strip()[-400:])
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc):
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            proc.wait()
            proc.stdout.close()
            proc.stderr.close()
        self.procs = []
        if getattr(self, "tmp", None):
            import shutil

            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None
        return False


def co_run(config_toml: str, batch: int, threads: int) -> None:
    """A co-runner's body: train the config at ``batch`` samples until killed."""
    import sys
    import tomllib

    from embedding.train.config import parse_config

    trainer = _one_rank_trainer(parse_config(tomllib.loads(config_toml)), batch, threads)
    trainer.run(1, horizon=2)
    print("ready", flush=True)
    sys.stdout.close()
    while True:
        trainer.run(1, horizon=trainer.step + 2)


def _fastest(measure, rounds: int = 2) -> dict:
    """Part by part, the fastest of ``rounds`` measurements: the first code of a kind a
    process runs is slower while its allocator and caches settle."""
    results = [measure() for _ in range(rounds)]
    return {p: min(r[p] for r in results) for p in results[0]}


def _embedding_parts(cfg, data, tables, shares: dict[str, float], batch: int, threads: int,
                     steps: int, warmup: int) -> dict:
    """``lookup`` and ``emb_backward`` seconds per step of the collection of the tables in
    ``shares`` at ``batch`` samples, one rank, scaled by the shares (module doc)."""
    import numpy as np

    from embedding.collection import ShardedEmbeddingCollection
    from embedding.train.data import GuardedDataset
    from embedding.train.setup import id_policy_of, make_reader
    from embedding.train.step import EmbeddingStages, PhaseTimer
    from embedding.types import Shard, ShardingPlan, TablePlan

    held = [t for t in tables if t.name in shares]
    if not held:
        return {"lookup": 0.0, "emb_backward": 0.0}
    plan = ShardingPlan(1, 1, tuple(
        TablePlan(t.name, ShardingType.TABLE_WISE, (Shard(0, 0, t.num_rows, 0, t.dim),))
        for t in held))
    tr = cfg.train
    coll = ShardedEmbeddingCollection(held, plan, device=tr.device, dtype=cfg.model.dtype,
                                      threads=threads, dedup=tr.dedup,
                                      id_policy=id_policy_of(cfg), seed=tr.seed)
    stages = EmbeddingStages(coll)
    reader = make_reader(GuardedDataset(data.train, data.num_dense, data.feature_names),
                         batch, coll.group, broadcast=False, shuffle=cfg.data.shuffle,
                         seed=tr.seed, feature_names=data.feature_names)
    features = list(coll.feature_names)
    timer = PhaseTimer()
    grad = None
    per_step = []
    for _ in range(warmup + steps):
        kjt = reader.next().to_jagged().select(features)
        pooled, ctx = stages.forward(stages.start(kjt), timer)
        if grad is None:
            grad = coll.xp.asarray(np.random.default_rng(tr.seed).standard_normal(
                pooled.shape).astype(pooled.dtype) * 1e-3)
        stages.backward(grad, ctx, timer)
        per_step.append({p.value: s for p, s in timer.reset().items()})
    per_step = per_step[warmup:]
    secs = {p: fmean(s[p] for s in per_step) for p in ("lookup", "emb_backward")}
    ids = data.ids_per_sample or {}
    weight = {t.name: t.dim * float(ids.get(t.name, 1.0)) for t in held}
    scale = sum(shares[n] * w for n, w in weight.items()) / sum(weight.values())
    return {"lookup": secs["lookup"] * scale, "emb_backward": secs["emb_backward"] * scale}


def profile_step(cfg, data, tables, plan, global_batch: int, *, ranks_on_host: int,
                 steps: int = 20, warmup: int = 5) -> dict[int, dict[str, float]]:
    """``{rank: {part: seconds per step}}`` of ``plan``'s ranks, measured here (module doc).

    ``ranks_on_host``: the job's ranks on one host. They share its cores, caches
    and memory, so the measurement runs beside as many copies of the trainer
    (processes of their own, each a world of one, started first and stopped
    after) as fill the host's cores, with the threads per rank the trainer would
    take (``train.threads`` when given); with more ranks than cores, the ranks
    take turns and every part stretches by ranks over cores. Ranks that hold the
    same shares are measured once.
    """
    if global_batch % plan.world_size:
        raise ValueError(f"batch size: {global_batch} samples do not split over "
                         f"{plan.world_size} ranks")
    from embedding.train.threads import default_threads, rank_threads

    threads = rank_threads(cfg.train.threads, ranks_on_host)
    cores = default_threads(1)
    beside = min(ranks_on_host, cores) - 1
    with _co_runners(cfg, global_batch // plan.world_size, threads, beside):
        measured = _profile(cfg, data, tables, plan, global_batch, threads, steps, warmup)
    stretch = max(1.0, ranks_on_host / cores)  # more ranks than cores take turns
    return {r: {p: t * stretch for p, t in parts.items()} for r, parts in measured.items()}


def _fresh_trainer_parts(cfg, batch: int, threads: int, steps: int, warmup: int,
                         ranks: int) -> dict:
    """:func:`_trainer_parts` measured in a process of its own, as a rank of the job runs its
    trainer: the first trainer a process builds runs its dense part about twice as long on
    this kind of host as a second one built in the same process, so a measurement inside
    the simulating process (which has built others) would undercount it."""
    import json
    import os
    import subprocess
    import sys

    from embedding.train.config import to_toml

    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "PMI_"))}  # its own world of one
    code = (f"import sys; from embedding.profile import _measure_child; "
            f"_measure_child(sys.stdin.read(), {int(batch)}, {int(threads)}, {int(steps)}, "
            f"{int(warmup)}, {int(ranks)})")
    done = subprocess.run([sys.executable, "-c", code], input=to_toml(cfg), text=True,
                          capture_output=True, env=env)
    if done.returncode != 0:
        raise RuntimeError("profile: measuring the trainer failed: " +
                           done.stderr.strip()[-400:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def _measure_child(config_toml: str, batch: int, threads: int, steps: int, warmup: int,
                   ranks: int) -> None:
    """:func:`_fresh_trainer_parts`' process: print the parts as one line of JSON."""
    import json
    import tomllib

    from embedding.train.config import parse_config

    cfg = parse_config(tomllib.loads(config_toml))
    print(json.dumps(_trainer_parts(cfg, None, batch, threads, steps, warmup, ranks)),
          flush=True)


def _profile(cfg, data, tables, plan, global_batch, threads, steps, warmup) -> dict:
    common = _fresh_trainer_parts(cfg, global_batch // plan.world_size, threads, steps, warmup,
                                  plan.world_size)
    shares = rank_shares(plan, tables)
    seen: dict[tuple, dict] = {}
    out = {}
    for rank, held in shares.items():
        key = tuple(sorted(held.items()))
        if key not in seen:
            seen[key] = _fastest(lambda: _embedding_parts(cfg, data, tables, held,
                                                          global_batch, threads, steps,
                                                          warmup))
        out[rank] = {p: common.get(p, seen[key].get(p, 0.0)) for p in COMPUTE_PARTS}
    return out


# -- the measured step, for validation ---------------------------------------------------
STEP_KIND = "neocomm-step-measurements"


def read_training(metrics_path: str, skip: int = 1) -> dict:
    """What a ``neocomm train`` metrics log says of its steps: ``step_ms`` and
    ``phases_ms`` of each logged window after the first ``skip`` (warm-up), and their
    medians (``median_step_ms``, ``median_phases_ms``). ValueError naming the file when
    it logged too few windows."""
    import json

    windows = []
    with open(metrics_path, encoding="utf-8") as fh:
        for line in fh:
            event = json.loads(line)
            if event.get("event") == "train":
                windows.append(event)
    windows = windows[skip:]
    if not windows:
        raise ValueError(f"{metrics_path}: no training window after the first {skip}; train "
                         f"more steps (or log more often)")
    parts = sorted({p for w in windows for p in w["phases_ms"]})
    return {"step_ms": [w["step_ms"] for w in windows],
            "median_step_ms": median(w["step_ms"] for w in windows),
            "median_phases_ms": {p: median(w["phases_ms"].get(p, 0.0) for w in windows)
                                 for p in parts}}


def run_training(layouts, *, config: str | None, steps: int, out_dir: str, hostfile=None,
                 timeout: float = 600.0, echo=None, launches: int = 1) -> list[dict]:
    """Run ``neocomm train`` (``config``, ``steps`` steps) at
    every ``(ranks, ranks_per_node)`` of ``layouts`` (nodes emulated on this host unless a
    ``hostfile`` spreads them: each layout on the first of its hosts, ``ranks_per_node``
    to a host), ``launches`` times over (every layout once, then again),
    and return what each layout logged (:func:`read_training`, with ``ranks``, ``nodes``
    and ``emulated``; several launches merged by :func:`median_of_training_launches`).
    RuntimeError naming the command, what its ranks said of why and the file with its
    whole output when one fails (each launch's output is kept beside its directory,
    ``train-...-N.log``)."""
    import os
    import shutil

    from neocomm.hostfile import layout_hostfile
    from neocomm.launcher import run_job

    if isinstance(launches, bool) or not isinstance(launches, int) or launches < 1:
        raise ValueError(f"launches: expected a count >= 1, got {launches!r}")
    exe = shutil.which("neocomm")
    if exe is None:
        raise RuntimeError("validation: the neocomm command is not on PATH (pip install it)")
    out = []
    for launch, (ranks, per_node) in ((k, lay) for k in range(launches) for lay in layouts):
        where = os.path.join(out_dir, f"train-{ranks}r-{ranks // per_node}n-{launch}")
        cmd = [exe, "run", "-n", str(ranks), "--ranks-per-node", str(per_node),
               "--timeout", str(int(timeout))]
        if hostfile:  # the layout's hosts, per_node ranks on each
            cmd += ["--hostfile", layout_hostfile(hostfile, ranks // per_node, per_node,
                                                  f"{where}-hosts")]
        cmd += ["--", exe, "train", "--steps", str(steps), "--out", where]
        cmd += ["--config", config] if config else []
        if echo:
            echo(" ".join(cmd[1:]).replace(exe, "neocomm"))
        metrics = os.path.join(where, "metrics.jsonl")
        run_job(cmd, what="validation", log=f"{where}.log", expect=(metrics,),
                shown=" ".join(cmd[1:]))
        out.append({"ranks": ranks, "nodes": ranks // per_node, "emulated": not hostfile,
                    "config": config, "steps": steps, **read_training(metrics)})
    return median_of_training_launches(out)


def median_of_training_launches(runs: list[dict]) -> list[dict]:
    """``runs`` (:func:`run_training`'s) with the launches of one layout and config merged,
    in first-seen order: ``median_step_ms`` and each of ``median_phases_ms`` the median
    of the launches' medians (each launch's step in ``launch_step_ms``; a run merged before
    brings its own), ``step_ms`` every launch's windows, ``launches`` how many were merged
    (one launch can place its ranks worse than the next on a shared host)."""
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        key = tuple(str(run.get(k)) for k in ("ranks", "nodes", "emulated", "config", "steps"))
        groups.setdefault(key, []).append(run)
    out = []
    for same in groups.values():
        merged = dict(same[0])
        merged["launches"] = sum(int(r.get("launches", 1)) for r in same)
        merged["step_ms"] = [t for r in same for t in r["step_ms"]]
        each = [t for r in same for t in r.get("launch_step_ms") or [r["median_step_ms"]]]
        merged["median_step_ms"] = median(each)
        if len(each) > 1:
            merged["launch_step_ms"] = each
        parts = sorted({p for r in same for p in r["median_phases_ms"]})
        merged["median_phases_ms"] = {p: median(r["median_phases_ms"].get(p, 0.0)
                                                for r in same) for p in parts}
        out.append(merged)
    return out
