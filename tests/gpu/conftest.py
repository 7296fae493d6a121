"""GPU tests need CuPy and a CUDA device; without them they skip with the reason."""
from __future__ import annotations

import pytest


def _gpu_reason() -> str | None:
    try:
        import cupy
    except ImportError:
        return "CuPy is not installed (pip install 'neocomm[gpu]')"
    try:
        if cupy.cuda.runtime.getDeviceCount() == 0:
            return "no CUDA device is visible"
    except Exception as exc:  # noqa: BLE001
        return f"no usable CUDA driver: {exc}"
    return None


GPU_REASON = _gpu_reason()


def pytest_collection_modifyitems(config, items):
    if GPU_REASON is None:
        return
    skip = pytest.mark.skip(reason=GPU_REASON)
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)
