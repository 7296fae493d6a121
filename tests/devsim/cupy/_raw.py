"""The stand-in's raw kernels: the CUDA source runs on a CPU OpenCL device.

``RawModule(code=...)`` translates the source mechanically to OpenCL C and
compiles it for PoCL (``tests/devsim/opencl.py``), or for Oclgrind when
:data:`OPENCL_DEVICE` says so (every access checked; slow); a launch copies its
array arguments in and out of the OpenCL buffers. A launch is a compute
step like any other: it runs at once unless it touches memory that pending
stream work uses, and is queued behind that work otherwise.
"""
from __future__ import annotations

import numpy as np

from cupy import _engine

__all__ = ["RawModule", "RawKernel"]

#: the OpenCL device that modules created from now on compile for: "pocl" or "oclgrind"
OPENCL_DEVICE = "pocl"


def _opencl():
    import opencl  # tests/devsim/opencl.py, on sys.path beside this package

    return opencl


def _check_str(name: str, value) -> None:
    """CuPy's typed ``str`` arguments: anything else is a ``TypeError``."""
    if value is not None and not isinstance(value, str):
        raise TypeError(f"Argument '{name}' has incorrect type (expected str, got "
                        f"{type(value).__name__})")


class RawModule:
    """A module of kernels compiled from CUDA source (keyword-only ``code=``, as CuPy's)."""

    def __init__(self, *, code: str | None = None, path=None, options=(), backend="nvrtc",
                 translate_cucomplex=False, enable_cooperative_groups=False,
                 name_expressions=None, jitify=None):
        _check_str("code", code)
        if code is None:
            raise NotImplementedError("stand-in: RawModule(path=...) (a cubin) cannot run "
                                      "without a GPU; pass code=")
        device = OPENCL_DEVICE
        ok, why = _opencl().available(device)
        if not ok:
            raise _engine.CudaError(f"the device stand-in cannot run raw kernels on {device}: "
                                    f"{why}")
        self.code = code
        self._program = _opencl().Program(code, device=device)

    def get_function(self, name: str) -> "RawKernel":
        _check_str("name", name)
        kernel = RawKernel(self.code, name)
        kernel._module = self
        return kernel


class RawKernel:
    """Kernel ``name`` of CUDA source ``code``, compiled at its first launch, as CuPy's;
    call it as ``kernel(grid, block, args)`` with ``grid`` and ``block`` tuples."""

    def __init__(self, code: str, name: str, options=(), backend="nvrtc",
                 translate_cucomplex=False, *, enable_cooperative_groups=False, jitify=None):
        _check_str("code", code)
        _check_str("name", name)
        if code is None or name is None:
            raise TypeError("RawKernel: code and name are required strings")
        self.code, self.name = code, name
        self._module: RawModule | None = None

    @property
    def _compiled(self) -> RawModule:
        if self._module is None:
            self._module = RawModule(code=self.code)
        return self._module

    def __call__(self, grid, block, args, *, shared_mem=0, stream=None, enable_cooperative_groups=False):
        import cupy

        arrays = [a for a in args if isinstance(a, cupy.ndarray)]
        for i, a in enumerate(args):
            if isinstance(a, np.ndarray):
                raise TypeError(f"kernel {self.name}: argument {i} is a NumPy array; pass a "
                                f"device array (a host pointer would fault on the GPU)")
            if isinstance(a, cupy.ndarray) and not a._a.flags.c_contiguous:
                raise ValueError(f"kernel {self.name}: argument {i} is not C-contiguous; the "
                                 f"kernel would read it as if it were")
            if isinstance(a, (int, float)) and not isinstance(a, (np.generic, bool)):
                raise TypeError(f"kernel {self.name}: argument {i} is a Python "
                                f"{type(a).__name__}; pass a NumPy scalar of the C type")
        for what, dims in (("grid", grid), ("block", block)):
            if not isinstance(dims, tuple):  # CuPy's launch takes tuples only
                raise TypeError(f"Argument '{what}' has incorrect type (expected tuple, got "
                                f"{type(dims).__name__})")
        program, name = self._compiled._program, self.name

        def launch(*unwrapped):
            # an empty array is a null pointer the kernel never reads: OpenCL wants a buffer
            program.launch(name, grid, block,
                           [np.zeros(1, a.dtype) if isinstance(a, np.ndarray) and a.size == 0
                            else a for a in unwrapped])
        if program.device == "oclgrind":
            # Oclgrind faults when driven from a stream's worker thread: its launches wait for
            # the stream and run in the issuing thread (its checks are on memory, not timing)
            _engine.current_stream().synchronize()
        cupy._apply(launch, tuple(args), {}, f"kernel {name}", writes=tuple(arrays))
