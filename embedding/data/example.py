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

:func:`write_ratings` writes a second shape, a public ratings set's
(MovieLens-100K-like): 943 users and 1,682 items whose activity and
popularity are skewed (a few users and items hold most ratings, every user
rates at least a few), a 0/1 label ``liked`` (rating 4 or 5) of a latent
factor model of ratings, integer ids, string columns (``gender``,
``occupation``, ``zip``), a genre list per item, and numeric columns with
nulls (``age``, ``year``) beside a wide one (``timestamp``). Its default
100,000 ratings are split 80/10/10 into train, valid and test, so the
default global batch of 2048 makes an epoch 39 steps.
``neocomm data example --shape ratings`` writes it.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from embedding.types import positive_arg

__all__ = ["write_example", "write_ratings", "EXAMPLE_CONFIG", "RATINGS_CONFIG", "GENRES",
           "CITIES"]

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

    for name, value in (("records", records), ("eval_records", eval_records),
                        ("users", users), ("items", items), ("row_group_size", row_group_size)):
        positive_arg(name, value, int)
    rng = np.random.default_rng(seed)
    schema = pa.schema([("event_id", pa.int64()), ("clicked", pa.int8()),
                        ("user_id", pa.int64()), ("item_id", pa.int32()),
                        ("city", pa.string()), ("genres", pa.list_(pa.string())),
                        ("age", pa.float64()), ("hour", pa.float64()),
                        ("year", pa.int32())])
    sets, first = [], 0
    for name, n in (("train", records), ("valid", eval_records), ("test", eval_records)):
        prob, cols = _rows(rng, n, users, items, first)
        sets.append((name, prob, cols))
        first += n
    return _write_sets(out_dir, schema, sets, "clicked", EXAMPLE_CONFIG, row_group_size)


def _write_sets(out_dir, schema, sets, label: str, config: str, row_group_size: int) -> dict:
    """Write each ``(name, planted probability, columns)`` of ``sets`` as ``name.parquet``
    and ``config`` (its ``{train}`` and ``{eval}`` filled in) as ``train.toml``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from embedding.dense.metrics import auc

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths, planted = {}, float("nan")
    for name, prob, cols in sets:
        if name == "test":
            planted = auc(np.asarray(cols[label], np.float64), prob)
        path = out / f"{name}.parquet"
        tmp = path.with_suffix(".parquet.tmp")
        pq.write_table(pa.table(cols, schema=schema), tmp, row_group_size=row_group_size)
        os.replace(tmp, path)
        paths[name] = str(path)
    path = out / "train.toml"
    path.write_text(config.format(train=f'"{paths["train"]}"',
                                  eval=f'"{paths["valid"]}", "{paths["test"]}"'))
    paths["config"] = str(path)
    paths["planted_auc"] = float(planted)
    return paths


# -- the ratings shape ---------------------------------------------------------------------

#: MovieLens-100K's 19 genres and 21 occupations, most frequent first.
RATING_GENRES = ("drama", "comedy", "action", "thriller", "romance", "adventure", "children",
                 "crime", "sci-fi", "horror", "war", "mystery", "musical", "documentary",
                 "animation", "western", "film-noir", "fantasy", "unknown")
OCCUPATIONS = ("student", "other", "educator", "administrator", "engineer", "programmer",
               "librarian", "writer", "executive", "scientist", "artist", "technician",
               "marketing", "entertainment", "healthcare", "retired", "lawyer", "salesman",
               "none", "homemaker", "doctor")

#: The training config of the ratings shape (``{train}`` and ``{eval}`` are the file lists).
RATINGS_CONFIG = """\
[data]
source = "parquet"
path = [{train}]
eval_path = [{eval}]
label = "liked"
dense = ["age", "year", "timestamp"]

[[data.sparse]]
name = "user"
column = "user_id"

[[data.sparse]]
name = "item"
column = "item_id"

[[data.sparse]]
name = "gender"
column = "gender"

[[data.sparse]]
name = "occupation"
column = "occupation"

[[data.sparse]]
name = "zip"
column = "zip"

[[data.sparse]]
name = "genres"
column = "genres"
pooling = "mean"

[model]
embedding_dim = 16
bottom_mlp = [64, 16]
top_mlp = [64, 1]

