"""A stand-in for NVIDIA's ``nvidia-cuda-mps-control``, for tests on machines without a GPU.

``install(directory)`` writes it there as an executable named ``nvidia-cuda-mps-control``
(this file with a ``#!`` line for the running interpreter); a test puts that directory
first on PATH. Stdlib only: it runs outside the test's interpreter.

It behaves as the real program does where ipcsync relies on it (see
ipcsync/launch/mps.py), and refuses the default directories (a test fails if the launcher
ever lets the daemon use them):

- ``-d``: daemonizes (double fork; the daemon leads its own session and process group;
  the command returns at once, before the daemon is ready), then after
  ``FAKE_MPS_START_DELAY`` seconds (default 0.2) listens
  on ``$CUDA_MPS_PIPE_DIRECTORY/control``, writes ``nvidia-cuda-mps-control.pid``,
  ``control_lock`` and a ``log`` fifo there and ``control.log`` in
  ``$CUDA_MPS_LOG_DIRECTORY``. Exits 1 with "An instance of this daemon is already
  running" where a live daemon's pid file is; exits 1 with ``$FAKE_MPS_FAIL_START`` as its
  message when that is set.
- without arguments: a client. Sends each line of stdin to the daemon and prints the
  answer; "Cannot find MPS control daemon process" and exit 1 when none listens.
- commands: ``get_server_list`` (the server's pid, if one runs), ``get_client_list PID``
  (its clients, or "Server PID not found"), ``quit`` (waits until every client has exited,
  stops the server, removes the pid file and the fifo, leaves the sockets, exits: the
  client's answer comes then) and, standing for the CUDA driver's connection at a
  process's first CUDA call, ``attach PID``: starts the server (a child of the daemon, in
  its session, named like the real one's 15 characters, without CUDA_MPS_* in its
  environment) if none runs and lists PID as
  its client. With ``FAKE_MPS_IGNORE_QUIT=1`` (in the daemon's environment) ``quit`` is
  answered never.
"""

from __future__ import annotations

import os
import signal
import socket
import stat
import sys
import time
from pathlib import Path

PID_FILE = "nvidia-cuda-mps-control.pid"
NAME = "nvidia-cuda-mps-control"


def install(directory: Path) -> Path:
    """Write the fake as ``directory/nvidia-cuda-mps-control`` (executable); its path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / NAME
    path.write_text(f"#!{sys.executable}\n" + Path(__file__).read_text())
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return False
    return data[data.rfind(b")") + 2:].split()[0] not in (b"Z", b"X")


class _Daemon:
    def __init__(self, pipe: str, log: str) -> None:
        self.pipe, self.log = pipe, log
        self.clients: list[int] = []
        self.server: int | None = None

    def say(self, line: str) -> None:
        with open(os.path.join(self.log, "control.log"), "a") as f:
            f.write(f"[{time.strftime('%H:%M:%S')} Control {os.getpid()}] {line}\n")

    def run(self) -> None:
        time.sleep(float(os.environ.get("FAKE_MPS_START_DELAY", "0.2")))
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(os.path.join(self.pipe, "control"))
        sock.listen(16)
        Path(self.pipe, "control_lock").touch()
        os.mkfifo(os.path.join(self.pipe, "log"))
        Path(self.pipe, PID_FILE).write_text(f"{os.getpid()}\n")
        self.say("Starting control daemon")
        while True:
            conn, _ = sock.accept()
            with conn:
                data = b""
                while not data.endswith(b"\n"):
                    chunk = conn.recv(4096)
                    if not chunk:
                        break
                    data += chunk
                words = data.decode().split()
                if words == ["quit"]:
                    if os.environ.get("FAKE_MPS_IGNORE_QUIT") == "1":
                        self.say("ignoring quit")
                        time.sleep(3600)
                    self.quit()
                    conn.sendall(b"")
                    return
                conn.sendall(self.answer(words).encode())

    def answer(self, words: list[str]) -> str:
        self.clients = [c for c in self.clients if _alive(c)]
        if words == ["get_server_list"]:
            return f"{self.server}\n" if self.server else ""
        if len(words) == 2 and words[0] == "get_client_list":
            if self.server is None or words[1] != str(self.server):
                return f"Server {words[1]} not found\n"
            return "".join(f"{c}\n" for c in self.clients)
        if len(words) == 2 and words[0] == "attach" and words[1].isdigit():
            if self.server is None:
                self.server = self.start_server()
            self.clients.append(int(words[1]))
            self.say(f"client {words[1]} attached to server {self.server}")
            return "ok\n"
        return f"unknown command {' '.join(words)!r}\n"

    def start_server(self) -> int:
        pid = os.fork()
        if pid == 0:
            try:  # without the pipe directory in its environment: found by its session
                env = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_MPS_")}
                os.execve(sys.argv[0], [sys.argv[0], "--server"], env)
            finally:
                os._exit(127)
        return pid

    def quit(self) -> None:
        self.say("quit: waiting for clients to exit")
        while any(_alive(c) for c in self.clients):
            time.sleep(0.05)
        if self.server is not None:
            os.kill(self.server, signal.SIGKILL)
            os.waitpid(self.server, 0)
        for name in (PID_FILE, "log"):
            try:
                os.unlink(os.path.join(self.pipe, name))
            except FileNotFoundError:
                pass
        self.say("Exit with status 0")


def _daemon() -> int:
    sys.argv[0] = os.path.abspath(sys.argv[0])  # the server is started from it after chdir("/")
    pipe, log = os.environ.get("CUDA_MPS_PIPE_DIRECTORY"), os.environ.get("CUDA_MPS_LOG_DIRECTORY")
    if not pipe or not log:
        print("fake nvidia-cuda-mps-control: refuses the default pipe and log directories", flush=True)
        return 3
    if os.environ.get("FAKE_MPS_FAIL_START"):
        print(os.environ["FAKE_MPS_FAIL_START"], flush=True)
        return 1
    try:
        old = int(Path(pipe, PID_FILE).read_text().strip())
    except (OSError, ValueError):
        old = 0
    if old and _alive(old):
        print("An instance of this daemon is already running", flush=True)
        return 1
    if os.fork() > 0:
        return 0
    if os.fork() > 0:
        os._exit(0)
    os.setsid()  # as the real one: the daemon leads its own session and process group
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.chdir("/")
    try:
        _Daemon(pipe, log).run()
    finally:
        os._exit(0)


def _client() -> int:
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
    for line in sys.stdin.read().splitlines():
        if not line.strip():
            continue
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            try:
                s.connect(os.path.join(pipe, "control"))
            except OSError:
                print("Cannot find MPS control daemon process", flush=True)
                return 1
            s.sendall(line.encode() + b"\n")
            answer = b""
            while chunk := s.recv(4096):
                answer += chunk
        sys.stdout.write(answer.decode())
    sys.stdout.flush()
    return 0


def _server() -> int:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    if sys.argv[1:] == ["-d"]:
        sys.exit(_daemon())
    if sys.argv[1:] == ["--server"]:
        sys.exit(_server())
    sys.exit(_client())
