"""``neocomm simulate calibrate`` and ``validate``: the model against measurements.

``calibrate`` fits a fabric spec's model to ``neocomm bench`` runs (read from
``--bench`` files or run here) with :func:`collectives.calibrate.fit_spec` and
writes the calibrated spec; ``validate`` compares the model's predictions with
the measured calls (or, with ``--step``, training steps) and says which
agree. The fitting and comparing live in :mod:`collectives.calibrate`; this
module reads the options and prints.
"""
from __future__ import annotations

from contextlib import contextmanager

from embedding.cli.simulate_job import Job, dump_json, positive_counts

__all__ = ["calibrate", "validate"]


@contextmanager
def _jobs_folder(prefix: str, dir: str | None = None):
    """A new folder for the jobs run here, removed when they succeed and kept when one
    fails: the error names the job's whole output there, which the user will want to read
    (an empty one goes: nothing ran). A job's RuntimeError comes out as the ValueError the
    command reports."""
    import os
    import shutil
    import tempfile

    where = tempfile.mkdtemp(prefix=prefix, dir=dir)
    try:
        yield where
    except RuntimeError as exc:
        if not os.listdir(where):
            os.rmdir(where)
        raise ValueError(str(exc)) from None
    except BaseException:
        shutil.rmtree(where, ignore_errors=True)
        raise
    shutil.rmtree(where, ignore_errors=True)


def _measurements(args) -> list[dict]:
    """The bench runs of ``--bench`` files, or of benches run here now (``--ranks`` x
    ``--nodes``), saved to ``--record`` when asked."""
    from collectives.calibrate import median_of_launches, read_measurements, run_benches

    if args.bench:  # several files of one layout (launches) are merged as launches are
        runs = median_of_launches([run for path in args.bench
                                   for run in read_measurements(path)])
    else:
        layouts = _layouts(args)
        with _jobs_folder("neocomm-calibrate-") as where:
            runs = run_benches(layouts, minbytes=args.minbytes, maxbytes=args.maxbytes,
                               factor=args.stepfactor, out_dir=where, device=args.device,
                               hostfile=args.hostfile, launches=args.launches,
                               echo=lambda cmd: print(f"# {cmd}", flush=True))
    if args.record:
        dump_json(args.record, {"kind": "neocomm-measurements", "runs": runs})
    return runs


def calibrate(args) -> int:
    import socket
    import time

    from collectives.calibrate import OPS, fabric_file, fit_spec, measured_rows, model_table
    from collectives.topofabric import TERMS, model_key
    from topology.spec import PRESETS_DIR, load_spec, preset_names

    spec = load_spec(args.fabric)
    runs = _measurements(args)
    rows = measured_rows(runs, args.device)
    result, start = fit_spec(spec, runs, rows, device=args.device)
    layouts = sorted({(m.ranks, m.nodes) for m in rows})
    where = (f"{socket.gethostname()}, {time.strftime('%Y-%m-%d')}, neocomm bench at "
             + ", ".join(f"{r} ranks on {n} node(s)" for r, n in layouts))
    table = model_table(result, buffers="device" if args.device else "host",
                        kinds=(start.intra.kind, start.inter.kind), measured_on=where)
    path = PRESETS_DIR / f"{spec.name}.toml" if args.fabric in preset_names() else \
        args.fabric
    with open(path, encoding="utf-8") as fh:
        text = fabric_file(fh.read(), table)
    out = args.output or f"{spec.name}-calibrated.toml"
    with open(out, "w", encoding="utf-8") as fh:
        fh.write(text)
    ops = sorted({m.op.value for m in rows})
    print(f"# neocomm simulate calibrate: {len(rows)} measured calls ({len(ops)} of "
          f"{len(OPS)} collectives; {', '.join(f'{r}x{n}' for r, n in layouts)} ranks x "
          f"nodes) fitted to fabric {spec.name!r}")
    print(f"# {'term':<34} {'value':>12}  from")
    kept = {model_key(t) for t in TERMS if t.name in result.kept}
    for key, value in table.items():
        if key in ("buffers", "measured_on", "measured", "factors", "overhead_factors") or \
                key.startswith("fit_"):
            continue
        origin = "host (read)" if key in ("cache_mib", "cores_per_node", "huge_page_mib") else \
            "link class" if key.endswith("_link") else \
            "fabric spec (no measurement depends on it)" if key in kept else "measured"
        print(f"  {key:<34} {value!s:>12}  {origin}")
    for label, field in (("factor", "factors"), ("overhead", "overhead_factors")):
        for key, value in table[field].items():
            print(f"  {label + ' ' + key:<34} {value:>12}  measured")
    print(f"# fit: median |log(predicted / measured)| {result.median_error:.3f}, worst "
          f"{result.worst_error:.3f}")
    print(f"# wrote {out}: pass it as --fabric {out} (simulate, plan), or check it with "
          f"neocomm simulate validate --fabric {out}")
    return 0


