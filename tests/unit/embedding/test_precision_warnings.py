"""Precision settings measured to cost AUC beyond float32's seed spread warn at start-up."""
from __future__ import annotations

import dataclasses
import logging

import pytest

from embedding import precision
from embedding.data.example import write_ratings
from embedding.precision import Rounding, quality_warning
from embedding.train import Trainer, load_config
from embedding.types import OptimizerKind


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    d = tmp_path_factory.mktemp("warn")
    return load_config(write_ratings(d, records=2000)["config"]), d


def _start(config, dtype: str, rounding: str, state: str, caplog) -> list[str]:
    """The warnings of a trainer's start-up with row-wise AdaGrad tables of that precision."""
    cfg, d = config
    assert cfg.sparse_optimizer.kind.value == "rowwise_adagrad"
    cfg = dataclasses.replace(
        cfg, tables=dataclasses.replace(cfg.tables, dtype=dtype, rounding=rounding,
                                        state_dtype=state),
        train=dataclasses.replace(cfg.train, batch_size=128),
        output=dataclasses.replace(cfg.output, dir=str(d / f"{dtype}-{rounding}-{state}")))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="embedding.train.loop"):
        Trainer(cfg, outputs=False).close()
    return [r.getMessage() for r in caplog.records if r.name == "embedding.train.loop"]


def test_the_settings_measured_to_lose_auc_are_named():
    assert precision._QUALITY, "docs/training.md lists settings that lose AUC"
    for (state, kind) in precision._QUALITY:
        for dtype in ("float32", "float16", "bfloat16"):
            msg = quality_warning(dtype, "nearest", state, kind)
            assert msg.startswith(f"tables.dtype {dtype} (rounding 'nearest') with {kind} "
                                  f"state in {state}: ") and "docs/training.md" in msg, msg
            # the same tables with float32 state, or another optimizer, are not named
            assert quality_warning(dtype, "nearest", "float32", kind) is None
            assert quality_warning(dtype, "nearest", state, "sgd") is None
    # half tables with float32 state were measured within float32's spread
    for dtype in ("float32", "float16", "bfloat16"):
        assert quality_warning(dtype, "nearest") is None
    assert quality_warning("bfloat16", Rounding.STOCHASTIC) is None
    assert quality_warning("bfloat16", "master", "bfloat16", OptimizerKind.ROWWISE_ADAGRAD) \
        is None


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_float16_adagrad_state_warns_once_at_start_up(config, caplog, rounding):
    got = _start(config, "float16", rounding, "float16", caplog)
    assert got == [quality_warning("float16", rounding, "float16", "rowwise_adagrad")], got
    assert "accumulator" in got[0]


@pytest.mark.parametrize("dtype,rounding", [("float32", "nearest"), ("float16", "nearest"),
                                            ("bfloat16", "stochastic"), ("bfloat16", "master")])
def test_settings_within_the_spread_start_quietly(config, caplog, dtype, rounding):
    assert _start(config, dtype, rounding, "", caplog) == []
