"""The device stand-in and the project hold to the real CuPy, NCCL and NVRTC (no GPU needed).

Every CuPy and NCCL name the stand-in (``tests/devsim``) defines or serves
from NumPy, and every one the project's code (``neocomm``, ``collectives``,
``embedding``, ``topology``) reaches through ``cupy``, must exist in the real
package; functions must take the same parameters (positional or keyword-only,
read with ``inspect`` or from Cython's embedded signature), NCCL's constants
must have the same values, each misuse the stand-in models must raise the same
exception type, and every kernel variant of the project must compile with the
NVRTC CuPy uses (for ``compute_80`` and ``compute_90``: CuPy's own helper asks
the GPU which architecture it is).

The real package and the stand-in are each imported in a process of their own
(``tests/unit/conformance/``): the stand-in takes the name ``cupy`` in the
processes that run the device tests, so the two never meet. The test extra
installs the real wheels; where they cannot be imported the tests fail when
``CI`` is set and skip elsewhere.
"""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SIDES = ROOT / "tests" / "unit" / "conformance"
DEVSIM = ROOT / "tests" / "devsim"
sys.path.insert(0, str(SIDES))

import conformance_cases as cases  # noqa: E402

#: the architectures every kernel variant compiles for (A100, H100)
ARCHS = ("compute_80", "compute_90")
#: parameters whose kind the docstring misstates, and the case that shows the real kind
DOC_KIND_PROVED = {("cupy.RawModule.__init__", "code"): "RawModule(code) given positionally",
                   ("cupy.RawModule", "code"): "RawModule(code) given positionally"}
