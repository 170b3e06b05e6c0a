"""Whether this process is a client of the MPS daemon that ``ipcsync-run`` runs for its run.

``ipcsync-run`` (``mps = "on"``, or ``"auto"`` when it decides so) starts a private MPS
control daemon for a run and gives every CUDA stage process ``CUDA_MPS_PIPE_DIRECTORY``
(where the CUDA driver finds the daemon), ``CUDA_MPS_LOG_DIRECTORY`` and two variables of
its own: ``IPCSYNC_MPS_PIPE`` (the same pipe directory: the mark that this process must be
a client) and ``IPCSYNC_MPS_CONTROL`` (the ``nvidia-cuda-mps-control`` program it used).

A CUDA process that does not reach the daemon does not fail: the driver silently runs it
without MPS, time-sliced beside the run's other processes on that GPU. ``check_attached``
turns that into an error: it asks the daemon (``get_server_list``, then
``get_client_list <server>``) whether this process's pid is one of its clients. The CUDA
backend calls it once per process, once the process has a CUDA context. Outside such a
run (no ``IPCSYNC_MPS_PIPE``) it does nothing.

The daemon's control protocol is text over the ``nvidia-cuda-mps-control`` program: one
command per line on its stdin, the answer on its stdout (pids one per line).
"""

from __future__ import annotations

import logging
import os
import subprocess
import time

from .errors import ConfigError
from .stage_contract import MPS_CONTROL, MPS_PIPE

__all__ = [
    "CONTROL", "ENV_PIPE", "ENV_CONTROL", "PIPE_ENV", "LOG_ENV", "ATTACH_TIMEOUT",
    "ask", "clients", "check_attached",
]

log = logging.getLogger(__name__)

CONTROL = MPS_CONTROL.default  # the MPS control program (daemon with -d, else a client of it)
ENV_PIPE = MPS_PIPE.name  # set by ipcsync-run: this process must be a client of the daemon there
ENV_CONTROL = MPS_CONTROL.name  # set by ipcsync-run: the control program it started the daemon with
PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"  # where the CUDA driver looks for the daemon
LOG_ENV = "CUDA_MPS_LOG_DIRECTORY"
ATTACH_TIMEOUT = 5.0  # seconds for this process to show in the daemon's client list
_ASK_TIMEOUT = 5.0
_POLL = 0.1

_attached_pid: int | None = None  # the pid found attached (a forked child checks again)


def ask(pipe_dir: str, command: str, control: str = CONTROL, timeout: float = _ASK_TIMEOUT) -> tuple[int, str]:
    """Send one ``command`` to the MPS control daemon of ``pipe_dir`` through the control
    program ``control``: (its exit status, its output). OSError if the program cannot be
    run; ``subprocess.TimeoutExpired`` after ``timeout`` seconds (the program is killed)."""
    env = dict(os.environ)
    env[PIPE_ENV] = pipe_dir
    done = subprocess.run(
        [control], input=command + "\n", stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, errors="replace", timeout=timeout, env=env,
    )
    return done.returncode, done.stdout


def _pids(text: str) -> list[int]:
    return [int(word) for word in text.split() if word.isdigit()]


def clients(pipe_dir: str, control: str = CONTROL, timeout: float = _ASK_TIMEOUT) -> dict[int, list[int]]:
    """Every MPS server of the daemon of ``pipe_dir`` and the pids of its clients. OSError
    (the daemon cannot be reached: ``ask``'s errors, or a non-zero exit, as OSError)."""
    rc, out = ask(pipe_dir, "get_server_list", control, timeout)
    if rc != 0:
        raise OSError(f"{control} get_server_list exited {rc}: {out.strip()[:300] or '(no output)'}")
    found: dict[int, list[int]] = {}
    for server in _pids(out):
        rc, listed = ask(pipe_dir, f"get_client_list {server}", control, timeout)
        found[server] = _pids(listed) if rc == 0 else []
    return found


def check_attached(timeout: float = ATTACH_TIMEOUT) -> None:
    """If ``ipcsync-run`` started this process under its private MPS daemon
    (``IPCSYNC_MPS_PIPE`` set), check that the daemon lists this process as a client of
    one of its servers, waiting up to ``timeout`` seconds for it to show; ConfigError
    naming the cause and the fix if it does not, or if the daemon cannot be asked.

    Call it once this process has a CUDA context (the CUDA backend calls it when it
    starts, after its first allocation on the device): the driver connects to the daemon
    when it creates the context. Checked once per process; a no-op outside such a run."""
    global _attached_pid
    pipe = MPS_PIPE.get()
    pid = os.getpid()
    if not pipe or _attached_pid == pid:
        return
    control = MPS_CONTROL.get()
    deadline = time.monotonic() + timeout
    while True:
        try:
            servers = clients(pipe, control)
        except (OSError, subprocess.SubprocessError) as exc:
            raise ConfigError(
                f"this process (pid {pid}) cannot ask its run's MPS daemon (pipe directory {pipe}) whether it "
                f"is one of its clients: {exc}; the daemon ipcsync-run started is gone or does not answer "
                "(see its control.log in $CUDA_MPS_LOG_DIRECTORY); run the pipeline again, or with "
                "ipcsync-run --mps off"
            ) from None
        if any(pid in listed for listed in servers.values()):
            _attached_pid = pid
            log.debug("pid %d is a client of the MPS daemon of %s", pid, pipe)
            return
        if time.monotonic() >= deadline:
            break
        time.sleep(_POLL)
    seen = "; ".join(f"server {s}: clients {c or 'none'}" for s, c in servers.items()) or "no server running"
    actual = os.environ.get(PIPE_ENV)
    cause = (
        f"its {PIPE_ENV} is {actual!r}, not the run's (the stage's code or its env changed it)"
        if actual != pipe else
        "its CUDA driver did not connect to the daemon (a CUDA context made before the variable was set, "
        "a CUDA build without MPS, or the daemon refused it: see control.log and server.log in "
        f"{os.environ.get(LOG_ENV) or '$CUDA_MPS_LOG_DIRECTORY'} while the run lasts)"
    )
    raise ConfigError(
        f"this process (pid {pid}) uses CUDA but is not a client of its run's MPS daemon (pipe directory "
        f"{pipe}; {seen}): it runs without MPS, time-sliced beside the run's other processes on that GPU. "
        f"Cause: {cause}. Fix: leave CUDA_MPS_PIPE_DIRECTORY as ipcsync-run sets it, or run the pipeline "
        "with ipcsync-run --mps off"
    )
