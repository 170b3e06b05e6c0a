"""What the launcher removes after an attempt, and after a launcher that was killed:
processes, run directories and the run's shared-memory segments.

- ``owner.json`` (``write_owner``) in each run directory records the launcher's and every
  stage's pid, start time and process group: what ``sweep_abandoned`` reads when that
  launcher is gone, to kill what lives of its run before removing its directory
  (``remove_run``: the directory with its sockets, locks and reports, and every
  /dev/shm segment tagged with the run id).
- With ``contain`` (the launcher), the launcher is a child subreaper
  (``set_child_subreaper``): daemons that left their stage's process group re-parent to
  it, ``kill_descendants`` ends them with the attempt, and ``reap_orphans`` reaps the
  zombies re-parented to it during a long run.

Invariant: a run directory is removed only once no process of its run lives.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import time
from dataclasses import dataclass
from typing import Any, Callable

from ..system import files, host
from ..system.shm import remove_run_segments
from ..stage_contract import RUN_ID

__all__ = ["OWNER_FILE", "write_owner", "remove_run", "set_child_subreaper", "reap_orphans", "kill_descendants",
           "sweep_abandoned"]

_PR_SET_CHILD_SUBREAPER = 36
OWNER_FILE = "owner.json"
_KILL_WAIT = 5.0  # seconds for SIGKILLed processes to be gone


def remove_run(run_dir: str, run_id: str) -> None:
    """Remove the run directory (sockets, locks, reports) and the run's shm segments."""
    shutil.rmtree(run_dir, ignore_errors=True)
    remove_run_segments(run_id)


def write_owner(run_dir: str, owner: dict[str, Any]) -> None:
    """Replace the run's owner.json atomically (a reader sees the old or the new one)."""
    files.write_atomic(os.path.join(run_dir, OWNER_FILE), json.dumps(owner))


def set_child_subreaper() -> bool:
    """Make orphaned descendants re-parent to this process instead of init (Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        status: int = libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        return status == 0
    except (OSError, AttributeError):
        return False


@dataclass(frozen=True)
class _PStat:
    pid: int
    state: str
    ppid: int
    pgrp: int
    start: int
    comm: str


def _proc_table() -> dict[int, _PStat]:
    """Every process this process can see, from /proc/<pid>/stat."""
    table = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return {}
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue
        close = data.rfind(b")")
        fields = data[close + 2 :].split()
        try:
            table[int(entry)] = _PStat(
                int(entry), fields[0].decode(), int(fields[1]), int(fields[2]), int(fields[19]),
                data[data.find(b"(") + 1 : close].decode(errors="replace"),
            )
        except (IndexError, ValueError):
            continue
    return table


def _descendants(root: int, table: dict[int, _PStat]) -> list[_PStat]:
    children: dict[int, list[_PStat]] = {}
    for st in table.values():
        children.setdefault(st.ppid, []).append(st)
    found, todo = [], [root]
    while todo:
        for st in children.get(todo.pop(), []):
            if st.pid != root:
                found.append(st)
                todo.append(st.pid)
    return found


def reap_orphans(keep: set[int]) -> None:
    """Reap zombie children of this process that are no stage leader (orphans re-parented
    to the subreaper), so that they do not pile up during a long run."""
    me = os.getpid()
    for st in _proc_table().values():
        if st.ppid == me and st.state == "Z" and st.pid not in keep:
            try:
                os.waitpid(st.pid, os.WNOHANG)
            except ChildProcessError:
                pass


def kill_descendants(keep: set[int]) -> list[tuple[int, str]]:
    """SIGKILL every descendant of this process but the unreaped stage leaders ``keep``
    (their Popen reaps them) and reap those re-parented to it; wait up to _KILL_WAIT s
    until none is left. Returns (pid, command name) of those killed."""
    me = os.getpid()
    killed: dict[int, str] = {}
    deadline = time.monotonic() + _KILL_WAIT
    while True:
        left = [st for st in _descendants(me, _proc_table()) if st.pid not in keep]
        if not left:
            break
        for st in left:
            if st.state != "Z":
                try:
                    os.kill(st.pid, signal.SIGKILL)
                    killed.setdefault(st.pid, st.comm)
                except (ProcessLookupError, PermissionError):
                    pass
            if st.ppid == me:
                try:
                    os.waitpid(st.pid, os.WNOHANG)
                except ChildProcessError:
                    pass
        if time.monotonic() >= deadline:
            break
        time.sleep(0.01)
    return sorted(killed.items())


def _environ_has(pid: int, needle: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read()
    except OSError:
        return False
    return needle in env.split(b"\0")


def _processes_of_run(owner: dict[str, Any], run_id: str) -> list[_PStat]:
    """Live processes of a run whose launcher is gone: every member of a recorded stage
    process group whose leader (pid and start time) still runs, and every process whose
    environment carries the run's IPCSYNC_RUN_ID (members of groups whose leader died,
    daemons that left their group). Only this user's processes are looked at."""
    uid = os.getuid()
    table = {
        pid: st for pid, st in _proc_table().items()
        if st.state not in ("Z", "X") and _owned_by(pid, uid) and pid != os.getpid()
    }
    groups = set()
    for rec in owner.get("stages") or []:
        try:
            pid, started, pgid = int(rec["pid"]), int(rec["start_time"]), int(rec["pgid"])
        except (KeyError, TypeError, ValueError):
            continue
        if host.process_alive(pid, started):  # the group id cannot have been reused
            groups.add(pgid)
    needle = f"{RUN_ID.name}={run_id}".encode()
    return [st for st in table.values() if st.pgrp in groups or _environ_has(st.pid, needle)]


