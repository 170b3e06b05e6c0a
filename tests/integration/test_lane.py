"""Lanes (``ipcsync.runtime.transport.lane``): a same-host ipc edge moves its frames from ZeroMQ to a
direct unix-socket lane after the handshake, keeping their order across the switch; a
lane that cannot be made or is refused leaves the edge on ZeroMQ; a lane that closes is
the same evidence as a closed connection, judged by the same liveness rule."""

from __future__ import annotations

import os
import signal
import socket
from typing import Any

import pytest
import torch

import ipcsync
from ipcsync.core import protocol as P
from polling import wait_until




def _stream(p: ipcsync.Producer, c: ipcsync.Consumer, n: int, start: int = 0) -> list[int]:
    """Send ``n`` items (meta and content ``start + i``), receive them all; their order."""
    got: list[int] = []
    # Items in flight, as many as leave room for the consumer's queued releases: a release
    # is queued until a batch gathers (at most half the ring), the consumer next waits, or
    # its service thread's tick, so one thread keeping more in flight waits a tick per send.
    in_flight = max(0, p.slots // 2 - 1)
    for i in range(start, start + n):
        p.send({"x": torch.full((16,), float(i))}, meta={"i": i})
        while len(got) < i - start + 1 - in_flight:
            item = c.get(timeout=10)
            assert item is not None
            assert float(item.tensors["x"][0]) == item.meta["i"]
            got.append(item.meta["i"])
            item.release()
    while len(got) < n:
        item = c.get(timeout=10)
        assert item is not None
        assert float(item.tensors["x"][0]) == item.meta["i"]
        got.append(item.meta["i"])
        item.release()
    return got


@pytest.mark.long
@pytest.mark.timeout(60)
def test_an_ipc_edge_moves_to_a_lane_and_keeps_order_meta_and_end(endpoints: Any) -> None:
    """Items sent at once after the handshake travel on ZeroMQ, later ones on the lane: the
    consumer sees every item in order with its meta, then the end of the stream."""
    p = endpoints.producer("lane-basic", slots=4, slot_bytes=4096, device="cpu")
    c = endpoints.consumer("lane-basic", device="cpu", timeout=10)
    p.wait_for_consumers(1, timeout=10)
    # Sent before the lane can have been switched to: these go on ZeroMQ.
    for i in range(3):
        p.send({"x": torch.full((16,), float(i))}, meta={"i": i})
    got = []
    for _ in range(3):
        item = c.get(timeout=10)
        got.append(item.meta["i"])
        item.release()
    got += _stream(p, c, 200, start=3)
    assert got == list(range(203))
    assert wait_until(lambda: p.stats()["lanes"] == 1 and c.stats()["lane"] is True, 10)
    got += _stream(p, c, 50, start=203)
    assert got == list(range(253))
    p.close()
    assert c.get(timeout=10) is None  # the end of the stream (the producer's BYE, on the lane)


@pytest.mark.timeout(60)
def test_frames_larger_than_a_lane_packet_are_split_and_arrive_whole(endpoints: Any) -> None:
    """A meta of ~300 KB travels on the lane as several packets, in order with the rest."""
    p = endpoints.producer("lane-big", slots=2, slot_bytes=4096, device="cpu")
    c = endpoints.consumer("lane-big", device="cpu", timeout=10)
    p.wait_for_consumers(1, timeout=10)
    _stream(p, c, 20)
    assert wait_until(lambda: p.stats()["lanes"] == 1, 10)
    big = "y" * 300_000
    for i in range(6):
        p.send({"x": torch.full((16,), float(i))}, meta={"i": i, "big": big if i % 2 else ""})
        item = c.get(timeout=10)
        assert item.meta["i"] == i and item.meta["big"] == (big if i % 2 else "")
        item.release()
    assert c.stats()["lane"] is True


@pytest.mark.timeout(60)
def test_an_error_after_the_switch_follows_the_last_item(endpoints: Any) -> None:
    """abort() on the lane: the consumer gets the items sent before it, then
    ProducerFailedError."""
    p = endpoints.producer("lane-err", slots=4, slot_bytes=4096, device="cpu")
    c = endpoints.consumer("lane-err", device="cpu", timeout=10)
    p.wait_for_consumers(1, timeout=10)
    _stream(p, c, 20)
    assert wait_until(lambda: p.stats()["lanes"] == 1, 10)
    p.send({"x": torch.zeros(16)}, meta={"i": 100})
    p.abort(RuntimeError("boom"))
    got = []
    with pytest.raises(ipcsync.ProducerFailedError, match="boom"):
        for _ in range(3):
            item = c.get(timeout=10)
            got.append(item.meta["i"])
            item.release()
    assert got in ([], [100])


def test_frames_sent_before_a_close_are_read_before_the_end_even_after_a_reset() -> None:
    """A side that closes its lane with frames of ours unread (an aborting producer with
    releases not yet read) makes the kernel report ECONNRESET ahead of the frames it sent
    last: they are still returned, in order, then the end."""
    from ipcsync.runtime.transport.lane import Lane, LaneClosed

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ours, theirs = Lane(a, 1 << 20), Lane(b, 1 << 20)
    assert ours.send(b"\x91\x01")  # unread by them when they close
    big = b"\x92" + bytes(3 * ours.max_packet)  # a split frame, too
    assert theirs.send(b"\x91\x02") and theirs.send(big) and theirs.flush()
    theirs.close()
    got = []
    with pytest.raises(LaneClosed):
        while True:
            frame = ours.recv()
            assert frame is not None, "a closed lane never makes recv() wait"
            got.append(frame)
    assert got == [b"\x91\x02", big]
    ours.close()


@pytest.mark.timeout(90)
def test_an_abort_with_releases_unread_still_delivers_its_cause(endpoints: Any) -> None:
    """abort() right after the consumer released items (its releases likely still unread
    on the producer's lane): the consumer gets ProducerFailedError with the cause, never
    a bare 'disconnected'."""
    for k in range(5):
        p = endpoints.producer(f"lane-err-unread{k}", slots=4, slot_bytes=4096, device="cpu")
        c = endpoints.consumer(f"lane-err-unread{k}", device="cpu", timeout=10)
        p.wait_for_consumers(1, timeout=10)
        _stream(p, c, 8)
        assert wait_until(lambda: p.stats()["lanes"] == 1, 10)
        for i in range(2):
            p.send({"x": torch.zeros(16)}, meta={"i": i})
        for _ in range(2):
            c.get(timeout=10).release()
        with pytest.raises(ipcsync.IpcTimeoutError):
            c.get(timeout=0.01)  # pumps: the releases go out on the lane
        p.abort(KeyboardInterrupt())
        with pytest.raises(ipcsync.ProducerFailedError, match="KeyboardInterrupt"):
            c.get(timeout=10)
        c.close()


@pytest.mark.timeout(60)
def test_ipcsync_lane_0_keeps_every_frame_on_zeromq(endpoints: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IPCSYNC_LANE", "0")
    p = endpoints.producer("lane-off", slots=4, slot_bytes=4096, device="cpu")
    assert not os.path.exists(p.endpoint.lane_path)
    c = endpoints.consumer("lane-off", device="cpu", timeout=10)
    p.wait_for_consumers(1, timeout=10)
    assert _stream(p, c, 100) == list(range(100))
    assert p.stats()["lanes"] == 0 and c.stats()["lane"] is False


@pytest.mark.timeout(60)
def test_a_consumer_with_lanes_off_is_served_by_a_producer_with_them(endpoints: Any,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    p = endpoints.producer("lane-half", slots=4, slot_bytes=4096, device="cpu")
    monkeypatch.setenv("IPCSYNC_LANE", "0")
    c = endpoints.consumer("lane-half", device="cpu", timeout=10)
    p.wait_for_consumers(1, timeout=10)
    assert _stream(p, c, 100) == list(range(100))
    assert p.stats()["lanes"] == 0 and c.stats()["lane"] is False


@pytest.mark.timeout(60)
def test_a_consumer_of_a_later_version_says_hello_again_as_this_one_and_gets_a_lane(
        endpoints: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The highest version spoken is 4: a consumer whose HELLO says 5 is refused for its
    version, says HELLO again one version lower, and is served on a lane."""
    assert P.HIGHEST_VERSION == P.PROTOCOL_VERSION == P.LANE_VERSION == 4
    p = endpoints.producer("lane-later", slots=4, slot_bytes=4096, device="cpu")
    monkeypatch.setattr(P, "PROTOCOL_VERSION", 5)  # (what the consumer's first HELLO says)
    c = endpoints.consumer("lane-later", device="cpu", timeout=10)
    p.wait_for_consumers(1, timeout=10)
    assert _stream(p, c, 100) == list(range(100))
    assert wait_until(lambda: p.stats()["lanes"] == 1 and c.stats()["lane"], 10)
    setup = c._endpoint.session.setup
    assert setup is not None and setup.version == 4


def test_ipcsync_lane_must_be_0_or_1(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IPCSYNC_LANE", "yes")
    with pytest.raises(ipcsync.ConfigError, match="IPCSYNC_LANE must be 0"):
        ipcsync.Producer("lane-bad-env", slots=1, slot_bytes=64, device="cpu")


def _streams_on_zeromq(p: ipcsync.Producer, c: ipcsync.Consumer) -> None:
    """100 items in order with no lane at either end, then a clean end of stream."""
    p.wait_for_consumers(1, timeout=10)
    assert _stream(p, c, 100) == list(range(100))
    assert p.stats()["lanes"] == 0 and c.stats()["lane"] is False
    p.close()
    assert c.get(timeout=10) is None


@pytest.mark.timeout(60)
def test_an_unusable_lane_path_leaves_the_edge_on_zeromq(endpoints: Any) -> None:
    """The lane socket file is gone (ENOENT on connect): the edge works over ZeroMQ."""
    p = endpoints.producer("lane-gone", slots=4, slot_bytes=4096, device="cpu")
    os.unlink(p.endpoint.lane_path)
    c = endpoints.consumer("lane-gone", device="cpu", timeout=10)
    _streams_on_zeromq(p, c)


@pytest.mark.timeout(60)
def test_a_consumer_that_cannot_open_a_socket_stays_on_zeromq(endpoints: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The consumer's lane socket cannot be made (EMFILE, as under a full fd table): no
    lane, every item over ZeroMQ, a clean end."""
    from ipcsync.runtime.transport import consumer_channel

    def full(*args: Any, **kwargs: Any) -> Any:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(consumer_channel, "connect_lane", full)
    p = endpoints.producer("lane-emfile", slots=4, slot_bytes=4096, device="cpu")
    c = endpoints.consumer("lane-emfile", device="cpu", timeout=10)
    _streams_on_zeromq(p, c)


@pytest.mark.timeout(60)
def test_wrong_tokens_and_malformed_first_packets_are_refused_and_nothing_is_lost(endpoints: Any) -> None:
    """Connections to the lane socket that send a wrong token, a packet of another size,
    or nothing are closed; the producer serves its real consumer on its own lane."""
    p = endpoints.producer("lane-rogue", slots=4, slot_bytes=4096, device="cpu")
    rogues = []
    for first in (b"\0" * P.LANE_TOKEN_BYTES, b"short", b"x" * 100, None):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.connect(p.endpoint.lane_path)
        if first is not None:
            s.send(first)
        rogues.append(s)
    c = endpoints.consumer("lane-rogue", device="cpu", timeout=10)
    p.wait_for_consumers(1, timeout=10)
    assert _stream(p, c, 100) == list(range(100))
    assert wait_until(lambda: p.stats()["lanes"] == 1, 10)
    for s in rogues[:3]:  # refused: closed by the producer
        s.settimeout(5)
        assert s.recv(10) == b""
    for s in rogues:
        s.close()
    assert _stream(p, c, 50, start=100) == list(range(100, 150))


@pytest.mark.timeout(60)
def test_killed_consumer_on_a_lane_is_lost_and_its_slots_come_back(procs: Any, endpoints: Any) -> None:
    """As without a lane (test_liveness): SIGKILL a consumer holding a slot; the producer
    reclaims it within seconds and keeps sending."""
    p = endpoints.producer("lane-kill", slots=2, slot_bytes=8192, heartbeat=0.2, device="cpu")
    cons = procs.start("consume", module="liveness_peers", endpoint="lane-kill", hold=0, hold_s=60,
                       heartbeat=0.2)
    p.send({"x": torch.zeros(1024)}, meta=0)
    cons.read_until(lambda l: l.get("event") == "holding", timeout=30)
    assert wait_until(lambda: p.stats()["lanes"] == 1, 10)
    p.send({"x": torch.zeros(1024)}, meta=1)
    cons.kill()
    # Needs slot 0 back: the producer reclaims it once the consumer is provably gone (a
    # bound far above the seconds that takes, so a loaded machine does not fail it).
    p.send({"x": torch.zeros(1024)}, meta=2, timeout=30)
    assert p.stats()["consumers_lost"] == 1


def _content(i: int) -> torch.Tensor:
    return torch.arange(16, dtype=torch.float32) + float(i) * 1000.0  # liveness_peers.content


@pytest.mark.timeout(60)
def test_stopped_consumer_on_a_lane_is_stalled_not_lost(procs: Any, endpoints: Any) -> None:
    """SIGSTOP a consumer on a lane past 1.5 heartbeats: stalled, never lost, its slot
    kept; after SIGCONT it reads every item intact, in order."""
    n = 20
    p = endpoints.producer("lane-stop", slots=2, slot_bytes=8192, heartbeat=0.2, device="cpu")
    cons = procs.start("consume", module="liveness_peers", endpoint="lane-stop", hold=0, hold_s=2.0,
                       heartbeat=0.2)
    p.send({"x": _content(0)}, meta=0)
    cons.read_until(lambda l: l.get("event") == "holding", timeout=30)
    assert wait_until(lambda: p.stats()["lanes"] == 1, 10)
    os.kill(cons.pid, signal.SIGSTOP)
    try:
        assert wait_until(lambda: p.stats()["consumers_stalled"] == 1, 30), p.stats()  # silent past 1.5 heartbeats
        p.send({"x": _content(1)}, meta=1)
        assert p.stats()["consumers_lost"] == 0
    finally:
        os.kill(cons.pid, signal.SIGCONT)
    for i in range(2, n):
        p.send({"x": _content(i)}, meta=i)
    stats = p.stats()
    assert stats["consumers_lost"] == 0 and stats["consumers_stalled_total"] >= 1, stats
    p.close()
    res = cons.result(timeout=30)
    assert res["error"] is None and res["bad"] == [] and res["received"] == n, res


def test_a_lane_arriving_after_its_consumer_left_is_closed_quietly_an_unknown_token_still_refused(
        tmp_path: Any, caplog: Any) -> None:
    # A consumer may connect its lane and leave (BYE) before the producer gets round to
    # accepting it: that late connection is no intruder and must not be reported as one.
    import logging

    from ipcsync.core.ratelog import RateLog
    from ipcsync.runtime.transport.lane import LaneHub, connect_lane

    hub = LaneHub(str(tmp_path / "lane"), 1 << 16, "late", RateLog(logging.getLogger("ipcsync.test.lane")))
    conns = []
    try:
        token = hub.offer(b"consumer-1", os.getpid())
        conns.append(connect_lane(hub.path, token, 1 << 16, None))
        hub.withdraw(b"consumer-1")  # its BYE was read first
        stranger = connect_lane(hub.path, os.urandom(P.LANE_TOKEN_BYTES), 1 << 16, None)
        conns.append(stranger)
        with caplog.at_level(logging.WARNING):
            got: list[Any] = []
            assert wait_until(lambda: (got.extend(hub.poll()), hub.refused >= 1 and not hub.unauth)[1], timeout=10)
        assert got == []  # no lane bound for either
        assert hub.refused == 1  # the stranger only
        warnings = [r.getMessage() for r in caplog.records if "refused a lane connection" in r.getMessage()]
        assert len(warnings) == 1 and "not a token this producer offered" in warnings[0], warnings
    finally:
        for c in conns:
            c.close()
        hub.close()
