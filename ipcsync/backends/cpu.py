"""CPU backend: arenas in POSIX shared memory (/dev/shm), events complete when recorded.

Arena lifetime:

- the producer creates ``/dev/shm/ipcsync-<pid>-[r<run id>-]<token>`` (mode 0600, O_EXCL), maps it, and
  registers the name with multiprocessing's resource tracker, a helper process that
  unlinks it if the producer dies without closing (SIGKILL included);
- the whole arena (slots x slot_bytes) is faulted in when mapped (MAP_POPULATE), so the
  memory is committed up front and no send pays page faults;
- consumers map it by name once per connection; a mapping stays valid after the producer
  unlinks the name, so items already delivered remain readable;
- ``close()`` on the producer unlinks the name and unregisters it. Mappings are dropped
  when the last tensor viewing them is freed (torch keeps the mmap alive), so closing can
  never pull memory from under a live tensor.

Linux only (it needs /dev/shm); so is CUDA IPC.
"""

from __future__ import annotations

import mmap
import os
import secrets
from multiprocessing import resource_tracker
from typing import Any

import torch

from .._shm import NAME_RE as _NAME_RE
from .._shm import RUN_ID_RE as _RUN_ID_RE
from .._shm import SHM_DIR, SHM_PREFIX, remove_run_segments
from ..errors import BackendError, IpcTimeoutError
from .base import Arena, Backend, Event

__all__ = ["CpuBackend", "CpuEvent", "CpuArena", "SHM_DIR", "SHM_PREFIX", "remove_run_segments"]

_EVENT_HANDLE = b"ipcsync-cpu-event"
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


class CpuEvent(Event):
    """An event on the CPU backend: host work is synchronous, so it is complete as soon as
    it is recorded. Same interface as the CUDA event."""

    __slots__ = ()

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
        self.path = os.path.join(SHM_DIR, name)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if owner else 0)
        try:
            fd = os.open(self.path, flags, 0o600)
        except OSError as exc:
            raise BackendError(
                f"cannot {'create' if owner else 'open'} shared memory {self.path}: {exc}"
                + ("" if owner else "; the producer may have closed or died")
            ) from None
        try:
            if owner:
                # Registered before anything else can fail, so it is unlinked on any exit.
                resource_tracker.register("/" + name, "shared_memory")
                os.ftruncate(fd, nbytes)
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
            mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED | _MAP_POPULATE, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            if owner:
                self._unlink()
            raise
        finally:
            os.close(fd)
        # torch keeps a reference to the mmap object: the mapping lives as long as any
        # tensor that views it.
        self.tensor = torch.frombuffer(mm, dtype=torch.uint8)
        self._closed = False

    def _unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        try:
            resource_tracker.unregister("/" + self.handle, "shared_memory")
        except Exception:  # tracker gone at interpreter exit
            pass

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.owner:
            self._unlink()
        # Drop our view; the mapping goes when the last tensor viewing it goes.
        self.tensor = torch.empty(0, dtype=torch.uint8)


class CpuBackend(Backend):
    """Shared-memory arenas and trivially complete events."""

    name = "cpu"

    def __init__(self, device: torch.device | None = None) -> None:
        super().__init__(device or torch.device("cpu"))

    def device_identity(self) -> str | None:
        return None

    def create_arena(self, nbytes: int) -> CpuArena:
        run_id = os.environ.get("IPCSYNC_RUN_ID", "")
        tag = f"r{run_id}-" if _RUN_ID_RE.fullmatch(run_id) else ""
        name = f"{SHM_PREFIX}{os.getpid()}-{tag}{secrets.token_hex(8)}"
        return CpuArena(name, nbytes, owner=True)

    def open_arena(self, handle: bytes | str, nbytes: int, where: Any = None) -> CpuArena:
        if type(handle) is not str or not _NAME_RE.fullmatch(handle):
            raise BackendError(f"not an ipcsync shared-memory name: {handle!r:.60}")
        return CpuArena(handle, nbytes, owner=False)

    def create_event(self) -> CpuEvent:
        return CpuEvent()

    def open_event(self, handle: bytes | str) -> CpuEvent:
        return CpuEvent.from_handle(handle)
