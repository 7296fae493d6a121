"""Which NCCL and NVRTC CuPy loads here: their versions and library files, or why not.

``neocomm info`` reports them. Neither check needs a GPU: CuPy loads NCCL
(``cupy.cuda.nccl``) and NVRTC (``cupy_backends.cuda.libs.nvrtc``, the
compiler of ``RawModule``) when asked, from the ``nvidia-*`` wheels of the
``gpu`` extra or from the system's library path (docs/gpu.md).
"""
from __future__ import annotations

import re
import warnings
from dataclasses import dataclass

__all__ = ["LibraryState", "nccl_state", "nvrtc_state", "cuda_headers", "loaded_path",
           "driver_devices"]

#: a kernel small enough to compile in a few milliseconds: it proves NVRTC works
_PROBE_KERNEL = 'extern "C" __global__ void neocomm_probe(float* x) { x[threadIdx.x] += 1.0f; }'
#: the architecture the probe compiles for (PTX: no GPU is asked which one it is)
PROBE_ARCH = "compute_80"


def driver_devices() -> int:
    """CUDA devices the driver reports: 0 without a driver (``libcuda``) or a device.

    Asked of the driver itself (``cuInit``, ``cuDeviceGetCount``) in a few milliseconds,
    without importing CuPy (most of a second): whether CuPy imports says nothing about a
    GPU, and a process on a host without one need not pay for it.
    """
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


@dataclass(frozen=True)
class LibraryState:
    """A shared library CuPy uses: ``version`` and ``path`` when it loaded, else ``reason``."""

    name: str
    available: bool
    version: str | None = None
    path: str | None = None
    reason: str | None = None

    def describe(self) -> str:
        """``"2.32.3 (/path/libnccl.so.2)"``, or ``"not available: <reason>"``."""
        if not self.available:
            return f"not available: {self.reason}"
        return f"{self.version} ({self.path or 'library file not found among the mapped ones'})"


def loaded_path(stem: str) -> str | None:
    """The file of the loaded shared library whose name starts with ``stem`` (``libnccl``),
    from this process's memory map (Linux); None when none is mapped or there is no map."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                if path.startswith("/") and path.rsplit("/", 1)[-1].startswith(stem + ".so"):
                    return path
    except OSError:
        return None
    return None


def _reason_of(caught: list) -> str | None:
    """The ``Reason: ...`` line of CuPy's warning that a library could not be loaded."""
    for w in caught:
        match = re.search(r"Reason:\s*(.+)", str(w.message))
        if match:
            return match.group(1).strip()
    return None


def nccl_state() -> LibraryState:
    """The NCCL that ``cupy.cuda.nccl`` loaded: version (``get_version()``) and file."""
    from neocomm.backends.nccl import version_text

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            import cupy  # noqa: F401
            from cupy.cuda import nccl
        except ImportError as exc:
            return LibraryState("nccl", False, reason=f"CuPy is not importable ({exc}); "
                                                      f"pip install 'neocomm[gpu]'")
    if not getattr(nccl, "available", True):
        why = _reason_of(caught) or "CuPy's NCCL bindings report NCCL as unavailable"
        return LibraryState("nccl", False, reason=f"{why}; pip install 'neocomm[gpu]' brings "
                                                  f"nvidia-nccl-cu12")
    try:
        code = int(nccl.get_version())
    except Exception as exc:  # noqa: BLE001 - a broken library raises anything
        return LibraryState("nccl", False, reason=f"get_version() failed: "
                                                  f"{type(exc).__name__}: {exc}")
    return LibraryState("nccl", True, version=version_text(code), path=loaded_path("libnccl"))


def nvrtc_state() -> LibraryState:
    """The NVRTC that CuPy compiles raw kernels with: version, file, and a probe kernel
    compiled for :data:`PROBE_ARCH` (PTX, so no GPU is needed)."""
    try:
        from cupy_backends.cuda.libs import nvrtc
    except ImportError as exc:
        return LibraryState("nvrtc", False, reason=f"CuPy is not importable ({exc})")
    try:
        major, minor = nvrtc.getVersion()
        prog = nvrtc.createProgram(_PROBE_KERNEL, "neocomm_probe.cu", [], [])
        try:
            nvrtc.compileProgram(prog, [f"--gpu-architecture={PROBE_ARCH}"])
            if not nvrtc.getPTX(prog):
                raise RuntimeError("the probe kernel compiled to no PTX")
        finally:
            nvrtc.destroyProgram(prog)
    except Exception as exc:  # noqa: BLE001 - a missing library raises several types
        return LibraryState("nvrtc", False, reason=f"{type(exc).__name__}: {exc}; "
                                                   f"pip install 'neocomm[gpu]' brings "
                                                   f"nvidia-cuda-nvrtc-cu12")
    return LibraryState("nvrtc", True, version=f"{major}.{minor}",
                        path=loaded_path("libnvrtc"))


def cuda_headers() -> str:
    """Where CuPy finds the CUDA runtime headers its own kernels include, or why not."""
    try:
        from cuda import pathfinder
    except ImportError as exc:
        return f"not available: cuda-pathfinder is not importable ({exc})"
    try:
        found = pathfinder.find_nvidia_header_directory("cudart")
    except Exception as exc:  # noqa: BLE001
        return f"not available: {type(exc).__name__}: {exc}"
    return found or ("not available: no CUDA runtime headers found; pip install "
                     "'neocomm[gpu]' brings nvidia-cuda-runtime-cu12, or set CUDA_PATH")
