"""The shared-memory doorbell wired into a lane edge (``ipcsync.runtime.bellwire``, behind
``IPCSYNC_DOORBELL=1``): negotiated only when both sides opt in, steady READYs and RELEASEs
as entries, everything else as lane frames, merged in the producer's order; a peer writing
garbage into its own segment gets a ProtocolError on its edge alone; a consumer SIGSTOPped
while holding items reads them intact after SIGCONT. (The conformance and fast-path tests
run with the doorbell off and on: ``doorbell_env``.)"""

from __future__ import annotations

import os
import signal
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

import ipcsync
from ipcsync.core import doorbell as D
from polling import wait_until

pytestmark = pytest.mark.timeout(90)

HEAD_AT, READ_AT = 24, 32  # a segment's head and read counters (core.doorbell's layout)


def _up(p: ipcsync.Producer, *consumers: ipcsync.Consumer) -> bool:
    return p.stats()["doorbells"] == len(consumers) and all(c.stats()["doorbell"] for c in consumers)


def _warm(p: ipcsync.Producer, c: ipcsync.Consumer) -> None:
    """Stream plain items until the doorbell is up (it is negotiated after the lane)."""
    def one() -> bool:
        p.send({"x": torch.full((4,), -1.0)})  # (the layout of the items to come: entries at once)
        item = c.get(timeout=10)
        assert item is not None and item.meta is None and float(item["x"][0]) == -1.0
        item.release()
        return _up(p, c)
    assert wait_until(one, 20), (p.stats(), c.stats())


def _two_consumers(monkeypatch: Any, endpoints: Any, name: str) -> tuple[Any, Any, Any]:
    """A producer (4 slots) with the doorbell on, its first consumer streaming through
    its doorbell, and a second one that joined after it (2 credits each)."""
    monkeypatch.setenv("IPCSYNC_DOORBELL", "1")
    p = endpoints.producer(name, slots=4, slot_bytes=4096, device="cpu")
    first = endpoints.consumer(name, device="cpu", timeout=10, credits=2)
    p.wait_for_consumers(1, timeout=10)
    _warm(p, first)
    second = endpoints.consumer(name, device="cpu", timeout=10, credits=2)
    p.wait_for_consumers(2, timeout=10)
    return p, first, second


def _items(n: int) -> list[tuple[str, Any]]:
    """Item ``i``: mostly plain (an entry), some with meta or a layout never seen (frames)."""
    out: list[tuple[str, Any]] = []
    for i in range(n):
        if i % 7 == 3:
            out.append(("meta", {"i": i}))
        elif i % 11 == 5:
            out.append((f"k{i}", None))  # a new layout: its READY carries it (a frame)
        else:
            out.append(("x", None))
    return out


def _check(item: Any, i: int, key: str, meta: Any) -> None:
    name = "x" if key == "meta" else key
    assert item.meta == meta, (i, item.meta, meta)
    assert float(item[name][0]) == float(i), (i, item[name])


@pytest.mark.parametrize("slots", [2, 8])
def test_mixed_items_keep_their_order_through_entries_and_frames(monkeypatch: Any, endpoints: Any,
                                                                 slots: int) -> None:
    """Plain items go as entries, items with meta or a new layout as lane frames: the
    consumer sees every item in order, intact, then the end of the stream; the segments
    are gone (their names removed once mapped, the mappings at close)."""
    monkeypatch.setenv("IPCSYNC_DOORBELL", "1")
    p = endpoints.producer("db-mixed", slots=slots, slot_bytes=4096, device="cpu")
    c = endpoints.consumer("db-mixed", device="cpu", timeout=10)
    p.wait_for_consumers(1, timeout=10)
    _warm(p, c)
    plan = _items(300)
    burst = slots // 2  # items in flight at once (never more than the free slots)
    for start in range(0, len(plan), burst):
        part = range(start, min(start + burst, len(plan)))
        for i in part:
            key, meta = plan[i]
            p.send({"x" if key == "meta" else key: torch.full((8,), float(i))}, meta=meta, timeout=10)
        for i in part:
            item = c.get(timeout=10)
            _check(item, i, *plan[i])
            item.release()
    assert _up(p, c)
    p.close()
    assert c.get(timeout=10) is None
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"ipcsync-{os.getpid()}-")
                and n not in _arenas(p)]


def _arenas(p: ipcsync.Producer) -> set[str]:
    return set()  # (a CPU producer's arena is unlinked once created: nothing of ours stays)


