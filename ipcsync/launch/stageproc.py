"""One stage's process, as the supervisor starts, signals and reaps it.

- ``spawn``: the process starts in its own session and process group (its pid is the
  group's id), stdin from /dev/null, stdout+stderr into one non-blocking pipe; on Linux it
  also gets SIGTERM if the launcher dies (``die_with_parent``, in the child before exec).
  A command that cannot start is a ``StageProc`` with no process, exit code 127 and the
  reason in ``partial``.
- ``reap``: once a leader has exited, SIGKILL to what is left of its group, then the
  leader is reaped.

Invariant: a group is signalled only while its leader is not reaped (running, or a
zombie), so its id cannot have been reused by an unrelated group.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Mapping

from .plan import Instance, stage_environ

__all__ = ["StageProc", "spawn", "reap", "killpg", "exit_code_of", "describe"]

_PR_SET_PDEATHSIG = 1


class StageProc:
    """One running instance: its process, output pipe and partial line. ``returncode``
    is None while it runs (its leader not reaped)."""

    def __init__(self, inst: Instance, popen: subprocess.Popen[bytes] | None, started: float) -> None:
        self.inst = inst
        self.popen = popen
        self.started = started
        self.partial = b""
        self.returncode: int | None = None if popen is not None else 127
        self.pipe_open = popen is not None

    @property
    def running(self) -> bool:
        return self.returncode is None


def spawn(inst: Instance, extra_env: Mapping[str, str]) -> StageProc:
    """Start one process in its own session and process group (a StageProc with no popen
    and the reason in ``partial`` if it cannot start). ``extra_env``: the observer's
    variables for this attempt's stages."""
    env = stage_environ(os.environ, inst.env, extra_env)
    parent = os.getpid()
    try:
        popen = subprocess.Popen(
            list(inst.cmd), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, env=env, cwd=inst.cwd, start_new_session=True,
            preexec_fn=lambda: die_with_parent(parent), close_fds=True,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        proc = StageProc(inst, None, time.monotonic())
        proc.partial = f"{exc} (cmd {list(inst.cmd)})".encode()
        return proc
    assert popen.stdout is not None  # stdout=PIPE
    os.set_blocking(popen.stdout.fileno(), False)
    return StageProc(inst, popen, time.monotonic())


def reap(p: StageProc) -> bool:
    """If ``p``'s leader has exited: SIGKILL what is left of its process group, then reap
    it, and return True. The group is killed while the leader is still a zombie, so its
    id cannot have been reused by an unrelated group."""
    if p.popen is None or not p.running:
        return True
    try:
        exited = os.waitid(os.P_PID, p.popen.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped already (by Popen)
        exited = True
    if not exited:
        return False
    killpg(p.popen.pid, signal.SIGKILL)
    p.popen.wait()
    p.returncode = p.popen.returncode
    return True


def killpg(pgid: int, signum: int) -> None:
    """``signum`` to process group ``pgid``; one that is gone, or not ours, is left be."""
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def die_with_parent(parent: int) -> None:
    """In the child before exec: get SIGTERM when the launcher dies (Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the launcher died before prctl took effect
        os._exit(1)


def exit_code_of(returncode: int) -> int:
    """A Popen returncode as a shell would report it (killed by signal N -> 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


def describe(returncode: int) -> str:
    """How a process ended, as a root cause says it ("was killed by SIGSEGV")."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with code {returncode}"
