"""Run with the device stand-in as ``cupy``: print its surface and the misuse cases' outcomes.

Output (JSON on stdout): ``names`` (dotted path -> kind, signature, value) of
every public name of :data:`cases.MODULES` and :data:`cases.CLASSES`, the
NumPy names it serves (``allow``), and ``cases`` (case -> outcome).
"""
from __future__ import annotations

import inspect
import json
import os
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "devsim"))

import conformance_cases as cases  # noqa: E402
import cupy  # noqa: E402

assert getattr(cupy, "STANDIN", False), f"not the stand-in: {cupy.__file__}"
from cupy._names import FUNCTIONS, NDARRAY_ATTRIBUTES  # noqa: E402
from cupy.cuda import nccl  # noqa: E402


def signature(obj) -> list | None:
    """``[[name, kind, has_default], ...]`` without ``self``; None when not inspectable."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    return [[p.name, p.kind.name, p.default is not inspect.Parameter.empty]
            for p in sig.parameters.values() if p.name != "self"]


def describe(obj) -> dict:
    if isinstance(obj, type):
        return {"kind": "class", "sig": signature(obj.__init__)
                if "__init__" in vars(obj) else None}
    if callable(obj):
        return {"kind": "function", "sig": signature(obj)}
    if isinstance(obj, bool) or not isinstance(obj, (int, float, str)):
        return {"kind": "value"}
    return {"kind": "value", "value": obj}


def surface() -> dict:
    names: dict = {}
    for path in cases.MODULES:
        mod = sys.modules[path] if path in sys.modules else __import__(path, fromlist=["x"])
        for name, obj in vars(mod).items():
            if name.startswith("_") or isinstance(obj, types.ModuleType) or name == "annotations":
                continue
            if isinstance(obj, type) and issubclass(obj, BaseException) and \
                    obj.__module__.startswith("builtins"):
                continue
            names[f"{path}.{name}"] = describe(obj)
    for path in cases.CLASSES:
        mod_path, cls_name = path.rsplit(".", 1)
        cls = getattr(__import__(mod_path, fromlist=["x"]), cls_name)
        for name, obj in vars(cls).items():
            if name.startswith("_") and name not in ("__init__", "__call__", "__enter__",
                                                      "__exit__"):
                continue
            if isinstance(obj, property):
                names[f"{path}.{name}"] = {"kind": "property"}
            elif isinstance(obj, (staticmethod, classmethod)):
                names[f"{path}.{name}"] = {"kind": "function", "sig": signature(obj.__func__)}
            elif callable(obj):
                names[f"{path}.{name}"] = {"kind": "function", "sig": signature(obj)}
            else:
                names[f"{path}.{name}"] = describe(obj)
    return names


def outcome(exc: BaseException | None) -> str:
    if exc is None:
        return "ok"
    if isinstance(exc, cupy.cuda.runtime.CUDARuntimeError):
        return "CUDARuntimeError"
    if isinstance(exc, nccl.NcclError):
        return "NcclError"
    return type(exc).__name__


def run_cases() -> dict:
    import numpy as np

    comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    scope = {"cupy": cupy, "np": np, "nccl": nccl, "SRC": cases._SRC, "COMM": comm}
    out = {}
    for name, standin, _real in cases.ERROR_CASES:
        no_gpu = "without a GPU" in name
        saved = os.environ.get("DEVSIM_DEVICES")
        if no_gpu:
            os.environ["DEVSIM_DEVICES"] = "0"
        try:
            exec(standin, dict(scope))  # noqa: S102 - the cases are this package's own code
            out[name] = outcome(None)
        except Exception as exc:  # noqa: BLE001 - the outcome is what is compared
            out[name] = outcome(exc)
        finally:
            if no_gpu:
                if saved is None:
                    del os.environ["DEVSIM_DEVICES"]
                else:
                    os.environ["DEVSIM_DEVICES"] = saved
    comm.destroy()
    return out


if __name__ == "__main__":
    json.dump({"version": cupy.__version__, "names": surface(), "cases": run_cases(),
               "allow": {"functions": sorted(FUNCTIONS), "ndarray": sorted(NDARRAY_ATTRIBUTES)}},
              sys.stdout)
