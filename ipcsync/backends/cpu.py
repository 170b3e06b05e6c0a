"""CPU backend: arenas in POSIX shared memory (/dev/shm), events complete when recorded.

Arena lifetime:

- the producer creates ``/dev/shm/ipcsync-<pid>-[r<run id>-]<start time>-<pid ns>-<token>``
  itself (``os.open`` with O_CREAT|O_EXCL, mode 0600, ``ftruncate``, ``mmap``): no
  ``multiprocessing.shared_memory`` and no resource tracker, so no helper process and
  no "leaked shared_memory objects" warnings at a stage's exit;
- the name says who owns it: pid, start time (clock ticks since boot) and pid namespace
  (inode of /proc/self/ns/pid). Who unlinks it:
  - the owner, in ``close()`` (a ``with`` block's exit, Ctrl-C included), at
    interpreter exit for any arena still open (``atexit``; never in a forked child), and
    when a SIGTERM ends it (``interrupts.at_terminate``);
  - for an owner that died without any of these (SIGKILL; a SIGTERM while a handler of
    the program's own, not ipcsync's, was in place and did not exit),
    ``reclaim_dead_segments``: it unlinks the segments of this user whose owner provably
    no longer exists, and runs whenever a producer creates an arena and whenever a
    consumer loses its producer; ``ipcsync-run`` also removes every segment tagged with
    its run id when the run ends (``system.shm.remove_run_segments``);
- the whole arena (slots x slot_bytes) is reserved when created (``posix_fallocate``: a
  full /dev/shm is a ConfigError then, never a SIGBUS at a later write) and faulted in when
  mapped (MAP_POPULATE), so no send pays page faults;
- consumers map it by name once per connection, **read-only** (``O_RDONLY``,
  ``PROT_READ``): an in-place op on a received tensor faults (SIGSEGV) in the consumer
  that did it instead of changing what other readers of the item see (a broadcast edge,
  forwarded items); consumers enable ``faulthandler`` so that fault shows where it
  happened, and each read-only mapping is watched (``ipcsync.writefaults``) so that the
  process says why before it dies. A mapping stays valid after the producer unlinks the name, so items already
  delivered remain readable;
- ``close()`` on the producer unlinks the name. Mappings are dropped when the last tensor
  viewing them is freed (torch keeps the mmap alive), so closing can never pull memory
  from under a live tensor.

Linux only (it needs /dev/shm); so is CUDA IPC.
"""

from __future__ import annotations

import atexit
import errno
import mmap
import os
import re
import secrets
import stat
import warnings
import weakref
from typing import Any, NamedTuple

import torch

from .. import interrupts
from ..system import host
from ..system.shm import NAME_RE, RUN_ID_RE, SHM_DIR, SHM_PREFIX, remove_run_segments
from .. import writefaults
from ..errors import BackendError, ConfigError, IpcTimeoutError
from . import cpu_descriptors, flags
from .base import Arena, Backend, Event

__all__ = [
    "CpuBackend", "CpuEvent", "CpuArena", "SHM_DIR", "SHM_PREFIX", "SegmentOwner",
    "remove_run_segments", "reclaim_dead_segments", "segment_owner",
]

_EVENT_HANDLE = b"ipcsync-cpu-event"
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)

# Paths of the arenas this process created and has not unlinked yet, with the pid that
# created them (a forked child inherits the dict, never the arenas: it unlinks nothing).
_owned: dict[str, int] = {}


@atexit.register
@interrupts.at_terminate
def _unlink_owned_at_exit() -> None:
    """An interpreter that exits with producers not closed (no ``with``, a global), or
    that a SIGTERM ends, leaves no segment behind."""
    me = os.getpid()
    for path, pid in list(_owned.items()):
        if pid == me:
            _unlink_path(path)


def _unlink_path(path: str) -> None:
    _owned.pop(path, None)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class CpuEvent(Event):
    """An event on the CPU backend: host work is synchronous, so it is complete as soon as
    it is recorded. Same interface as the CUDA event."""

    __slots__ = ()
    complete_on_record = True

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self, timeout: float | None = None) -> None:
        if timeout is not None and timeout < 0:
            raise IpcTimeoutError("synchronize() timed out (negative timeout)")

    def handle(self) -> bytes:
        return _EVENT_HANDLE

    @classmethod
    def from_handle(cls, handle: bytes | str, device: Any = None) -> "CpuEvent":
        if handle != _EVENT_HANDLE:
            raise BackendError(f"not a CPU event handle: {handle!r:.60}")
        return cls()


