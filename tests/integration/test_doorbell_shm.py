"""runtime.doorbell: the shared-memory doorbell's segments and eventfds (not wired into
the sessions yet). Each side writes only its own segment and maps the peer's read-only;
a parked side is woken through its eventfd, which select waits on; a rogue peer's
garbage is a ProtocolError for that peer's doorbell only; nothing is left in /dev/shm."""

from __future__ import annotations

import multiprocessing as mp
import os
import select
import socket
import struct
from typing import Any, Iterator

import pytest

from ipcsync.core import doorbell as D
from ipcsync.errors import ClosedError, ProtocolError
from ipcsync.runtime import doorbell as R
from ipcsync.runtime.shm import SHM_DIR

GEOM = D.Geometry(8, 3)
NSLOTS = 4
WAIT_S = 10.0  # a bound for waits that normally end at once (never a timed assertion)


def _side_pair() -> tuple[R.Doorbell, R.Doorbell]:
    """Producer and consumer doorbells of one edge, both in this process; the bells travel
    over an AF_UNIX socket pair, as they would over the edge's lane."""
    a, b = R.OwnSegment(GEOM), R.OwnSegment(GEOM)
    pa, pb = R.PeerSegment(a.name, GEOM, "producer 1"), R.PeerSegment(b.name, GEOM, "consumer 2")
    a.unlink()
    b.unlink()
    bell_a, bell_b = R.Bell(), R.Bell()
    s1, s2 = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with s1, s2:
        R.send_bell(s1, bell_a)
        R.send_bell(s2, bell_b)
        ring_b, ring_a = R.receive_bell(s2, "producer 1"), R.receive_bell(s1, "consumer 2")
    producer = R.Doorbell(a, pb, bell_a, ring_a, "consumer 2", bounds=[0, NSLOTS, 0], sequential=0)
    consumer = R.Doorbell(b, pa, bell_b, ring_b, "producer 1", bounds=[0, NSLOTS, 0], sequential=0)
    return producer, consumer


@pytest.fixture
def edge() -> Iterator[tuple[R.Doorbell, R.Doorbell]]:
    p, c = _side_pair()
    try:
        yield p, c
    finally:
        p.close()
        c.close()


def test_ready_and_release_go_both_ways_in_order(edge: Any) -> None:
    producer, consumer = edge
    for i in range(20):  # more than the ring holds: room comes back as the consumer reads
        assert producer.post([(i, i % NSLOTS, 7)]) == 1
        assert consumer.take() == [(i, i % NSLOTS, 7)]
        assert consumer.post([(i, i % NSLOTS, 0)]) == 1
        assert producer.take() == [(i, i % NSLOTS, 0)]
    assert not producer.pending() and not consumer.pending()


def test_a_parked_side_is_woken_through_its_eventfd_and_only_then(edge: Any) -> None:
    producer, consumer = edge
    assert consumer.park()
    assert select.select([consumer.fd], [], [], 0)[0] == []
    producer.post([(0, 1, 0)])
    assert select.select([consumer.fd], [], [], WAIT_S)[0] == [consumer.fd]
    consumer.unpark()
    assert consumer.take() == [(0, 1, 0)]
    assert select.select([consumer.fd], [], [], 0)[0] == []
    producer.post([(1, 1, 0)])  # the consumer is awake: no ring
    assert select.select([consumer.fd], [], [], 0)[0] == []
    assert consumer.take() == [(1, 1, 0)]


def test_park_refuses_to_sleep_when_entries_came_meanwhile(edge: Any) -> None:
    producer, consumer = edge
    producer.post([(0, 1, 0)])
    assert not consumer.park()
    assert consumer.take() == [(0, 1, 0)]


def test_the_peer_segment_is_read_only(edge: Any) -> None:
    producer, _consumer = edge
    with pytest.raises(TypeError):
        producer.peer.buf[24:32] = bytes(8)


def test_segments_are_private_and_gone_after_close() -> None:
    own = R.OwnSegment(GEOM)
    path = os.path.join(SHM_DIR, own.name)
    try:
        assert os.stat(path).st_mode & 0o777 == 0o600
    finally:
        own.close()
    assert not os.path.exists(path)


