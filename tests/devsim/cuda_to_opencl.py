"""Translate CUDA C kernels to OpenCL C for the CPU OpenCL devices of ``opencl.py``.

Self-contained (NumPy and the standard library only): :mod:`opencl` imports it with
``tests/devsim`` on ``sys.path`` and re-exports what it defines.

**Translation** (:func:`translate`) rewrites exactly the CUDA constructs the
fused kernels use and refuses every other CUDA construct with a
:class:`TranslationError` naming it, so a kernel change fails loudly instead
of being mistranslated:

=============================================  =======================================
CUDA                                           OpenCL C
=============================================  =======================================
``extern "C" __global__``                      ``__kernel``
``[static] __device__ [__forceinline__]``      ``static inline``
``__restrict__``                               ``restrict``
every pointer type (parameters of kernels and  ``__global`` pointer (the kernels use
device functions, locals, casts)               no shared memory)
``long long`` / ``unsigned long long``         ``long`` / ``ulong`` (64-bit in both)
``threadIdx.x``, ``blockIdx.x``,               the launch model of opencl.py
``blockDim.x``, ``gridDim.x``
``__fadd_rn`` … ``__fsqrt_rn``, ``__dadd_rn``  one operator per call, no FMA contraction
… ``__dsqrt_rn``                               (``#pragma OPENCL FP_CONTRACT OFF``;
                                               built with ``-cl-fp32-correctly-rounded-
                                               divide-sqrt``): round-to-nearest like CUDA;
                                               the float ones flush subnormal inputs and
                                               results to zero (below)
``pow`` on doubles                             OpenCL ``pow`` (``cl_khr_fp64`` enabled)
``__float_as_uint``, ``__uint_as_float``       ``as_uint``, ``as_float`` (bit casts)
``__shfl_xor_sync(full mask, v, o[, 32])``     exchange through a ``__local`` scratch of
                                               32 slots, a barrier before and after the
                                               write (scratch threaded as an extra first
                                               parameter of the device functions that
                                               need it)
``__syncwarp([full mask])``                    ``barrier(CLK_LOCAL_MEM_FENCE |
                                               CLK_GLOBAL_MEM_FENCE)``
=============================================  =======================================

**Flush to zero.** CuPy compiles every ``RawModule`` with ``-ftz=true``
(whatever ``options`` say), so on a GPU single-precision operations flush
subnormal inputs and results (``|x| < 2**-126``) to a zero of the same sign,
and double precision keeps them. The translation does the same in the float
intrinsics (``__fadd_rn`` … ``__fsqrt_rn``, through ``__nc_ftz``), exactly.
It does not use OpenCL's ``-cl-denorms-are-zero``: PoCL applies it to double
precision too (``1e-310 + 0.0`` gives 0), which CUDA never flushes. Other
single-precision operations (comparisons, conversions from double) keep
subnormals here; the kernels do their float arithmetic through the
intrinsics.

Refused (examples): ``__shared__``, ``__syncthreads``, atomics, any other
``__`` identifier (``__ldg``, ``__launch_bounds__``, ``__CUDA_ARCH__`` …),
``threadIdx.y``/``.z``, partial warp masks, ``warpSize``, ``#include`` and
``#pragma``, string literals other than ``extern "C"``, C++ (``template``,
``::``, ``<<<``), kernels not declared ``extern "C"``, ``__device__`` variables,
kernel parameters that are not a scalar or a pointer to a scalar.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping, Sequence

import numpy as np

__all__ = ["KernelParam", "Translation", "TranslationError", "translate"]


class TranslationError(ValueError):
    """A CUDA construct the translator does not know (``construct``), at ``line`` (1-based)."""

    def __init__(self, construct: str, line: int, why: str = ""):
        self.construct, self.line, self.why = construct, line, why
        super().__init__(f"cuda_source: cannot translate {construct!r} at line {line}"
                         + (f": {why}" if why else ""))

    def __reduce__(self):
        return type(self), (self.construct, self.line, self.why)



@dataclass(frozen=True)
class KernelParam:
    """One kernel parameter: a scalar of ``dtype`` or (``pointer``) an array of ``dtype``."""

    name: str
    dtype: np.dtype
    pointer: bool
    const: bool


@dataclass(frozen=True)
class Translation:
    """OpenCL C ``source`` and each kernel's parameters (in order) of a CUDA source."""

    source: str
    kernels: Mapping[str, tuple[KernelParam, ...]]