[train]
steps = 468
eval_every = 117
"""


def _skewed(rng, n: int, alpha: float, floor: float) -> np.ndarray:
    """Probabilities of ``n`` things in a random order: a Zipf law of exponent ``alpha`` over
    their ranks, mixed with a uniform share ``floor`` (so each gets a few)."""
    p = np.arange(1, n + 1, dtype=np.float64) ** -alpha
    p = (1 - floor) * p / p.sum() + floor / n
    return p[rng.permutation(n)]


def write_ratings(out_dir, *, records: int = 100_000, seed: int = 0, users: int = 943,
                  items: int = 1_682, row_group_size: int = 8192) -> dict:
    """Write the ratings shape (module doc): ``records`` ratings split 80/10/10 into
    ``train``, ``valid`` and ``test`` Parquet files, and ``train.toml``; returns their paths
    and ``planted_auc`` (the AUC on ``test`` of the planted model's probabilities).

    A rating is ``2.95 + user bias + item bias + user·item factors + the item's genres'
    effect + the user's taste for its main genre + noise`` (noise std 1.0); ``liked`` is a
    rating of 3.5 or more (about 60% of the rows). Popular items are rated higher. Users'
    ``age`` is null for 3% of the users, items' ``year`` for 1% of the items. Seeded: the
    same arguments give the same files.
    """
    import pyarrow as pa

    for name, value in (("records", records), ("users", users), ("items", items),
                        ("row_group_size", row_group_size)):
        positive_arg(name, value, int)
    if records < 10:
        raise ValueError(f"records: expected at least 10 (an 80/10/10 split), got {records}")
    rng = np.random.default_rng(seed)
    k = 6                                                  # latent factors
    g = len(RATING_GENRES)
    # users: activity, demographics, taste
    p_user = _skewed(rng, users, 0.9, 0.15)
    gender = np.where(rng.random(users) < 0.71, "M", "F")
    age = np.clip(np.round(rng.normal(33, 12, users)), 7, 73)
    age_null = rng.random(users) < 0.03
    occupation = rng.choice(len(OCCUPATIONS), users, p=_skewed(rng, len(OCCUPATIONS), 1.0, 0.1))
    zips = np.array([f"{z:05d}" for z in rng.integers(0, 100_000, users)])
    zips[rng.random(users) < 0.1] = zips[0]                # a crowded zip code
    b_user = rng.normal(0, 0.45, users)
    f_user = rng.normal(0, 0.45, (users, k))
    taste = rng.normal(0, 0.35, (users, g))
    # items: popularity, genres, release year
    p_item = _skewed(rng, items, 1.05, 0.05)
    pop = np.log(p_item * items)
    pop = (pop - pop.mean()) / pop.std()
    p_genre = np.linspace(3.0, 0.2, g) ** 2
    p_genre /= p_genre.sum()
    item_genres = [sorted(set(rng.choice(g, rng.integers(1, 4), p=p_genre).tolist()))
                   for _ in range(items)]
    main_genre = np.array([gs[0] for gs in item_genres])
    g_eff = rng.normal(0, 0.25, g)
    genre_eff = np.array([g_eff[gs].mean() for gs in item_genres])
    b_item = rng.normal(0, 0.55, items) + 0.25 * pop
    f_item = rng.normal(0, 0.45, (items, k))
    year = np.clip(np.round(1998 - rng.exponential(9, items) - 0.5 * np.maximum(-pop, 0)),
                   1922, 1998)
    year_null = rng.random(items) < 0.01
    # ratings
    user = rng.choice(users, records, p=p_user)
    item = rng.choice(items, records, p=p_item)
    rating = (2.95 + b_user[user] + b_item[item] + genre_eff[item]
              + np.einsum("ij,ij->i", f_user[user], f_item[item])
              + taste[user, main_genre[item]])
    prob = 1 - 0.5 * (1 + _erf((3.5 - rating) / (1.0 * np.sqrt(2))))
    liked = (rating + rng.normal(0, 1.0, records) >= 3.5).astype(np.int8)
    timestamp = rng.integers(874_724_710, 893_286_638, records)  # seconds, seven months
    cols = {
        "rating_id": np.arange(records, dtype=np.int64),
        "liked": liked,
        "user_id": (user + 1).astype(np.int32),
        "item_id": (item + 1).astype(np.int32),
        "gender": gender[user].tolist(),
        "occupation": [OCCUPATIONS[o] for o in occupation[user]],
        "zip": zips[user].tolist(),
        "genres": [[RATING_GENRES[x] for x in item_genres[i]] for i in item],
        "age": [None if age_null[u] else float(age[u]) for u in user],
        "year": [None if year_null[i] else int(year[i]) for i in item],
        "timestamp": timestamp.astype(np.int64),
    }
    schema = pa.schema([("rating_id", pa.int64()), ("liked", pa.int8()),
                        ("user_id", pa.int32()), ("item_id", pa.int32()),
                        ("gender", pa.string()), ("occupation", pa.string()),
                        ("zip", pa.string()), ("genres", pa.list_(pa.string())),
                        ("age", pa.float64()), ("year", pa.int32()),
                        ("timestamp", pa.int64())])
    n_eval = records // 10
    cuts = {"train": slice(0, records - 2 * n_eval),
            "valid": slice(records - 2 * n_eval, records - n_eval),
            "test": slice(records - n_eval, records)}
    sets = [(name, prob[cut], {c: v[cut] for c, v in cols.items()})
            for name, cut in cuts.items()]
    return _write_sets(out_dir, schema, sets, "liked", RATINGS_CONFIG, row_group_size)


def _erf(x: np.ndarray) -> np.ndarray:
    """The error function (Abramowitz and Stegun 7.1.26, absolute error below 1.5e-7)."""
    s = np.sign(x)
    a = np.abs(x)
    t = 1 / (1 + 0.3275911 * a)
    y = 1 - (((((1.061405429 * t - 1.453152027) * t) + 1.421413741) * t - 0.284496736) * t
             + 0.254829592) * t * np.exp(-a * a)
    return s * y
