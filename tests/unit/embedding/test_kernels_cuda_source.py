"""The CUDA sources of the fused kernels compile with nvcc (sm_90)."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from embedding.kernels.cuda_src import KERNEL_NAMES, source_for


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_cuda_sources_compile_with_nvcc(tmp_path, dtype):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH")
    src = tmp_path / f"kernels_{dtype}.cu"
    src.write_text(source_for(dtype))
    proc = subprocess.run([nvcc, "-arch=sm_90", "-c", "-o", str(tmp_path / "k.o"), str(src)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    text = source_for(dtype)
    for name in KERNEL_NAMES:
        assert f'extern "C" __global__ void {name}(' in text


def test_source_rejects_other_dtypes():
    with pytest.raises(ValueError, match="dtype"):
        source_for("float16")


def test_sources_round_every_operation():
    """No bare + or * on values: every operation is an _rn intrinsic (no FMA contraction)."""
    text = source_for("float32")
    assert "__fadd_rn" in text and "__fmul_rn" in text and "__dadd_rn" not in text
    assert "__dadd_rn" in source_for("float64")
