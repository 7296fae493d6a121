"""``neocomm info``: versions, MPI library, the NCCL and NVRTC CuPy loads, backends and why
not, settings."""
from __future__ import annotations

import argparse
import json
import platform
import sys
import warnings

__all__ = ["HELP", "INFO_GROUP", "add_arguments", "run", "collect", "contributions"]

HELP = "versions, MPI library, NCCL and NVRTC loaded, backends available and why not, settings"
#: entry-point group of the lines packages above the core add to the report
INFO_GROUP = "neocomm.info"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


def contributions() -> dict[str, tuple[str, str]]:
    """``{key: (title, state)}`` from the packages above the core.

    A package adds a line by registering, in the ``neocomm.info`` entry-point
    group, a function that returns ``(title, state)``; the entry's name is
    the key in ``--json``. One that cannot load or fails says so in its state.
    """
    from importlib.metadata import entry_points

    out: dict[str, tuple[str, str]] = {}
    for ep in entry_points(group=INFO_GROUP):
        try:
            title, state = ep.load()()
        except Exception as exc:  # noqa: BLE001 - a broken plug-in must not stop the report
            title, state = ep.name, f"unknown: {ep.value} failed: {type(exc).__name__}: {exc}"
        out.setdefault(ep.name, (str(title), str(state)))
    return out


def collect() -> dict:
    """Everything ``neocomm info`` reports, as a JSON-able dict."""
    return _collect()[0]


def _collect() -> tuple[dict, dict[str, str]]:
    """The report and the titles of the contributed lines (by key)."""
    import numpy

    import neocomm
    from neocomm import config
    from neocomm.backends import availability

    out: dict = {"neocomm": neocomm.__version__, "python": platform.python_version(),
                 "numpy": numpy.__version__}
    try:
        import mpi4py

        from neocomm.mpistart import mpi

        MPI = mpi()  # started as the runtime starts it (a singleton leaves no segment behind)
        out["mpi4py"] = mpi4py.__version__
        out["mpi_library"] = MPI.Get_library_version().strip().splitlines()[0]
        out["mpi_standard"] = "%d.%d" % MPI.Get_version()
    except ImportError as exc:
        out["mpi4py"] = f"not importable: {exc}"
    try:
        import cupy

        out["cupy"] = cupy.__version__
    except ImportError:
        out["cupy"] = "not installed"
    from neocomm.cuda_libs import cuda_headers, nccl_state, nvrtc_state

    out["nccl"] = nccl_state().describe()
    out["nvrtc"] = nvrtc_state().describe()
    out["cuda_headers"] = cuda_headers()
    try:
        from neocomm.launcher import find_launcher

        out["launcher"] = find_launcher().path
    except Exception as exc:  # noqa: BLE001
        out["launcher"] = f"missing: {exc}"
    out["backends"] = {k.value: ("available" if ok else f"unavailable: {why}")
                       for k, (ok, why) in availability().items()}
    extra = {k: v for k, v in contributions().items() if k not in out}
    for key, (_title, state) in extra.items():
        out[key] = state
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        values = config.settings()
    out["unknown_settings"] = [str(w.message) for w in caught]
    out["settings"] = {s.env + ("<OP>" if s.prefix else ""): {
        "value": values.get(s.name, s.default), "default": s.default, "unit": s.unit,
        "help": s.help} for s in config.table()}
    return out, {key: title for key, (title, _state) in extra.items()}


def run(args) -> int:
    info, titles = _collect()
    if args.json:
        json.dump(info, sys.stdout, indent=1, default=str)
        print()
        return 0
    for key in ("neocomm", "python", "numpy", "mpi4py", "mpi_library", "mpi_standard", "cupy",
                "nccl", "nvrtc", "cuda_headers", "launcher"):
        if key in info:
            print(f"{key:<13} {info[key]}")
    print("\nbackends")
    for name, state in info["backends"].items():
        print(f"  {name:<8} {state}")
    for key, title in titles.items():
        print(f"\n{title}: {info[key]}")
    print("\nsettings (NEOCOMM_*; value, default, unit)")
    for env, s in info["settings"].items():
        mark = "" if s["value"] == s["default"] else "  (set)"
        unit = f" {s['unit']}" if s["unit"] else ""
        print(f"  {env:<28} {s['value']!s:<10}{unit}{mark}\n      {s['help']}")
    for msg in info["unknown_settings"]:
        print(f"warning: {msg}", file=sys.stderr)
    return 0