# --------------------------------------------------------------------------- translation

_KNOWN_DUNDER = {"__global__", "__device__", "__forceinline__", "__restrict__",
                 "__shfl_xor_sync", "__syncwarp", "__float_as_uint", "__uint_as_float"} | {
    f"__{p}{op}_rn" for p in "fd" for op in ("add", "sub", "mul", "div", "sqrt")}
_REFUSED_WORDS = {"warpSize", "template", "typename", "namespace", "using", "class",
                  "operator", "new", "delete", "nullptr", "constexpr", "static_assert", "asm",
                  "auto", "this", "throw", "try", "catch"}
_BUILTINS = ("threadIdx", "blockIdx", "blockDim", "gridDim")
_FULL_MASKS = {"0xffffffff", "0xffffffffu", "0xffffffffull", "0xffffffffll", "~0", "~0u",
               "-1", "(unsigned)-1", "0xfffffffful"}
_DIRECTIVES = {"define", "undef", "if", "ifdef", "ifndef", "elif", "else", "endif"}
_C_TYPES = {"void", "char", "short", "int", "long", "float", "double", "bool", "unsigned",
            "signed", "ulong", "uint", "ushort", "uchar", "size_t"}
_DTYPES = {("char",): "int8", ("char", "signed"): "int8", ("char", "unsigned"): "uint8",
           ("short",): "int16", ("short", "unsigned"): "uint16",
           ("int",): "int32", ("unsigned",): "uint32",
           ("long",): "int64", ("long", "long"): "int64", ("long", "unsigned"): "uint64",
           ("long", "long", "unsigned"): "uint64", ("float",): "float32",
           ("double",): "float64"}
_TOKEN = re.compile(r'"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|[A-Za-z_]\w*|\d[\w.]*'
                    r'|::|<<<|>>>|\S')

_PRELUDE = r"""/* Translated from CUDA C by tests/devsim/opencl.py: do not edit. */
#pragma OPENCL EXTENSION cl_khr_fp64 : enable
#pragma OPENCL FP_CONTRACT OFF
/* A CUDA block of B threads = B/32 work-groups of 32; B is the global offset of dim 1. */
#define __NC_B ((uint)get_global_offset(1))
#define __nc_blockDim_x __NC_B
#define __nc_blockIdx_x ((uint)(get_group_id(0) / (__NC_B >> 5)))
#define __nc_threadIdx_x ((uint)((get_group_id(0) % (__NC_B >> 5)) * 32 + get_local_id(0)))
#define __nc_gridDim_x ((uint)(get_num_groups(0) / (__NC_B >> 5)))
static inline void __nc_syncwarp(void) { barrier(CLK_LOCAL_MEM_FENCE | CLK_GLOBAL_MEM_FENCE); }
static inline uint __float_as_uint(float x) { return as_uint(x); }
static inline float __uint_as_float(uint x) { return as_float(x); }
"""
_ARITH = "static inline {t} __{p}{op}_rn({t} a, {t} b) {{ return a {sym} b; }}\n"
_SQRT = "static inline {t} __{p}sqrt_rn({t} a) {{ return sqrt(a); }}\n"
#: CuPy compiles every RawModule with ``-ftz=true``: single-precision operations flush
#: subnormal inputs and results to zero (sign kept); double precision keeps them.
_FTZ = ("static inline float __nc_ftz(float x) "
        "{ return fabs(x) < FLT_MIN ? copysign(0.0f, x) : x; }\n")
_ARITH_FTZ = ("static inline float __f{op}_rn(float a, float b) "
              "{{ return __nc_ftz(__nc_ftz(a) {sym} __nc_ftz(b)); }}\n")
_SQRT_FTZ = "static inline float __fsqrt_rn(float a) { return __nc_ftz(sqrt(__nc_ftz(a))); }\n"
_SHFL = """static inline {t} __attribute__((overloadable)) __nc_shfl_xor(
        __local ulong* s, {t} v, int o) {{
    const uint l = (uint)get_local_id(0), src = l ^ (uint)o;
    barrier(CLK_LOCAL_MEM_FENCE);
    s[l] = {to};
    barrier(CLK_LOCAL_MEM_FENCE);
    const ulong x = s[src < 32u ? src : l];
    return {back};
}}
"""
_SHFL_TYPES = {"float": ("(ulong)as_uint(v)", "as_float((uint)x)"),
               "double": ("as_ulong(v)", "as_double(x)"),
               "int": ("(ulong)(uint)v", "(int)(uint)x"), "uint": ("(ulong)v", "(uint)x"),
               "long": ("(ulong)v", "(long)x"), "ulong": ("v", "x")}


