"""The private MPS control daemon of one ``ipcsync-run`` run, and the watchdog that ends
it when the launcher cannot (``mps.decide`` says whether a run gets one).

- ``PrivateMps``: ``start()`` (before the stages) makes a private directory (mkdtemp,
  0700) ``mps-XXXXXXXX`` in the runtime directory (or ``$TMPDIR`` where that path is too
  long for the daemon's sockets), with ``pipe/`` and ``log/`` (never the default
  ``/tmp/nvidia-mps``), starts the watchdog, then ``nvidia-cuda-mps-control -d`` with
  ``CUDA_MPS_PIPE_DIRECTORY`` and ``CUDA_MPS_LOG_DIRECTORY`` set, and waits until the
  daemon answers. ``apply(plan)`` gives every CUDA stage process those two variables and
  ``IPCSYNC_MPS_PIPE`` / ``IPCSYNC_MPS_CONTROL`` (``ipcsync.mps_attach``: each process
  checks that it is a client). ``stop()`` (after the run: success, failure, Ctrl-C) has
  the watchdog end it, and waits for its report.
- ``cleanup(root, ...)``: the one way a daemon ends: ``quit`` through the control program
  (bounded: quit waits for attached clients), SIGKILL to what is left of it
  (``leftovers``: this user's ``nvidia-cuda-mps*`` processes that are the daemon, in its
  session or process group, such as its servers, or whose environment names the pipe
  directory), then the directory removed.
- The watchdog, ``python -m ipcsync.launch.mps_daemon watch ROOT CONTROL QUIT_TIMEOUT``:
  started by ``start()``, it leaves the launcher's process tree (double fork, its own
  session: the launcher, a child subreaper, kills its descendants after every attempt)
  and holds the read end of a pipe whose write end only the launcher holds. When the pipe
  reaches EOF (``stop()`` closed it, or the launcher exited or was SIGKILLed) it runs
  ``cleanup``, writes one JSON line of what it did to its stdout (``stop()`` reads it) and
  exits. ``sweep_abandoned`` cleans up after a launcher whose watchdog was killed too.

Facts of the real daemon (CUDA 13, driver 580) this relies on: ``-d`` daemonizes (its own
session) and returns; the pipe directory then holds ``control`` (the socket clients and
``nvidia-cuda-mps-control`` connect to), ``control_privileged``, ``control_lock``, a
``log`` fifo and ``nvidia-cuda-mps-control.pid``; the server
(``nvidia-cuda-mps-server``, a child of the daemon, in its session) starts at the first
client's ``cuInit``; ``quit`` blocks while clients are attached, then removes the pid file
and the fifo and leaves the sockets; ``get_client_list`` of an unknown server prints
"Server N not found" and exits 0.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

from .. import stage_contract as contract
from ..errors import ConfigError
from ..limits import IPC_PATH_MAX
from ..mps_attach import LOG_ENV, PIPE_ENV, ask
from ..system import files, host
from .plan import Plan

__all__ = [
    "PrivateMps", "cleanup", "sweep_abandoned", "leftovers", "running_daemons", "watch", "main", "PID_FILE",
    "START_TIMEOUT", "QUIT_TIMEOUT",
]

PID_FILE = "nvidia-cuda-mps-control.pid"  # the daemon's pid, in its pipe directory
_NAME_PREFIX = "nvidia-cuda-mps"  # the daemon's and the servers' command names (15 characters of them)
_LONGEST_SOCKET = "pipe/control_privileged"  # the longest socket path the daemon makes, from the root
_OWNER = "owner.json"
START_TIMEOUT = 15.0  # seconds for nvidia-cuda-mps-control -d to return and the daemon to answer
QUIT_TIMEOUT = 10.0  # seconds for "quit" (it waits for attached clients), then SIGKILL
_KILL_WAIT = 5.0
_WATCH_START = 30.0  # seconds for the watchdog's interpreter to start (a loaded machine)


# ---------------------------------------------------------------------------- processes
@dataclass(frozen=True)
class _Proc:
    pid: int
    comm: str
    pgrp: int
    session: int
    start: int


def _mps_procs() -> list[_Proc]:
    """Live processes whose command name is an MPS daemon's or server's."""
    found = []
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return []
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue
        comm = data[data.find(b"(") + 1: data.rfind(b")")].decode(errors="replace")
        fields = data[data.rfind(b")") + 2:].split()
        if not comm.startswith(_NAME_PREFIX) or len(fields) < 20 or fields[0] in (b"Z", b"X"):
            continue
        try:
            found.append(_Proc(int(entry), comm, int(fields[2]), int(fields[3]), int(fields[19])))
        except ValueError:
            continue
    return found


def _full_name(pid: int) -> str | None:
    """The program name of an MPS process from its command line: its first word, or the
    second where the first is an interpreter running it as a script."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            words = f.read(4096).split(b"\0")[:2]
    except OSError:
        return None
    names = [os.path.basename(w.decode(errors="replace")) for w in words]
    return next((n for n in names if n.startswith(_NAME_PREFIX)), None)


