"""What the stand-in and the real CuPy are compared on (plain data: no CuPy import here).

Both sides run in processes of their own: ``standin_side.py`` with the device
stand-in as ``cupy``, ``real_side.py`` with the real package. Each misuse case
is a statement run on each side (``stand-in``/``real`` code where the real call
needs a GPU to reach its check, such as a kernel launch); the outcome is
``"ok"`` or the exception's class (CUDA and NCCL errors by their CuPy name),
and the two must agree.
"""
from __future__ import annotations

#: modules whose public names the stand-in defines, as real CuPy spells their paths
MODULES = ("cupy", "cupy.cuda", "cupy.cuda.runtime", "cupy.cuda.nccl", "cupy.testing")

#: classes whose public methods and properties are compared (path in the real package)
CLASSES = ("cupy.ndarray", "cupy.RawModule", "cupy.RawKernel", "cupy.cuda.Device",
           "cupy.cuda.Stream", "cupy.cuda.Event", "cupy.cuda.MemoryPointer",
           "cupy.cuda.PinnedMemoryPointer", "cupy.cuda.nccl.NcclCommunicator")

#: names the stand-in has for the tests' sake, which real CuPy has not
STANDIN_ONLY = frozenset({
    "cupy.STANDIN", "cupy.HazardError", "cupy.cuda.nccl.ncclSuccess",
    "cupy.cuda.nccl.ncclUnhandledCudaError", "cupy.cuda.nccl.ncclSystemError",
    "cupy.cuda.nccl.ncclInternalError", "cupy.cuda.nccl.ncclInvalidArgument",
    "cupy.cuda.nccl.ncclInvalidUsage",
})

_SRC = 'extern "C" __global__ void f(float* x) { x[threadIdx.x] = 1.0f; }'
_LAUNCH = "cupy.RawKernel(SRC, 'f')({}, {}, (cupy.zeros(128, cupy.float32),))"

#: (case, stand-in statement, real statement or None for the same); ``cupy``, ``np``,
#: ``nccl`` and ``SRC`` (a one-kernel source) are in scope
ERROR_CASES = (
    ("RawModule(code) given positionally", "cupy.RawModule(SRC)", None),
    ("RawModule(code=) not a str", "cupy.RawModule(code=b'x')", None),
    ("RawKernel(module, name)", "cupy.RawKernel(cupy.RawModule(code=SRC), 'f')",
     "cupy.RawKernel(object(), 'f')"),
    ("RawKernel(code, name) of a str", "cupy.RawKernel(SRC, 'f')", None),
    ("launch with an int grid", _LAUNCH.format("4", "(32,)"),
     "FUNCTION(4, (32,), ())"),
    ("launch with a list grid", _LAUNCH.format("[4]", "(32,)"),
     "FUNCTION([4], (32,), ())"),
    ("launch with an int block", _LAUNCH.format("(4,)", "32"),
     "FUNCTION((4,), 32, ())"),
    ("launch with a list block", _LAUNCH.format("(4,)", "[32]"),
     "FUNCTION((4,), [32], ())"),
    ("sort kind='quicksort'", "cupy.sort(cupy.zeros(3, cupy.int32), kind='quicksort')",
     "cupy.ndarray._check_kind_sort('quicksort')"),
    ("argsort kind='mergesort'", "cupy.zeros(3, cupy.int32).argsort(kind='mergesort')",
     "cupy.ndarray._check_kind_sort('mergesort')"),
    ("sort kind='stable'", "cupy.sort(cupy.zeros(3, cupy.int32), kind='stable')",
     "cupy.ndarray._check_kind_sort('stable')"),
    ("unique id as bytearray", "nccl.NcclCommunicator(1, bytearray(128), 0)", None),
    ("unique id as a tuple (CuPy 14)", "nccl.NcclCommunicator(1, tuple(range(128)), 0)", None),
    ("unique id of 10 bytes", "nccl.NcclCommunicator(1, b'x' * 10, 0)", None),
    ("unique id type", "assert type(nccl.get_unique_id()) is bytes", None),
    ("unique id length", "assert len(nccl.get_unique_id()) == 128", None),
    ("negative count (allReduce)",
     "COMM.allReduce(0, 0, -1, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, 0)", None),
    ("negative count (send)", "COMM.send(0, -1, nccl.NCCL_FLOAT32, 0, 0)", None),
    ("negative count (recv)", "COMM.recv(0, -1, nccl.NCCL_FLOAT32, 0, 0)", None),
    ("get_current_stream(device_id=None)", "cupy.cuda.get_current_stream(device_id=None)", None),
    ("pinned memory size is a method",
     "assert callable(cupy.cuda.alloc_pinned_memory(8).size)",
     "assert callable(cupy.cuda.PinnedMemoryPointer.size)"),
    ("a NumPy name CuPy lacks (cupy.nanpercentile)", "cupy.nanpercentile", None),
    ("a NumPy name CuPy lacks (cupy.insert)", "cupy.insert", None),
    ("an ndarray method CuPy lacks (setflags)", "cupy.zeros(2).setflags",
     "cupy.ndarray.setflags"),
    ("getDeviceCount() without a GPU", "cupy.cuda.runtime.getDeviceCount()", None),
    ("is_available() without a GPU", "assert cupy.cuda.is_available() is False", None),
)
