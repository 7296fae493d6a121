"""``neocomm info``: versions, MPI library, backends and why not, settings."""
from __future__ import annotations

import argparse
import json
import platform
import sys
import warnings


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


def collect() -> dict:
    """Everything ``neocomm info`` reports, as a JSON-able dict."""
    import numpy

    import neocomm
    from neocomm import config
    from neocomm.backends import availability

    out: dict = {"neocomm": neocomm.__version__, "python": platform.python_version(),
                 "numpy": numpy.__version__}
    try:
        import mpi4py
        from mpi4py import MPI

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
    try:
        from neocomm.launcher import find_launcher

        out["launcher"] = find_launcher().path
    except Exception as exc:  # noqa: BLE001
        out["launcher"] = f"missing: {exc}"
    out["backends"] = {k.value: ("available" if ok else f"unavailable: {why}")
                       for k, (ok, why) in availability().items()}
    from collectives import symmetric

    ok, where = symmetric.availability()
    out["symmetric_memory"] = f"{'available' if ok else 'unavailable'}: {where}"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        values = config.settings()
    out["unknown_settings"] = [str(w.message) for w in caught]
    out["settings"] = {s.env + ("<OP>" if s.prefix else ""): {
        "value": values.get(s.name, s.default), "default": s.default, "unit": s.unit,
        "help": s.help} for s in config.table()}
    return out


def run(args) -> int:
    info = collect()
    if args.json:
        json.dump(info, sys.stdout, indent=1, default=str)
        print()
        return 0
    for key in ("neocomm", "python", "numpy", "mpi4py", "mpi_library", "mpi_standard", "cupy",
                "launcher"):
        if key in info:
            print(f"{key:<13} {info[key]}")
    print("\nbackends")
    for name, state in info["backends"].items():
        print(f"  {name:<8} {state}")
    print(f"\nsymmetric memory (host collectives): {info['symmetric_memory']}")
    print("\nsettings (NEOCOMM_*; value, default, unit)")
    for env, s in info["settings"].items():
        mark = "" if s["value"] == s["default"] else "  (set)"
        unit = f" {s['unit']}" if s["unit"] else ""
        print(f"  {env:<28} {s['value']!s:<10}{unit}{mark}\n      {s['help']}")
    for msg in info["unknown_settings"]:
        print(f"warning: {msg}", file=sys.stderr)
    return 0
