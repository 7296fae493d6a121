"""The stand-in's ``cupy.cuda.runtime``: device count and selection, synchronisation."""
from __future__ import annotations

from cupy import _engine

__all__ = ["CUDARuntimeError", "getDeviceCount", "getDevice", "setDevice", "deviceSynchronize"]

CUDARuntimeError = _engine.CudaError


def getDeviceCount() -> int:
    """Devices of this host; with none CUDA fails (``cudaErrorNoDevice``), as CuPy raises."""
    n = _engine.num_devices()
    if n < 1:
        raise CUDARuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected")
    return n


def getDevice() -> int:
    return _engine.current_device()


def setDevice(device: int) -> None:
    _engine.set_device(device)


def deviceSynchronize() -> None:
    _engine.synchronize_device()


def runtimeGetVersion() -> int:
    return 12040


def driverGetVersion() -> int:
    return 12040
