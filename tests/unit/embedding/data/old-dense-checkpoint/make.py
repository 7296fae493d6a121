"""How this directory was written: with the code of commit 8ba613c (before dense columns had
transforms), ``PYTHONPATH=<a checkout of 8ba613c> python make.py OUT``; then
``OUT/{train,test,scores}.parquet`` and ``OUT/run/checkpoints/step-000000000016`` were
copied here. ``scores.parquet`` holds that code's predictions for ``test.parquet``: a
checkpoint without dense statistics must predict them bit for bit."""
import dataclasses, json, sys, shutil
from pathlib import Path
import numpy as np, pyarrow as pa, pyarrow.parquet as pq
import embedding
from embedding.train import Trainer, parse_config
from embedding.train.predict import predict

out = Path(sys.argv[1]); shutil.rmtree(out, ignore_errors=True); out.mkdir(parents=True)

def write(path, n, seed):
    rng = np.random.default_rng(seed)
    item = rng.integers(0, 50, n)
    eff = np.random.default_rng(1).normal(0, 1.0, 50)
    x = rng.normal(0, 1, n)
    year = rng.integers(1920, 2001, n).astype(np.float64)
    logit = eff[item] + 0.6 * x - 0.02 * (year - 1960)
    y = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.int8)
    yr = pa.array([None if i % 17 == 3 else v for i, v in enumerate(year)], pa.float64())
    pq.write_table(pa.table({"key": np.arange(n, dtype=np.int64), "y": y,
                             "item": item.astype(np.int64), "x": x, "year": yr}),
                   path, row_group_size=256)

write(out / "train.parquet", 1024, 0)
write(out / "test.parquet", 300, 1)
cfg = parse_config({"data": {"source": "parquet", "path": [str(out / "train.parquet")],
    "eval_path": [str(out / "test.parquet")], "label": "y",
    "dense": ["x", {"column": "year", "fill": 1960.0, "indicator": True}],
    "sparse": [{"name": "item"}]},
    "model": {"embedding_dim": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]},
    "train": {"steps": 16, "batch_size": 64, "eval_every": 0, "log_every": 1000},
    "output": {"dir": str(out / "run")}}, "old")
t = Trainer(cfg); t.train(); t.close()
r = predict(out / "run", out / "test.parquet", out / "scores.parquet")
print(r)
