"""Identity of this process and host, and liveness of a peer process on the same host.

CUDA IPC and POSIX shared memory only work between processes of one host and boot, so
peers are always local: a peer is named by (pid, start time), which survives pid reuse.

The proof of death the liveness rule needs (``core.liveness``): ``ProcessWatch.gone()`` is
True only on proof (a pidfd readable, or another start time at that pid); anything that
cannot be read (``read_start_time`` None: EMFILE, EACCES) means "cannot say", never death.
Also ``boot_id`` / ``host_identity``, ``pid_namespace``, ``peer_credentials``
(``SO_PEERCRED``) and ``owner_gone`` (a segment's owner, for reclaiming). Imports neither
torch nor zmq: the backends and the launcher use it.
"""

from __future__ import annotations

import errno
import functools
import os
import select

from ..envopts import HOST_ID

__all__ = ["boot_id", "host_identity", "HOST_ID_ENV", "pid_namespace", "start_time", "read_start_time", "process_alive",
           "ProcessWatch", "GONE", "owner_gone", "peer_credentials"]


@functools.cache
def boot_id() -> str:
    """This boot of this host (Linux: /proc/sys/kernel/random/boot_id)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


HOST_ID_ENV = HOST_ID.name


def host_identity() -> str:
    """What a HELLO's ``boot_id`` field says about where this process runs: the boot id,
    followed by ``/`` and ``$IPCSYNC_HOST_ID`` when that is set. Two processes are on one
    host exactly when their identities are equal, so setting the variable differently makes
    processes of one machine count as different hosts (their edges become remote edges;
    see ``core.remote_session``). Read at each call: the variable belongs to the process."""
    extra = HOST_ID.get()
    return boot_id() + "/" + extra if extra else boot_id()


@functools.cache
def pid_namespace() -> str:
    """Identity of this process's PID namespace, "" where unknown."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


#: What ``read_start_time`` returns for a process that provably does not exist (no /proc
#: entry, or a zombie: it has exited and only waits to be reaped).
GONE = -1


def read_start_time(pid: int) -> int | None:
    """Start time of process ``pid`` in clock ticks since boot; ``GONE`` if it provably
    does not exist; None if /proc could not say (EMFILE, EACCES, a torn read, ...).

    Only "no such process" counts as proof: an error reading /proc is never death (a
    process that briefly has no free fd must not declare its live peers dead).
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return GONE
    except OSError as exc:
        return GONE if exc.errno == errno.ESRCH else None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    fields = data[data.rfind(b")") + 2 :].split()
    try:
        if fields[0] in (b"Z", b"X"):  # a zombie (or dead) has exited
            return GONE
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def start_time(pid: int) -> int:
    """Start time of process ``pid`` in clock ticks since boot; -1 if it does not exist or
    /proc cannot say (use ``read_start_time`` where the difference matters)."""
    t = read_start_time(pid)
    return GONE if t is None else t


def process_alive(pid: int, started: int) -> bool:
    """False only when the process (pid, start time) provably no longer exists: its pid is
    gone, or now names another process. An error reading /proc counts as alive."""
    t = read_start_time(pid)
    return t is None or t == started


class ProcessWatch:
    """Tells whether one process of this PID namespace has exited, without false deaths.

    Uses a pidfd (Linux 5.3+: readable once the process has exited, immune to pid reuse)
    where it can get one, else ``(pid, start time)`` read from /proc. ``gone()`` is True
    only on proof; failing to open or read anything means "still alive". Not thread-safe;
    owned by one endpoint, used under its lock.
    """

    __slots__ = ("pid", "started", "_pidfd", "_gone")

    def __init__(self, pid: int, started: int | None = None) -> None:
        self.pid = pid
        self._pidfd: int | None = None
        # None: /proc could not say; then only a pidfd can prove the exit.
        self.started: int | None = read_start_time(pid) if started is None else started
        self._gone = self.started == GONE
        if self._gone or pid <= 0:
            return
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._gone = True
            return
        except (AttributeError, OSError):  # no pidfds here, or no free fd: use /proc
            return
        # The pid may have been reused between the identity we were given and the
        # pidfd_open: the pidfd counts only if it names the same process.
        now = read_start_time(pid)
        if now == GONE or (now is not None and self.started is not None and now != self.started):
            os.close(fd)
            self._gone = True
            return
        os.set_inheritable(fd, False)
        self._pidfd = fd

    def gone(self) -> bool:
        """True once the process has provably exited (cached: death is final)."""
        if self._gone:
            return True
        if self._pidfd is not None:
            try:
                readable, _, _ = select.select([self._pidfd], [], [], 0)
            except (OSError, ValueError):
                return False
            if readable:
                self._gone = True
                self.close()
            return self._gone
        if self.started is None:
            return False  # no identity to compare with: cannot prove anything
        t = read_start_time(self.pid)
        if t is not None and t != self.started:
            self._gone = True
        return self._gone

    def close(self) -> None:
        fd, self._pidfd = self._pidfd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def __del__(self) -> None:
        self.close()


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
    t = read_start_time(pid)
    if t is None:
        return None
    return t == GONE or t != started


def flocked_inodes() -> set[tuple[int, int]] | None:
    """(device, inode) of every file some process holds an ``flock`` on now, from
    /proc/locks (read only: no lock is taken); None where it cannot be read."""
    try:
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    held = set()
    for line in lines:
        parts = line.split()
        if len(parts) < 6 or parts[1] != "FLOCK":
            continue
        try:
            major, minor, inode = parts[5].split(":")
            held.add((os.makedev(int(major, 16), int(minor, 16)), int(inode)))
        except ValueError:
            continue
    return held
