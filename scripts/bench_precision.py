#!/usr/bin/env python3
"""Precision settings side by side: bytes sent per step, step time and AUC, against float32.

    python scripts/bench_precision.py                       # built-in data, 2 ranks, 3 seeds
    python scripts/bench_precision.py --data example,ratings --steps 200 --json precision.json
    python scripts/bench_precision.py --data dac_sample.txt     # Criteo text (.gz too)
    python scripts/bench_precision.py --data mydata.toml        # any training config

Runs ``neocomm run -n RANKS -- neocomm train --seed S`` once per setting below
and seed ``S`` in ``0 .. --seeds - 1``, on the same data and number of steps,
in one invocation (so every setting sees the same machine), and reads each
run's ``metrics.jsonl``:

* bytes: what rank 0 passed per step to the collectives of the pooled
  embeddings, their gradients and the dense AllReduce (``comm_bytes``:
  counted from the buffers, not estimated), and the ratio to float32;
* step ms: the median over the seeds of each run's median logged window
  (the first, warm-up, window left out);
* AUC: the held-out AUC at the last step, as the mean over the seeds and
  its spread (the sample standard deviation over the seeds), and the
  mean's difference to float32's mean. A setting is ``ok`` when that
  difference is within ``max(0.002, float32's spread)``: the seed decides
  the initial weights and the data order, so float32's own spread is what a
  difference must exceed to mean something.

``--data`` takes one data set or several, comma-separated, each reported on
its own: ``builtin`` is the trainer's built-in synthetic Criteo-shaped data
(26 tables of the criteo-1tb-1000x preset, dim 16, with a planted model);
``example`` the example Parquet data of ``neocomm data example``;
``ratings`` the ratings-shaped data of ``neocomm data example --shape ratings``
(MovieLens-100K-like, 100,000 ratings; its 468 steps are the 12 epochs of its
config); ``FILE.toml`` a training config of your own (its ``[data]``,
``[tables]``, ``[model]`` and ``[train]`` are kept, each setting adds its
sections, and relative paths are read from the working directory as
``neocomm train`` reads them); any other ``FILE`` is Criteo text (the Kaggle
display-advertising sample ``dac_sample.txt``, a day of Criteo 1TB, ``.gz``
too), trained with the trainer's defaults and its last ``[data] eval_records``
lines held out.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

from neocomm.launcher import run_job

#: (name, TOML sections added to the data's config)
SETTINGS = (
    ("float32", ""),
    ("tables bf16 stochastic", '[tables]\ndtype = "bfloat16"\nrounding = "stochastic"\n'),
    ("tables fp16 nearest", '[tables]\ndtype = "float16"\n'),
    ("comms fp16 (loss scale 1024)",
     '[comms]\nforward = "fp16"\nbackward = "fp16"\ndense = "fp16"\nloss_scale = 1024\n'),
    ("comms bf16", '[comms]\nforward = "bf16"\nbackward = "bf16"\ndense = "bf16"\n'),
    ("comms int8 fwd, bf16 bwd", '[comms]\nforward = "int8"\nbackward = "bf16"\n'
                                 'dense = "bf16"\n'),
    ("bf16 tables + fp16 comms", '[tables]\ndtype = "bfloat16"\nrounding = "stochastic"\n'
                                 '[comms]\nforward = "fp16"\nbackward = "fp16"\n'
                                 'dense = "fp16"\nloss_scale = 1024\n'),
    ("tables bf16 nearest", '[tables]\ndtype = "bfloat16"\n'),
    ("tables fp16 stochastic", '[tables]\ndtype = "float16"\nrounding = "stochastic"\n'),
    ("tables bf16 master", '[tables]\ndtype = "bfloat16"\nrounding = "master"\n'),
    ("tables + state fp16", '[tables]\ndtype = "float16"\nstate_dtype = "float16"\n'),
    ("tables + state bf16 stochastic", '[tables]\ndtype = "bfloat16"\nrounding = "stochastic"\n'
                                       'state_dtype = "bfloat16"\n'),
)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="builtin",
                   help="comma-separated data sets, each builtin | example | ratings | a "
                   "training config (.toml) | a Criteo text file (default builtin)")
    p.add_argument("--ranks", type=int, default=2, help="ranks of each run (default 2)")
    p.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    p.add_argument("--seeds", type=int, default=3, help="runs of each setting, with train "
                   "seeds 0 .. N-1 (default 3)")
    p.add_argument("--only", default="", help="comma-separated setting numbers (1-based) to "
                   "run besides float32 (default: all)")
    p.add_argument("--out", default="", help="keep the runs here (default: a temporary dir); "
                   "an invocation with the same --out reads the runs that finished there")
    p.add_argument("--json", default="", help="write the rows as JSON here")
    return p.parse_args(argv)


def _merge(base: str, extra: str) -> str:
    """``base`` TOML with the sections of ``extra`` merged in (a section present in both
    gets ``extra``'s keys appended under it)."""
    if not extra:
        return base
    lines = base.splitlines()
    current = None
    add: dict[str, list[str]] = {}
    for line in extra.splitlines():
        if line.startswith("["):
            current = line.strip()
            add.setdefault(current, [])
        elif line.strip():
            add[current].append(line)
    out = []
    for line in lines:
        out.append(line)
        if line.strip() in add:
            out.extend(add.pop(line.strip()))
    for section, keys in add.items():
        out += ["", section, *keys]
    return "\n".join(out) + "\n"


def _base_config(data: str, exe: str, out: str) -> str:
    """The training config every setting starts from (module doc)."""
    if data == "builtin":
        return ""
    if data in ("example", "ratings"):
        where = os.path.join(out, f"data-{data}")
        if data == "example":
            subprocess.run([exe, "data", "example", "-o", where], check=True,
                           capture_output=True)
        else:
            from embedding.data.example import write_ratings

            write_ratings(where)
        data = os.path.join(where, "train.toml")
    if not os.path.isfile(data):
        raise ValueError("expected builtin, example, ratings, a training config (.toml) or a "
                         "Criteo text file; no such file")
    if data.endswith(".toml"):
        # its relative paths stay relative to the working directory, as for neocomm train
        with open(data, encoding="utf-8") as fh:
            return fh.read()
    return f'[data]\nsource = "criteo"\npath = {json.dumps(os.path.abspath(data))}\n'


def _read(metrics: str) -> dict:
    train, evals = [], []
    with open(metrics, encoding="utf-8") as fh:
        for line in fh:
            r = json.loads(line)
            if r.get("event") == "train":
                train.append(r)
            elif r.get("event") == "eval":
                evals.append(r)
    if len(train) < 2 or not evals:
        raise RuntimeError(f"{metrics}: too few windows or no evaluation; train more steps")
    last = evals[-1]
    sets = last.get("sets") or {"held-out": last}
    name = "valid" if "valid" in sets else next(iter(sets))
    sent = train[-1].get("comm_bytes", {})
    return {"step_ms": statistics.median(r["step_ms"] for r in train[1:]),
            "bytes": {k: int(v) for k, v in sent.items()},
            "auc": float(sets[name]["auc"]), "auc_set": name, "step": int(last["step"])}


def _spread(values) -> float:
    """The sample standard deviation of ``values`` (0 for one value)."""
    return statistics.stdev(values) if len(values) > 1 else 0.0


def _run(exe: str, args, base: str, out: str, i: int, name: str, extra: str,
         seed: int) -> dict:
    """One training run of setting ``i`` with train seed ``seed``: its metrics (:func:`_read`)."""
    where = os.path.join(out, f"run{i}-seed{seed}")
    config = os.path.join(out, f"setting{i}.toml")
    with open(config, "w", encoding="utf-8") as fh:
        fh.write(_merge(base, extra))
    metrics = os.path.join(where, "metrics.jsonl")
    if _finished(metrics, args.steps):
        print(f"# {name}, seed {seed}: the finished run in {where}", flush=True)
        return _read(metrics)
    cmd = [exe, "run", "-n", str(args.ranks), "--", exe, "train", "--config", config,
           "--steps", str(args.steps), "--seed", str(seed), "--out", where]
    shutil.rmtree(where, ignore_errors=True)       # a run cut short starts over
    print(f"# {name}: neocomm run -n {args.ranks} -- neocomm train --config {config} "
          f"--steps {args.steps} --seed {seed}", flush=True)
    run_job(cmd, what=name, log=f"{where}.log", expect=(metrics,),
            shown=" ".join(cmd).replace(exe, "neocomm"))
    return _read(metrics)


def _finished(metrics: str, steps: int) -> bool:
    """Whether ``metrics`` is the log of a run that ended at ``steps`` (an ``--out`` kept
    from an earlier invocation: its finished runs are read, not run again)."""
    try:
        with open(metrics, encoding="utf-8") as fh:
            return any(r.get("event") == "end" and r.get("step") == steps
                       for r in map(json.loads, fh))
    except (OSError, ValueError):
        return False


def bench_data(exe: str, args, data: str, out: str) -> list[dict]:
    """Every chosen setting on ``data``, ``args.seeds`` runs each; one row per setting:
    bytes and step of seed 0, the median step time and each seed's AUC, their mean and
    spread (sample standard deviation), and the mean's difference to float32's."""
    os.makedirs(out, exist_ok=True)
    base = _base_config(data, exe, out)
    chosen = {1} | {int(i) for i in args.only.split(",") if i} if args.only else None
    rows = []
    for i, (name, extra) in enumerate(SETTINGS, 1):
        if chosen is not None and i not in chosen:
            continue
        runs = [_run(exe, args, base, out, i, name, extra, seed) for seed in range(args.seeds)]
        aucs = [r["auc"] for r in runs]
        rows.append({"data": data, "setting": name, "toml": extra, **runs[0],
                     "step_ms": statistics.median(r["step_ms"] for r in runs),
                     "aucs": aucs, "auc": statistics.fmean(aucs), "auc_spread": _spread(aucs)})
    ref = rows[0]
    total = sum(ref["bytes"].values()) or 1
    tolerance = max(0.002, ref["auc_spread"])
    for r in rows:
        r["bytes_ratio"] = sum(r["bytes"].values()) / total
        r["auc_delta"] = r["auc"] - ref["auc"]
        r["fp32_spread"] = ref["auc_spread"]
        r["within"] = abs(r["auc_delta"]) <= tolerance
    return rows


def _print(data: str, args, rows: list[dict]) -> None:
    ref = rows[0]
    print(f"# {data} data, {args.ranks} ranks, {args.steps} steps, seeds 0..{args.seeds - 1}; "
          f"bytes per step on rank 0 (counted); AUC on the {ref['auc_set']} set at step "
          f"{ref['step']}: the mean over the seeds, its spread (standard deviation over the "
          f"seeds), the mean's difference to float32's; ok: within max(0.002, float32's "
          f"spread) = {max(0.002, ref['auc_spread']):.4f}")
    print(f"{'setting':<30} {'emb fwd B':>10} {'emb bwd B':>10} {'dense B':>9} "
          f"{'bytes/fp32':>10} {'step ms':>8} {'AUC':>7} {'spread':>7} {'dAUC':>8} "
          f"{'fp32 sp':>7} {'ok':>3}")
    for r in rows:
        b = r["bytes"]
        print(f"{r['setting']:<30} {b.get('emb_forward', 0):>10} {b.get('emb_backward', 0):>10} "
              f"{b.get('dense', 0):>9} {r['bytes_ratio']:>10.3f} {r['step_ms']:>8.1f} "
              f"{r['auc']:>7.4f} {r['auc_spread']:>7.4f} {r['auc_delta']:>+8.4f} "
              f"{r['fp32_spread']:>7.4f} {'yes' if r['within'] else 'NO':>3}", flush=True)


def main(argv=None) -> int:
    args = parse(argv)
    exe = shutil.which("neocomm")
    if exe is None:
        print("bench_precision: the neocomm command is not on PATH (pip install it)",
              file=sys.stderr)
        return 2
    if args.seeds < 1:
        print(f"bench_precision: --seeds: expected >= 1, got {args.seeds}", file=sys.stderr)
        return 2
    out = args.out or tempfile.mkdtemp(prefix="neocomm-precision-")
    os.makedirs(out, exist_ok=True)
    datasets = [d for d in args.data.split(",") if d]
    everything = []
    for k, data in enumerate(datasets):
        try:
            rows = bench_data(exe, args, data, os.path.join(out, f"data{k}"))
        except (OSError, ValueError) as e:
            print(f"bench_precision: --data {data}: {e}", file=sys.stderr)
            return 2
        except RuntimeError as e:
            print(f"bench_precision: {e}", file=sys.stderr)
            return 1
        _print(data, args, rows)
        everything += rows
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"data": datasets, "ranks": args.ranks, "steps": args.steps,
                       "seeds": args.seeds, "rows": everything}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
