"""A fork server for the test peers: one process per pytest worker imports torch, numpy,
msgpack and pyzmq once; every peer the `procs` fixture starts is then a fork of it instead
of a new interpreter that imports torch again (about 2.5 s of CPU each on a 2-core
machine; the suite starts hundreds of peers).

What a peer sees is what ``python -c <launch> module role args`` gives it: its own session
(``start_new_session``), stdin from /dev/null, stdout and stderr on the pipes the test
reads, the environment and working directory the test chose, SIGINT raising
KeyboardInterrupt, faulthandler on SIGUSR1, and the exit status Python would give
(an uncaught exception: 1; Ctrl-C: killed by SIGINT; ``sys.exit(x)``: as Python maps it).
ipcsync itself is not preloaded: the peer imports it after its environment is set, so
every ``IPCSYNC_*`` variable the test sets is read as in a fresh process.
``Procs.start`` falls back to a fresh interpreter for an environment that changes what an
interpreter or a preloaded module reads at start (``PYTHON*``, ``OMP_*``, ``MKL_*``,
``TORCH_*``...): see ``ForkServer.forkable``.

Wire format (a Unix socketpair, one request at a time, guarded by a lock on the client):
the client sends one JSON header (argv, env, cwd) with three descriptors attached
(SCM_RIGHTS): the child's stdout, its stderr and the write end of a status pipe. The
server answers the child's pid as 8 bytes, watches the child through a pidfd, reaps it and
writes its return code (Popen's convention: ``-N`` for a signal) as text into the status
pipe. The client side (``ForkedProcess``) offers what tests use of ``subprocess.Popen``:
``pid``, ``poll``, ``wait(timeout=)``, ``returncode``, ``stdout``, ``stderr``, ``stdin``
(None), ``send_signal``, ``kill``, ``terminate``. The server exits when its socket closes
(its pytest worker is gone) and never writes to its own stdout.
"""

from __future__ import annotations

import array
import json
import os
import select
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
from typing import IO, Any

PRELOAD = ("torch", "numpy", "msgpack", "zmq")
# Variables an interpreter or a preloaded module reads when it starts: a peer whose
# environment changes one of them from the server's gets a fresh interpreter instead.
STARTUP_PREFIXES = ("PYTHON", "OMP_", "MKL_", "OPENBLAS_", "TORCH_", "PYTORCH_", "LD_", "MALLOC_",
                    "ZMQ_", "NUMPY_", "KMP_", "GOMP_", "CUDA_MODULE_LOADING")
_MAX_HEADER = 1 << 20
_PID = struct.Struct("<q")


# --------------------------------------------------------------------------- server
def serve(fd: int) -> None:
    """Run the server on the socket ``fd`` until it closes."""
    for name in PRELOAD:
        __import__(name)
    sock = socket.socket(fileno=fd)
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ, None)
    while True:
        for key, _ in sel.select():
            if key.data is None:
                if not _accept(sock, sel):
                    return
            else:
                pid, status_w = key.data
                sel.unregister(key.fileobj)
                os.close(key.fd)
                _, wstatus = os.waitpid(pid, 0)
                try:
                    os.write(status_w, str(os.waitstatus_to_exitcode(wstatus)).encode())
                except OSError:
                    pass  # the test side closed its end: nobody is waiting
                os.close(status_w)


def _recv_exact(sock: socket.socket, n: int, fds: list[int]) -> bytes | None:
    buf = b""
    while len(buf) < n:
        data, ancdata, _, _ = sock.recvmsg(n - len(buf), socket.CMSG_SPACE(3 * 4))
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                got = array.array("i")
                got.frombytes(payload[: len(payload) - len(payload) % 4])
                fds.extend(got)
        if not data:
            return None
        buf += data
    return buf


def _accept(sock: socket.socket, sel: selectors.BaseSelector) -> bool:
    """Read one request and fork its child; False when the client is gone."""
    fds: list[int] = []
    head = _recv_exact(sock, 4, fds)
    if head is None:
        return False
    (size,) = struct.unpack("<I", head)
    if size > _MAX_HEADER:
        return False
    body = _recv_exact(sock, size, fds)
    if body is None or len(fds) != 3:
        for fd in fds:
            os.close(fd)
        return False
    request = json.loads(body)
    out_w, err_w, status_w = fds
    pid = os.fork()
    if pid == 0:
        try:
            _child(request, out_w, err_w)
        finally:
            os._exit(70)  # _child never returns; this only guards against a bug in it
    os.close(out_w)
    os.close(err_w)
    sel.register(os.pidfd_open(pid), selectors.EVENT_READ, (pid, status_w))
    sock.sendall(_PID.pack(pid))
    return True