def running_daemons() -> list[tuple[int, str]]:
    """MPS control daemons and servers running here, any user's: (pid, program name). The
    kernel keeps 15 characters of a command name, so the name is read from the command line."""
    return [(p.pid, _full_name(p.pid) or p.comm) for p in _mps_procs()]


def _environ_names(pid: int, pipe: str) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read()
    except OSError:
        return False
    return f"{PIPE_ENV}={pipe}".encode() in env.split(b"\0")


def leftovers(daemon: tuple[int, int] | None, pipe: str) -> list[tuple[int, str]]:
    """This user's MPS processes that belong to the daemon ``daemon`` (pid, start time) of
    ``pipe``: the daemon itself, the processes of its session or process group (its
    servers), and any whose environment names ``pipe``. (pid, command name) each."""
    uid = os.getuid()
    found = []
    for p in _mps_procs():
        try:
            if os.stat(f"/proc/{p.pid}").st_uid != uid:
                continue
        except OSError:
            continue
        mine = daemon is not None and (
            (p.pid == daemon[0] and p.start == daemon[1]) or daemon[0] in (p.pgrp, p.session)
        )
        if mine or _environ_names(p.pid, pipe):
            found.append((p.pid, p.comm))
    return found


def _read_pid(pipe: str) -> int | None:
    try:
        with open(os.path.join(pipe, PID_FILE), "rb") as f:
            text = f.read(64).strip()
    except OSError:
        return None
    return int(text) if text.isdigit() and int(text) > 0 else None


def _identity(pid: int | None) -> tuple[int, int] | None:
    started = host.read_start_time(pid) if pid is not None else None
    return (pid, started) if pid is not None and started is not None and started != host.GONE else None


def _alive(daemon: tuple[int, int] | None) -> bool:
    return daemon is not None and host.read_start_time(daemon[0]) == daemon[1]


def cleanup(root: str, control: str, daemon: tuple[int, int] | None = None,
            quit_timeout: float = QUIT_TIMEOUT) -> list[str]:
    """End the MPS daemon of the private directory ``root`` and remove the directory:
    ``quit`` through ``control`` (up to ``quit_timeout`` seconds: it waits for attached
    clients), then SIGKILL to what is left of it (``leftovers``). ``daemon``: its (pid,
    start time), else read from its pid file. Returns lines saying what went wrong or had
    to be killed (empty when it quit cleanly). Safe to run twice."""
    pipe = os.path.join(root, "pipe")
    said: list[str] = []
    if daemon is None:
        daemon = _identity(_read_pid(pipe))
    if _alive(daemon) and os.path.exists(os.path.join(pipe, "control")):
        assert daemon is not None
        try:
            rc, out = ask(pipe, "quit", control, timeout=quit_timeout)
            if rc != 0:
                said.append(f"quit: {control} exited {rc}: {out.strip()[:200]}")
        except subprocess.TimeoutExpired:
            said.append(f"the MPS daemon (pid {daemon[0]}) did not quit within {quit_timeout:g} s "
                        "(clients still attached)")
        except OSError as exc:
            said.append(f"cannot ask the MPS daemon (pid {daemon[0]}) to quit: {exc}")
        deadline = time.monotonic() + _KILL_WAIT
        while _alive(daemon) and time.monotonic() < deadline:
            time.sleep(0.02)
    victims = leftovers(daemon, pipe)
    for pid, _ in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + _KILL_WAIT
    while victims and time.monotonic() < deadline:
        victims = [(pid, c) for pid, c in victims if host.read_start_time(pid) != host.GONE]
        if victims:
            time.sleep(0.02)
    killed = [f"pid {pid} ({comm})" for pid, comm in leftovers(daemon, pipe)]
    if killed:
        said.append(f"cannot kill MPS process(es) {', '.join(killed)}")
    shutil.rmtree(root, ignore_errors=True)
    if os.path.lexists(root):
        said.append(f"cannot remove {root}")
    return said


