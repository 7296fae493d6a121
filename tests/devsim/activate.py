"""Put the device stand-in in place of CuPy, unless a real GPU is usable.

``use_standin()`` decides once per process, by whether there is a usable GPU
(never by whether CuPy imports: the real CuPy is installed for the tests that
check the stand-in against it): a real CuPy that sees a CUDA device wins (the
device tests then run on the GPU); otherwise
``tests/devsim`` goes first on ``sys.path`` (and into ``PYTHONPATH`` for
the processes a test starts), so ``import cupy`` gets the stand-in.
``DEVSIM=1`` forces the stand-in, ``DEVSIM=0`` forbids it.
"""
from __future__ import annotations

import os
import sys

from neocomm.cuda_libs import driver_devices

HERE = os.path.dirname(os.path.abspath(__file__))


def _real_gpu() -> bool:
    """A real CuPy that sees a CUDA device (decided by the device, never by the import)."""
    if driver_devices() < 1:
        return False
    try:
        import cupy
    except ImportError:
        return False
    if getattr(cupy, "STANDIN", False):
        return False
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - driver and runtime disagree
        return False


def use_standin() -> bool:
    """Install the stand-in when there is no real GPU; True when it is in use."""
    forced = os.environ.get("DEVSIM")
    if forced == "0":
        return False
    if forced != "1" and "cupy" not in sys.modules and _real_gpu():
        return False
    mod = sys.modules.get("cupy")
    if mod is not None and not getattr(mod, "STANDIN", False):
        for name in [n for n in sys.modules
                     if n.split(".")[0] in ("cupy", "cupyx", "cupy_backends")]:
            del sys.modules[name]
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if HERE not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([HERE, *parts])
    os.environ["DEVSIM"] = "1"
    import cupy

    return bool(getattr(cupy, "STANDIN", False))
