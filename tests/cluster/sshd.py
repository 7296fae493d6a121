"""The test hosts' remote shell: a small sshd, and the client the MPI launcher runs as ssh.

Server (started on every host by ``hostinit.py``): ``sshd.py serve PORT``. Each
connection carries one command; the server runs it as a fresh login would be run
(``/bin/sh -c`` in a session of its own, a clean environment, the home directory as
working directory, stdin from /dev/null), sends its output back and then its exit status.
When the client goes away first the session gets SIGHUP, then SIGKILL, as sshd does.

Client (``PRTE_MCA_plm_ssh_agent``): ``sshd.py [ssh options] HOST COMMAND...`` connects to
HOST over the cluster's own network (names from the host's /etc/hosts), joins the command
words with spaces as ssh does, copies the output to its stdout and stderr and exits with
the command's status; 255 when it cannot connect ("Could not resolve hostname", "Connection
refused"), as ssh does.

Frames both ways: one byte of channel (1 stdout, 2 stderr, 3 exit status), four bytes of
big-endian length, the bytes.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading

#: what a login shell on a fresh host starts with (Debian's default PATH)
LOGIN_ENV = {"HOME": "/root", "USER": "root", "LOGNAME": "root", "SHELL": "/bin/sh",
             "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
PORT = 22
#: ssh options that take a value (the launcher may pass some)
_WITH_VALUE = set("bcDEeFIiJLlmOopQRSWw")
_HEAD = struct.Struct(">BI")


def _send(sock: socket.socket, lock: threading.Lock, channel: int, data: bytes) -> None:
    with lock:
        sock.sendall(_HEAD.pack(channel, len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            return None
        buf += part
    return buf


# -- server ---------------------------------------------------------------------------------
def _session(conn: socket.socket) -> None:
    lock = threading.Lock()
    with conn:
        line = b""
        while not line.endswith(b"\n"):
            part = conn.recv(4096)
            if not part:
                return
            line += part
        command = json.loads(line)["command"]
        proc = subprocess.Popen(["/bin/sh", "-c", command], env=LOGIN_ENV,
                                cwd=LOGIN_ENV["HOME"], stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)

        def pump(stream, channel):
            for chunk in iter(lambda: stream.read1(65536), b""):
                try:
                    _send(conn, lock, channel, chunk)
                except OSError:
                    break

        def hangup():  # the client went away: end the session as sshd does
            try:
                while conn.recv(4096):
                    pass
            except OSError:
                pass
            if proc.poll() is None:
                for sig in (signal.SIGHUP, signal.SIGKILL):
                    try:
                        os.killpg(proc.pid, sig)
                    except ProcessLookupError:
                        return
                    try:
                        proc.wait(timeout=5)
                        return
                    except subprocess.TimeoutExpired:
                        pass

        pumps = [threading.Thread(target=pump, args=(proc.stdout, 1), daemon=True),
                 threading.Thread(target=pump, args=(proc.stderr, 2), daemon=True)]
        for t in pumps:
            t.start()
        threading.Thread(target=hangup, daemon=True).start()
        rc = proc.wait()
        for t in pumps:
            t.join()
        try:
            _send(conn, lock, 3, str(rc if rc >= 0 else 128 - rc).encode())
            conn.shutdown(socket.SHUT_WR)
            conn.recv(1)  # until the client closes
        except OSError:
            pass


def serve(port: int) -> None:
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", port))
    srv.listen(64)
    print("listening", flush=True)
    while True:
        conn, _ = srv.accept()
        threading.Thread(target=_session, args=(conn,), daemon=True).start()


# -- client ---------------------------------------------------------------------------------
def client(argv: list[str]) -> int:
    args = list(argv)
    while args and args[0].startswith("-"):
        opt = args.pop(0)
        if len(opt) == 2 and opt[1] in _WITH_VALUE and args:
            args.pop(0)
    if not args:
        sys.stderr.write("usage: ssh HOST COMMAND...\n")
        return 255
    host, command = args[0].split("@")[-1], " ".join(args[1:])
    try:
        sock = socket.create_connection((host, PORT), timeout=30)
    except socket.gaierror:
        sys.stderr.write(f"ssh: Could not resolve hostname {host}: Name or service not known\n")
        return 255
    except OSError as exc:
        sys.stderr.write(f"ssh: connect to host {host} port {PORT}: {exc.strerror or exc}\n")
        return 255
    sock.settimeout(None)
    with sock:
        sock.sendall(json.dumps({"command": command}).encode() + b"\n")
        outs = {1: sys.stdout.buffer, 2: sys.stderr.buffer}
        while True:
            head = _recv_exact(sock, _HEAD.size)
            if head is None:
                sys.stderr.write(f"Connection to {host} closed by remote host.\n")
                return 255
            channel, n = _HEAD.unpack(head)
            data = _recv_exact(sock, n) if n else b""
            if data is None:
                return 255
            if channel == 3:
                return int(data)
            outs[channel].write(data)
            outs[channel].flush()


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        serve(int(sys.argv[2]) if len(sys.argv) > 2 else PORT)
    else:
        sys.exit(client(sys.argv[1:]))
