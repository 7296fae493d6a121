"""``neocomm info``'s NCCL and NVRTC lines: what loaded, from where, or why not.

The real libraries are checked in ``tests/unit/test_cupy_conformance.py`` (a
process of its own); here CuPy's modules are replaced so each branch is seen.
"""
from __future__ import annotations

import sys
import types
import warnings

import pytest

from neocomm import cuda_libs
from neocomm.cuda_libs import LibraryState, loaded_path, nccl_state, nvrtc_state


def _fake_cupy(monkeypatch, nccl):
    cupy = types.ModuleType("cupy")
    cuda = types.ModuleType("cupy.cuda")
    cupy.cuda, cuda.nccl = cuda, nccl
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cuda)
    monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", nccl)


def test_describe_names_version_and_file_or_the_reason():
    assert LibraryState("nccl", True, "2.32.3", "/x/libnccl.so.2").describe() == \
        "2.32.3 (/x/libnccl.so.2)"
    assert LibraryState("nccl", False, reason="no libnccl").describe() == \
        "not available: no libnccl"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_loaded_path_finds_a_mapped_library_by_its_name():
    path = loaded_path("libc")
    assert path is not None and "/libc.so" in path, path
    assert loaded_path("libneocomm-no-such-library") is None


def test_nccl_unavailable_gives_cupys_reason(monkeypatch):
    nccl = types.ModuleType("cupy.cuda.nccl")
    nccl.available = False

    def warn_on_import():
        warnings.warn("\nnccl library could not be loaded.\n\nReason: ImportError (libnccl.so.2: "
                      "cannot open shared object file)\n")

    _fake_cupy(monkeypatch, nccl)
    real_import = __import__

    def importing(name, *args, **kwargs):
        if name == "cupy.cuda":
            warn_on_import()
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr("builtins.__import__", importing)
    state = nccl_state()
    assert not state.available
    assert state.reason.startswith("ImportError (libnccl.so.2: cannot open shared object file)")
    assert "nvidia-nccl-cu12" in state.reason


def test_nccl_version_code_is_shown_as_a_version(monkeypatch):
    nccl = types.ModuleType("cupy.cuda.nccl")
    nccl.available = True
    nccl.get_version = lambda: 23203
    _fake_cupy(monkeypatch, nccl)
    monkeypatch.setattr(cuda_libs, "loaded_path", lambda stem: f"/lib/{stem}.so.2")
    state = nccl_state()
    assert state.available and state.version == "2.32.3" and state.path == "/lib/libnccl.so.2"


def test_nccl_without_cupy_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)
    state = nccl_state()
    assert not state.available and "neocomm[gpu]" in state.reason


def test_nvrtc_that_fails_to_compile_is_not_available(monkeypatch):
    libs = types.ModuleType("cupy_backends.cuda.libs")
    nvrtc = types.ModuleType("cupy_backends.cuda.libs.nvrtc")
    nvrtc.getVersion = lambda: (12, 9)

    def create(*args):
        raise RuntimeError("NVRTC_ERROR_BUILTIN_OPERATION_FAILURE")

    nvrtc.createProgram = create
    libs.nvrtc = nvrtc
    for name, mod in (("cupy_backends", types.ModuleType("cupy_backends")),
                      ("cupy_backends.cuda", types.ModuleType("cupy_backends.cuda")),
                      ("cupy_backends.cuda.libs", libs),
                      ("cupy_backends.cuda.libs.nvrtc", nvrtc)):
        monkeypatch.setitem(sys.modules, name, mod)
    sys.modules["cupy_backends"].cuda = sys.modules["cupy_backends.cuda"]
    sys.modules["cupy_backends.cuda"].libs = libs
    state = nvrtc_state()
    assert not state.available
    assert "NVRTC_ERROR_BUILTIN_OPERATION_FAILURE" in state.reason
