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


class RawModule:
    """A module of kernels compiled from CUDA source (``code=``)."""

    def __init__(self, code: str | None = None, *, path=None, options=(), backend="nvrtc",
                 translate_cucomplex=False, name_expressions=None, jitify=False):
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
        return RawKernel(self, name)


class RawKernel:
    """One kernel of a :class:`RawModule`; call it as ``kernel(grid, block, args)``."""

    def __init__(self, module: RawModule, name: str):
        self.module, self.name = module, name

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
        grid = tuple(grid) if isinstance(grid, tuple) else (int(grid),)
        block = tuple(block) if isinstance(block, tuple) else (int(block),)
        program, name = self.module._program, self.name

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
