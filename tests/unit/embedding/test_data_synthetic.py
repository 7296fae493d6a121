"""The synthetic generator: determinism, shape, skew, planted model, presets."""
from __future__ import annotations

import numpy as np
import pytest

from embedding.data import (CRITEO_1TB_TABLE_SIZES, TABLE_PRESETS, SyntheticConfig,
                            SyntheticDataset, planted_auc, scale_table_sizes, table_size_preset)
from embedding.dense import auc


def test_records_are_a_function_of_seed_and_index():
    ds = SyntheticDataset(SyntheticConfig(seed=5), 4096)
    whole = ds.read(0, 1000)
    part = ds.read(300, 700)
    np.testing.assert_array_equal(whole.dense[300:700], part.dense)
    np.testing.assert_array_equal(whole.labels[300:700], part.labels)
    for f in range(26):
        np.testing.assert_array_equal(whole.values[f][300:700], part.values[f])
    again = SyntheticDataset(SyntheticConfig(seed=5), 4096).read(300, 700)
    np.testing.assert_array_equal(again.values[7], part.values[7])
    other = SyntheticDataset(SyntheticConfig(seed=6), 4096).read(300, 700)
    assert not np.array_equal(other.values[0], part.values[0])


def test_shape_and_ranges():
    sizes = TABLE_PRESETS["tiny"]
    ds = SyntheticDataset(SyntheticConfig(table_sizes=sizes), 2000)
    b = ds.read(0, 2000)
    assert b.dense.shape == (2000, 13) and b.dense.dtype == np.float32
    assert set(np.unique(b.labels)) == {0.0, 1.0}
    assert (b.dense >= 0).all() and np.isfinite(b.dense).all()
    assert (b.dense == 0).mean() > 0.05  # missing and clamped values
    b.check(table_sizes=sizes)
    assert b.feature_names[0] == "C1"
    for f, n in enumerate(sizes):
        assert b.lengths[f].tolist() == [1] * 2000
        assert 0 <= b.values[f].min() and b.values[f].max() < n


def test_popularity_is_skewed():
    sizes = (100_000,) * 26
    ds = SyntheticDataset(SyntheticConfig(table_sizes=sizes, zipf_alpha=1.2), 20000)
    ids = ds.read(0, 20000).values[0]
    _, counts = np.unique(ids, return_counts=True)
    top = np.sort(counts)[::-1]
    assert top[0] / 20000 > 0.05          # uniform would give 1e-5
    assert top[:100].sum() / 20000 > 0.4  # the head holds much of the mass
    # the hottest rows are spread over the table, not bunched at its start
    hot = np.unique(ids)[np.argsort(-counts)[:20]]
    assert hot.max() > 10_000


def test_planted_model_auc_is_about_0_8_and_learnable_signal():
    r = planted_auc(SyntheticConfig(), 1 << 16)
    assert 0.76 < r["auc"] < 0.84
    assert 0.1 < r["positive_rate"] < 0.4
    ds = SyntheticDataset(SyntheticConfig(), 1 << 14)
    b, p = ds.read_with_probabilities(0, 1 << 14)
    # labels really follow the planted probabilities (calibration within noise)
    assert abs(b.labels.mean() - p.mean()) < 0.02
    # an unrelated score is at chance
    assert abs(auc(b.labels, np.random.default_rng(0).random(b.batch_size)) - 0.5) < 0.03
    # a logistic regression on the dense features alone learns part of the signal
    x = (b.dense - b.dense.mean(0)) / (b.dense.std(0) + 1e-6)
    w = np.zeros(13)
    for _ in range(200):
        q = 1 / (1 + np.exp(-(x @ w)))
        w -= 0.5 * x.T @ (q - b.labels) / b.batch_size
    assert auc(b.labels, x @ w) > 0.6


def test_logit_std_zero_means_no_signal():
    r = planted_auc(SyntheticConfig(logit_std=0.0), 1 << 14)
    assert abs(r["auc"] - 0.5) < 0.03


def test_scale_table_sizes_and_presets():
    assert TABLE_PRESETS["criteo-1tb"] == CRITEO_1TB_TABLE_SIZES
    assert len(CRITEO_1TB_TABLE_SIZES) == 26 and sum(CRITEO_1TB_TABLE_SIZES) == 187_767_399
    s = scale_table_sizes(CRITEO_1TB_TABLE_SIZES, scale=1000)
    assert s[0] == 39885 and s[5] == 3 and s[1] == 1000 and s[7] == 1000
    assert max(scale_table_sizes(CRITEO_1TB_TABLE_SIZES, cap=100_000)) == 100_000
    assert scale_table_sizes((10, 5000), scale=10, min_rows=1) == (1, 500)
    assert table_size_preset("criteo-1tb-100x")[0] == 398845
    with pytest.raises(ValueError, match="preset"):
        table_size_preset("criteo-2tb")
    with pytest.raises(ValueError, match="scale"):
        scale_table_sizes((10,), scale=0.5)
    with pytest.raises(ValueError, match="cap"):
        scale_table_sizes((10,), cap=0)


@pytest.mark.parametrize("kw, match", [
    ({"table_sizes": (0, 4)}, "table_sizes"),
    ({"table_sizes": (4, 4), "zipf_alpha": (1.0,)}, "zipf_alpha"),
    ({"dense_share": 1.5}, "dense_share"),
    ({"dense_missing": 1.0}, "dense_missing"),
    ({"logit_std": -1}, "logit_std"),
])
def test_bad_config(kw, match):
    with pytest.raises(ValueError, match=match):
        SyntheticConfig(**kw)


def test_bad_reads():
    ds = SyntheticDataset(SyntheticConfig(), 10)
    with pytest.raises(ValueError, match="start/stop"):
        ds.read(0, 11)
    with pytest.raises(ValueError, match="num_records"):
        SyntheticDataset(SyntheticConfig(), 0)


def test_command_line_reports_planted_auc(capsys):
    from neocomm.cli import main as neocomm_main

    def main(argv):  # the data tools, as `neocomm data ...` runs them
        return neocomm_main(["data", *argv])

    assert main(["planted-auc", "--preset", "tiny", "--records", "4096"]) == 0
    out = capsys.readouterr().out
    assert "preset tiny seed 0: 4096 records, planted-model AUC 0." in out