def _prelude() -> str:
    parts = [_PRELUDE, _FTZ]
    for op, sym in (("add", "+"), ("sub", "-"), ("mul", "*"), ("div", "/")):
        parts.append(_ARITH_FTZ.format(op=op, sym=sym))
        parts.append(_ARITH.format(t="double", p="d", op=op, sym=sym))
    parts.append(_SQRT_FTZ)
    parts.append(_SQRT.format(t="double", p="d"))
    for t, (to, back) in _SHFL_TYPES.items():
        parts.append(_SHFL.format(t=t, to=to, back=back))
    return "".join(parts) + "/* ---- translated source ---- */\n"


def _strip_comments(src: str) -> str:
    """``src`` with comments blanked (newlines kept, so line numbers hold)."""
    out, i, n = [], 0, len(src)
    while i < n:
        c = src[i]
        if c in "\"'":
            j = i + 1
            while j < n and src[j] != c and src[j] != "\n":
                j += 2 if src[j] == "\\" else 1
            out.append(src[i:j + 1])
            i = j + 1
        elif src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif src.startswith("/*", i):
            j = src.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", src[i:j]))
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _matching(text: str, pos: int) -> int:
    """Index of the bracket closing the one at ``pos``."""
    pairs = {"(": ")", "[": "]", "{": "}"}
    stack = []
    for i in range(pos, len(text)):
        c = text[i]
        if c in pairs:
            stack.append(pairs[c])
        elif c in ")]}":
            if not stack or stack.pop() != c:
                raise TranslationError(c, _line(text, i), "unbalanced brackets")
            if not stack:
                return i
    raise TranslationError(text[pos], _line(text, pos), "unclosed bracket")