def validate(args) -> int:
    if not 0 < args.tolerance < 10:
        raise ValueError(f"--tolerance: expected a fraction like 0.25, got {args.tolerance}")
    if not 0 < args.repeat_tolerance < 10:
        raise ValueError(f"--repeat-tolerance: expected a fraction like 0.1, got "
                         f"{args.repeat_tolerance}")
    if args.step:
        return _validate_step(args)
    from collectives.calibrate import check_kinds, compare, measured_kinds, measured_rows
    from collectives.topofabric import spec_links
    from topology.spec import load_spec

    spec = load_spec(args.fabric)
    fabric = spec_links(spec, device=args.device)
    if not (args.bench or args.hostfile or args.device) and fabric.inter.kind != "shm" and \
            any(ranks > per_node for ranks, per_node in _layouts(args)):
        # refused before any bench runs: the nodes would share this host's memory
        raise ValueError(f"--nodes {args.nodes}: nodes measured here are emulated on this "
                         f"host's shared memory, but fabric {spec.name!r} has "
                         f"{fabric.inter.kind} between nodes; pass --hostfile to measure "
                         f"across real nodes, --nodes 1, or the fabric `neocomm simulate "
                         f"calibrate` wrote here")
    runs = _measurements(args)
    rows = measured_rows(runs, args.device)
    check_kinds(fabric, measured_kinds(runs), spec.name)
    table = compare(rows, fabric)
    print(f"# neocomm simulate validate: fabric {spec.name!r} ({fabric.source}); "
          f"{len(table)} measured calls; pass: |predicted / measured - 1| <= "
          f"{args.tolerance:.0%}")
    print(f"# {'ranks':>5} {'nodes':>5} {'op':<15} {'size':>10} {'algorithm':<13} "
          f"{'measured us':>12} {'predicted us':>12} {'ratio':>6}")
    for c in table:
        m = c.measurement
        print(f"  {m.ranks:>5} {m.nodes:>5} {m.op.value:<15} {m.size:>10} {m.algorithm:<13} "
              f"{m.time * 1e6:>12.1f} {c.predicted * 1e6:>12.1f} {c.ratio:>6.2f}"
              + ("" if c.within(args.tolerance) else "  off"))
    groups: dict = {}
    for c in table:
        m = c.measurement
        groups.setdefault((m.ranks, m.nodes), []).append(c)
    inside = sum(c.within(args.tolerance) for c in table)
    print(f"# within {args.tolerance:.0%}: {inside} of {len(table)} calls; " + "; ".join(
        f"{r} ranks on {n} node(s): {sum(c.within(args.tolerance) for c in cs)}/{len(cs)}"
        for (r, n), cs in sorted(groups.items())))
    repeated = {key: [ok for c in cs if (ok := c.measurement.repeated(args.tolerance))
                      is not None] for key, cs in sorted(groups.items())}
    counted = [ok for oks in repeated.values() for ok in oks]
    alike = sum(counted)
    if counted:
        launches = sorted({len(c.measurement.launch_times) for c in table} - {0})
        print(f"# the host itself: {alike} of {len(counted)} calls measured alike by every "
              f"launch ({'/'.join(map(str, launches))} launches each, within "
              f"{args.tolerance:.0%} of their median); " + "; ".join(
                  f"{r} ranks on {n} node(s): {sum(oks)}/{len(oks)}"
                  for (r, n), oks in repeated.items() if oks))
    held = [c for c in table if c.measurement.repeated(args.repeat_tolerance)]
    where = ""
    if args.baseline:
        earlier = _baseline(args, rows)
        agree = [c for c in table if _agrees(c.measurement, earlier, args.repeat_tolerance)]
        print(f"# the earlier measurement (--baseline): {len(agree)} of {len(table)} calls "
              f"within {args.repeat_tolerance:.0%} of this one")
        agreed = {id(c) for c in agree}
        held = [c for c in held if id(c) in agreed]
        where = " and the earlier measurement"
    held_in = sum(c.within(args.tolerance) for c in held)
    if counted:
        print(f"# held to the calls the host repeats (every launch{where} within "
              f"{args.repeat_tolerance:.0%} of their median): {held_in} of {len(held)} "
              f"within {args.tolerance:.0%}" + "".join(
                  f"; off: {c.measurement.op.value} {c.measurement.size} bytes at "
                  f"{c.measurement.ranks} ranks on {c.measurement.nodes} node(s) "
                  f"({c.ratio:.2f})"
                  for c in held if not c.within(args.tolerance)))
    elif args.repeatable_only:
        raise ValueError("--repeatable-only: the calls were measured by one launch each; "
                         "measure them with --launches 2 or more (or pass several --bench "
                         "files of one layout)")
    worst = max(table, key=lambda c: abs(c.ratio - 1.0))
    print(f"# worst: {worst.measurement.op.value} {worst.measurement.size} bytes at "
          f"{worst.measurement.ranks} ranks on {worst.measurement.nodes} node(s), "
          f"predicted / measured {worst.ratio:.2f}")
    if args.json:
        dump_json(args.json, {"kind": "neocomm-simulate-validate", "fabric": spec.name,
                          "tolerance": args.tolerance, "within": inside,
                          "measured_alike": alike if counted else None,
                          "repeat_tolerance": args.repeat_tolerance,
                          "repeatable": len(held) if counted else None,
                          "repeatable_within": held_in if counted else None,
                          "rows": [c.to_dict() for c in table]})
    if args.repeatable_only:
        return 0 if held and held_in == len(held) else 1
    return 0 if inside == len(table) else 1


