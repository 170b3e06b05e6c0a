"""backends.flags without a GPU: the segment's layout and checks, the cyclic comparison,
poisoning, and what a FlagEvent asks of the driver (a fake one that records calls and
"writes" a flag at once, as a stream with no work queued would)."""

from __future__ import annotations

import fcntl
import os
from typing import Any

import pytest
from hypothesis import given, strategies as st

from ipcsync.backends import flags as F
from ipcsync.backends.cuda_driver import NoContext
from ipcsync.errors import BackendError, IpcTimeoutError


class FakeDriver:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.registered: dict[int, int] = {}
        self.segment: F.FlagSegment | None = None
        self.no_context_once = False

    def host_register(self, addr: int, nbytes: int, device: int = 0) -> int:
        dev = 0x7000_0000_0000 + len(self.registered) * 0x10000
        self.registered[addr] = dev
        self.calls.append(("register", nbytes))
        return dev

    def host_unregister(self, addr: int, device: int = 0) -> None:
        del self.registered[addr]
        self.calls.append(("unregister",))

    def _index(self, devptr: int) -> int:
        assert self.segment is not None
        return (devptr - self.segment.devptr) // 8

    def write_value(self, stream: int, devptr: int, value: int) -> None:
        if self.no_context_once:
            self.no_context_once = False
            raise NoContext("no context")
        assert self.segment is not None
        self.segment.words[self._index(devptr)] = value
        self.calls.append(("write", stream, self._index(devptr), value))

    def wait_value(self, stream: int, devptr: int, value: int) -> None:
        self.calls.append(("wait", stream, self._index(devptr), value))

    def bind(self, device: int) -> None:
        self.calls.append(("bind", device))


class Stream:
    cuda_stream = 1234


def _segment(slots: int = 4) -> tuple[FakeDriver, F.FlagSegment, int]:
    drv = FakeDriver()
    fd = F.new_segment_fd(slots)
    seg = F.FlagSegment(drv, fd, slots, 0, peer=True)
    drv.segment = seg
    return drv, seg, fd


def test_segment_sizes_are_whole_pages() -> None:
    assert F.segment_bytes(1) == os.sysconf("SC_PAGE_SIZE")
    assert F.segment_bytes(256) == 4096 or F.segment_bytes(256) % os.sysconf("SC_PAGE_SIZE") == 0
    assert F.segment_bytes(1024) >= 2 * 1024 * 8
    for bad in (0, -1, 2.0, "4"):
        with pytest.raises(BackendError):
            F.segment_bytes(bad)  # type: ignore[arg-type]


def test_new_segment_is_sealed_and_zero() -> None:
    fd = F.new_segment_fd(8)
    try:
        F.check_segment(fd, 8)
        with pytest.raises(OSError):
            os.ftruncate(fd, 0)  # sealed: a peer cannot shrink it under us (SIGBUS)
        assert os.pread(fd, 128, 0) == bytes(128)
    finally:
        os.close(fd)


def test_a_peers_segment_is_checked_before_it_is_mapped(tmp_path: Any) -> None:
    drv = FakeDriver()
    fd = F.new_segment_fd(4)
    try:
        with pytest.raises(BackendError, match="bytes"):
            F.FlagSegment(drv, fd, 400, 0, peer=True)  # announced more slots than it holds
    finally:
        os.close(fd)
    unsealed = os.memfd_create("x", os.MFD_ALLOW_SEALING)
    os.ftruncate(unsealed, F.segment_bytes(4))
    try:
        with pytest.raises(BackendError, match="sealed"):
            F.check_segment(unsealed, 4)
    finally:
        os.close(unsealed)
    r, w = os.pipe()
    try:
        with pytest.raises(BackendError, match="regular file|inspected"):
            F.check_segment(r, 4)
    finally:
        os.close(r)
        os.close(w)
    plain = tmp_path / "f"
    plain.write_bytes(bytes(F.segment_bytes(4)))
    pfd = os.open(plain, os.O_RDONLY)
    try:
        with pytest.raises(BackendError):
            F.check_segment(pfd, 4)  # a regular file, but not sealed (no seals at all)
    finally:
        os.close(pfd)
    assert drv.calls == []  # nothing was registered for any of them


@given(st.integers(0, 2**64 - 1), st.integers(0, 2**62))
def test_reached_is_a_cyclic_comparison(base: int, step: int) -> None:
    later = (base + step) & (2**64 - 1)
    assert F.reached(later, base)
    if step:
        assert not F.reached(base, later)


def test_events_write_wait_and_query_by_generation() -> None:
    drv, seg, fd = _segment()
    try:
        ready, release = seg.ready(2), seg.release(2)
        assert seg.ready(2) is ready  # one event per flag
        ready.value = 5
        assert not ready.query()
        ready.wait(Stream())
        ready.record(Stream())
        assert ready.query()
        release.value = 7
        release.record(Stream())
        assert drv.calls[-3:] == [("wait", 1234, 2, 5), ("write", 1234, 2, 5), ("write", 1234, 4 + 2, 7)]
        assert seg.words[2] == 5 and seg.words[6] == 7
        ready.value = 6
        assert not ready.query()
        with pytest.raises(IpcTimeoutError):
            ready.synchronize(timeout=0.01)
        with pytest.raises(BackendError):
            seg.ready(4)  # past the slots
        with pytest.raises(BackendError):
            ready.handle()
    finally:
        seg.close()
        os.close(fd)
    assert drv.registered == {}


def test_poison_frees_every_wait_of_one_side_only() -> None:
    drv, seg, fd = _segment()
    try:
        for s in range(4):
            seg.ready(s).value = 10 + s
            seg.release(s).value = 20 + s
        seg.poison("ready")
        assert all(seg.ready(s).query() for s in range(4))
        assert not any(seg.release(s).query() for s in range(4))
        seg.poison("release")
        assert all(seg.release(s).query() for s in range(4))
    finally:
        seg.close()
        os.close(fd)
    seg.poison("ready")  # closed: nothing to do, no error


def test_a_thread_without_a_context_is_given_torchs() -> None:
    drv, seg, fd = _segment()
    try:
        drv.no_context_once = True
        ev = seg.ready(0)
        ev.value = 3
        ev.record(Stream())
        assert ("bind", 0) in drv.calls and seg.words[0] == 3
    finally:
        seg.close()
        os.close(fd)


def test_two_mappings_of_one_segment_see_each_others_writes() -> None:
    drv_a, seg_a, fd = _segment()
    drv_b = FakeDriver()
    dup = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 0)
    seg_b = F.FlagSegment(drv_b, dup, 4, 0, peer=True)
    drv_b.segment = seg_b
    try:
        seg_a.words[1] = 99
        ev = seg_b.ready(1)
        ev.value = 99
        assert ev.query()
        seg_b.poison("release")
        assert seg_a.words[4] == F.POISON
    finally:
        seg_a.close()
        seg_b.close()
        os.close(fd)
        os.close(dup)