def _child(request: dict[str, Any], out_w: int, err_w: int) -> None:
    """Become the peer: its session, stdio, environment and directory, then run it the way
    ``python -c`` would, and exit with the status Python would give."""
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    os.closerange(3, min(os.sysconf("SC_OPEN_MAX"), 65536))
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.argv = ["-c", *request["argv"]]
    import faulthandler  # noqa: PLC0415 - after fd 2 is the peer's stderr

    faulthandler.register(signal.SIGUSR1, all_threads=True)
    code = _run(request["argv"])
    os._exit(code)


def _run(argv: list[str]) -> int:
    """Run ``<module>.<role>(args)``; the exit code ``python -c`` would end with."""
    import importlib  # noqa: PLC0415
    import traceback  # noqa: PLC0415 - for what fails in the exit steps

    code = 0
    try:
        module, role, args = argv
        getattr(importlib.import_module(module), role)(json.loads(args))
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException as exc:  # noqa: BLE001 - as the interpreter does: sys.excepthook, exit 1
        # As PyErr_Print: sys.last_* set (ipcsync's exit hook reads them), then the hook.
        sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, exc.__traceback__
        sys.last_exc = exc  # type: ignore[attr-defined]  # Python 3.12+
        sys.excepthook(type(exc), exc, exc.__traceback__)
        code = -signal.SIGINT if isinstance(exc, KeyboardInterrupt) else 1
    # What the interpreter does at exit: wait for non-daemon threads, run atexit, flush.
    try:
        threading._shutdown()  # type: ignore[attr-defined]
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    import atexit  # noqa: PLC0415

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if code == -signal.SIGINT:  # died of Ctrl-C, as a Python process does
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        code = 1
    return code


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1


# --------------------------------------------------------------------------- client
class ForkedProcess:
    """The part of ``subprocess.Popen`` the tests use, for a child of the fork server.

    The child is not this process's child: its exit status arrives through the status
    pipe once the server has reaped it."""

    stdin: IO[bytes] | None = None

    def __init__(self, args: list[str], pid: int, stdout: IO[bytes], stderr: IO[bytes], status_r: int) -> None:
        self.args = args
        self.pid = pid
        self.stdout: IO[bytes] | None = stdout
        self.stderr: IO[bytes] | None = stderr
        self.returncode: int | None = None
        self._status_r = status_r

    def _read_status(self, timeout: float | None) -> int | None:
        if self.returncode is not None:
            return self.returncode
        ready, _, _ = select.select([self._status_r], [], [], timeout)
        if not ready:
            return None
        data = os.read(self._status_r, 64)
        os.close(self._status_r)
        # Empty: the server died before it could reap the child; say "killed".
        self.returncode = int(data) if data else -signal.SIGKILL
        return self.returncode

    def poll(self) -> int | None:
        return self._read_status(0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._read_status(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def __del__(self) -> None:
        if self.returncode is None:
            try:
                os.close(self._status_r)
            except OSError:
                pass


class ForkServer:
    """This process's fork server, started on first use (``start``)."""

    def __init__(self, pythonpath: str) -> None:
        self.env = dict(os.environ, PYTHONPATH=pythonpath, PYTHONUNBUFFERED="1")
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    def _ensure(self) -> socket.socket:
        if self._sock is not None and self._proc is not None and self._proc.poll() is None:
            return self._sock
        self.close()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._proc = subprocess.Popen(
            [sys.executable, "-c", f"import forkserver; forkserver.serve({theirs.fileno()})"],
            pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, env=self.env, start_new_session=True,
        )
        theirs.close()
        self._sock = ours
        return ours

    def forkable(self, env: dict[str, str]) -> bool:
        """True when ``env`` differs from the server's only in variables that no
        interpreter or preloaded module has read by the time the server forks."""
        for key in set(env) | set(self.env):
            if env.get(key) != self.env.get(key) and key.startswith(STARTUP_PREFIXES):
                return False
        return True

    def start(self, argv: list[str], env: dict[str, str], cwd: str | None = None) -> ForkedProcess:
        """Fork a child running ``argv`` = [module, role, args-json] with ``env``."""
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        status_r, status_w = os.pipe()
        body = json.dumps({"argv": argv, "env": env, "cwd": cwd or os.getcwd()}).encode()
        try:
            with self._lock:
                sock = self._ensure()
                sock.sendmsg([struct.pack("<I", len(body)) + body],
                             [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [out_w, err_w, status_w]))])
                got = b""
                while len(got) < _PID.size:
                    chunk = sock.recv(_PID.size - len(got))
                    if not chunk:
                        raise RuntimeError("the test fork server exited; see its stderr above")
                    got += chunk
        except BaseException:
            for fd in (out_r, err_r, status_r):
                os.close(fd)
            raise
        finally:
            for fd in (out_w, err_w, status_w):
                os.close(fd)
        (pid,) = _PID.unpack(got)
        return ForkedProcess(argv, pid, os.fdopen(out_r, "rb"), os.fdopen(err_r, "rb"), status_r)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._proc is not None:
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
