"""The first process of one test host (PID 1 of its own PID namespace).

Started by :class:`tests.cluster.testcluster.TestCluster` inside fresh network, UTS,
IPC, mount and PID namespaces: it takes its host name, mounts the host's private
/dev/shm and /tmp, puts back the shared paths that live under /tmp (the Python
environment, the checkout, the cluster's shared folder: on a real cluster these are the
file system every node mounts), binds the cluster's hosts file over /etc/hosts, mounts its own /proc, starts the
host's remote shell (``sshd.py``), says ``ready PID`` (the shell's pid here) and then
reaps orphans until it is killed. Killing it ends every process of
the host, and the kernel then removes the host's namespaces, mounts and links.

    python hostinit.py CONFIG_JSON
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True)


def main(cfg: dict) -> None:
    socket.sethostname(cfg["name"])
    _mount("--make-rprivate", "/")
    _mount("-t", "tmpfs", "-o", f"size={cfg['shm_bytes']}", "tmpfs", "/dev/shm")
    stage = "/mnt"  # private to this mount namespace: holds the shared /tmp a moment
    _mount("--bind", "/tmp", stage)
    _mount("-t", "tmpfs", "-o", f"size={cfg['tmp_bytes']}", "tmpfs", "/tmp")
    os.chmod("/tmp", 0o1777)
    for path in cfg["shared"]:
        rel = os.path.relpath(path, "/tmp")
        if rel.startswith(".."):
            continue  # not under /tmp: already the same on every host
        os.makedirs(path, exist_ok=True)
        _mount("--bind", os.path.join(stage, rel), path)
    subprocess.run(["umount", "-l", stage], check=True)
    _mount("-t", "proc", "proc", "/proc")  # this host's own process table
    _mount("--bind", cfg["hosts_file"], "/etc/hosts")
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    sshd = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), "sshd.py"),
                             "serve"], stdout=subprocess.PIPE, text=True)
    if sshd.stdout.readline().strip() != "listening":
        raise SystemExit(f"{cfg['name']}: the remote shell did not start")
    print(f"ready {sshd.pid}", flush=True)
    while True:  # PID 1: reap whatever is orphaned here
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            time.sleep(0.2)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
