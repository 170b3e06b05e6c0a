"""Flags: how two processes order their GPU work on one connection without sharing a
synchronization object either of them owns.

A connection's flags are one segment of host memory both processes map (a sealed memfd,
passed once over the connection's lane) and register for the GPU: ``ready[slot]``, written
by the producer, then ``release[slot]``, written by the consumer, 8 bytes each. A write is a
stream memory operation (``cuStreamWriteValue64``, after a memory barrier, in stream order);
a GPU-side wait is ``cuStreamWaitValue64`` (later work on the stream waits until the flag
reaches the value); a host-side wait reads the word. The value is the slot's generation, so
a wait names the item it waits for.

Rules:

- **No owner to lose.** The segment stays valid in each process while that process maps it,
  whoever made it; neither side ever waits on, queries, records into or destroys a CUDA
  object of the other's.
- **A survivor frees its own waits.** When the peer is gone, ``poison`` stores, from the CPU,
  a value every pending wait accepts (``cuda_driver.POISON_STEP``), so no stream of ours
  waits for ever on a dead peer's flag. The caller then drops the peer's items.
- **Untrusted sizes.** An imported segment must be a sealed regular file of exactly the
  size the slot count implies (``check_segment``), so a peer can neither make us read past
  it nor shrink it under us (SIGBUS).
- Values compare cyclically in 64 bits (as the GPU's wait does): ``reached(word, value)``.

The CPU-side logic (layout, checks, comparisons, poisoning) runs with any ``driver`` that
has ``write_value``, ``wait_value``, ``host_register`` and ``host_unregister``, so it is
tested without a GPU.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import stat
import time
from typing import Any, Callable, ClassVar, Protocol

from ..errors import BackendError, IpcTimeoutError
from ..interrupts import wait_point
from .base import Event
from .cuda_driver import NoContext

__all__ = ["FlagDriver", "FlagSegment", "FlagEvent", "segment_bytes", "reached", "check_segment", "new_segment_fd",
           "POISON"]

_WORD = 8
_MASK = (1 << 64) - 1
_HALF = 1 << 63
_PAGE = mmap.PAGESIZE
# Stored by a survivor into the flags its own waits read: passes every wait for a value
# below it (generations never come near 2**62).
POISON = 1 << 62
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class FlagDriver(Protocol):
    """What flags use of ``cuda_driver.Driver``."""

    def write_value(self, stream: int, devptr: int, value: int) -> None: ...

    def wait_value(self, stream: int, devptr: int, value: int) -> None: ...

    def host_register(self, addr: int, nbytes: int, device: int = 0) -> int: ...

    def host_unregister(self, addr: int, device: int = 0) -> None: ...

    def bind(self, device: int) -> None: ...


def segment_bytes(slots: int) -> int:
    """The size of a connection's segment for ``slots`` slots: whole pages."""
    if type(slots) is not int or slots <= 0:
        raise BackendError(f"a flag segment needs a positive slot count, got {slots!r}")
    need = 2 * slots * _WORD
    return -(-need // _PAGE) * _PAGE


def reached(word: int, value: int) -> bool:
    """Whether a flag holding ``word`` satisfies a wait for ``value`` (cyclic, 64 bits)."""
    return ((word - value) & _MASK) < _HALF


def new_segment_fd(slots: int) -> int:
    """A sealed memfd of ``segment_bytes(slots)`` zero bytes (its size can never change)."""
    fd = os.memfd_create("ipcsync-flags", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, segment_bytes(slots))
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_segment(fd: int, slots: int) -> None:
    """BackendError unless ``fd`` is a sealed regular file of exactly the size ``slots``
    slots need (a descriptor a peer sent: never trusted)."""
    try:
        st = os.fstat(fd)
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as exc:
        raise BackendError(f"the peer's flag segment cannot be inspected: {exc}") from None
    want = segment_bytes(slots)
    if not stat.S_ISREG(st.st_mode):
        raise BackendError("the peer's flag segment is not a regular file")
    if st.st_size != want:
        raise BackendError(f"the peer's flag segment has {st.st_size} bytes; {slots} slots need {want}")
    if seals & _SEALS != _SEALS:
        raise BackendError("the peer's flag segment is not sealed against resizing")


class FlagSegment:
    """One connection's flags in this process: mapped, registered for the GPU, and read as
    words from the CPU. ``ready(slot)``/``release(slot)`` give each flag's event."""

    def __init__(self, driver: FlagDriver, fd: int, slots: int, device_index: int, *, peer: bool,
                 current_stream: Callable[[], int] | None = None) -> None:
        """Map ``fd`` (not taken: the caller closes it). ``peer``: the descriptor came from
        the other process (checked first). ``current_stream``: the handle of the current
        stream, for a record or wait given no stream (None: streams mean nothing here)."""
        if peer:
            check_segment(fd, slots)
        self.driver = driver
        self.current_stream = current_stream
        self.slots = slots
        self.device_index = device_index
        self.nbytes = segment_bytes(slots)
        self._events: dict[int, FlagEvent] = {}
        self._mm: mmap.mmap | None = mmap.mmap(fd, self.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._buf: Any = (ctypes.c_char * self.nbytes).from_buffer(self._mm)
        self.addr = ctypes.addressof(self._buf)
        self.words: memoryview = memoryview(self._mm).cast("Q")
        try:
            self.devptr = driver.host_register(self.addr, self.nbytes, device_index)
        except BaseException:
            self._unmap()
            raise

    def ready(self, slot: int) -> "FlagEvent":
        """Slot ``slot``'s ready flag (the producer writes it, the consumer waits)."""
        return self._event(slot, 0)

    def release(self, slot: int) -> "FlagEvent":
        """Slot ``slot``'s release flag (the consumer writes it, the producer waits)."""
        return self._event(slot, self.slots)

    def _event(self, slot: int, base: int) -> "FlagEvent":
        if type(slot) is not int or not 0 <= slot < self.slots:
            raise BackendError(f"slot {slot!r} is outside a segment of {self.slots} slots")
        index = base + slot
        ev = self._events.get(index)
        if ev is None:
            ev = self._events[index] = FlagEvent(self, index)
        return ev

    def poison(self, which: str) -> None:
        """The peer is gone: let every wait of ours on its flags (``"ready"`` or
        ``"release"``) pass, from the CPU, so no stream waits for ever on it."""
        if self._mm is None:
            return
        start = 0 if which == "ready" else self.slots
        for i in range(start, start + self.slots):
            self.words[i] = POISON

    def close(self) -> None:
        """Unregister and unmap. The caller makes sure no GPU work of ours still reads or
        writes the segment (its streams synchronized, or its waits poisoned and drained)."""
        if self._mm is None:
            return
        try:
            self.driver.host_unregister(self.addr, self.device_index)
        finally:
            self._unmap()

    def _unmap(self) -> None:
        self._events.clear()
        words, self.words = self.words, memoryview(b"")
        words.release()
        self._buf = None
        mm, self._mm = self._mm, None
        if mm is not None:
            mm.close()


def _stream_handle(segment: FlagSegment, stream: Any) -> int:
    if stream is None:
        return segment.current_stream() if segment.current_stream is not None else 0
    return int(getattr(stream, "cuda_stream", 0) or 0)


class FlagEvent(Event):
    """One flag as an ``Event``: ``value`` is the generation that ``record`` writes and
    ``wait``/``query`` wait for; the runtime sets it before each use (the item's
    generation). It is never exported on its own (``handle`` refuses): the segment is."""

    complete_on_record: ClassVar[bool] = False
    __slots__ = ("segment", "index", "devptr", "value")

    def __init__(self, segment: FlagSegment, index: int) -> None:
        self.segment = segment
        self.index = index
        self.devptr = segment.devptr + index * _WORD
        self.value = 0

    def record(self, stream: Any = None) -> None:
        seg = self.segment
        try:
            seg.driver.write_value(_stream_handle(seg, stream), self.devptr, self.value)
        except NoContext:  # a thread of ours that never used CUDA: give it torch's context
            seg.driver.bind(seg.device_index)
            seg.driver.write_value(_stream_handle(seg, stream), self.devptr, self.value)

    def wait(self, stream: Any = None) -> None:
        seg = self.segment
        try:
            seg.driver.wait_value(_stream_handle(seg, stream), self.devptr, self.value)
        except NoContext:
            seg.driver.bind(seg.device_index)
            seg.driver.wait_value(_stream_handle(seg, stream), self.devptr, self.value)

    def query(self) -> bool:
        return ((self.segment.words[self.index] - self.value) & _MASK) < _HALF

    def bound_record(self) -> Callable[[Any], None]:
        return self.record

    def bound_query(self) -> Callable[[], bool]:
        return self.query

    @wait_point
    def synchronize(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 1e-5
        while not self.query():
            if deadline is not None and time.monotonic() >= deadline:
                raise IpcTimeoutError(f"flag {self.index} did not reach {self.value} within {timeout} s")
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)

    def handle(self) -> bytes:
        raise BackendError("a flag is shared with its segment, not on its own")
