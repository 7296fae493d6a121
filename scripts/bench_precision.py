#!/usr/bin/env python3
"""Precision settings side by side: bytes sent per step, step time and AUC, against float32.

    python scripts/bench_precision.py                       # built-in data, 2 ranks
    python scripts/bench_precision.py --data example --steps 200 --json precision.json
    python scripts/bench_precision.py --data dac_sample.txt     # Criteo text (.gz too)
    python scripts/bench_precision.py --data mydata.toml        # any training config

Runs ``neocomm run -n RANKS -- neocomm train`` once per setting below, on the
same data, seed and number of steps, in one invocation (so every setting
sees the same machine), and reads each run's ``metrics.jsonl``:

* bytes: what rank 0 passed per step to the collectives of the pooled
  embeddings, their gradients and the dense AllReduce (``comm_bytes``:
  counted from the buffers, not estimated), and the ratio to float32;
* step ms: the median of the logged windows' mean step, the first (warm-up)
  window left out;
* AUC: the held-out AUC at the last step, and its difference to float32.

``--data builtin`` is the trainer's built-in synthetic Criteo-shaped data
(26 tables of the criteo-1tb-1000x preset, dim 16, with a planted model);
``--data example`` the example Parquet data of ``neocomm data example``;
``--data FILE.toml`` a training config of your own (its ``[data]``, ``[tables]``,
``[model]`` and ``[train]`` are kept, each setting adds its sections, and relative
paths are read from the working directory as ``neocomm train`` reads them);
``--data FILE`` any other file is Criteo text (the Kaggle display-advertising
sample ``dac_sample.txt``, a day of Criteo 1TB, ``.gz`` too), trained with the
trainer's defaults and its last ``[data] eval_records`` lines held out.
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
)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="builtin",
                   help="builtin | example | a training config (.toml) | a Criteo text file "
                   "(default builtin)")
    p.add_argument("--ranks", type=int, default=2, help="ranks of each run (default 2)")
    p.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    p.add_argument("--only", default="", help="comma-separated setting numbers (1-based) to "
                   "run besides float32 (default: all)")
    p.add_argument("--out", default="", help="keep the runs here (default: a temporary dir)")
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
    if data == "example":
        subprocess.run([exe, "data", "example", "-o", os.path.join(out, "data")], check=True,
                       capture_output=True)
        data = os.path.join(out, "data", "train.toml")
    if not os.path.isfile(data):
        raise ValueError("expected builtin, example, a training config (.toml) or a Criteo "
                         "text file; no such file")
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


def main(argv=None) -> int:
    args = parse(argv)
    exe = shutil.which("neocomm")
    if exe is None:
        print("bench_precision: the neocomm command is not on PATH (pip install it)",
              file=sys.stderr)
        return 2
    out = args.out or tempfile.mkdtemp(prefix="neocomm-precision-")
    os.makedirs(out, exist_ok=True)
    try:
        base = _base_config(args.data, exe, out)
    except (OSError, ValueError) as e:
        print(f"bench_precision: --data {args.data}: {e}", file=sys.stderr)
        return 2
    chosen = {1} | {int(i) for i in args.only.split(",") if i} if args.only else None
    rows = []
    for i, (name, extra) in enumerate(SETTINGS, 1):
        if chosen is not None and i not in chosen:
            continue
        where = os.path.join(out, f"run{i}")
        config = os.path.join(out, f"setting{i}.toml")
        with open(config, "w", encoding="utf-8") as fh:
            fh.write(_merge(base, extra))
        cmd = [exe, "run", "-n", str(args.ranks), "--", exe, "train", "--config", config,
               "--steps", str(args.steps), "--out", where]
        print(f"# {name}: neocomm run -n {args.ranks} -- neocomm train --config "
              f"{config} --steps {args.steps}", flush=True)
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            tail = " | ".join((done.stdout + done.stderr).strip().splitlines()[-4:])
            print(f"bench_precision: {name} failed (exit {done.returncode}): {tail}",
                  file=sys.stderr)
            return 1
        rows.append({"setting": name, "toml": extra,
                     **_read(os.path.join(where, "metrics.jsonl"))})
    ref = rows[0]
    total = sum(ref["bytes"].values()) or 1
    print(f"# {args.data} data, {args.ranks} ranks, {args.steps} steps; bytes per step on "
          f"rank 0 (counted); AUC on the {ref['auc_set']} set at step {ref['step']}")
    print(f"{'setting':<30} {'emb fwd B':>10} {'emb bwd B':>10} {'dense B':>9} "
          f"{'bytes/fp32':>10} {'step ms':>8} {'AUC':>7} {'dAUC':>8}")
    for r in rows:
        b = r["bytes"]
        r["bytes_ratio"] = sum(b.values()) / total
        r["auc_delta"] = r["auc"] - ref["auc"]
        print(f"{r['setting']:<30} {b.get('emb_forward', 0):>10} {b.get('emb_backward', 0):>10} "
              f"{b.get('dense', 0):>9} {r['bytes_ratio']:>10.3f} {r['step_ms']:>8.1f} "
              f"{r['auc']:>7.4f} {r['auc_delta']:>+8.4f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"data": args.data, "ranks": args.ranks, "steps": args.steps,
                       "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