def test_a_consumer_joining_mid_stream_gets_its_own_doorbell(monkeypatch: Any, endpoints: Any) -> None:
    """A second consumer joins while the first streams through its doorbell: both get one,
    every item goes to exactly one of them, and each sees its items in order."""
    p, a, b = _two_consumers(monkeypatch, endpoints, "db-join")
    seen: dict[str, list[int]] = {"a": [], "b": []}
    sent = 0

    def drain(c: ipcsync.Consumer, who: str) -> None:
        while (item := _poll(c)) is not None:
            seen[who].append(int(item["x"][0]))
            item.release()

    def step() -> bool:
        nonlocal sent
        p.send({"x": torch.full((4,), float(sent))}, timeout=10)
        sent += 1
        drain(a, "a")
        drain(b, "b")
        return _up(p, a, b) and sent >= 100
    assert wait_until(step, 30)
    assert wait_until(lambda: (drain(a, "a"), drain(b, "b"), len(seen["a"]) + len(seen["b"]) == sent)[-1], 20)
    assert sorted(seen["a"] + seen["b"]) == list(range(sent))
    for who in ("a", "b"):
        assert seen[who] == sorted(seen[who]), who


@pytest.mark.parametrize("producer_on,consumer_on", [(True, False), (False, True)])
def test_one_side_opting_in_keeps_the_lane_alone(monkeypatch: Any, endpoints: Any, producer_on: bool,
                                                 consumer_on: bool) -> None:
    """Only one side opted in: no doorbell, the edge works on its lane as before."""
    monkeypatch.setenv("IPCSYNC_DOORBELL", "1" if producer_on else "0")
    p = endpoints.producer("db-half", slots=2, slot_bytes=4096, device="cpu")
    monkeypatch.setenv("IPCSYNC_DOORBELL", "1" if consumer_on else "0")
    c = endpoints.consumer("db-half", device="cpu", timeout=10)
    p.wait_for_consumers(1, timeout=10)
    for i in range(60):
        p.send({"x": torch.full((4,), float(i))})
        item = c.get(timeout=10)
        assert float(item["x"][0]) == i
        item.release()
    assert wait_until(lambda: p.stats()["lanes"] == 1 and c.stats()["lane"], 10)
    assert p.stats()["doorbells"] == 0 and c.stats()["doorbell"] is False


def test_a_bad_doorbell_value_is_a_config_error(monkeypatch: Any) -> None:
    monkeypatch.setenv("IPCSYNC_DOORBELL", "yes")
    with pytest.raises(ipcsync.ConfigError, match="IPCSYNC_DOORBELL"):
        ipcsync.Producer("db-bad-env", slots=2, slot_bytes=4096, device="cpu")


def _poll(c: ipcsync.Consumer) -> Any:
    """The next item if one has arrived, else None (never waits)."""
    try:
        return c.get(timeout=0)
    except ipcsync.IpcTimeoutError:
        return None


# --------------------------------------------------------------------------- rogue peers
def _own_writer(bell: Any) -> D.RingWriter:
    """A second writer over a side's own segment: what a rogue process could write there."""
    return D.RingWriter(bell.own.buf, bell.peer.buf, bell.own.geom, "test")


@pytest.mark.parametrize("garbage", ["head", "slot", "stamp", "read"])
def test_a_rogue_consumer_writing_garbage_into_its_segment_loses_its_edge_only(
        monkeypatch: Any, endpoints: Any, garbage: str) -> None:
    """A consumer whose own segment (its RELEASE ring, its read counter of the producer's
    ring) holds garbage is dropped with a ProtocolError; a second consumer of the same
    producer goes on receiving every item sent to it."""
    p, rogue, good = _two_consumers(monkeypatch, endpoints, "db-rogue-c")
    bell = rogue._endpoint._link.bell  # (the test plays the rogue process, writing its own segment)
    buf, geom = bell.own.buf, bell.own.geom
    # The rogue's own releases (of _warm's items) go out first, under its lock: none of its
    # service thread's flushes can then write over the garbage (its ring's head and stamps).
    lock = rogue._endpoint._lock
    lock.acquire()
    rogue._endpoint._link.flush_releases()
    assert not rogue._endpoint.session.pending
    if garbage == "head":
        struct.pack_into("=Q", buf, HEAD_AT, bell.writer.head + geom.capacity + 5)
    elif garbage == "slot":
        _own_writer(bell).publish([(0, 999, 0, 0, 0, 0)])
    elif garbage == "stamp":
        head = bell.writer.head  # the next entry's stamp is garbage, then a head past it
        struct.pack_into("=Q", buf, D.HEADER_BYTES + (head % geom.capacity) * geom.entry_bytes, head + 12345)
        struct.pack_into("=Q", buf, HEAD_AT, head + 1)
    else:
        struct.pack_into("=Q", buf, READ_AT, 10**9)  # says it read entries never published
    lock.release()
    got: list[int] = []

    def drain() -> bool:
        while (item := _poll(good)) is not None:
            got.append(int(item["x"][0]))
            item.release()
        return p.stats()["consumers"] == 1
    def send(i: int) -> None:
        """Send item ``i``; while no slot is free, take what reached ``good`` (this thread
        is its only reader)."""
        while True:
            try:
                p.send({"x": torch.full((4,), float(i))}, timeout=0.2)
                return
            except ipcsync.IpcTimeoutError:
                drain()
    sent = 0
    while sent < 4 and not drain():  # (garbage in its read counter shows when an item goes to it)
        send(sent)
        sent += 1
    assert wait_until(drain, 20), p.stats()
    assert p.stats()["bad_frames"] >= 1
    for i in range(sent, sent + 50):  # the other consumer is served as before
        send(i)
        drain()
    assert wait_until(lambda: (drain(), len(got) + len(set(range(sent)) - set(got)) >= sent + 50)[-1], 20)
    assert got == sorted(got) and set(range(sent, sent + 50)) <= set(got)
    with pytest.raises(ipcsync.ProtocolError):
        for _ in range(10):
            item = rogue.get(timeout=10)
            assert item is not None
            item.release()