def _write_owner(root: str, owner: dict[str, Any]) -> None:
    try:
        files.write_atomic(os.path.join(root, _OWNER), json.dumps(owner))
    except OSError:
        pass  # only sweep_abandoned reads it; the watchdog does not need it


def sweep_abandoned(base: str, control: str) -> list[str]:
    """Clean up the private MPS directories in ``base`` whose launcher and watchdog are
    both gone (``cleanup``); returns the directories removed."""
    removed = []
    try:
        names = [n for n in os.listdir(base) if n.startswith("mps-")]
    except OSError:
        return []
    for name in names:
        root = os.path.join(base, name)
        try:
            with open(os.path.join(root, _OWNER), "rb") as f:
                owner = json.loads(f.read(4096))
            who = {k: (int(owner[k][0]), int(owner[k][1])) for k in ("launcher", "watchdog") if k in owner}
            daemon = (int(owner["daemon"][0]), int(owner["daemon"][1])) if "daemon" in owner else None
        except (OSError, ValueError, KeyError, TypeError, IndexError):
            continue
        if "launcher" not in who or any(host.process_alive(*ident) for ident in who.values()):
            continue
        cleanup(root, control, daemon)
        if not os.path.lexists(root):
            removed.append(root)
    return removed


# ---------------------------------------------------------------------------- the daemon of a run
def _private_root(base: str) -> str:
    """A fresh private directory (0700) for the daemon's pipe and log directories, in
    ``base`` or, where the daemon's socket paths would be too long there, in $TMPDIR."""
    for where in (base, tempfile.gettempdir()):
        longest = os.path.join(where, "mps-xxxxxxxx", _LONGEST_SOCKET)
        if len(longest.encode()) <= IPC_PATH_MAX and os.path.isdir(where):
            root = tempfile.mkdtemp(prefix="mps-", dir=where)
            for sub in ("pipe", "log"):
                os.mkdir(os.path.join(root, sub), 0o700)
            return root
    raise ConfigError(f"cannot place a private MPS daemon: its socket paths in {base} and in "
                      f"{tempfile.gettempdir()} would be over the OS limit of {IPC_PATH_MAX} bytes; set "
                      "IPCSYNC_RUNTIME_DIR or TMPDIR to a shorter directory")