def _baseline(args, rows) -> dict:
    """``{call: median seconds}`` of the ``--baseline`` measurements."""
    from collectives.calibrate import (call_key, measured_rows, median_of_launches,
                                       read_measurements)

    runs = median_of_launches([run for path in args.baseline for run in read_measurements(path)])
    return {call_key(m): m.time for m in measured_rows(runs, args.device)}


def _agrees(m, earlier: dict, tolerance: float) -> bool:
    """Whether the earlier measurement of ``m``'s call came within ``tolerance`` of it."""
    from collectives.calibrate import call_key

    then = earlier.get(call_key(m))
    return then is not None and abs(then / m.time - 1.0) <= tolerance


def _layouts(args) -> list[tuple[int, int]]:
    """``(ranks, ranks per node)`` of every ``--ranks`` x ``--nodes`` that splits evenly."""
    layouts = [(r, r // n) for r in positive_counts(args.ranks, "--ranks", "rank counts like 2,4")
               for n in positive_counts(args.nodes, "--nodes", "node counts like 1,2")
               if r % n == 0 and n <= r]
    if not layouts:
        raise ValueError(f"--ranks {args.ranks} --nodes {args.nodes}: no rank count splits "
                         f"evenly over those nodes")
    return layouts


def _training_runs(args) -> list[dict]:
    """The training runs of ``--bench`` files (``--record`` of an earlier ``validate
    --step``), or runs made here now, each with the profile of its compute taken beside it;
    saved to ``--record`` when asked."""
    from collectives.fabric import read_json
    from embedding.profile import STEP_KIND, median_of_training_launches, run_training

    if args.bench:
        runs = []
        for path in args.bench:
            data = read_json(path)
            if not isinstance(data, dict) or data.get("kind") != STEP_KIND:
                raise ValueError(f"--bench {path}: expected the training runs that "
                                 f"`neocomm simulate validate --step --record` writes")
            runs += data["runs"]
        return median_of_training_launches(runs)  # several files of one layout: launches
    # across hosts every rank writes under --out: a folder they all see (the current one,
    # as the ranks' working directory is), not this host's own temporary directory
    import os

    shared = os.getcwd() if args.hostfile else None
    with _jobs_folder("neocomm-validate-", dir=shared) as tmp:
        return run_training(_layouts(args), config=args.config, steps=args.steps,
                            out_dir=tmp, hostfile=args.hostfile, launches=args.launches,
                            echo=lambda c: print(f"# running: {c}", flush=True))


def _validate_step(args) -> int:
    import platform

    from collectives.calibrate import launches_agree
    from embedding.profile import STEP_KIND

    args.flops = None
    args.ranks_per_node = args.memory = args.plan = args.batch_size = None
    args.no_overlap = False
    job = Job(args)
    if not job.profiled:
        raise ValueError(f"--fabric {args.fabric}: the step is validated on the machine at "
                         f"hand, a fabric without GPUs (cpu-host or its calibration)")
    runs = _training_runs(args)
    print(f"# neocomm simulate validate --step: {args.config or 'the default config'} on "
          f"fabric {args.fabric!r}; pass: |predicted / measured - 1| <= {args.tolerance:.0%}")
    print(f"# {'ranks':>5} {'nodes':>5} {'measured ms':>12} {'predicted ms':>12} {'ratio':>6}"
          f"   parts (measured / predicted ms)")
    rows, inside = [], 0
    for run in runs:
        profile = run.get("profile")
        if profile is not None:
            profile = {int(r): p for r, p in profile.items()}
        est, _, _ = job.step(run["ranks"], job.batch, nodes=run["nodes"],
                             emulated=run.get("emulated", True), profile=profile)
        measured = run["median_step_ms"] / 1e3
        ratio = est.step_seconds / measured
        ok = abs(ratio - 1.0) <= args.tolerance
        inside += ok
        phases = run["median_phases_ms"]
        detail = " ".join(f"{p} {phases.get(p, 0.0):.1f}/{t * 1e3:.1f}" for p, t in est.parts
                          if phases.get(p, 0.0) >= 0.05 or t >= 5e-5)
        print(f"  {run['ranks']:>5} {run['nodes']:>5} {measured * 1e3:>12.2f} "
              f"{est.step_seconds * 1e3:>12.2f} {ratio:>6.2f}   {detail}"
              + ("" if ok else "  off"))
        run = dict(run, profile={str(r): p for r, p in job.last_profile.items()})
        rows.append({"run": run, "predicted": est.to_dict(), "ratio": ratio})
    print(f"# within {args.tolerance:.0%}: {inside} of {len(runs)} layouts")
    repeats = [run for run in runs if len(run.get("launch_step_ms") or ()) > 1]
    if repeats:
        alike = [run for run in repeats if launches_agree(
            run["launch_step_ms"], run["median_step_ms"], args.tolerance)]
        print(f"# the host itself: {len(alike)} of {len(repeats)} layouts measured alike by "
              f"every launch (within {args.tolerance:.0%} of their median step; launches "
              + ", ".join(f"{r['ranks']}x{r['nodes']}: " + "/".join(
                  f"{t:.1f}" for t in r["launch_step_ms"]) + " ms" for r in repeats) + ")")
    if args.record:
        dump_json(args.record, {"kind": STEP_KIND, "host": platform.node(),
                            "runs": [r["run"] for r in rows]})
    if args.json:
        dump_json(args.json, {"kind": "neocomm-simulate-validate-step", "fabric": args.fabric,
                          "tolerance": args.tolerance, "within": inside, "rows": rows})
    return 0 if inside == len(runs) else 1
