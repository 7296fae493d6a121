"""The trainer's configuration: TOML in, a checked :class:`~embedding.train.types.TrainConfig` out.

Every section and key is optional; what is left out keeps its default
(``neocomm train --print-config`` prints them all). Example::

    [data]
    source = "binary"            # synthetic | criteo | binary | parquet
    path = "train.bin"
    eval_records = 65536

(a Parquet source names its columns: ``label``, ``dense`` and
``[[data.sparse]]`` tables, see :mod:`embedding.data.schema`)

    [tables]
    preset = "criteo-1tb-100x"   # or rows = [1000, 2000, ...]

    [model]
    embedding_dim = 32
    bottom_mlp = [128, 32]
    top_mlp = [256, 64, 1]

    [sparse_optimizer]
    kind = "rowwise_adagrad"
    lr = 0.05

    [train]
    steps = 10000
    batch_size = 8192

    [checkpoint]
    every = 1000

    [comms]
    forward = "fp16"             # fp32 | fp16 | bf16 | int8 (pooled embeddings)
    backward = "bf16"            # fp32 | fp16 | bf16 (their gradients)
    dense = "bf16"               # fp32 | fp16 | bf16 (dense and data-parallel AllReduce)
    loss_scale = 1024            # static scale of fp16 gradients (0: none)

An unknown section or key, or a value of the wrong type or range, raises
:class:`~embedding.train.types.ConfigError` naming the file and the dotted
key (``train.steps``). Relative paths are relative to the working directory.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Mapping

from embedding.data.schema import SchemaError, dense_columns, sparse_features
from embedding.dense.types import DenseOptimizerConfig, DenseOptimizerKind
from embedding.train.sources import SOURCES, source_of
from embedding.train.types import (CheckpointConfig, CommsConfig, ConfigError, DataConfig,
                                   DataSource, LoopConfig, ModelConfig, OutputConfig,
                                   PlanConfig, TablesConfig, TrainConfig, cache_rows)
from embedding.types import (CachePolicy, Eviction, IdPolicy, OptimizerConfig, OptimizerKind,
                             Pooling, Rounding, Tier)
from topology.sizes import parse_size

__all__ = ["load_config", "parse_config", "apply_overrides", "config_to_dict", "to_toml",
           "cache_rows"]

Check = Callable[[Any], Any]  # returns the converted value or raises ValueError(reason)


# -- value checks ----------------------------------------------------------------
def _int(minimum: int | None = None) -> Check:
    def check(v):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"expected an int, got {type(v).__name__} {v!r}")
        if minimum is not None and v < minimum:
            raise ValueError(f"expected an int >= {minimum}, got {v}")
        return v
    return check


def _float(minimum: float | None = None, maximum: float | None = None,
           positive: bool = False, below: float | None = None) -> Check:
    def check(v):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"expected a number, got {type(v).__name__} {v!r}")
        v = float(v)
        if positive and not v > 0:
            raise ValueError(f"expected a number > 0, got {v}")
        if minimum is not None and v < minimum:
            raise ValueError(f"expected a number >= {minimum}, got {v}")
        if maximum is not None and v > maximum:
            raise ValueError(f"expected a number <= {maximum}, got {v}")
        if below is not None and not v < below:
            raise ValueError(f"expected a number < {below}, got {v}")
        return v
    return check


def _bool(v):
    if not isinstance(v, bool):
        raise ValueError(f"expected true or false, got {type(v).__name__} {v!r}")
    return v


def _str(choices=None) -> Check:
    def check(v):
        if not isinstance(v, str):
            raise ValueError(f"expected a string, got {type(v).__name__} {v!r}")
        if choices is not None and v not in choices:
            raise ValueError(f"expected one of {list(choices)}, got {v!r}")
        return v
    return check


def _widths(v):
    if not isinstance(v, (list, tuple)) or not v:
        raise ValueError(f"expected a non-empty list of positive ints, got {v!r}")
    for i, x in enumerate(v):
        if isinstance(x, bool) or not isinstance(x, int) or x <= 0:
            raise ValueError(f"expected positive ints, got {x!r} at position {i}")
    return tuple(v)


def _rows(v):
    if isinstance(v, (list, tuple)) and not v:
        return ()
    return _widths(v)


def _paths(v):
    if isinstance(v, str):
        return (v,) if v else ()
    if not isinstance(v, (list, tuple)) or not all(isinstance(p, str) and p for p in v):
        raise ValueError(f"expected a path or a list of paths, got {v!r}")
    return tuple(v)


def _shardings(v):
    from embedding.types import ShardingType

    items = [v] if isinstance(v, str) else v
    choices = [t.value for t in ShardingType]
    if not isinstance(items, (list, tuple)) or not all(isinstance(x, str) for x in items):
        raise ValueError(f"expected a list of sharding types, got {v!r}")
    for x in items:
        if x not in choices:
            raise ValueError(f"expected sharding types among {choices}, got {x!r}")
    return tuple(items)


def _size_text(v):
    if not isinstance(v, str):
        raise ValueError(f"expected a size such as \"8GiB\", got {type(v).__name__} {v!r}")
    if v:
        parse_size(v)
    return v


def _cache_text(v):
    """A cache size: ``"5%"`` of the rows, ``"4096"`` rows or ``"64MiB"``; ints are rows."""
    if isinstance(v, int) and not isinstance(v, bool):
        v = str(v)
    if not isinstance(v, str):
        raise ValueError(f"expected a cache size such as \"5%\", \"4096\" (rows) or "
                         f"\"64MiB\", got {type(v).__name__} {v!r}")
    if v:
        cache_rows(v, 1, 1)  # raises with the reason
    return v


def _source(v):
    choices = [s.value for s in SOURCES]
    if v in choices:
        return v
    hint = ""
    if isinstance(v, str) and v.lower() in ("csv", "tsv", "text", "txt"):
        hint = (f"; convert {v} files to Parquet with: neocomm data convert FILE -o "
                f"FILE.parquet, then set source = \"parquet\"")
    raise ValueError(f"expected one of {choices}, got {v!r}{hint}")


_SPARSE_KINDS = [k.value for k in OptimizerKind]
_DENSE_KINDS = [k.value for k in DenseOptimizerKind]

#: section -> key -> check. Field names follow the dataclasses of embedding.train.types.
SCHEMA: dict[str, dict[str, Check]] = {
    "data": {"source": _source, "path": _paths,
             "eval_path": _paths, "records": _int(1), "eval_records": _int(1),
             "shuffle": _bool, "shuffle_window": _int(-1), "broadcast": _bool,
             "verify": _str(["none", "lazy", "full"]),
             "missing": _str(["zero", "empty"]), "zipf_alpha": _float(positive=True),
             "logit_std": _float(minimum=0.0), "dense_share": _float(0.0, 1.0),
             "label": _str(), "dense": dense_columns,
             "sparse": sparse_features},  # these raise SchemaError, naming their own key
    "tables": {"preset": _str(), "rows": _rows, "cap": _int(0),
               "pooling": _str([p.value for p in Pooling]),
               "id_policy": _str([p.value for p in IdPolicy]),
               "tier": _str([t.value for t in Tier]), "tier_min_rows": _int(0),
               "cache": _cache_text, "cache_policy": _str([p.value for p in CachePolicy]),
               "admit_after": _int(1), "dynamic": _bool,
               "eviction": _str([e.value for e in Eviction]),
               "dtype": _str(["", "float32", "float16", "bfloat16"]),
               "rounding": _str([r.value for r in Rounding]), "rounding_seed": _int(0),
               "state_dtype": _str(["", "float32", "float16", "bfloat16"])},
    "model": {"embedding_dim": _int(1), "bottom_mlp": _widths, "top_mlp": _widths,
              "dtype": _str(["float32", "float64"])},
    "sparse_optimizer": {"kind": _str(_SPARSE_KINDS), "lr": _float(positive=True),
                         "eps": _float(positive=True), "beta1": _float(0.0, below=1.0),
                         "beta2": _float(0.0, below=1.0)},
    "dense_optimizer": {"kind": _str(_DENSE_KINDS), "lr": _float(positive=True),
                        "momentum": _float(0.0, below=1.0), "weight_decay": _float(0.0),
                        "eps": _float(positive=True), "beta1": _float(0.0, below=1.0),
                        "beta2": _float(0.0, below=1.0), "initial_accumulator": _float(0.0)},
    "train": {"steps": _int(1), "batch_size": _int(0), "eval_every": _int(0),
              "eval_batch_size": _int(0), "log_every": _int(1), "overlap": _bool,
              "bucket_kib": _int(1), "dedup": _bool, "threads": _int(0), "seed": _int(0),
              "device": _str(["cpu", "cuda"])},
    "plan": {"file": _str(), "fabric": _str(), "memory": _size_text,
             "host_memory": _size_text, "shardings": _shardings, "pack": _bool,
             "pack_rows": _int(1)},
    "checkpoint": {"dir": _str(), "every": _int(0), "keep": _int(1), "resume": _str()},
    "output": {"dir": _str(), "plot": _bool},
    "comms": {"forward": _str(["fp32", "fp16", "bf16", "int8"]),
              "backward": _str(["fp32", "fp16", "bf16"]), "dense": _str(["fp32", "fp16", "bf16"]),
              "loss_scale": _float(minimum=0.0)},
}


# -- loading ---------------------------------------------------------------------
def load_config(path: str | os.PathLike | None) -> TrainConfig:
    """The configuration in TOML file ``path`` (None: the defaults)."""
    if path is None:
        return TrainConfig()
    path = os.fspath(path)
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except OSError as exc:
        raise ConfigError(path, "", f"cannot read: {exc.strerror or exc}") from None
    import tomllib

    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(path, "", f"not valid TOML: {exc}") from None
    return parse_config(data, path)


def parse_config(data: Mapping[str, Any], path: str = "<config>") -> TrainConfig:
    """A checked :class:`TrainConfig` from the decoded TOML document ``data``."""
    if not isinstance(data, Mapping):
        raise ConfigError(path, "", f"expected a TOML document, got {type(data).__name__}")
    values: dict[str, dict[str, Any]] = {}
    for section, body in data.items():
        if section not in SCHEMA:
            kind = "section" if isinstance(body, Mapping) else "key"
            raise ConfigError(path, section, f"unknown {kind}; expected one of the sections "
                              f"{sorted(SCHEMA)}")
        if not isinstance(body, Mapping):
            raise ConfigError(path, section, f"expected a [{section}] section, got "
                              f"{type(body).__name__} {body!r}")
        values[section] = {}
        for key, value in body.items():
            check = SCHEMA[section].get(key)
            if check is None:
                raise ConfigError(path, f"{section}.{key}", f"unknown key; expected one of "
                                  f"{sorted(SCHEMA[section])}")
            try:
                values[section][key] = check(value)
            except SchemaError as exc:
                raise ConfigError(path, exc.key, exc.reason) from None
            except ValueError as exc:
                raise ConfigError(path, f"{section}.{key}", str(exc)) from None
    return _build(values, path)


def _build(values: dict[str, dict[str, Any]], path: str,
           base: TrainConfig | None = None) -> TrainConfig:
    base = base or TrainConfig()

    def section(name, cls, current):
        fields = dict(values.get(name, {}))
        if not fields:
            return current
        try:
            return dataclasses.replace(current, **fields)
        except (TypeError, ValueError) as exc:
            raise ConfigError(path, name, str(exc)) from None

    data = section("data", DataConfig, base.data)
    if isinstance(data.source, str):
        data = dataclasses.replace(data, source=DataSource(data.source))
    cfg = TrainConfig(
        data=data,
        tables=section("tables", TablesConfig, base.tables),
        model=section("model", ModelConfig, base.model),
        sparse_optimizer=_optimizer(values.get("sparse_optimizer", {}), base.sparse_optimizer,
                                    OptimizerConfig, OptimizerKind, path, "sparse_optimizer"),
        dense_optimizer=_optimizer(values.get("dense_optimizer", {}), base.dense_optimizer,
                                   DenseOptimizerConfig, DenseOptimizerKind, path,
                                   "dense_optimizer"),
        train=section("train", LoopConfig, base.train),
        plan=section("plan", PlanConfig, base.plan),
        checkpoint=section("checkpoint", CheckpointConfig, base.checkpoint),
        output=section("output", OutputConfig, base.output),
        comms=section("comms", CommsConfig, base.comms),
        source=path)
    _cross_check(cfg, path)
    return cfg


def _optimizer(fields, current, cls, kinds, path, name):
    if not fields:
        return current
    fields = dict(fields)
    if "kind" in fields:
        fields["kind"] = kinds(fields["kind"])
    try:
        return dataclasses.replace(current, **fields)
    except ValueError as exc:
        raise ConfigError(path, name, str(exc)) from None


def _cross_check(cfg: TrainConfig, path: str) -> None:
    m = cfg.model
    if m.bottom_mlp[-1] != m.embedding_dim:
        raise ConfigError(path, "model.bottom_mlp", f"the last width is the embedding dimension "
                          f"and must be model.embedding_dim = {m.embedding_dim}, got "
                          f"{list(m.bottom_mlp)}")
    if m.top_mlp[-1] != 1:
        raise ConfigError(path, "model.top_mlp", f"the last width is the logit and must be 1, "
                          f"got {list(m.top_mlp)}")
    d = cfg.data
    source_of(d.source).check(cfg, path)  # the [data] table, as its source reads it
    t = cfg.tables
    _check_precision(path, cfg)
    if not t.rows:
        from embedding.presets import table_rows

        try:
            table_rows(t.preset)
        except ValueError as exc:
            raise ConfigError(path, "tables.preset", str(exc).removeprefix("preset: ")) \
                from None
    c = cfg.comms
    if c.loss_scale and "fp16" not in (c.backward, c.dense):
        raise ConfigError(path, "comms.loss_scale", f"{c.loss_scale:g} scales fp16 gradients "
                          f"only; comms.backward is {c.backward!r} and comms.dense is "
                          f"{c.dense!r} (set one to \"fp16\", or loss_scale = 0)")
    if c.loss_scale == float("inf"):
        raise ConfigError(path, "comms.loss_scale", "expected a finite number, got inf")
    tr = cfg.train
    if tr.eval_batch_size and tr.eval_batch_size > d.eval_records and not (
            d.source is DataSource.PARQUET and d.eval_path):
        raise ConfigError(path, "train.eval_batch_size", f"{tr.eval_batch_size} is larger than "
                          f"the held-out set (data.eval_records = {d.eval_records})")


def _check_precision(path: str, cfg) -> None:
    """ConfigError naming the key when ``[tables]`` precision settings do not fit the run."""
    t = cfg.tables
    half = t.dtype in ("float16", "bfloat16")
    if t.rounding != "nearest" and not half:
        raise ConfigError(path, "tables.rounding", f"{t.rounding!r} rounding applies to "
                          f"tables.dtype float16 or bfloat16, got {t.dtype or cfg.model.dtype!r}")
    if not half:
        return
    if cfg.model.dtype != "float32":
        raise ConfigError(path, "tables.dtype", f"{t.dtype} tables compute in float32; "
                          f"model.dtype is {cfg.model.dtype!r}")


def apply_overrides(cfg: TrainConfig, *, steps: int | None = None,
                    batch_size: int | None = None, out: str | None = None,
                    resume: str | None = None, seed: int | None = None,
                    plot: bool | None = None, overlap: bool | None = None,
                    device: str | None = None, plan: str | None = None) -> TrainConfig:
    """``cfg`` with command-line overrides (None: keep); ConfigError names the option."""
    train = {}
    for name, value, minimum in (("steps", steps, 1), ("batch_size", batch_size, 0),
                                 ("seed", seed, 0)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ConfigError("command line", f"--{name.replace('_', '-')}",
                              f"expected an int >= {minimum}, got {value!r}")
        train[name] = value
    if overlap is not None:
        train["overlap"] = bool(overlap)
    if device is not None:
        if device not in ("cpu", "cuda"):
            raise ConfigError("command line", "--device", f"expected cpu or cuda, got {device!r}")
        train["device"] = device
    if train:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **train))
    if out is not None:
        if not out:
            raise ConfigError("command line", "--out", "expected a directory, got ''")
        cfg = dataclasses.replace(cfg, output=dataclasses.replace(cfg.output, dir=out))
    if plot is not None:
        cfg = dataclasses.replace(cfg, output=dataclasses.replace(cfg.output, plot=bool(plot)))
    if resume is not None:
        cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint,
                                                                      resume=resume))
    if plan is not None:
        if not plan:
            raise ConfigError("command line", "--plan", "expected a plan file, got ''")
        cfg = dataclasses.replace(cfg, plan=dataclasses.replace(cfg.plan, file=plan))
    _cross_check(cfg, cfg.source)
    return cfg


# -- output ----------------------------------------------------------------------
def config_to_dict(cfg: TrainConfig) -> dict[str, dict[str, Any]]:
    """The configuration as JSON/TOML-ready nested dicts (enums as their values)."""
    out: dict[str, dict[str, Any]] = {}
    for name in SCHEMA:
        obj = getattr(cfg, name)
        body = {}
        for key in SCHEMA[name]:
            value = getattr(obj, key)
            if hasattr(value, "value"):
                value = value.value
            elif isinstance(value, tuple):
                value = [x.to_config() if hasattr(x, "to_config") else x for x in value]
            body[key] = value
        out[name] = body
    return out


def to_toml(cfg: TrainConfig) -> str:
    """The whole configuration as a TOML document (every key, defaults included)."""
    lines = []
    for section, body in config_to_dict(cfg).items():
        lines.append(f"[{section}]")
        for key, value in body.items():
            lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, Mapping):
        return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + " }"
    return "[" + ", ".join(_toml_value(x) for x in v) + "]"