#: classes whose objects CuPy hands out (``ndarray.data``, ``alloc_pinned_memory``) and the
#: stand-in builds its own way: their names and methods are compared, their constructors
#: not, and the project must not construct them
HANDED_OUT = ("cupy.cuda.MemoryPointer", "cupy.cuda.PinnedMemoryPointer")
_PROJECT = ("neocomm", "collectives", "embedding", "topology")


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _env(standin: bool) -> dict:
    """This process's environment for a side: the stand-in on the path only if asked."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEVSIM")}
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
             if p and Path(p).resolve() != DEVSIM.resolve()]
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *parts])
    if standin:
        env["DEVSIM"] = "1"
    return env


def _run(script: str, standin: bool, stdin: str = "", timeout: int = 600) -> dict:
    proc = subprocess.run([sys.executable, str(SIDES / script)], input=stdin, text=True,
                          capture_output=True, cwd=ROOT, env=_env(standin), timeout=timeout)
    assert proc.returncode == 0, f"{script} failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout)


# -- what the project reaches through cupy --------------------------------------------------

#: attributes of ``self`` that hold a module: the array module, CuPy, its NCCL
_SELF_MODULES = {"_cupy": "cupy", "_nccl": "cupy.cuda.nccl", "xp": "cupy", "_xp": "cupy"}


def _returns_cupy(fn: ast.FunctionDef) -> bool:
    """``def _cp(): import cupy; return cupy`` (the lazy import helpers)."""
    body = [n for n in fn.body if not isinstance(n, ast.Expr)]
    return (len(body) == 2 and isinstance(body[0], ast.Import)
            and [a.name for a in body[0].names] == ["cupy"]
            and isinstance(body[1], ast.Return) and isinstance(body[1].value, ast.Name))


def _chain(node: ast.AST, aliases: dict, helpers: set) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    dunder = [i for i, part in enumerate(reversed(parts)) if part.startswith("__")]
    if dunder:  # ``cupy.__version__.split``: the chain leaves CuPy at its first dunder
        parts = list(reversed(list(reversed(parts))[:dunder[0] + 1]))
    if isinstance(node, ast.Name) and node.id in aliases:
        root = aliases[node.id]
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
            and node.func.id in helpers and not node.args:
        root = "cupy"
    else:
        return None
    return ".".join([root, *reversed(parts)])


def _self_chain(node: ast.Attribute) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id == "self" and len(parts) >= 2 \
            and parts[-1] in _SELF_MODULES:
        return ".".join([_SELF_MODULES[parts[-1]], *reversed(parts[:-1])])
    return None


def project_names() -> dict[str, list[str]]:
    """``{dotted cupy path: [file:line, ...]}`` of every attribute chain the project's code
    takes from ``cupy`` (its imports, ``cp = _cp()`` helpers, ``xp``/``self._cupy``...)."""
    found: dict[str, list[str]] = {}
    for package in _PROJECT:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            aliases: dict[str, str] = {}
            helpers = {fn.name for fn in ast.walk(tree)
                       if isinstance(fn, ast.FunctionDef) and _returns_cupy(fn)}
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    for a in node.names:
                        if a.name.split(".")[0] == "cupy":
                            aliases[a.asname or a.name.split(".")[0]] = \
                                a.name if a.asname else "cupy"
                elif isinstance(node, ast.ImportFrom) and node.module and \
                        node.module.split(".")[0] == "cupy":
                    for a in node.names:
                        aliases[a.asname or a.name] = f"{node.module}.{a.name}"
                        found.setdefault(f"{node.module}.{a.name}", []).append(
                            f"{path.relative_to(ROOT)}:{node.lineno}")
                elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and \
                        isinstance(node.value.func, ast.Name) and node.value.func.id in helpers:
                    for t in node.targets:
                        if isinstance(t, ast.Name):
                            aliases[t.id] = "cupy"
            if "xp" not in aliases and any(isinstance(n, ast.Name) and n.id == "xp"
                                           for n in ast.walk(tree)):
                aliases["xp"] = "cupy"  # the array module: CuPy on the device paths
            seen_inner: set[int] = set()
            for node in ast.walk(tree):
                if not isinstance(node, ast.Attribute) or id(node) in seen_inner:
                    continue
                inner = node.value
                while isinstance(inner, ast.Attribute):
                    seen_inner.add(id(inner))
                    inner = inner.value
                name = _chain(node, aliases, helpers) or _self_chain(node)
                if name and name != "cupy":
                    found.setdefault(name, []).append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def kernel_sources() -> dict[str, tuple[str, tuple[str, ...]]]:
    """``{variant: (CUDA source, kernel names the project launches from it)}``: every
    (weight dtype, state dtype, wire format) :func:`source_for` accepts, and the id probe."""
    sys.path.insert(0, str(ROOT))
    from embedding.kernels.cuda_src import KERNEL_NAMES, WIRE_FORMATS, source_for
    from embedding.kernels.idmap import PROBE_SOURCE

    out: dict = {}
    seen: set[str] = set()
    for dtype in ("float32", "float64", "float16", "bfloat16"):
        for state in (None, "float32", "float64", "float16", "bfloat16"):
            for wire in (None, *WIRE_FORMATS):
                try:
                    src = source_for(dtype, state, wire)
                except ValueError:
                    continue  # a combination the kernels refuse (half state of float64)
                if src not in seen:
                    seen.add(src)
                    out[f"{dtype}/state={state}/wire={wire}"] = (src, KERNEL_NAMES)
    out["idmap.id_probe"] = (PROBE_SOURCE, ("id_probe",))
    return out


# -- the two sides ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sides():
    standin = _run("standin_side.py", standin=True)
    project = project_names()
    kernels = kernel_sources()
    standin_paths = [p for p in standin["names"] if p not in cases.STANDIN_ONLY]
    allow = [f"cupy.{n}" for n in standin["allow"]["functions"]] + \
        [f"cupy.ndarray.{n}" for n in standin["allow"]["ndarray"]]
    from neocomm.backends import nccl as nccl_backend

    constants = {f"cupy.cuda.nccl.NCCL_{name.upper()}": code
                 for name, code in nccl_backend._NCCL_DTYPES.items()}
    constants.update({f"cupy.cuda.nccl.NCCL_{op.name}": code
                      for op, code in nccl_backend._NCCL_OPS.items()})
    request = {"paths": sorted(set(standin_paths) | set(allow) | set(project) | set(constants)),
               "kernels": {k: src for k, (src, _) in kernels.items()}, "archs": list(ARCHS),
               "threads": 2}
    real = _run("real_side.py", standin=False, stdin=json.dumps(request))
    if "import_error" in real:
        reason = f"the real CuPy cannot be imported: {real['import_error']}"
        if _in_ci():
            pytest.fail(f"{reason} (the test extra installs cupy-cuda12x, nvidia-nccl-cu12 "
                        f"and nvidia-cuda-nvrtc-cu12; in CI this must run)")
        pytest.skip(reason)
    return {"standin": standin, "real": real, "project": project, "kernels": kernels,
            "standin_paths": standin_paths, "allow": allow, "constants": constants}


def _report(record_property, **counts) -> None:
    record_property("conformance", ", ".join(f"{k} {v}" for k, v in counts.items()))


def test_every_name_exists_in_real_cupy(sides, record_property):
    real = sides["real"]["names"]
    missing = [f"stand-in {p}" for p in sides["standin_paths"] if not real[p]["exists"]]
    missing += [f"stand-in serves {p} from NumPy" for p in sides["allow"]
                if not real[p]["exists"]]
    missing += [f"project {p} at {', '.join(where[:3])}" for p, where in
                sorted(sides["project"].items()) if not real[p]["exists"]]
    _report(record_property, **{"stand-in names": len(sides["standin_paths"]),
                                "NumPy names served": len(sides["allow"]),
                                "project names": len(sides["project"])})
    assert not missing, f"not in CuPy {sides['real']['cupy']}:\n" + "\n".join(missing)


def _kind(k: str) -> str:
    return {"POSITIONAL_ONLY": "positional", "POSITIONAL_OR_KEYWORD": "positional",
            "KEYWORD_ONLY": "keyword-only"}.get(k, k)


def compare_signatures(path: str, mine: list, theirs: list) -> list[str]:
    """How the stand-in's parameters differ from the real ones (empty: they agree)."""
    problems = []
    real = {n: (k, d) for n, k, d in theirs}
    takes_kwargs = any(k == "VAR_KEYWORD" for _, k, _ in theirs)
    takes_args = any(k == "VAR_POSITIONAL" for _, k, _ in theirs)
    for name, kind, _default in mine:
        if kind in ("VAR_POSITIONAL", "VAR_KEYWORD"):
            continue
        if name not in real:
            if not (takes_kwargs and kind == "KEYWORD_ONLY"):
                problems.append(f"{path}: parameter {name!r} is not in the real signature")
            continue
        if _kind(kind) != _kind(real[name][0]) and (path, name) not in DOC_KIND_PROVED:
            problems.append(f"{path}: {name!r} is {_kind(kind)} in the stand-in, "
                            f"{_kind(real[name][0])} in CuPy")
    mine_pos = [n for n, k, _ in mine if _kind(k) == "positional"
                and (path, n) not in DOC_KIND_PROVED]
    real_pos = [n for n, k, _ in theirs if _kind(k) == "positional"
                and (path, n) not in DOC_KIND_PROVED]
    if mine_pos != real_pos[:len(mine_pos)] and not takes_args:
        problems.append(f"{path}: positional order {mine_pos} != CuPy's {real_pos}")
    names = {n for n, _, _ in mine}
    takes_all = any(k == "VAR_KEYWORD" for _, k, _ in mine)
    for name, (kind, default) in real.items():
        if kind not in ("VAR_POSITIONAL", "VAR_KEYWORD") and not default \
                and name not in names and not takes_all:
            problems.append(f"{path}: CuPy requires {name!r}, the stand-in lacks it")
    return problems