@pytest.mark.parametrize("name", ["../etc/passwd", "ipcsync-1-zz", "", "ipcsync-12-0123456789abcdef/x"])
def test_a_peer_naming_something_else_than_a_segment_is_refused(name: str) -> None:
    with pytest.raises(ProtocolError, match="not a segment name"):
        R.PeerSegment(name, GEOM, "producer 1")


def test_a_segment_of_the_wrong_size_or_a_symlink_is_refused(tmp_path: Any) -> None:
    own = R.OwnSegment(D.Geometry(16, 3))
    try:
        with pytest.raises(ProtocolError, match="is not a .*-byte file"):
            R.PeerSegment(own.name, GEOM, "producer 1")
    finally:
        own.close()
    target = R.OwnSegment(GEOM)
    link = os.path.join(SHM_DIR, f"ipcsync-{os.getpid()}-{'ab' * 8}")
    os.symlink(os.path.join(SHM_DIR, target.name), link)
    try:
        with pytest.raises(ProtocolError, match="cannot open"):
            R.PeerSegment(os.path.basename(link), GEOM, "producer 1")
    finally:
        os.unlink(link)
        target.close()


def test_a_descriptor_packet_that_is_not_one_bell_is_refused() -> None:
    s1, s2 = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    r, w = os.pipe()
    try:
        socket.send_fds(s1, [b"B"], [r, w])
        with pytest.raises(ProtocolError, match="2 descriptor"):
            R.receive_bell(s2, "producer 1")
    finally:
        for fd in (r, w):
            os.close(fd)
        s1.close()
        s2.close()


def test_closed_parts_say_so_and_a_closed_bell_rings_nothing() -> None:
    bell = R.Bell()
    bell.close()
    bell.ring()  # as ringing a peer whose descriptor is gone: nothing, no error
    bell.drain()
    s1, s2 = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with s1, s2, pytest.raises(ClosedError, match="closed doorbell"):
        R.send_bell(s1, bell)
    a, b = R.OwnSegment(GEOM), R.OwnSegment(GEOM)
    pb = R.PeerSegment(b.name, GEOM, "consumer 2")
    bells = [R.Bell(), R.Bell()]
    try:
        pb.close()
        with pytest.raises(ClosedError, match="both segments open"):
            R.Doorbell(a, pb, bells[0], bells[1], "consumer 2", bounds=[0, NSLOTS, 0])
    finally:
        for part in (a, b, pb, *bells):
            part.close()


# ------------------------------------------------------------------ a rogue peer process
def _rogue(geom: tuple[int, int], conn: Any) -> None:
    """A peer process: makes its segment, then, told to, writes garbage into it."""
    seg = R.OwnSegment(D.Geometry(*geom))
    try:
        conn.send(seg.name)
        what = conn.recv()
        if what == "garbage":
            struct.pack_into("<Q", seg.buf, 24, 2 ** 63)  # a head far past anything published
        conn.send("done")
        conn.recv()  # until the test is done with it
    finally:
        seg.close()


def test_a_rogue_peer_process_gets_a_protocol_error_and_the_other_edge_goes_on(edge: Any) -> None:
    producer, consumer = edge
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    peer = ctx.Process(target=_rogue, args=((GEOM.capacity, GEOM.words), theirs), daemon=True)
    peer.start()
    try:
        assert mine.poll(60), "the peer process did not start"
        rogue = R.PeerSegment(mine.recv(), GEOM, "consumer 9")
        try:
            reader = D.RingReader(rogue.buf, GEOM, "consumer 9", [0, NSLOTS, 0], sequential=0)
            assert reader.take() == []
            mine.send("garbage")
            assert mine.poll(WAIT_S) and mine.recv() == "done"
            with pytest.raises(ProtocolError, match="consumer 9 broke the doorbell protocol"):
                reader.take()
        finally:
            rogue.close()
        # The other edge's doorbell is not affected.
        producer.post([(0, 2, 1)])
        assert consumer.take() == [(0, 2, 1)]
        mine.send("bye")
    finally:
        peer.join(WAIT_S)
        if peer.is_alive():
            peer.kill()
            peer.join(WAIT_S)
        mine.close()
        theirs.close()