def _package_env() -> dict[str, str]:
    """The launcher's environment with this ipcsync first on PYTHONPATH (for the watchdog)."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


def _read_line(fd: int, deadline: float) -> bytes | None:
    """One line from ``fd`` (without its newline) before ``deadline``; None at EOF or
    when the time is up."""
    buf = b""
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            chunk = os.read(fd, 4096)
            if not chunk:
                return None
            buf += chunk
    return buf.split(b"\n", 1)[0]


class PrivateMps:
    """The private MPS control daemon of one run (see the module's docstring):
    ``start()`` before the stages, ``apply(plan)`` for each attempt's plan, ``stop()``
    after; or ``with PrivateMps(...) as mps:``. ConfigError from ``start()`` when the
    daemon cannot be started (everything it made is removed)."""

    def __init__(self, control: str, base: str, *, quit_timeout: float = QUIT_TIMEOUT,
                 start_timeout: float = START_TIMEOUT, say: Callable[[str], None] | None = None) -> None:
        self.control = os.path.abspath(control) if os.sep in control else control
        self.base = base
        self.quit_timeout = quit_timeout
        self.start_timeout = start_timeout
        self._say = say
        self.root: str | None = None
        self.daemon: tuple[int, int] | None = None  # (pid, start time)
        self.watchdog: int | None = None  # its pid
        self._alive_w: int | None = None  # the launcher's end of the watchdog's pipe
        self._watch_out: int | None = None  # the watchdog's stdout (its report)
        self._owner: dict[str, Any] = {}

    @property
    def pipe(self) -> str:
        assert self.root is not None, "not started"
        return os.path.join(self.root, "pipe")

    @property
    def log(self) -> str:
        assert self.root is not None, "not started"
        return os.path.join(self.root, "log")

    @property
    def env(self) -> dict[str, str]:
        """The variables every CUDA stage process gets."""
        return {PIPE_ENV: self.pipe, LOG_ENV: self.log, **contract.mps_env(pipe=self.pipe, control=self.control)}

    def apply(self, plan: Plan) -> Plan:
        """``plan`` with ``env`` given to each of its CUDA processes."""
        extra = self.env
        return replace(plan, instances=tuple(
            replace(i, env={**i.env, **extra}) if i.device.startswith("cuda") else i for i in plan.instances
        ))

    def start(self) -> None:
        """Make the private directories, start the watchdog and the daemon, and wait until
        the daemon answers. ConfigError (after cleaning up) if it cannot be started."""
        for root in sweep_abandoned(self.base, self.control):
            self._tell(f"removed the MPS daemon directory {root} that a killed launcher left")
        self.root = _private_root(self.base)
        self._owner = {"launcher": [os.getpid(), host.start_time(os.getpid())]}
        _write_owner(self.root, self._owner)
        try:
            self._start_watchdog()
            self._start_daemon()
        except BaseException:
            self.stop()
            raise

    def _start_watchdog(self) -> None:
        assert self.root is not None
        r, w = os.pipe()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "ipcsync.launch.mps_daemon", "watch", self.root, self.control,
                 f"{self.quit_timeout:g}"],
                stdin=r, stdout=subprocess.PIPE, close_fds=True, start_new_session=True, env=_package_env(),
            )
        except OSError as exc:
            os.close(w)
            raise ConfigError(f"cannot start the MPS watchdog ({sys.executable} -m ipcsync.launch.mps_daemon): "
                              f"{exc}") from None
        finally:
            os.close(r)
        self._alive_w = w
        assert proc.stdout is not None
        self._watch_out = os.dup(proc.stdout.fileno())
        proc.stdout.close()
        line = _read_line(self._watch_out, time.monotonic() + _WATCH_START)
        try:
            proc.wait(timeout=_WATCH_START)  # the parent of the watchdog exits once it forked
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if line is None or not line.startswith(b"watching ") or not line[9:].isdigit():
            raise ConfigError(f"the MPS watchdog ({sys.executable} -m ipcsync.launch.mps_daemon watch) did not start "
                              f"(it said {line!r}; its errors are above)")
        self.watchdog = int(line[9:])
        self._owner["watchdog"] = [self.watchdog, host.start_time(self.watchdog)]
        _write_owner(self.root, self._owner)

    def _start_daemon(self) -> None:
        assert self.root is not None
        env = dict(os.environ)
        env.update({PIPE_ENV: self.pipe, LOG_ENV: self.log})
        out_path = os.path.join(self.root, "start.out")
        what = f"cannot start a private MPS daemon ({self.control} -d, pipe directory {self.pipe})"
        try:
            with open(out_path, "wb") as out:  # a file, not a pipe: the daemon may keep it open
                done = subprocess.run([self.control, "-d"], stdin=subprocess.DEVNULL, stdout=out,
                                      stderr=subprocess.STDOUT, env=env, timeout=self.start_timeout, close_fds=True)
        except OSError as exc:
            raise ConfigError(f"{what}: {exc}") from None
        except subprocess.TimeoutExpired:
            raise ConfigError(f"{what}: it did not return within {self.start_timeout:g} s") from None
        if done.returncode != 0:
            raise ConfigError(f"{what}: it exited {done.returncode}: {self._last_words(out_path)}")
        deadline = time.monotonic() + self.start_timeout
        while True:
            daemon = _identity(_read_pid(self.pipe))
            if daemon is not None and os.path.exists(os.path.join(self.pipe, "control")):
                try:
                    if ask(self.pipe, "get_server_list", self.control, timeout=self.start_timeout)[0] == 0:
                        break
                except (OSError, subprocess.SubprocessError):
                    pass
            if time.monotonic() >= deadline:
                raise ConfigError(f"{what}: it did not answer within {self.start_timeout:g} s: "
                                  f"{self._last_words(out_path)}")
            time.sleep(0.05)
        self.daemon = daemon
        self._tell_watchdog(f"daemon {daemon[0]} {daemon[1]}\n".encode())
        self._owner["daemon"] = list(daemon)
        _write_owner(self.root, self._owner)

    def _last_words(self, out_path: str) -> str:
        """The daemon's own words: its start output, else the last line of its control.log."""
        for path in (out_path, os.path.join(self.log, "control.log")):
            try:
                with open(path, "rb") as f:
                    lines = f.read()[-4096:].decode(errors="replace").strip().splitlines()
            except OSError:
                continue
            if lines:
                return lines[-1][:300]
        return "(it said nothing)"

    def _tell_watchdog(self, data: bytes) -> None:
        if self._alive_w is not None:
            try:
                os.write(self._alive_w, data)
            except OSError:
                pass

    def _tell(self, line: str) -> None:
        if self._say is not None:
            self._say(line)

    def stop(self) -> None:
        """End the daemon and remove its directories: the watchdog does it (the pipe
        closed), and this waits for its report; if it cannot, this does it itself. Says
        what went wrong, if anything. Safe to call twice."""
        if self.root is None:
            return
        said: list[str] | None = None
        if self._alive_w is not None:
            self._tell_watchdog(b"stop\n")
            os.close(self._alive_w)
            self._alive_w = None
        if self._watch_out is not None:
            line = _read_line(self._watch_out, time.monotonic() + self.quit_timeout + 2 * _KILL_WAIT + 10)
            os.close(self._watch_out)
            self._watch_out = None
            try:
                report = json.loads(line) if line else None
                if isinstance(report, dict) and isinstance(report.get("said"), list):
                    said = [str(s) for s in report["said"]]
            except ValueError:
                pass
        if said is None:  # no watchdog, or it did not report: do it here
            said = cleanup(self.root, self.control, self.daemon, self.quit_timeout)
        for line_said in said:
            self._tell(f"mps: {line_said}")
        self.root = None

    def __enter__(self) -> PrivateMps:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---------------------------------------------------------------------------- the watchdog
def watch(root: str, control: str, quit_timeout: float) -> int:
    """The watchdog's body (see the module's docstring): fork away from the launcher's
    tree, say ``watching PID``, read the launcher's lines (``daemon PID START``, ``stop``)
    until EOF, then ``cleanup`` and report."""
    if os.fork() > 0:
        os._exit(0)  # the launcher reaps this parent; the watchdog leaves its tree
    for s in (signal.SIGINT, signal.SIGHUP):
        signal.signal(s, signal.SIG_IGN)
    os.chdir("/")
    os.write(1, f"watching {os.getpid()}\n".encode())
    daemon: tuple[int, int] | None = None
    stopped = False
    buf = b""
    while True:
        try:
            chunk = os.read(0, 4096)
        except InterruptedError:
            continue
        except OSError:
            chunk = b""
        if not chunk:
            break
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            words = line.split()
            if words == [b"stop"]:
                stopped = True
            elif len(words) == 3 and words[0] == b"daemon" and words[1].isdigit() and words[2].isdigit():
                daemon = (int(words[1]), int(words[2]))
    said = cleanup(root, control, daemon, quit_timeout)
    if not stopped:
        said.insert(0, "the launcher exited without stopping its MPS daemon; the watchdog stopped it and "
                       f"removed {root}")
        for line_said in said:
            try:
                os.write(2, f"ipcsync-run: mps: {line_said}\n".encode())
            except OSError:
                pass
    try:
        os.write(1, (json.dumps({"said": said}) + "\n").encode())
    except OSError:
        pass  # the launcher is gone
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ipcsync.launch.mps_daemon watch ROOT CONTROL QUIT_TIMEOUT`` (started by
    ``PrivateMps.start``; not a command for people)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 4 or args[0] != "watch":
        sys.stderr.write("usage: python -m ipcsync.launch.mps_daemon watch ROOT CONTROL QUIT_TIMEOUT\n")
        return 2
    return watch(args[1], args[2], float(args[3]))


if __name__ == "__main__":
    sys.exit(main())