class CpuArena(Arena):
    """A shared-memory segment mapped into this process."""

    def __init__(self, name: str, nbytes: int, owner: bool) -> None:
        self.handle = name
        self.nbytes = nbytes
        self.owner = owner
        self.readonly = not owner
        self.path = os.path.join(SHM_DIR, name)
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL if owner else os.O_RDONLY
        try:
            fd = os.open(self.path, flags, 0o600)
        except OSError as exc:
            raise BackendError(
                f"cannot {'create' if owner else 'open'} shared memory {self.path}: {exc}"
                + ("" if owner else "; the producer may have closed or died")
            ) from None
        try:
            if owner:
                # Recorded before anything else can fail, so it is unlinked on any exit.
                _owned[self.path] = os.getpid()
                os.ftruncate(fd, nbytes)
                _reserve(fd, nbytes)
            else:
                st = os.fstat(fd)
                if st.st_uid != os.getuid():
                    raise BackendError(f"{self.path} is owned by uid {st.st_uid}, not by this user")
                if st.st_size < nbytes:
                    raise BackendError(
                        f"{self.path} has {st.st_size} bytes, the producer announced {nbytes}"
                    )
            # MAP_POPULATE: fault the whole arena in now. Otherwise every first write to a
            # page of a large slot faults (64 MiB sends ran at a tenth of a memcpy).
            # A consumer's mapping is read-only (module docstring).
            prot = mmap.PROT_READ | mmap.PROT_WRITE if owner else mmap.PROT_READ
            mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED | _MAP_POPULATE, prot)
        except BaseException:
            if owner:
                self._unlink()
            raise
        finally:
            os.close(fd)
        # torch keeps a reference to the mmap object: the mapping lives as long as any
        # tensor that views it. (torch warns that a read-only buffer gives tensors it
        # cannot protect: the mapping protects them.)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
            self.tensor = torch.frombuffer(mm, dtype=torch.uint8)
        if not owner:
            # A write into it faults: say why (ipcsync.writefaults), while it is mapped.
            who = segment_owner(name)
            token = writefaults.watch(self.tensor.data_ptr(), nbytes, "shared memory of the producer with pid "
                                      f"{who.pid if who is not None else '?'} ({self.path})")
            if token is not None:
                weakref.finalize(mm, writefaults.unwatch, token)
        self._closed = False

    def _unlink(self) -> None:
        _unlink_path(self.path)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.owner:
            self._unlink()
        # Drop our view; the mapping goes when the last tensor viewing it goes.
        self.tensor = torch.empty(0, dtype=torch.uint8)


def _reserve(fd: int, nbytes: int) -> None:
    """Allocate every page of the segment now. tmpfs allocates a page at its first touch,
    and a touch that finds /dev/shm full is a SIGBUS (MAP_POPULATE does not report it):
    reserving makes a full /dev/shm a ConfigError here instead."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                return  # a file system without fallocate: MAP_POPULATE is all we have
            raise
        try:
            vfs = os.statvfs(SHM_DIR)
            free = f"{_mib(vfs.f_bavail * vfs.f_frsize)} free of {_mib(vfs.f_blocks * vfs.f_frsize)}"
        except OSError:
            free = "free space unknown"
        raise ConfigError(
            f"the arena needs {nbytes} bytes ({_mib(nbytes)}) of shared memory but {SHM_DIR} "
            f"has {free} ({os.strerror(exc.errno)}); run the container with --shm-size=... "
            "(at least the arenas of all producers) or --ipc=host, or use fewer/smaller slots"
        ) from None


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


class SegmentOwner(NamedTuple):
    """Who created a segment, as its name says: start time and pid namespace are None in
    names that do not carry them."""

    pid: int
    start_time: int | None
    pid_ns: int | None


def segment_owner(name: str) -> SegmentOwner | None:
    """The owner a valid ipcsync segment name records; None for any other name."""
    m = NAME_RE.fullmatch(name) if type(name) is str else None
    if m is None:
        return None
    start, ns = m.group("start"), m.group("ns")
    return SegmentOwner(int(m.group("pid")), None if start is None else int(start),
                        None if ns is None else int(ns))


def _pid_ns_inode() -> int:
    """Inode of this process's pid namespace; 0 where unknown."""
    m = re.fullmatch(r"pid:\[([0-9]+)\]", host.pid_namespace())
    return int(m.group(1)) if m else 0


