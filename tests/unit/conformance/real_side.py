"""Run with the real CuPy (no stand-in on the path): answer what the other side asks.

Input (JSON on stdin): ``paths`` (dotted names to look up), ``kernels``
(``{key: CUDA source}``), ``archs`` (``["compute_80", ...]``). Output (JSON on
stdout): ``names`` (path -> exists, kind, signature and where it was read,
value), ``cases`` (misuse case -> outcome), ``kernels`` (key/arch -> ok, the
``.entry`` names of the PTX, the compiler log), and the versions. When the real
package cannot be imported: ``{"import_error": "..."}``.
"""
from __future__ import annotations

import importlib
import inspect
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import conformance_cases as cases  # noqa: E402

try:
    import cupy
    from cupy.cuda import nccl
    from cupy_backends.cuda.libs import nvrtc
except Exception as exc:  # noqa: BLE001 - reported to the test, which fails in CI
    json.dump({"import_error": f"{type(exc).__name__}: {exc}"}, sys.stdout)
    sys.exit(0)

if getattr(cupy, "STANDIN", False):
    json.dump({"import_error": f"the stand-in was imported as cupy ({cupy.__file__})"},
              sys.stdout)
    sys.exit(0)

#: CuPy's options for RawModule sources (cupy/cuda/compiler.py, CuPy 14), less the
#: architecture, which is pinned here because CuPy asks the GPU for it
CUPY_NVRTC_OPTIONS = ("-ftz=true", "--device-as-default-execution-space")
_ENTRY = re.compile(r"\.entry\s+(\w+)")


#: real objects whose instance attributes stand for their class's (CuPy sets ``ptr`` and
#: ``device_id`` in ``__init__``; only the singleton streams exist without a GPU)
_INSTANCES = {"cupy.cuda.Stream": "cupy.cuda.Stream.null"}


def _resolve(path: str):
    """The object at dotted ``path`` (a module, then attributes), or raise AttributeError."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise AttributeError(path)


def _from_inspect(obj) -> list | None:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    params = [p for p in sig.parameters.values() if p.name != "self"]
    kinds = {p.kind for p in params}
    if kinds <= {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD} and params:
        return None  # Cython's (*args, **kwargs): the docstring has the real one
    return [[p.name, p.kind.name, p.default is not inspect.Parameter.empty] for p in params]


def _split_top(text: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur)
    return out


def _from_doc(doc: str | None, name: str) -> list | None:
    """Cython's embedded signature: the docstring's first line ``name(params) -> type``."""
    if not doc:
        return None
    first = doc.strip().splitlines()[0]
    m = re.match(r"^[\w.]*?" + re.escape(name) + r"\((.*)\)(\s*->.*)?$", first)
    if not m:
        return None
    params, kind = [], "POSITIONAL_OR_KEYWORD"
    for raw in _split_top(m.group(1)):
        item = raw.strip().replace("\\*", "*")
        if item in ("self", ""):
            continue
        if item == "/":
            params = [[n, "POSITIONAL_ONLY", d] for n, _, d in params]
            continue
        if item == "*":
            kind = "KEYWORD_ONLY"
            continue
        if item.startswith("**"):
            params.append([item[2:], "VAR_KEYWORD", False])
            continue
        if item.startswith("*"):
            params.append([item[1:], "VAR_POSITIONAL", False])
            kind = "KEYWORD_ONLY"
            continue
        left, has_default = (item.split("=", 1)[0], True) if "=" in item else (item, False)
        pname = left.split()[-1]
        if pname == "self":
            continue
        params.append([pname, kind, has_default])
    return params


def describe(path: str) -> dict:
    owner_path, name = path.rsplit(".", 1)
    try:
        obj = _resolve(path)
    except AttributeError:
        if owner_path not in _INSTANCES:
            return {"exists": False}
        try:
            obj = getattr(_resolve(_INSTANCES[owner_path]), name)
        except AttributeError:
            return {"exists": False}
    out = {"exists": True, "callable": callable(obj)}
    if isinstance(obj, (int, float, str)) and not isinstance(obj, bool):
        out["value"] = obj
    target, doc_name = obj, name
    if name == "__init__":
        cls = _resolve(owner_path)
        target, doc, doc_name = cls, cls.__doc__, owner_path.rsplit(".", 1)[1]
    elif isinstance(obj, type):
        doc = obj.__doc__
    else:
        doc = getattr(obj, "__doc__", None)
    if callable(obj) or name == "__init__":
        sig = None if isinstance(target, type) else _from_inspect(target)
        if sig is not None:
            out["sig"], out["sig_from"] = sig, "inspect"
        else:
            sig = _from_doc(doc, doc_name)
            if sig is not None:
                out["sig"], out["sig_from"] = sig, "docstring"
    return out


def outcome(exc: BaseException | None) -> str:
    from cupy_backends.cuda.api.runtime import CUDARuntimeError

    if exc is None:
        return "ok"
    if isinstance(exc, CUDARuntimeError):
        return "CUDARuntimeError"
    if isinstance(exc, nccl.NcclError):
        return "NcclError"
    return type(exc).__name__


def run_cases() -> dict:
    import numpy as np
    from cupy.cuda import function

    scope = {"cupy": cupy, "np": np, "nccl": nccl, "SRC": cases._SRC,
             # a communicator and a kernel function that never reached NCCL or the GPU: the
             # argument checks run before either is needed
             "COMM": nccl.NcclCommunicator.__new__(nccl.NcclCommunicator),
             "FUNCTION": function.Function.__new__(function.Function)}
    out = {}
    for name, standin, real in cases.ERROR_CASES:
        try:
            exec(real or standin, dict(scope))  # noqa: S102 - this package's own cases
            out[name] = outcome(None)
        except Exception as exc:  # noqa: BLE001 - the outcome is what is compared
            out[name] = outcome(exc)
    return out


def compile_kernel(source: str, arch: str) -> dict:
    prog = nvrtc.createProgram(source, "neocomm_kernels.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, [*CUPY_NVRTC_OPTIONS, f"--gpu-architecture={arch}"])
        except Exception as exc:  # noqa: BLE001 - the log says why
            return {"ok": False, "log": f"{exc}\n{nvrtc.getProgramLog(prog)}"}
        ptx = nvrtc.getPTX(prog)
        ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
        return {"ok": True, "entries": sorted(set(_ENTRY.findall(ptx))),
                "log": nvrtc.getProgramLog(prog)}
    finally:
        nvrtc.destroyProgram(prog)


def main() -> None:
    request = json.load(sys.stdin)
    from concurrent.futures import ThreadPoolExecutor

    jobs = [(key, arch) for key in request["kernels"] for arch in request["archs"]]
    with ThreadPoolExecutor(max_workers=int(request.get("threads", 2))) as pool:
        compiled = list(pool.map(lambda ka: compile_kernel(request["kernels"][ka[0]], ka[1]),
                                 jobs))
    json.dump({
        "cupy": cupy.__version__, "cupy_file": cupy.__file__,
        "nccl_version": int(nccl.get_version()), "nvrtc_version": list(nvrtc.getVersion()),
        "names": {p: describe(p) for p in request["paths"]},
        "cases": run_cases(),
        "kernels": {f"{k}@{a}": r for (k, a), r in zip(jobs, compiled)},
    }, sys.stdout)


if __name__ == "__main__":
    main()