def _split_args(text: str) -> list[str]:
    """Top-level comma-separated pieces of ``text``."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(text):
        depth += c in "([{"
        depth -= c in ")]}"
        if c == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    last = text[start:].strip()
    return parts + [last] if last or parts else parts


def _check_constructs(text: str) -> None:
    """TranslationError for the first CUDA construct outside the known set."""
    for m in re.finditer(r"^[ \t]*#[ \t]*(\w*)", text, re.M):
        if m.group(1) not in _DIRECTIVES:
            raise TranslationError(f"#{m.group(1)}", _line(text, m.start()),
                                   f"only #{', #'.join(sorted(_DIRECTIVES))} are known")
    toks = [(m.group(), m.start()) for m in _TOKEN.finditer(text)]
    for k, (tok, pos) in enumerate(toks):
        nxt = [t for t, _ in toks[k + 1:k + 3]]
        prev = [t for t, _ in toks[max(0, k - 2):k]]
        if tok.startswith('"'):
            if prev[-1:] != ["extern"] or tok != '"C"':
                raise TranslationError(tok, _line(text, pos), "no string literals")
        elif tok.startswith("__") and tok not in _KNOWN_DUNDER:
            raise TranslationError(tok, _line(text, pos), "unknown CUDA identifier")
        elif tok in _REFUSED_WORDS or tok.startswith("atomic") or tok in ("::", "<<<", ">>>"):
            raise TranslationError(tok, _line(text, pos), "not supported")
        elif tok in _BUILTINS and nxt != [".", "x"]:
            raise TranslationError(tok + "".join(nxt), _line(text, pos),
                                   "only the x dimension is translated")
        elif tok == "extern" and nxt != ['"C"', "__global__"]:
            raise TranslationError(" ".join([tok] + nxt), _line(text, pos),
                                   'only extern "C" __global__ kernels are known')
        elif tok == "__global__" and prev != ["extern", '"C"']:
            raise TranslationError("__global__", _line(text, pos),
                                   'kernels must be declared extern "C"')
    for m in re.finditer(r"__device__(?:\s+(?:__forceinline__|inline))*([^;{(=]*)([;{(=])", text):
        if m.group(2) != "(":
            raise TranslationError("__device__ " + m.group(1).strip(), _line(text, m.start()),
                                   "__device__ variables are not translated")


def _typedefs(text: str) -> dict[str, tuple[str, ...]]:
    """``{name: base type words}`` of every ``typedef <words> name;`` (resolved in order)."""
    out: dict[str, tuple[str, ...]] = {}
    for m in re.finditer(r"\btypedef\s+([\w\s]+?)\s+(\w+)\s*;", text):
        words: list[str] = []
        for w in m.group(1).split():
            words.extend(out.get(w, (w,)))
        out[m.group(2)] = tuple(words)
    return out


def _dtype_of(words: Sequence[str], typedefs, where: str, line: int, construct: str) -> np.dtype:
    resolved: list[str] = []
    for w in words:
        resolved.extend(typedefs.get(w, (w,)))
    key = [w for w in resolved if w != "signed" or resolved == ["signed"]]
    if len(key) > 1 and "int" in key:
        key.remove("int")
    key = ["int"] if key == ["signed"] else key
    name = _DTYPES.get(tuple(sorted(key)))
    if name is None:
        raise TranslationError(construct, line, f"{where}: not a scalar or a pointer "
                               "to a scalar of a fixed-width C type")
    return np.dtype(name)


def _kernel_params(text: str, typedefs) -> dict[str, tuple[KernelParam, ...]]:
    kernels = {}
    for m in re.finditer(r'extern\s*"C"\s*__global__\s+(\w+)\s+(\w+)\s*\(', text):
        line = _line(text, m.start())
        if m.group(1) != "void":
            raise TranslationError(m.group(1), line, "kernels return void")
        close = _matching(text, m.end() - 1)
        params = []
        for piece in _split_args(text[m.end():close]):
            if piece in ("", "void"):
                continue
            if any(c in piece for c in "[]&=("):
                raise TranslationError(piece, line, f"parameter of kernel {m.group(2)}")
            stars = piece.count("*")
            if stars > 1:
                raise TranslationError(piece, line, "pointer-to-pointer kernel parameters")
            head, _, tail = piece.partition("*")
            words = [w for w in re.findall(r"\w+", head + " " + tail)
                     if w not in ("const", "volatile", "__restrict__")]
            if len(words) < 2:
                raise TranslationError(piece, line, "unnamed kernel parameter")
            const = stars == 1 and "const" in head.split()
            where = f"parameter {words[-1]!r} of kernel {m.group(2)}"
            dtype = _dtype_of(words[:-1], typedefs, where, line, piece)
            params.append(KernelParam(words[-1], dtype, stars == 1, const))
        if m.group(2) in kernels:
            raise TranslationError(m.group(2), line, "kernel defined twice")
        kernels[m.group(2)] = tuple(params)
    return kernels


def _rewrite_calls(text: str, name: str, fn) -> str:
    """Replace every call ``name(args)`` in ``text`` by ``fn(args list, line)`` (inner first)."""
    starts = [m.start() for m in re.finditer(rf"\b{name}\s*\(", text)]
    for s in reversed(starts):
        open_ = text.index("(", s)
        close = _matching(text, open_)
        text = text[:s] + fn(_split_args(text[open_ + 1:close]), _line(text, s)) + text[close + 1:]
    return text


def _shfl(args: list[str], line: int) -> str:
    if len(args) not in (3, 4):
        raise TranslationError("__shfl_xor_sync", line, "expected (mask, var, laneMask[, width])")
    if re.sub(r"\s", "", args[0]).lower() not in _FULL_MASKS:
        raise TranslationError(f"__shfl_xor_sync mask {args[0]}", line,
                               "only full-warp masks (0xffffffff) are translated")
    if len(args) == 4 and args[3].strip() != "32":
        raise TranslationError(f"__shfl_xor_sync width {args[3]}", line, "only width 32")
    return f"__nc_shfl_xor(__nc_shfl, ({args[1]}), ({args[2]}))"


def _syncwarp(args: list[str], line: int) -> str:
    if args and re.sub(r"\s", "", args[0]).lower() not in _FULL_MASKS:
        raise TranslationError(f"__syncwarp mask {args[0]}", line, "only the full-warp mask")
    return "__nc_syncwarp()"


def _thread_scratch(text: str) -> str:
    """Give every function that shuffles (itself or through callees/macros) the scratch."""
    depth = np.cumsum([(c == "{") - (c == "}") for c in text]) if text else np.zeros(0)
    funcs = []  # (kind, name, params span, body span or None)
    for m in re.finditer(r"(__kernel\s+void\s+|static\s+inline\s+[\w\s\*]*?)\b(\w+)\s*\(", text):
        if m.start() and depth[m.start() - 1] != 0:
            continue
        close = _matching(text, m.end() - 1)
        rest = text[close + 1:].lstrip()
        body = None
        if rest.startswith("{"):
            b = close + 1 + (len(text[close + 1:]) - len(rest))
            body = (b, _matching(text, b))
        funcs.append(("kernel" if m.group(1).startswith("__kernel") else "device", m.group(2),
                      (m.end(), close), body))
    macros = {m.group(1): m.group(2) for m in
              re.finditer(r"^[ \t]*#[ \t]*define[ \t]+(\w+)(.*)$", text, re.M)}
    bodies = {name: text[b[0]:b[1]] for kind, name, _, b in funcs if b and kind == "device"}
    bodies.update(macros)
    users: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, body in bodies.items():
            if name not in users and (set(re.findall(r"\w+", body)) & (users | {"__nc_shfl"})):
                users.add(name)
                changed = True
    device_users = {name for kind, name, _, _ in funcs if kind == "device" and name in users}
    call = re.compile(rf"\b({'|'.join(sorted(device_users)) or '(?!)'})\s*\((\s*\))?")

    def add_arg(segment: str) -> str:
        return call.sub(lambda m: f"{m.group(1)}(__nc_shfl" + (")" if m.group(2) else ", "),
                        segment)

    edits = []  # (start, end, replacement), applied from the end
    for kind, name, (p0, p1), body in funcs:
        if kind == "device" and name in device_users:
            params = text[p0:p1].strip()
            sep = ", " if params and params != "void" else ""
            edits.append((p0, p1, "__local ulong* __nc_shfl" + sep
                          + ("" if params == "void" else text[p0:p1])))
        if body:
            inner = text[body[0] + 1:body[1]]
            uses = set(re.findall(r"\w+", inner)) & (users | {"__nc_shfl"})
            head = "\n    __local ulong __nc_shfl[32];" if kind == "kernel" and uses else ""
            edits.append((body[0] + 1, body[1], head + add_arg(inner)))
    for m in re.finditer(r"^[ \t]*#[ \t]*define[ \t]+\w+.*$", text, re.M):
        if m.start() and depth[m.start() - 1] != 0:
            continue  # inside a function body: rewritten with it
        edits.append((m.start(), m.end(), add_arg(m.group())))
    for start, end, rep in sorted(edits, reverse=True):
        text = text[:start] + rep + text[end:]
    return text


def translate(cuda_source: str) -> Translation:
    """Mechanical OpenCL C translation of ``cuda_source`` (see the module doc for the rules)."""
    if not isinstance(cuda_source, str):
        raise TypeError(f"cuda_source: expected a str, got {type(cuda_source).__name__}")
    text = _strip_comments(cuda_source)
    _check_constructs(text)
    typedefs = _typedefs(text)
    kernels = _kernel_params(text, typedefs)
    if not kernels:
        raise TranslationError("(no kernel)", 1, 'expected at least one extern "C" __global__')
    text = re.sub(r'extern\s*"C"\s*__global__', "__kernel", text)
    text = re.sub(r"(?:\bstatic\s+)?__device__(?:\s+(?:__forceinline__|inline)\b)*",
                  "static inline", text)
    text = re.sub(r"\b__restrict__\b", "restrict", text)
    text = re.sub(r"\bunsigned\s+long(?:\s+long)?(?:\s+int)?\b", "ulong", text)
    text = re.sub(r"\b(?:signed\s+)?long\s+long(?:\s+int)?\b|\blong\s+int\b", "long", text)
    types = sorted(_C_TYPES | set(typedefs), key=len, reverse=True)
    pointer = re.compile(r"(?<![\w.])((?:(?:const|volatile)\s+)*(?:(?:unsigned|signed)\s+)?"
                         rf"(?:struct\s+\w+|(?:{'|'.join(types)})\b)(?:\s+(?:const|volatile)\b)*"
                         r")(\s*\*)")
    text = pointer.sub(r"__global \1\2", text)
    text = re.sub(r"\b(threadIdx|blockIdx|blockDim|gridDim)\s*\.\s*x\b", r"__nc_\1_x", text)
    text = _rewrite_calls(text, "__shfl_xor_sync", _shfl)
    text = _rewrite_calls(text, "__syncwarp", _syncwarp)
    text = _thread_scratch(text)
    return Translation(_prelude() + text, MappingProxyType(kernels))
