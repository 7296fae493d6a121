"""The CUDA sources of the fused kernels: nvcc finds nothing to contract into an FMA.

The kernels round every operation as NumPy does (``__fadd_rn``, ``__fmul_rn``...),
so the device results equal the NumPy twins bit for bit. A bare ``a * x + y`` would
let nvcc fuse it into one FMA (one rounding instead of two) and the results would
drift by an ulp. Checked on what nvcc makes of the sources: each kernel's PTX holds
as many FMA instructions with contraction on (nvcc's default) as with
``-fmad=false``. Without nvcc the check fails when ``CI`` is set and skips elsewhere
(``NVCC`` may name the compiler), as in ``test_kernels_nvcc.py``.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from embedding.kernels.cuda_src import KERNEL_NAMES, source_for

_ENTRY = re.compile(r"\.visible \.entry (\w+)\(.*?\n}\n", re.S)
_FMA = re.compile(r"^\s*fma\.", re.M)

#: a kernel written with bare operators: the control that the check sees contraction
_BARE = r'''
extern "C" __global__ void axpy(const float* __restrict__ x, float* __restrict__ y,
                                const float a, const long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}'''


def _nvcc() -> str:
    for candidate in (os.environ.get("NVCC"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    reason = "nvcc is not on PATH, not at /usr/local/cuda/bin/nvcc and NVCC is not set"
    if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
        pytest.fail(f"nvcc must run in CI: {reason}")
    pytest.skip(reason)


def _fmas_per_kernel(tmp_path: Path, source: str, fmad: bool) -> dict[str, int]:
    """``{kernel: FMA instructions in its PTX}`` of ``source`` compiled for sm_90."""
    src = tmp_path / "kernels.cu"
    src.write_text(source)
    out = tmp_path / f"kernels-{fmad}.ptx"
    cmd = [_nvcc(), "-ptx", "-arch=sm_90", f"-fmad={'true' if fmad else 'false'}",
           "-o", str(out), str(src)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stderr}"
    return {m.group(1): len(_FMA.findall(m.group(0))) for m in _ENTRY.finditer(out.read_text())}


@pytest.mark.parametrize("dtype, state_dtype", [("float32", None), ("float64", None),
                                                ("float16", "float16"), ("bfloat16", None)])
def test_nvcc_contracts_nothing_in_the_kernels(tmp_path, dtype, state_dtype):
    contracted = _fmas_per_kernel(tmp_path, source_for(dtype, state_dtype), fmad=True)
    plain = _fmas_per_kernel(tmp_path, source_for(dtype, state_dtype), fmad=False)
    assert set(contracted) == set(KERNEL_NAMES), contracted
    fused = {k: (plain[k], n) for k, n in contracted.items() if n != plain[k]}
    assert not fused, f"nvcc fused operations into FMAs in the {dtype} kernels " \
                      f"(FMAs without, with contraction): {fused}"


@pytest.mark.parametrize("dtype, wire", [("float32", "float16"), ("float32", "int8"),
                                         ("float64", "float16"), ("bfloat16", "bfloat16")])
def test_nvcc_contracts_nothing_in_the_wire_kernels(tmp_path, dtype, wire):
    """The modules that encode pooled rows (fp16/bf16 rounding, int8 codes) and decode
    gradients round every operation as NumPy's codec does."""
    contracted = _fmas_per_kernel(tmp_path, source_for(dtype, None, wire), fmad=True)
    plain = _fmas_per_kernel(tmp_path, source_for(dtype, None, wire), fmad=False)
    assert set(contracted) == set(KERNEL_NAMES), contracted
    fused = {k: (plain[k], n) for k, n in contracted.items() if n != plain[k]}
    assert not fused, f"nvcc fused operations into FMAs in the {dtype}/{wire} kernels: {fused}"


def test_the_check_sees_a_contracted_kernel(tmp_path):
    assert _fmas_per_kernel(tmp_path, _BARE, fmad=True) == {"axpy": 1}
    assert _fmas_per_kernel(tmp_path, _BARE, fmad=False) == {"axpy": 0}


def test_source_rejects_other_dtypes():
    with pytest.raises(ValueError, match=r"dtype: expected one of .*got int8"):
        source_for("int8")
    with pytest.raises(ValueError, match=r"state_dtype: expected one of .*got int16"):
        source_for("float32", "int16")
    with pytest.raises(ValueError, match=r"state_dtype: .*float16 optimizer state.*not float64"):
        source_for("float64", "float16")
    with pytest.raises(ValueError, match=r"wire: expected None or one of .*got 'fp8'"):
        source_for("float32", None, "fp8")
