"""Identity of this process and host, and liveness of a peer process on the same host.

CUDA IPC and POSIX shared memory only work between processes of one host and boot, so
peers are always local: a peer is named by (pid, start time), which survives pid reuse.
"""

from __future__ import annotations

import functools
import os

__all__ = ["boot_id", "pid_namespace", "start_time", "process_alive", "owner_gone", "peer_credentials"]


@functools.cache
def boot_id() -> str:
    """This boot of this host (Linux: /proc/sys/kernel/random/boot_id)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


@functools.cache
def pid_namespace() -> str:
    """Identity of this process's PID namespace, "" where unknown."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def start_time(pid: int) -> int:
    """Start time of process ``pid`` in clock ticks since boot; -1 if it does not exist."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return -1
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    fields = data[data.rfind(b")") + 2 :].split()
    try:
        if fields[0] == b"Z":  # a zombie has exited
            return -1
        return int(fields[19])
    except (IndexError, ValueError):
        return -1


def process_alive(pid: int, started: int) -> bool:
    """True while the process (pid, start time) exists and has not exited."""
    return start_time(pid) == started


def peer_credentials(fd: int) -> tuple[int, int, int] | None:
    """(pid, uid, gid) of the process at the other end of the Unix socket ``fd``, as the
    kernel recorded them at connect time (SO_PEERCRED); None where the OS cannot say."""
    import socket
    import struct

    if fd < 0 or not hasattr(socket, "SO_PEERCRED"):
        return None
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        if sock.family != socket.AF_UNIX:
            return None
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, gid = struct.unpack("3i", raw)
        return pid, uid, gid
    except OSError:
        return None
    finally:
        sock.close()


def owner_gone(pid: int, started: int) -> bool | None:
    """True only with proof that the process (pid, start time) no longer exists: no
    /proc/<pid> (ENOENT, ESRCH), a zombie, or another process under that pid. False while
    it exists; None when /proc cannot tell (any other error): never treat that as death."""
    import errno

    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError as exc:
        return True if exc.errno in (errno.ENOENT, errno.ESRCH) else None
    fields = data[data.rfind(b")") + 2 :].split()
    try:
        if fields[0] in (b"Z", b"X"):
            return True
        return int(fields[19]) != started
    except (IndexError, ValueError):
        return None
