"""Memory shared by descriptor (runtime.producer.sharing, runtime.transport.memory_wire, backends.flags) on
the CPU route (IPCSYNC_CPU_DESCRIPTORS=1, backends.cpu_descriptors): the path the CUDA
backend takes on a GPU, run without one. The descriptors travel on the lane, flags order
the items by generation, a peer's death poisons the survivor's waits, and nothing a peer
sends on the lane is trusted."""

from __future__ import annotations

import os
import signal
import socket
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import given, settings, strategies as st

import ipcsync
from ipcsync.backends import flags as F
from ipcsync.errors import BackendError
from ipcsync.runtime.transport import memory_wire as W

ROUTE = {"IPCSYNC_CPU_DESCRIPTORS": "1"}


@pytest.fixture
def by_descriptor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IPCSYNC_CPU_DESCRIPTORS", "1")


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.timeout(90)
def test_a_stream_by_descriptor_arrives_whole_in_order(by_descriptor: None, procs: Any, endpoints: Any) -> None:
    out = endpoints.producer("desc-stream", slots=4, slot_bytes=1 << 16)
    assert out.port.sharing is not None and out.port.share_problem is None
    c = procs.start("consume", module="peers.basic", endpoint="desc-stream", size=64, env=ROUTE)
    c.read_until(lambda m: m.get("event") == "connected")
    from peers.common import expected

    for i in range(301):
        out.send(expected(i, 64), meta={"i": i, "tag": f"item-{i}"})
    out.close()
    r = c.result()
    assert r["end"] == "stop" and r["received"] == 301 and r["errors"] == [], r


@pytest.mark.timeout(60)
def test_slot_blocks_and_a_consumer_in_the_same_process(by_descriptor: None, endpoints: Any) -> None:
    out = endpoints.producer("desc-slot", slots=2, slot_bytes=4096)
    inp = endpoints.consumer("desc-slot", timeout=10)
    for i in range(20):
        with out.slot(x=((16,), torch.float32), meta={"i": i}) as s:
            s["x"].fill_(float(i))
        item = inp.get(timeout=10)
        assert item.meta == {"i": i} and torch.equal(item["x"], torch.full((16,), float(i)))
        assert inp.stats()["handoffs"] == i + 1 if isinstance(inp.stats(), dict) else True
        item.release()


@pytest.mark.timeout(90)
def test_a_write_into_an_item_shared_by_descriptor_faults_and_says_why(procs: Any, endpoints: Any,
                                                                        by_descriptor: None) -> None:
    from peers.common import expected

    out = endpoints.producer("desc-write", slots=2, slot_bytes=4096, heartbeat=0.5, timeout=30)
    writer = procs.start("write_one", module="peers.refs", endpoint="desc-write", how="item", env=ROUTE)
    out.wait_for_consumers(1, timeout=30)
    out.send(expected(7, 16), meta={"i": 7}, timeout=30)
    assert writer.proc.wait(timeout=60) == -signal.SIGSEGV
    err = writer.stderr()
    assert "this process wrote into memory it received read-only" in err and "clone()" in err, err[-3000:]
    assert not any(line.get("event") == "wrote" for line in writer.lines)


@pytest.mark.timeout(120)
def test_a_consumer_killed_mid_stream_leaves_the_producer_serving_the_other(by_descriptor: None, procs: Any,
                                                                              endpoints: Any) -> None:
    out = endpoints.producer("desc-kill", slots=4, slot_bytes=1 << 16)
    fds_before = _open_fds()
    good = procs.start("consume", module="peers.basic", endpoint="desc-kill", size=32, sharded=True, env=ROUTE)
    bad = procs.start("consume", module="peers.basic", endpoint="desc-kill", size=32, sharded=True,
                      kill_after=5, env=ROUTE)
    good.read_until(lambda m: m.get("event") == "connected")
    bad.read_until(lambda m: m.get("event") == "connected")
    from peers.common import expected

    for i in range(400):
        out.send(expected(i, 32), meta={"i": i, "tag": f"item-{i}"}, timeout=60)
    out.close(timeout=60)
    r = good.result()
    assert r["errors"] == [] and r["received"] >= 400 - 4 - 5, r  # the killed one's took at most its slots
    assert _open_fds() <= fds_before + 2  # its flag segment and lane went with it


@pytest.mark.timeout(120)
def test_a_producer_killed_mid_stream_ends_the_consumer_with_peer_lost(procs: Any) -> None:
    p = procs.start("produce", module="peers.basic", endpoint="desc-pk", n=10_000, size=32, kill_after=50,
                    env=ROUTE)
    c = procs.start("consume", module="peers.basic", endpoint="desc-pk", size=32, env=ROUTE)
    r = c.result()
    assert r["end"] == "peer-lost" and r["errors"] == [], r
    assert 0 < r["received"] <= 50
    assert p.proc.wait(timeout=30) == -signal.SIGKILL