# ------------------------------------------------------------------ two processes at full speed
STREAM_ITEMS = 100_000  # each way; a counter read half-written showed within ~10,000 on 2 cores
STREAM_GEOM = (32, 3)
_IDLE_LOOKS = 20_000  # looks without progress before checking that the other process lives


def _echo(geom: tuple[int, int], conn: Any, parent: int) -> None:
    """A consumer process at full speed: takes each READY entry of the test's ring and
    answers it with a RELEASE entry in its own; reports what went wrong, if anything."""
    g = D.Geometry(*geom)
    seg = R.OwnSegment(g)
    try:
        conn.send(seg.name)
        peer = R.PeerSegment(conn.recv(), g, "producer 1")
        assert seg.buf is not None and peer.buf is not None
        writer = D.RingWriter(seg.buf, peer.buf, g, "producer 1")
        reader = D.RingReader(peer.buf, g, "producer 1", [0, NSLOTS, 0], sequential=0)
        backlog: list[tuple[int, ...]] = []
        done = idle = 0
        try:
            while done < STREAM_ITEMS:
                got = reader.take()
                if got:
                    writer.set_read(reader.read)
                    backlog += [(seq, slot, 0) for seq, slot, _ in got]
                sent = writer.publish(backlog) if backlog else 0
                del backlog[:sent]
                done += sent
                idle = 0 if got or sent else idle + 1
                if idle >= _IDLE_LOOKS and os.getppid() != parent:
                    return  # the test is gone
            conn.send("ok")
        except ProtocolError as exc:
            conn.send(f"consumer: {exc}")
        finally:
            writer.release()
            reader.release()
            peer.close()
        conn.recv()  # until the test read its own side's last entries
    finally:
        seg.close()


@pytest.mark.long
@pytest.mark.timeout(240)  # (spawning the peer and 200,000 entries on a busy machine)
def test_counters_are_never_seen_half_written_by_a_peer_running_at_once() -> None:
    """Both sides of an edge in two processes, publishing and taking as fast as they can:
    each side reads the other's head and read counters while they change, and must see
    every value whole (the same protocol on one core and on many; this edge once failed
    mid-stream with 'head says 0 with 17860 consumed' on a 16-core host)."""
    g = D.Geometry(*STREAM_GEOM)
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=_echo, args=(STREAM_GEOM, theirs, os.getpid()), daemon=True)
    own = R.OwnSegment(g)
    peer = None
    proc.start()
    try:
        assert mine.poll(60), "the peer process did not start"
        peer = R.PeerSegment(mine.recv(), g, "consumer 2")
        mine.send(own.name)
        assert own.buf is not None and peer.buf is not None
        writer = D.RingWriter(own.buf, peer.buf, g, "consumer 2")
        reader = D.RingReader(peer.buf, g, "consumer 2", [0, NSLOTS, 0], sequential=0)
        released: list[tuple[int, ...]] = []
        problem = None
        try:
            seq = idle = 0
            while len(released) < STREAM_ITEMS and problem is None:
                batch = [(seq + k, (seq + k) % NSLOTS, 7) for k in range(min(4, STREAM_ITEMS - seq))]
                sent = writer.publish(batch) if batch else 0
                seq += sent
                got = reader.take()
                if got:
                    writer.set_read(reader.read)
                    released += got
                idle = 0 if got or sent else idle + 1
                if idle >= _IDLE_LOOKS and (not proc.is_alive() or mine.poll()):
                    problem = mine.recv() if mine.poll() else f"the peer process ended ({proc.exitcode})"
        except ProtocolError as exc:
            problem = f"producer: {exc}"
        finally:
            writer.release()
            reader.release()
        assert problem is None, problem
        assert mine.poll(WAIT_S) and mine.recv() == "ok"
        assert released == [(i, i % NSLOTS, 0) for i in range(STREAM_ITEMS)]
    finally:
        try:
            mine.send("bye")
        except OSError:
            pass  # (it is gone already)
        proc.join(WAIT_S)
        if proc.is_alive():
            proc.kill()
            proc.join(WAIT_S)
        if peer is not None:
            peer.close()
        own.close()
        mine.close()
        theirs.close()
