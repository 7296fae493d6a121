"""An example Parquet data set of the shape users bring: ratings turned into clicks.

:func:`write_example` writes ``records`` rows with a 0/1 label ``clicked``,
integer ids (``user_id``, ``item_id``), a string column (``city``), a
list-valued string column (``genres``), numeric columns with nulls
(``age``, ``hour``), a wide numeric column (``year``, each item's release
year, 1920-2000) and a key column (``event_id``) the model does not read.
Whether a row is clicked is drawn from a planted logistic model of the
user, the item, the genres, the city and the age, so a model that learns
from the columns scores well above 0.5 AUC. The year tells something of
the item's effect (later items are clicked less, with noise), in units far
from the other columns': the config names it without a transform setting,
so it is standardised by default. Seeded: the same arguments give the same
file.

``neocomm data example`` writes it, with the training config that reads it.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from embedding.types import positive_arg

__all__ = ["write_example", "EXAMPLE_CONFIG", "GENRES", "CITIES"]

GENRES = ("action", "comedy", "drama", "horror", "romance", "sci-fi", "thriller", "documentary",
          "animation", "crime")
CITIES = ("berlin", "lagos", "lima", "mumbai", "osaka", "paris", "seattle", "sydney", "toronto")

#: The training config of the example (``{train}`` and ``{eval}`` are the file lists).
EXAMPLE_CONFIG = """\
[data]
source = "parquet"
path = [{train}]
eval_path = [{eval}]
label = "clicked"
dense = ["age", "hour", "year"]

[[data.sparse]]
name = "user"
column = "user_id"

[[data.sparse]]
name = "item"
column = "item_id"

[[data.sparse]]
name = "city"
column = "city"

[[data.sparse]]
name = "genres"
column = "genres"
pooling = "mean"

[model]
embedding_dim = 16
bottom_mlp = [64, 16]
top_mlp = [64, 1]

[train]
steps = 200
eval_every = 100
# batch_size: the global batch, samples per step over all ranks; it must be a multiple
# of the ranks. Left out (or 0) it is 2048 rounded down to a multiple of the ranks.
"""


def _rows(rng, n: int, users: int, items: int, first_event: int):
    user = rng.zipf(1.3, n) % users
    item = rng.zipf(1.2, n) % items
    # each item has 1-3 genres, fixed per item; the rows carry them as a list
    item_rng = np.random.default_rng(12345)
    item_genres = [sorted(set(item_rng.choice(len(GENRES), item_rng.integers(1, 4)).tolist()))
                   for _ in range(items)]
    city = rng.integers(0, len(CITIES), n)
    age = rng.normal(38, 12, n).clip(16, 90)
    hour = rng.integers(0, 24, n).astype(np.float64)
    # the planted model: per-user, per-item, per-genre and per-city effects, an age slope
    eff = np.random.default_rng(777)
    u_eff = eff.normal(0, 0.9, users)
    i_eff = eff.normal(0, 0.9, items)
    g_eff = eff.normal(0, 0.6, len(GENRES))
    c_eff = eff.normal(0, 0.4, len(CITIES))
    logit = (u_eff[user] + i_eff[item] + c_eff[city] - 0.02 * (age - 38) - 0.4
             + np.array([g_eff[item_genres[i]].mean() for i in item]))
    # each item's release year (its own generator: the other columns stay as they were)
    year_rng = np.random.default_rng(4242)
    item_year = np.clip(np.round(1975 - 12 * i_eff + year_rng.normal(0, 12, items)), 1920,
                        2000).astype(np.int32)
    prob = 1 / (1 + np.exp(-logit))
    clicked = (rng.random(n) < prob).astype(np.int8)
    age_missing = rng.random(n) < 0.1
    hour_missing = rng.random(n) < 0.05
    return prob, {
        "event_id": np.arange(first_event, first_event + n, dtype=np.int64),
        "clicked": clicked,
        "user_id": (user * 7919 + 1_000_003).astype(np.int64),  # ids are not 0..N-1
        "item_id": (item + 50_000).astype(np.int32),
        "city": [CITIES[c] for c in city],
        "genres": [[GENRES[g] for g in item_genres[i]] for i in item],
        "age": [None if m else float(round(a, 1)) for a, m in zip(age, age_missing)],
        "hour": [None if m else h for h, m in zip(hour, hour_missing)],
        "year": item_year[item],
    }


def write_example(out_dir, *, records: int = 60_000, eval_records: int = 10_000,
                  seed: int = 0, users: int = 2_000, items: int = 1_000,
                  row_group_size: int = 8192) -> dict:
    """Write ``train.parquet``, ``valid.parquet``, ``test.parquet`` and ``train.toml`` into
    ``out_dir``; returns their paths and ``planted_auc``: the AUC of the planted model's
    probabilities on ``test`` (what a perfect model approaches). ``valid`` and ``test``
    hold ``eval_records`` each."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for name, value in (("records", records), ("eval_records", eval_records),
                        ("users", users), ("items", items), ("row_group_size", row_group_size)):
        positive_arg(name, value, int)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    schema = pa.schema([("event_id", pa.int64()), ("clicked", pa.int8()),
                        ("user_id", pa.int64()), ("item_id", pa.int32()),
                        ("city", pa.string()), ("genres", pa.list_(pa.string())),
                        ("age", pa.float64()), ("hour", pa.float64()),
                        ("year", pa.int32())])
    paths, first = {}, 0
    for name, n in (("train", records), ("valid", eval_records), ("test", eval_records)):
        prob, cols = _rows(rng, n, users, items, first)
        table = pa.table(cols, schema=schema)
        if name == "test":
            from embedding.dense.metrics import auc

            planted = auc(np.asarray(cols["clicked"], np.float64), prob)
        path = out / f"{name}.parquet"
        tmp = path.with_suffix(".parquet.tmp")
        pq.write_table(table, tmp, row_group_size=row_group_size)
        os.replace(tmp, path)
        paths[name], first = str(path), first + n
    config = out / "train.toml"
    config.write_text(EXAMPLE_CONFIG.format(train=f'"{paths["train"]}"',
                                            eval=f'"{paths["valid"]}", "{paths["test"]}"'))
    paths["config"] = str(config)
    paths["planted_auc"] = float(planted)
    return paths
