"""The trainer's [comms] section: settings reach the collection and the dense AllReduce;
bad values name the key and the value."""
from __future__ import annotations

import numpy as np
import pytest

from embedding.sharding.qcomm import CommPrecision, QComms, Wire
from embedding.train import parse_config
from embedding.train.types import ConfigError


def test_comms_section_maps_to_qcomms():
    cfg = parse_config({"comms": {"forward": "int8", "backward": "fp16", "dense": "bf16",
                                  "loss_scale": 1024}})
    # data-parallel tables AllReduce their gradients as the dense model's, in bf16 unscaled
    assert cfg.comms.qcomms() == QComms("int8", "fp16", 1024.0, dense="bf16")
    assert cfg.comms.dense_scale() is None  # the dense AllReduce is bf16: unscaled


def test_dense_setting_and_its_loss_scale_reach_data_parallel_tables():
    cfg = parse_config({"comms": {"dense": "fp16", "loss_scale": 512}})
    assert cfg.comms.qcomms() == QComms(dense="fp16", dense_loss_scale=512.0)
    assert cfg.comms.dense_scale() == 512.0


@pytest.mark.parametrize("key,value,text", [
    ("backward", "int8", "comms.backward: expected one of ['fp32', 'fp16', 'bf16'], got 'int8'"),
    ("forward", "fp8", "comms.forward: expected one of ['fp32', 'fp16', 'bf16', 'int8'], "
                       "got 'fp8'"),
    ("dense", "int8", "comms.dense: expected one of ['fp32', 'fp16', 'bf16'], got 'int8'"),
    ("loss_scale", -2, "comms.loss_scale: expected a number >= 0.0, got -2.0"),
])
def test_bad_comms_values_name_key_and_value(key, value, text):
    with pytest.raises(ConfigError) as info:
        parse_config({"comms": {key: value}})
    assert text in str(info.value)


def test_loss_scale_needs_an_fp16_exchange():
    with pytest.raises(ConfigError, match=r"comms.loss_scale: 512 scales fp16 gradients only; "
                                          r"comms.backward is 'bf16' and comms.dense is 'fp32'"):
        parse_config({"comms": {"backward": "bf16", "loss_scale": 512}})


@pytest.mark.parametrize("precision,rel", [("fp16", 2.0 ** -11), ("bf16", 2.0 ** -8)])
def test_16_bit_wire_error_bound(precision, rel):
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    w = Wire(CommPrecision(precision), np, "float32")
    got = w.decode(w.encode(x))
    assert got.dtype == np.float32 and w.encode(x).nbytes == 2 * x.size
    assert np.all(np.abs(got - x) <= rel * np.abs(x))
    assert np.any(got != x)


def test_int8_rows_within_half_a_step():
    x = np.random.default_rng(1).standard_normal((50, 8)).astype(np.float32) * 3
    x[7] = 0.25  # a constant row comes back exactly
    w = Wire(CommPrecision.INT8, np, "float32", row=8)
    buf = w.encode(x.reshape(-1))
    assert buf.dtype == np.uint8 and buf.size == 50 * 16 == w.count(x.size)
    got = w.decode(buf).reshape(50, 8)
    step = (x.max(axis=1) - x.min(axis=1)) / 255
    assert np.all(np.abs(got - x) <= step[:, None] / 2 * 1.001 + 1e-6)
    assert np.array_equal(got[7], x[7])
    from embedding.checkpoint.fused8bit import quantize_rows  # the same FUSED8BIT bytes
    assert np.array_equal(buf.reshape(50, 16), quantize_rows(x))


def test_fp16_loss_scale_is_undone():
    x = np.array([1e-6, -3e-7, 2.0], np.float32)
    w = Wire(CommPrecision.FP16, np, "float32", scale=1024.0)
    assert np.allclose(w.decode(w.encode(x)), x, rtol=2.0 ** -11)