def test_signatures_match_real_cupy(sides, record_property):
    real = sides["real"]["names"]
    problems, compared, unreadable = [], 0, []
    for path in sides["standin_paths"]:
        mine = sides["standin"]["names"][path].get("sig")
        theirs = real[path].get("sig")
        if mine is None or not real[path]["exists"]:
            continue
        if path in HANDED_OUT or path in {f"{c}.__init__" for c in HANDED_OUT}:
            continue
        if theirs is None:
            unreadable.append(path)
            continue
        compared += 1
        problems += compare_signatures(path, mine, theirs)
    constructed = [f"{p} at {', '.join(w[:3])}" for p, w in sides["project"].items()
                   if p in HANDED_OUT]
    assert not constructed, f"the project constructs what CuPy hands out: {constructed}"
    _report(record_property, **{"signatures compared": compared,
                                "without a readable real signature": len(unreadable)})
    assert compared >= 40, f"only {compared} signatures compared"
    assert not problems, "\n".join(problems)


def test_nccl_constants_match_real_nccl(sides, record_property):
    real = sides["real"]["names"]
    wrong, checked = [], 0
    for path in sides["standin_paths"]:
        value = sides["standin"]["names"][path].get("value")
        if path.startswith("cupy.cuda.nccl.") and isinstance(value, int):
            checked += 1
            if real[path].get("value") != value:
                wrong.append(f"stand-in {path} = {value}, CuPy: {real[path].get('value')}")
    for path, value in sides["constants"].items():
        checked += 1
        if real[path].get("value") != value:
            wrong.append(f"neocomm.backends.nccl: {path} = {value}, CuPy: "
                         f"{real[path].get('value')}")
    _report(record_property, **{"NCCL constants": checked})
    assert checked >= 25 and not wrong, "\n".join(wrong)