def reclaim_dead_segments() -> list[str]:
    """Unlink the segments of this user, in this pid namespace, whose owner (pid, start
    time) provably no longer exists; return their names.

    Only proof counts: the owner's /proc entry is missing, or it is a zombie, or its pid
    now belongs to a process started at another time. Any other error reading /proc, a
    name without start time or namespace, another owner uid or another namespace leaves
    the segment alone. One listdir of /dev/shm, one /proc read per candidate."""
    ns = _pid_ns_inode()
    if not ns:
        return []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    uid, me = os.getuid(), os.getpid()
    removed = []
    for name in names:
        if not name.startswith(SHM_PREFIX):
            continue
        who = segment_owner(name)
        if who is None or who.start_time is None or who.pid_ns != ns or who.pid == me:
            continue
        if host.owner_gone(who.pid, who.start_time) is not True:
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            st = os.lstat(path)
            if st.st_uid != uid or not stat.S_ISREG(st.st_mode):
                continue
            os.unlink(path)
        except OSError:
            continue
        removed.append(name)
    return removed


class CpuBackend(Backend):
    """Shared-memory arenas and trivially complete events."""

    name = "cpu"
    host_sync = True

    def __init__(self, device: torch.device | None = None, run_id: str | None = None) -> None:
        """``run_id``: tag the names of the segments this backend creates with the id of an
        ipcsync-run run (8 hex digits), so that the launcher's sweep removes them; None for
        no tag. ``backends.backend_for`` passes the run of this process."""
        super().__init__(device or torch.device("cpu"))
        if run_id is not None and not (type(run_id) is str and RUN_ID_RE.fullmatch(run_id)):
            raise ConfigError(f"run_id must be 8 lowercase hex digits, as ipcsync-run makes them; got {run_id!r}")
        self.run_id = run_id

    def device_identity(self) -> str | None:
        return None

    def create_arena(self, nbytes: int) -> CpuArena:
        tag = "" if self.run_id is None else f"r{self.run_id}-"
        reclaim_dead_segments()
        pid = os.getpid()
        owner = f"{host.start_time(pid)}-{_pid_ns_inode()}-"
        name = f"{SHM_PREFIX}{pid}-{tag}{owner}{secrets.token_hex(8)}"
        return CpuArena(name, nbytes, owner=True)

    def open_arena(self, handle: bytes | str, nbytes: int, where: Any = None) -> CpuArena:
        if type(handle) is not str or segment_owner(handle) is None:
            raise BackendError(f"not an ipcsync shared-memory name: {handle!r:.60}")
        return CpuArena(handle, nbytes, owner=False)

    def arena_owner_problem(self, handle: bytes | str, pid: int) -> str | None:
        """A segment's name records the pid that created it: a producer may export only its
        own (the owner uid is checked when the segment is opened)."""
        owner = segment_owner(handle) if type(handle) is str else None
        if owner is not None and owner.pid != pid:
            return f"names shared memory {handle!s} of pid {owner.pid}"
        return None

    def create_event(self) -> CpuEvent:
        return CpuEvent()

    # ------------------------------------------------------------------ by descriptor (test route)
    def descriptor_problem(self) -> str | None:
        if cpu_descriptors.enabled():
            return None
        return "the CPU backend shares its memory by name (IPCSYNC_CPU_DESCRIPTORS=1: by descriptor, for tests)"

    def create_shared_arena(self, nbytes: int) -> cpu_descriptors.MemfdArena:
        return cpu_descriptors.MemfdArena(nbytes)

    def is_shared_handle(self, handle: bytes | str) -> bool:
        return cpu_descriptors.parse_descriptor(handle) is not None

    def open_shared_arena(self, handle: bytes | str, nbytes: int, fd: int, where: Any = None) -> Arena:
        size = cpu_descriptors.parse_descriptor(handle)
        if size is None or size < nbytes:
            raise BackendError(f"not a CPU arena descriptor of {nbytes} bytes or more: {handle!r:.60}")
        return cpu_descriptors.MemfdArena(size, fd)

    def new_flags(self, slots: int) -> tuple[Any, int]:
        fd = flags.new_segment_fd(slots)
        try:
            return flags.FlagSegment(cpu_descriptors.HostFlags(), fd, slots, 0, peer=False), fd
        except BaseException:
            os.close(fd)
            raise

    def open_flags(self, fd: int, slots: int) -> Any:
        return flags.FlagSegment(cpu_descriptors.HostFlags(), fd, slots, 0, peer=True)

    def retire_flags(self, segment: Any) -> None:
        segment.close()  # (host work is synchronous: nothing of ours still uses it)

    def open_event(self, handle: bytes | str) -> CpuEvent:
        return CpuEvent.from_handle(handle)
