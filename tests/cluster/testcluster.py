"""A cluster of real hosts on one machine: network namespaces joined by a bridge.

Each host is a set of fresh Linux namespaces (network, UTS, IPC, mount, PID) whose first
process is ``hostinit.py``: its own host name and address, its own /dev/shm and /tmp, its
own process table, and an ``/etc/hosts`` naming every host of the cluster. The hosts'
links (``eth0``, a veth pair) end on a bridge inside a namespace of its own (the
"switch"), so no address of the cluster exists outside the namespaces made here and
nothing is routed anywhere else. Each host runs a small remote shell (``sshd.py``); its
client is what the MPI launcher runs in place of ssh to start its daemons on the other
hosts, over the cluster's own network.

Everything is torn down by handle: killing a host's first process ends every process of
that host, and the kernel removes its namespaces with their mounts and links; the switch
goes the same way. Nothing is looked up or removed by name.

    with TestCluster(["node-a", "node-b"]) as cluster:
        cluster.run("node-a", ["hostname"]).stdout   # "node-a\\n"

Needs root on Linux with ``unshare``, ``nsenter``, ``ip`` (and ``tc`` for a shaped link);
:func:`why_unavailable` says what is missing.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

__all__ = ["TestCluster", "Host", "why_unavailable", "SUBNET"]

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
#: the cluster's addresses (a /24 that exists only inside its namespaces)
SUBNET = "10.231.7"
#: exits 0 when the address answers (a refused connection is an answer)
_PROBE = ("import socket, sys\ntry:\n    socket.create_connection((sys.argv[1], 9), 1).close()\n"
          "except ConnectionRefusedError:\n    pass\n")
_NAMESPACES = ["--net", "--uts", "--ipc", "--mount", "--pid", "--fork"]


def why_unavailable() -> str | None:
    """Why a test cluster cannot be built here, or None when it can."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "building network namespaces needs root"
    for tool in ("unshare", "nsenter", "ip", "mount"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (util-linux / iproute2)"
    probe = subprocess.run(["unshare", "--net", "--uts", "--mount", "--pid", "--fork", "true"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return f"unshare cannot make namespaces here: {probe.stderr.strip() or probe.returncode}"
    return None


@dataclass
class Host:
    """One host of the cluster: its name, address and first process (a root-namespace pid)."""

    name: str
    addr: str
    pid: int = 0
    sshd: int = 0  # the host's remote shell, a pid on the host
    proc: subprocess.Popen | None = field(default=None, repr=False)


class TestCluster:
    """Hosts named ``names`` on one bridge; ``rate`` (e.g. ``"1gbit"``) shapes each host's
    link with a token bucket in both directions. ``shm_bytes`` and ``tmp_bytes`` size
    each host's /dev/shm and /tmp."""

    __test__ = False  # not a pytest class

    def __init__(self, names, *, rate: str | None = None, shm_bytes: int = 512 << 20,
                 tmp_bytes: int = 512 << 20, shared: tuple[str, ...] = ()):
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"names: expected distinct host names, got {names!r}")
        self.hosts = [Host(n, f"{SUBNET}.{10 + i}") for i, n in enumerate(names)]
        self.rate = rate
        self.shm_bytes, self.tmp_bytes = shm_bytes, tmp_bytes
        self.workdir = tempfile.mkdtemp(prefix="neocomm-cluster-")
        self.shared = tuple(dict.fromkeys([sys.prefix, ROOT, self.workdir, *shared]))
        self._switch: subprocess.Popen | None = None
        self._switch_pid = 0

    # -- life cycle ---------------------------------------------------------------------
    def __enter__(self) -> "TestCluster":
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        hosts_file = os.path.join(self.workdir, "hosts")
        with open(hosts_file, "w") as fh:
            fh.write("127.0.0.1\tlocalhost\n")
            for h in self.hosts:
                fh.write(f"{h.addr}\t{h.name}\n")
        self._switch, self._switch_pid, _ = self._spawn(
            ["unshare", "--net", "--", sys.executable, "-c",
             "import time, sys; print('ready', flush=True); time.sleep(1e9)"])
        self._in(self._switch_pid, ["ip", "link", "add", "br0", "type", "bridge"])
        self._in(self._switch_pid, ["ip", "link", "set", "br0", "up"])
        for i, h in enumerate(self.hosts):
            cfg = {"name": h.name, "shm_bytes": self.shm_bytes, "tmp_bytes": self.tmp_bytes,
                   "shared": list(self.shared), "hosts_file": hosts_file}
            h.proc, h.pid, h.sshd = self._spawn(["unshare", *_NAMESPACES, "--", sys.executable,
                                         os.path.join(HERE, "hostinit.py"), json.dumps(cfg)])
            port = f"p{i}"
            subprocess.run(["ip", "link", "add", port, "netns", str(self._switch_pid), "type",
                            "veth", "peer", "name", "eth0", "netns", str(h.pid)], check=True)
            self._in(self._switch_pid, ["ip", "link", "set", port, "master", "br0"])
            self._in(self._switch_pid, ["ip", "link", "set", port, "up"])
            self._in(h.pid, ["ip", "addr", "add", f"{h.addr}/24", "dev", "eth0"])
            self._in(h.pid, ["ip", "link", "set", "eth0", "up"])
            if self.rate:
                for pid, dev in ((h.pid, "eth0"), (self._switch_pid, port)):
                    self._in(pid, ["tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                                   self.rate, "burst", "64kb", "latency", "50ms"])
        self.agent = os.path.join(self.workdir, "ssh")
        with open(self.agent, "w") as fh:
            fh.write(f"#!/bin/sh\nexec {sys.executable} {os.path.join(HERE, 'sshd.py')} "
                     f"\"$@\"\n")
        os.chmod(self.agent, 0o755)
        self._wait_links()

    def close(self) -> None:
        """Kill every host (and so everything on it) and the switch; remove the workdir."""
        for h in self.hosts:
            self._kill(h.proc, h.pid)
            h.pid = 0
        self._kill(self._switch, self._switch_pid)
        self._switch = None
        shutil.rmtree(self.workdir, ignore_errors=True)

    # -- use ----------------------------------------------------------------------------
    def host(self, name: str) -> Host:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(f"no host {name!r} in this cluster ({[h.name for h in self.hosts]})")

    def launch_env(self, **extra: str) -> dict:
        """The environment a user's shell on a head host has (this Python's environment,
        its bin first on PATH, this checkout first on PYTHONPATH) plus what the MPI
        launcher needs here: the ssh stand-in, and MPI's traffic kept on the cluster's
        link."""
        env = dict(os.environ)
        env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
        # the hosts run this checkout's code (neocomm run passes PYTHONPATH to every
        # rank), whichever checkout the environment has installed
        env["PYTHONPATH"] = os.pathsep.join(
            [ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != ROOT])
        env.pop("NEOCOMM_RANKS_PER_NODE", None)
        env.update({"PRTE_MCA_plm_ssh_agent": self.agent,
                    "PRTE_MCA_oob_tcp_if_include": f"{SUBNET}.0/24",
                    "OMPI_MCA_btl_tcp_if_include": f"{SUBNET}.0/24",
                    "OMPI_MCA_btl": "self,sm,tcp", "OMPI_MCA_pml": "ob1",
                    "OMPI_MCA_mtl": "^ofi", "HOME": "/root",
                    # the hosts share this machine's cores: a rank waiting for a message
                    # yields its core instead of spinning on it (each host alone is not
                    # oversubscribed, so MPI would spin)
                    "OMPI_MCA_mpi_yield_when_idle": "1"})
        env.update(extra)
        return env

    def popen(self, host: str, argv: list[str], *, env: dict | None = None,
              cwd: str | None = None, **kw) -> subprocess.Popen:
        """Start ``argv`` on ``host`` (as a user logged in there would), output piped."""
        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("stderr", subprocess.PIPE)
        return subprocess.Popen(self._enter(self.host(host).pid, cwd) + list(argv),
                                env=self.launch_env() if env is None else env, text=True, **kw)

    def run(self, host: str, argv: list[str], *, env: dict | None = None, timeout: float = 300,
            cwd: str | None = None, check: bool = False) -> subprocess.CompletedProcess:
        """Run ``argv`` on ``host`` and wait (``timeout`` seconds, then the host's processes
        of it are killed with the host at close)."""
        proc = self.popen(host, argv, env=env, cwd=cwd)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            raise AssertionError(f"{argv} on {host} did not finish in {timeout} s\n"
                                 f"stdout:\n{out}\nstderr:\n{err}") from None
        done = subprocess.CompletedProcess(argv, proc.returncode, out, err)
        if check and done.returncode != 0:
            raise AssertionError(f"{argv} on {host} exited {done.returncode}\nstdout:\n{out}\n"
                                 f"stderr:\n{err}")
        return done

    def hostfile(self, slots: dict[str, int | None] | None = None, name: str = "hostfile") -> str:
        """A hostfile in the shared folder: every host (or those of ``slots``), with
        ``slots=N`` where given."""
        slots = {h.name: None for h in self.hosts} if slots is None else slots
        path = os.path.join(self.workdir, name)
        with open(path, "w") as fh:
            for host, n in slots.items():
                fh.write(host + (f" slots={n}" if n else "") + "\n")
        return path

    def processes(self, host: str) -> list[str]:
        """The command lines of the processes on ``host`` besides its first one."""
        out = self._in(self.host(host).pid, ["ps", "-ww", "-eo", "pid=,args="], capture=True)
        rows = []
        for line in out.splitlines():
            pid, _, args = line.strip().partition(" ")
            if pid not in ("1", str(self.host(host).sshd)) and not args.startswith("ps "):
                rows.append(f"{pid} {args}")
        return rows

    def files(self, host: str, path: str) -> list[str]:
        """The names in ``path`` (e.g. /dev/shm) as ``host`` sees it."""
        out = self._in(self.host(host).pid, ["ls", "-A", path], capture=True)
        return out.split()

    def assert_clean(self, settle: float = 10.0, tmp_allowed: tuple[str, ...] = ()) -> None:
        """Every host has nothing left: no process but its first, nothing in /dev/shm or
        in /tmp besides the shared paths and names starting with ``tmp_allowed`` (waits
        up to ``settle`` seconds for processes that are on their way out)."""
        shared_tmp = {os.path.relpath(p, "/tmp").split(os.sep)[0] for p in self.shared
                      if not os.path.relpath(p, "/tmp").startswith("..")}
        end = time.monotonic() + settle
        while True:
            left = {}
            for h in self.hosts:
                procs = self.processes(h.name)
                shm = self.files(h.name, "/dev/shm")
                tmp = [n for n in self.files(h.name, "/tmp") if n not in shared_tmp
                       and not (tmp_allowed and n.startswith(tmp_allowed))]
                if procs or shm or tmp:
                    left[h.name] = {"processes": procs, "/dev/shm": shm, "/tmp": tmp}
            if not left or time.monotonic() > end:
                break
            time.sleep(0.2)
        assert not left, f"left behind on the hosts: {left}"

    def shape(self, rate: str) -> None:
        """Replace each host link's token bucket with ``rate`` (both directions)."""
        for i, h in enumerate(self.hosts):
            for pid, dev in ((h.pid, "eth0"), (self._switch_pid, f"p{i}")):
                self._in(pid, ["tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate",
                               rate, "burst", "64kb", "latency", "50ms"])
        self.rate = rate

    # -- internals ----------------------------------------------------------------------
    @staticmethod
    def _enter(pid: int, cwd: str | None = None) -> list[str]:
        return ["nsenter", "-t", str(pid), "-n", "-u", "-i", "-m", "-p",
                f"--wd={cwd or os.getcwd()}", "--"]

    def _in(self, pid: int, argv: list[str], capture: bool = False) -> str:
        done = subprocess.run(["nsenter", "-t", str(pid), "-n", "-m", "-u", "-i"]
                              + (["-p"] if pid != self._switch_pid else []) + ["--"] + argv,
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} (in namespace of {pid}) failed: "
                               f"{done.stderr.strip()}")
        return done.stdout

    @staticmethod
    def _spawn(argv: list[str]) -> tuple[subprocess.Popen, int, int]:
        """Start ``argv`` (an unshare), wait for its ``ready [N]``; the process, the pid of
        the process that runs in the new namespaces (unshare's child with ``--fork``, else
        unshare) and N (0 when not given)."""
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
        line = proc.stdout.readline().split()
        if line[:1] != ["ready"]:
            proc.kill()
            err = proc.stderr.read()
            raise RuntimeError(f"{' '.join(argv[:8])}... did not start: {err.strip()}")
        pid = proc.pid
        kids = f"/proc/{proc.pid}/task/{proc.pid}/children"
        if "--fork" in argv:
            with open(kids) as fh:
                pid = int(fh.read().split()[0])
        proc.stdout.close()
        return proc, pid, int(line[1]) if len(line) > 1 else 0

    @staticmethod
    def _kill(proc: subprocess.Popen | None, pid: int) -> None:
        if proc is None:
            return
        for target in {pid, proc.pid} - {0}:
            try:
                os.kill(target, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:  # pragma: no cover - the kernel is slow to reap
            pass
        if proc.stderr:
            proc.stderr.close()

    def _wait_links(self, timeout: float = 10.0) -> None:
        """Wait until every host reaches every other (the bridge learns addresses)."""
        end = time.monotonic() + timeout
        for a in self.hosts:
            for b in self.hosts:
                if a is b:
                    continue
                while subprocess.run(self._enter(a.pid) + [sys.executable, "-c", _PROBE,
                                                           b.addr], capture_output=True
                                     ).returncode != 0:
                    if time.monotonic() > end:
                        raise RuntimeError(f"{a.name} cannot reach {b.name} ({b.addr})")
                    time.sleep(0.1)