def test_a_flag_segments_poison_lets_every_pending_wait_pass() -> None:
    from ipcsync.backends.cpu_descriptors import HostFlags

    fd = F.new_segment_fd(4)
    seg = F.FlagSegment(HostFlags(), fd, 4, 0, peer=True)
    try:
        ev = seg.ready(3)
        ev.value = 12
        with pytest.raises(BackendError, match="before it was written"):
            ev.wait(None)  # a wait the writer has not satisfied is a bug on the host: said, never a hang
        seg.poison("ready")
        ev.wait(None)
        assert ev.query()
    finally:
        seg.close()
        os.close(fd)


# ------------------------------------------------------------------ the memory packet, untrusted
def _pair() -> tuple[socket.socket, socket.socket]:
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


def test_the_memory_packet_carries_the_descriptors() -> None:
    a, b = _pair()
    arena = os.memfd_create("a")
    flags_fd = F.new_segment_fd(2)
    try:
        W.send_memory(a, [arena], flags_fd)
        got, fl = W.recv_memory(b, 1, timeout=1.0)
        assert len(got) == 1
        assert os.fstat(got[0]).st_ino == os.fstat(arena).st_ino
        assert os.fstat(fl).st_ino == os.fstat(flags_fd).st_ino
        for fd in (*got, fl):
            os.close(fd)
    finally:
        for fd in (arena, flags_fd):
            os.close(fd)
        a.close()
        b.close()


@settings(max_examples=60, deadline=None)
@given(payload=st.one_of(st.binary(max_size=64),
                         st.builds(lambda x: msgpack.packb(x), st.lists(st.integers(-3, 20) | st.text(max_size=16),
                                                                        max_size=4))),
       nfds=st.integers(0, 5), announced=st.integers(1, 3))
def test_a_bad_memory_packet_is_refused_and_leaks_no_descriptor(payload: bytes, nfds: int, announced: int) -> None:
    before = _open_fds()
    a, b = _pair()
    mine = [os.memfd_create("x") for _ in range(nfds)]
    try:
        if payload or mine:
            socket.send_fds(a, [payload or b"\x00"], mine) if mine else a.send(payload)
        good = payload == msgpack.packb([W.MAGIC, announced]) and nfds == announced + 1
        if good:
            fds, fl = W.recv_memory(b, announced, timeout=0.2)
            for fd in (*fds, fl):
                os.close(fd)
        else:
            with pytest.raises(BackendError):
                W.recv_memory(b, announced, timeout=0.2)
    finally:
        for fd in mine:
            os.close(fd)
        a.close()
        b.close()
    assert _open_fds() == before


def test_a_producer_announcing_too_many_arenas_is_refused() -> None:
    a, b = _pair()
    try:
        with pytest.raises(BackendError):
            W.recv_memory(b, 0, timeout=0.1)
        with pytest.raises(BackendError):
            W.recv_memory(b, 10_000, timeout=0.1)
    finally:
        a.close()
        b.close()


def test_an_arena_descriptor_must_be_sealed_and_of_its_size(by_descriptor: None) -> None:
    from ipcsync.backends.cpu import CpuBackend

    be = CpuBackend()
    arena = be.create_shared_arena(8192)
    fd = arena.export_fd()
    plain = os.memfd_create("plain")
    os.ftruncate(plain, 8192)
    try:
        got = be.open_shared_arena(arena.export(), 8192, fd)
        assert got.readonly and got.tensor.numel() == 8192
        with pytest.raises(BackendError):
            be.open_shared_arena(arena.export(), 8192, plain)  # not sealed: could shrink under us
        with pytest.raises(BackendError):
            be.open_shared_arena(arena.export(), 16384, fd)  # announced more than it is
        with pytest.raises(BackendError):
            be.open_shared_arena(b"\x93\xa3abc\x01\x02", 8192, fd)
    finally:
        os.close(fd)
        os.close(plain)
        arena.close()


def test_the_cpu_backend_shares_by_name_unless_asked(monkeypatch: pytest.MonkeyPatch, endpoints: Any) -> None:
    monkeypatch.delenv("IPCSYNC_CPU_DESCRIPTORS", raising=False)
    out = endpoints.producer("desc-off", slots=2, slot_bytes=4096)
    assert out.port.sharing is None and "by name" in str(out.port.share_problem)
    assert isinstance(ipcsync.Producer, type)
