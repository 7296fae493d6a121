"""FBGEMM's FUSED8BIT rows: the layout byte by byte, rounding, the half-step bound, and
(where ``fbgemm_gpu`` loads) the same bytes as ``torch.ops.fbgemm``'s quantizer."""
from __future__ import annotations

import struct

import numpy as np
import pytest

from embedding.checkpoint.fused8bit import (check_format, dequantize_rows, fused_width,
                                            quantize_rows, scale_bias)


def test_a_row_is_its_codes_then_scale_then_bias_as_little_endian_float32():
    row = np.arange(256, dtype=np.float32) * 0.5 - 3.0  # min -3, max 124.5: step 0.5
    fused = quantize_rows(row[None, :])
    assert fused.dtype == np.uint8 and fused.shape == (1, 256 + 8) == (1, fused_width(256))
    want = bytes(range(256)) + struct.pack("<ff", np.float32(127.5) / np.float32(255), -3.0)
    assert fused.tobytes() == want
    assert np.array_equal(dequantize_rows(fused)[0], row)


def test_codes_round_half_to_even_as_lrintf():
    # range 255: scale 1, and 255 / (255 + 1e-8) is 1 in float32, so code = rint(x - min)
    row = np.array([[0.0, 0.5, 1.5, 2.5, 3.5, 254.5, 255.0]], np.float32)
    fused = quantize_rows(row)
    assert list(fused[0, :7]) == [0, 0, 2, 2, 4, 254, 255]
    assert struct.unpack("<ff", fused[0, 7:].tobytes()) == (1.0, 0.0)


def test_dequantized_rows_are_within_half_a_step():
    rng = np.random.default_rng(3)
    for scale, shape in ((1.0, (300, 16)), (1e-5, (200, 7)), (3e4, (100, 64)), (0.02, (50, 1))):
        x = (rng.standard_normal(shape) * scale + rng.standard_normal((shape[0], 1))
             ).astype(np.float32)
        fused = quantize_rows(x)
        step, bias = scale_bias(fused)
        assert np.array_equal(bias, x.min(axis=1))
        assert np.array_equal(step, (x.max(axis=1) - x.min(axis=1)) / np.float32(255))
        err = np.abs(dequantize_rows(fused).astype(np.float64) - x)
        # half a step, plus float32 rounding of the values themselves
        bound = step[:, None] / 2 + 4 * np.finfo(np.float32).eps * np.abs(x).max(axis=1)[:, None]
        assert (err <= bound).all(), float((err - bound).max())


def test_a_constant_row_comes_back_exactly_and_half_precision_widens():
    x = np.full((3, 5), -2.75, np.float32)
    fused = quantize_rows(x)
    assert not fused[:, :5].any() and np.array_equal(dequantize_rows(fused), x)
    h = np.random.default_rng(0).standard_normal((40, 8)).astype(np.float16)
    assert np.array_equal(quantize_rows(h), quantize_rows(h.astype(np.float32)))


def test_many_rows_in_chunks_equal_row_by_row():
    x = np.random.default_rng(1).standard_normal(((1 << 16) + 5, 3)).astype(np.float32)
    fused = quantize_rows(x)
    for i in (0, (1 << 16) - 1, 1 << 16, (1 << 16) + 4):
        assert np.array_equal(fused[i], quantize_rows(x[i:i + 1])[0])
    assert np.array_equal(dequantize_rows(fused)[-5:], dequantize_rows(fused[-5:]))


def test_bad_input_is_named():
    x = np.zeros((4, 3), np.float32)
    x[2, 1] = np.nan
    with pytest.raises(ValueError, match="rows: row 2 holds NaN or inf"):
        quantize_rows(x)
    with pytest.raises(ValueError, match=r"rows: expected a 2-D array .* shape \(3,\)"):
        quantize_rows(np.zeros(3, np.float32))
    with pytest.raises(ValueError, match=r"fused: expected uint8 rows .* float32 of shape"):
        dequantize_rows(np.zeros((2, 12), np.float32))
    with pytest.raises(ValueError, match="format: unsupported row format 'int4'; supported: "
                                         "fused8bit_rowwise"):
        check_format("int4")


def _fbgemm():
    import importlib

    try:
        torch = importlib.import_module("torch")
        importlib.import_module("fbgemm_gpu")  # registers torch.ops.fbgemm
    except Exception as exc:  # ImportError, or a build that does not load with this torch
        pytest.skip(f"fbgemm_gpu does not load here ({type(exc).__name__}: {exc}); "
                    f"pip install fbgemm-gpu-cpu matching torch to run this comparison")
    return torch


def test_the_same_bytes_as_fbgemm():
    torch = _fbgemm()
    rng = np.random.default_rng(7)
    for x in (rng.standard_normal((500, 16)), rng.standard_normal((200, 13)) * 1e-6,
              rng.uniform(-1e4, 1e4, (100, 64)), np.full((4, 8), 3.25),
              np.round(rng.standard_normal((300, 32)) * 4) / 4):
        x = np.ascontiguousarray(x, np.float32)
        theirs = torch.ops.fbgemm.FloatToFused8BitRowwiseQuantized(torch.from_numpy(x)).numpy()
        assert np.array_equal(quantize_rows(x), theirs)
        back = torch.ops.fbgemm.Fused8BitRowwiseQuantizedToFloat(torch.from_numpy(theirs))
        # FBGEMM's vector path rounds code * scale + bias once (a fused multiply-add), as
        # dequantize_rows does; its scalar path rounds twice: at most one unit apart.
        np.testing.assert_array_max_ulp(dequantize_rows(theirs), back.numpy(), maxulp=1)