def test_misuse_raises_what_real_cupy_raises(sides, record_property):
    mine, theirs = sides["standin"]["cases"], sides["real"]["cases"]
    differ = [f"{case}: stand-in {mine[case]}, CuPy {theirs[case]}"
              for case, _, _ in cases.ERROR_CASES if mine[case] != theirs[case]]
    _report(record_property, **{"misuse cases": len(cases.ERROR_CASES)})
    assert not differ, "\n".join(differ)
    # the cases are misuses: most must raise (a case that passed on both proves nothing alone)
    assert sum(v != "ok" for v in theirs.values()) >= len(theirs) - 6


def test_every_kernel_variant_compiles_with_real_nvrtc(sides, record_property):
    compiled = sides["real"]["kernels"]
    failed = []
    for key, (_src, names) in sides["kernels"].items():
        for arch in ARCHS:
            result = compiled[f"{key}@{arch}"]
            if not result["ok"]:
                failed.append(f"{key} for {arch}:\n{result['log'][-3000:]}")
            elif not set(names) <= set(result["entries"]):
                lost = sorted(set(names) - set(result["entries"]))
                failed.append(f"{key} for {arch}: kernels {lost} are not in the PTX "
                              f"({result['entries']})")
    nvrtc = ".".join(map(str, sides["real"]["nvrtc_version"]))
    _report(record_property, **{"kernel variants": len(sides["kernels"]),
                                "compiles": len(sides["kernels"]) * len(ARCHS),
                                f"NVRTC {nvrtc} archs": "/".join(ARCHS)})
    assert len(sides["kernels"]) >= 30
    assert not failed, "\n\n".join(failed)


def test_info_names_the_nccl_and_nvrtc_real_cupy_loads(sides):
    proc = subprocess.run([sys.executable, "-m", "neocomm", "info", "--json"], text=True,
                          capture_output=True, cwd=ROOT, env=_env(standin=False), timeout=300)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    from neocomm.backends.nccl import version_text

    want = version_text(sides["real"]["nccl_version"])
    assert info["cupy"] == sides["real"]["cupy"]
    assert info["nccl"].startswith(f"{want} ("), info["nccl"]
    nccl_file = info["nccl"][len(want) + 2:-1]
    assert Path(nccl_file).is_file() and "libnccl" in nccl_file, info["nccl"]
    major, minor = sides["real"]["nvrtc_version"]
    assert info["nvrtc"].startswith(f"{major}.{minor} ("), info["nvrtc"]
    assert "libnvrtc" in info["nvrtc"], info["nvrtc"]


def test_device_tests_take_the_standin_when_no_gpu_even_with_real_cupy(sides):
    """The device tests decide by the GPU, not by whether CuPy imports."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import activate; "
            "gpus = activate.driver_devices(); used = activate.use_standin(); import cupy; "
            "print(gpus, used, bool(getattr(cupy, 'STANDIN', False)), "
            "'cupy_backends' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code, str(DEVSIM)], text=True,
                          capture_output=True, cwd=ROOT, env=_env(standin=False), timeout=300)
    assert proc.returncode == 0, proc.stderr
    gpus, used, is_standin, real_loaded = proc.stdout.split()
    if int(gpus) > 0:
        pytest.skip(f"this machine has {gpus} GPU(s): the device tests run on them")
    assert (used, is_standin) == ("True", "True"), proc.stdout
    assert real_loaded == "False", "the real CuPy was imported only to find no GPU"


def test_signature_comparison_sees_each_kind_of_difference():
    """The comparison itself (no CuPy needed): what it must catch, and what it must let be."""
    real = [["code", "POSITIONAL_OR_KEYWORD", False], ["name", "POSITIONAL_OR_KEYWORD", False],
            ["options", "POSITIONAL_OR_KEYWORD", True], ["jitify", "KEYWORD_ONLY", True]]
    assert compare_signatures("f", real, real) == []
    assert compare_signatures("f", real[:2], real) == []  # optional ones may be left out
    kw_code = [["code", "KEYWORD_ONLY", True], *real[1:]]
    assert any("keyword-only in the stand-in" in p for p in compare_signatures("f", kw_code, real))
    swapped = [real[1], real[0]]
    assert any("positional order" in p for p in compare_signatures("f", swapped, real))
    extra = [*real, ["stream", "KEYWORD_ONLY", True]]
    assert any("'stream' is not in" in p for p in compare_signatures("f", extra, real))
    assert compare_signatures("f", extra, [*real, ["kwargs", "VAR_KEYWORD", False]]) == []
    assert any("requires 'name'" in p for p in compare_signatures("f", real[:1], real))
