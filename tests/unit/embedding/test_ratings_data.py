"""The ratings-shaped example data: skewed ids, a genre list, nulls, an 80/10/10 split."""
from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

from embedding.data.example import RATING_GENRES, write_ratings
from embedding.train import load_config
from neocomm.cli import main


@pytest.fixture(scope="module")
def ratings(tmp_path_factory):
    return write_ratings(tmp_path_factory.mktemp("ratings"), records=20_000)


def test_ratings_have_the_shape_of_a_public_ratings_set(ratings):
    tables = {k: pq.read_table(ratings[k]) for k in ("train", "valid", "test")}
    assert [t.num_rows for t in tables.values()] == [16_000, 2_000, 2_000]
    t = tables["train"]
    assert str(t.schema.field("genres").type.value_type) == "string"
    assert t.schema.field("user_id").type == "int32" and t.schema.field("zip").type == "string"
    users = np.bincount(t["user_id"].to_numpy())
    items = np.bincount(t["item_id"].to_numpy())
    # skew: the busiest tenth of the users and items hold far more than a tenth of the rows
    for counts in (users, items):
        top = np.sort(counts)[::-1][:len(counts) // 10].sum()
        assert top > 0.35 * counts.sum(), top / counts.sum()
    assert 0 < t["age"].null_count < 0.1 * t.num_rows
    assert 0 < t["year"].null_count < 0.05 * t.num_rows
    genres = {g for row in t["genres"].to_pylist() for g in row}
    assert genres <= set(RATING_GENRES) and len(genres) > 10
    liked = t["liked"].to_numpy().mean()
    assert 0.45 < liked < 0.75, liked
    assert 0.75 < ratings["planted_auc"] < 0.95, ratings["planted_auc"]
    cfg = load_config(ratings["config"])
    assert [s.name for s in cfg.data.sparse] == ["user", "item", "gender", "occupation", "zip",
                                                 "genres"]


def test_ratings_are_reproducible_and_written_by_the_data_command(ratings, tmp_path, capsys):
    assert main(["data", "example", "--shape", "ratings", "--records", "20000",
                 "-o", str(tmp_path)]) == 0
    assert "80/10/10 of 20,000 ratings" in capsys.readouterr().out
    for name in ("train", "valid", "test"):
        assert pq.read_table(tmp_path / f"{name}.parquet").equals(pq.read_table(ratings[name]))