@pytest.mark.parametrize("garbage", ["slot", "layout", "head"])
def test_a_rogue_producer_writing_garbage_into_its_segment_fails_that_edge_only(
        monkeypatch: Any, endpoints: Any, garbage: str) -> None:
    """The producer's segment for one consumer holds garbage (an entry naming a slot
    outside the ring or a layout the consumer never got, a head past the ring): that
    consumer gets a ProtocolError; a second consumer of the same producer goes on."""
    p, victim, other = _two_consumers(monkeypatch, endpoints, "db-rogue-p")
    mine = bytes(victim._endpoint._link.bell.own.buf[:D.HEADER_BYTES])  # the victim's edge: the one reading this
    bell = next(x.bell for x in p.port.peers.by_id.values()
                if x.bell is not None and bytes(x.bell.peer.buf[:D.HEADER_BYTES]) == mine)
    # (the test plays a rogue producer, writing its own segment)
    if garbage == "head":
        struct.pack_into("=Q", bell.own.buf, HEAD_AT, bell.writer.head + bell.own.geom.capacity + 1)
    else:
        entry = (10**6, 99, 0, 1, 0, 0) if garbage == "slot" else (10**6, 0, 0, 4000, 0, 0)
        _own_writer(bell).publish([entry])
        bell.peer_bell.ring()
    with pytest.raises(ipcsync.ProtocolError, match="doorbell"):
        for _ in range(10):
            item = victim.get(timeout=10)
            assert item is not None
            item.release()
    assert wait_until(lambda: p.stats()["consumers"] == 1, 20)  # the victim's ERROR reached it
    got: list[int] = []
    for i in range(30):  # the other consumer is served as before
        while True:
            try:
                p.send({"x": torch.full((4,), float(i))}, timeout=0.2)
                break
            except ipcsync.IpcTimeoutError:
                pass
        item = other.get(timeout=10)
        got.append(int(item["x"][0]))
        item.release()
    assert got == list(range(30))


# --------------------------------------------------------------------------- pauses
def _said(name: str) -> Any:
    return lambda line: line.get("event") == name


@pytest.mark.timeout(120)
def test_a_consumer_paused_while_holding_items_reads_them_intact(monkeypatch: Any, procs: Any,
                                                                  tmp_path: Path) -> None:
    """Plain items (doorbell entries) to a consumer SIGSTOPped while it holds item 0, until
    the producer reports it stalled: no slot it holds is reused, and after SIGCONT item 0
    and every later item read exactly what was sent, through the doorbell."""
    monkeypatch.setenv("IPCSYNC_DOORBELL", "1")
    n = 40
    mark = tmp_path / "stopped"
    prod = procs.start("produce", module="liveness_peers", endpoint="db-pause", n=n, slots=2, plain=True,
                       heartbeat=0.2, stalled_after=str(mark))
    prod.read_until(_said("bound"))
    cons = procs.start("consume", module="liveness_peers", endpoint="db-pause", hold=0, hold_s=1.0,
                       heartbeat=0.2)
    cons.read_until(_said("holding"), timeout=60)
    os.kill(cons.pid, signal.SIGSTOP)
    try:
        mark.touch()  # the producer's stall report counts from here: the consumer is stopped
        prod.read_until(_said("peer-stalled"), timeout=60)
    finally:
        os.kill(cons.pid, signal.SIGCONT)
    held = cons.read_until(_said("held-checked"), timeout=60)
    assert held["ok"], cons.lines
    res = cons.result(timeout=60)
    assert res["error"] is None and res["bad"] == [] and res["received"] == n, res
    assert res["doorbell"] is True, res
    pres = prod.result(timeout=30)
    assert pres["lost"] == 0 and pres["stalled"] >= 1, pres
