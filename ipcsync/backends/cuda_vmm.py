"""CUDA arenas no process's death can free under another: memory made with CUDA's virtual
memory API, shared as a POSIX file descriptor.

The producer makes each arena with ``cuMemCreate`` and maps it read-write; for each
connection it exports a fresh descriptor (``cuMemExportToShareableHandle``), which travels
once over the connection's lane (``SCM_RIGHTS``) beside a small descriptor of the arena in
SETUP (``export``: magic, owner pid, size). The consumer imports it and maps it
**read-only** (``cuMemSetAccess`` with ``PROT_READ``): a kernel that writes into a received
item faults at once in the process that ran it, and never changes what another reader sees.

Rules:

- **Memory lives while any process maps it.** The driver frees an allocation only once
  every handle and mapping of it in every process is gone, so a consumer keeps reading its
  items after the producer died, and a producer's arena outlives a consumer killed while
  reading it.
- **A mapping goes only when nothing of ours uses it.** Tensors over an arena keep its
  ``_Mapping`` alive (``torch.as_tensor`` over ``__cuda_array_interface__`` holds it); when
  the last goes, the mapping is queued, and ``collect`` (an endpoint's close,
  ``Backend.collect``) synchronizes this process's GPU work and unmaps what is queued. A
  tensor the program keeps after close keeps its memory mapped.
- **Nothing a peer sends is trusted.** The descriptor's size must be a whole number of the
  granularity and at least the announced bytes; the mapping must succeed for all of it and
  the allocation must live on the GPU SETUP named (checked by ``import_fd`` and
  ``device_of``); any failure is a BackendError and the descriptor is closed.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any

import torch

from .. import gpufaults
from ..errors import BackendError
from . import handles
from .base import Arena
from .cuda_driver import Driver

__all__ = ["VmmArena", "create_arena", "open_arena", "descriptor", "parse_descriptor", "collect", "MAGIC"]

MAGIC = "ipcsync-cuda-vmm"
_pending: list[tuple[Driver, int, int, int, int]] = []  # (driver, ptr, size, handle, device) to unmap
_pending_lock = threading.Lock()


class _Mapping:
    """One mapped range: what ``torch.as_tensor`` reads (``__cuda_array_interface__``) and
    keeps alive while any tensor over it lives."""

    def __init__(self, driver: Driver, ptr: int, size: int, handle: int, device: int) -> None:
        # (torch refuses the interface's read-only flag; the mapping itself is what is
        # read-only, and a write through it faults on the GPU.)
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}
        weakref.finalize(self, _queue, driver, ptr, size, handle, device)


def _queue(driver: Driver, ptr: int, size: int, handle: int, device: int) -> None:
    with _pending_lock:
        _pending.append((driver, ptr, size, handle, device))


def collect() -> int:
    """Unmap and release the mappings no tensor uses any more, after this process's GPU work
    is done (a context synchronize). Returns how many went."""
    with _pending_lock:
        todo = list(_pending)
        _pending.clear()
    if not todo:
        return 0
    for device in {entry[4] for entry in todo}:
        todo[0][0].synchronize(device)
    for driver, ptr, size, handle, device in todo:
        driver.unmap(ptr, size, device)
        driver.release(handle, device)
    return len(todo)


class VmmArena(Arena):
    """An arena in VMM memory: owned (read-write, exportable) or imported (read-only)."""

    def __init__(self, driver: Driver, handle: int, size: int, nbytes: int, device_index: int, owner: bool,
                 reader: int | None = None) -> None:
        """Map the allocation on ``device_index`` (the GPU it lies on: the tensor's device),
        readable also from ``reader`` (a consumer on a peer GPU)."""
        self.driver = driver
        self.alloc = handle
        self.size = size
        self.nbytes = nbytes
        self.owner = owner
        self.readonly = not owner
        self.device_index = device_index
        also = () if reader is None else (reader,)
        ptr = driver.map(handle, size, device_index, readonly=not owner, also=also)
        try:
            mapping = _Mapping(driver, ptr, size, handle, device_index)
        except BaseException:
            driver.unmap(ptr, size, device_index)
            raise
        with torch.cuda.device(device_index):
            self.tensor = torch.as_tensor(mapping, device=torch.device("cuda", device_index))[:nbytes]
        self.descriptor = descriptor(size) if owner else b""
        self.handle = self.descriptor

    def export(self) -> bytes:
        return self.descriptor

    def export_fd(self) -> int:
        """A new descriptor of the allocation for one connection (the caller closes it)."""
        if not self.owner:
            raise BackendError("only the arena's owner exports it")
        return self.driver.export_fd(self.alloc, self.device_index)

    def close(self) -> None:
        """Drop our view: the mapping goes once no tensor of the program uses it (``collect``)."""
        self.tensor = torch.empty(0, dtype=torch.uint8)


def descriptor(size: int) -> bytes:
    """What SETUP carries for a VMM arena (its memory travels as a descriptor on the lane)."""
    return handles.pack(MAGIC, os.getpid(), size)


def parse_descriptor(handle: bytes | str) -> int | None:
    """The allocation size a VMM arena's SETUP handle announces; None if ``handle`` is not
    one (a legacy CUDA IPC handle); BackendError if it is one but malformed."""
    fields = handles.unpack(handle, MAGIC, 2)
    return None if fields is None else fields[1]


def create_arena(driver: Driver, nbytes: int, device_index: int) -> VmmArena:
    """A new arena of at least ``nbytes`` on ``device_index``, mapped read-write here."""
    handle, size = driver.create(nbytes, device_index)
    try:
        return VmmArena(driver, handle, size, nbytes, device_index, owner=True)
    except BaseException:
        driver.release(handle, device_index)
        raise


def open_arena(driver: Driver, handle: bytes | str, nbytes: int, fd: int, device_index: int,
               memory_device: int | None = None, explain_faults: bool = True) -> VmmArena:
    """Map a peer's arena read-only from its descriptor ``fd`` (not taken: the caller closes
    it), for kernels on ``device_index``. ``memory_device``: the GPU the allocation must live
    on, where its tensors are (default ``device_index``)."""
    size = parse_descriptor(handle)
    if size is None:
        raise BackendError(f"not a VMM arena descriptor: {handle!r:.60}")
    granularity = driver.granularity(device_index)
    if size < nbytes or size % granularity:
        raise BackendError(f"the producer's arena descriptor says {size} bytes; it announced {nbytes} "
                           f"(and allocations come in multiples of {granularity})")
    alloc = driver.import_fd(fd, device_index)
    try:
        where = driver.device_of(alloc, device_index)
        want = device_index if memory_device is None else memory_device
        if where != want:
            raise BackendError(f"the producer's arena lies on GPU {where}, not on the GPU its SETUP named ({want})")
        arena = VmmArena(driver, alloc, size, nbytes, want, owner=False, reader=device_index)
        if explain_faults:
            gpufaults.watching()  # a write into it faults the GPU: say why when that escapes
        return arena
    except BaseException:
        driver.release(alloc, device_index)
        raise


def describe(arena: Any) -> str:
    """How an arena's memory is shared, for logs and ``ipcsync doctor``."""
    return "vmm" if isinstance(arena, VmmArena) else "legacy"
