"""The CPU backend sharing its memory by descriptor: the test route of the path the CUDA
backend takes on a GPU (``runtime.producer.sharing``, ``runtime.transport.memory_wire``, ``backends.flags``),
so the suite runs that protocol (descriptors on the lane, flags by generation, poison on
a peer's death) on a machine without a GPU. On only with ``IPCSYNC_CPU_DESCRIPTORS=1``;
the CPU backend otherwise shares its memory by name (``backends.cpu``).

- Arenas are sealed memfds (their size can never change under a reader), mapped
  read-write by the producer and read-only by consumers (a write faults, as with /dev/shm
  arenas, and is explained by ``ipcsync.writefaults``).
- Flags: ``HostFlags`` is the driver a ``FlagSegment`` uses. Host work is synchronous, so
  a write stores the value at once, and a wait must find its flag already reached (the
  writer stored it before its notice went out); one that does not is a bug of the path,
  raised as a BackendError, never a hang.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import stat
import warnings
import weakref

import torch

from .. import writefaults
from ..envopts import CPU_DESCRIPTORS
from ..errors import BackendError
from . import handles
from .base import Arena
from .flags import reached

__all__ = ["MemfdArena", "HostFlags", "MAGIC", "enabled", "parse_descriptor"]

MAGIC = "ipcsync-cpu-fd"
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def enabled() -> bool:
    """``$IPCSYNC_CPU_DESCRIPTORS`` (``envopts.CPU_DESCRIPTORS``): whether a CPU producer
    shares its memory by descriptor."""
    return CPU_DESCRIPTORS.get()


class HostFlags:
    """``flags.FlagDriver`` for host memory: the "device" address is the host address."""

    def write_value(self, stream: int, devptr: int, value: int) -> None:
        ctypes.c_uint64.from_address(devptr).value = value

    def wait_value(self, stream: int, devptr: int, value: int) -> None:
        if not reached(ctypes.c_uint64.from_address(devptr).value, value):
            raise BackendError(f"a host flag waited for {value} before it was written")

    def host_register(self, addr: int, nbytes: int, device: int = 0) -> int:
        return addr

    def host_unregister(self, addr: int, device: int = 0) -> None:
        pass

    def bind(self, device: int) -> None:
        pass


def parse_descriptor(handle: bytes | str) -> int | None:
    """The size a CPU descriptor arena's handle announces; None if it is not one."""
    fields = handles.unpack(handle, MAGIC, 1)
    return None if fields is None else fields[0]


class MemfdArena(Arena):
    """An arena in a sealed memfd."""

    def __init__(self, nbytes: int, fd: int | None = None, label: str = "") -> None:
        """Make one (``fd`` None), or map a peer's ``fd`` (not taken) read-only."""
        self.nbytes = nbytes
        self.owner = fd is None
        self.readonly = not self.owner
        if fd is None:
            self._fd = os.memfd_create("ipcsync-arena", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            try:
                os.ftruncate(self._fd, nbytes)
                fcntl.fcntl(self._fd, fcntl.F_ADD_SEALS, _SEALS)
            except BaseException:
                os.close(self._fd)
                raise
            use = self._fd
        else:
            self._fd = -1
            try:
                st = os.fstat(fd)
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            except OSError as exc:
                raise BackendError(f"the producer's arena descriptor cannot be inspected: {exc}") from None
            if not stat.S_ISREG(st.st_mode) or st.st_size != nbytes or seals & _SEALS != _SEALS:
                raise BackendError(f"the producer's arena descriptor is not a sealed file of {nbytes} bytes")
            use = fd
        prot = mmap.PROT_READ | mmap.PROT_WRITE if self.owner else mmap.PROT_READ
        mm = mmap.mmap(use, nbytes, mmap.MAP_SHARED | _MAP_POPULATE, prot)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
            self.tensor = torch.frombuffer(mm, dtype=torch.uint8)
        self.handle = handles.pack(MAGIC, nbytes) if self.owner else b""
        if not self.owner:
            token = writefaults.watch(self.tensor.data_ptr(), nbytes, label or "shared memory of the producer")
            if token is not None:
                weakref.finalize(mm, writefaults.unwatch, token)

    def export(self) -> bytes | str:
        return self.handle

    def export_fd(self) -> int:
        if self._fd < 0:
            raise BackendError("only the arena's owner exports it")
        return os.dup(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self.tensor = torch.empty(0, dtype=torch.uint8)