def _owned_by(pid: int, uid: int) -> bool:
    try:
        return os.stat(f"/proc/{pid}").st_uid == uid
    except OSError:
        return False


def _kill_run(owner: dict[str, Any], run_id: str) -> tuple[list[_PStat], list[_PStat]]:
    """SIGKILL what lives of a dead launcher's run; wait until it is gone. Returns
    (killed, still alive after _KILL_WAIT seconds)."""
    victims = _processes_of_run(owner, run_id)
    for st in victims:
        try:
            os.kill(st.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + _KILL_WAIT
    while True:
        alive = [st for st in victims if host.process_alive(st.pid, st.start)]
        if not alive or time.monotonic() >= deadline:
            return victims, alive
        time.sleep(0.02)


def sweep_abandoned(base: str, say: Callable[[str], None] | None = None) -> list[str]:
    """Clean up after launchers that died without doing it (SIGKILL): for each run
    directory whose launcher is gone, kill every process of that run still alive (a stage
    that ignored the parent-death SIGTERM, its helpers), then remove the directory and
    the run's shm segments. A directory whose processes cannot all be killed is left
    (and reported through ``say``). Returns the run ids removed."""
    removed = []
    try:
        names = os.listdir(base)
    except OSError:
        return []
    for name in names:
        if not name.startswith("run-") or len(name) != 12:
            continue
        path = os.path.join(base, name)
        try:
            owner = files.read_json(os.path.join(path, OWNER_FILE), 1 << 20)
            pid, started = int(owner["pid"]), int(owner["start_time"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not ours, or being created right now
        if host.process_alive(pid, started):
            continue
        run_id = name[4:]
        killed, alive = _kill_run(owner, run_id)
        if killed and say is not None:
            say(f"killed {len(killed)} process(es) still running of run {run_id} (its launcher was killed): "
                + ", ".join(f"pid {st.pid} ({st.comm})" for st in killed))
        if alive:
            if say is not None:
                say(f"cannot kill process(es) of run {run_id}: "
                    + ", ".join(f"pid {st.pid} ({st.comm})" for st in alive)
                    + f"; leaving {path} in place (remove it once they are gone)")
            continue
        remove_run(path, run_id)
        removed.append(run_id)
    return removed
