"""The producer's fast path hands over to the general path, and back, at every edge,
without losing or reordering an item (runtime.producer.slots: a steady send takes each step's fast
branch; anything else takes the general one):

- the layout changes mid-stream (a new plan, its id reassigned, no id free: inline);
- a consumer joins mid-stream (two consumers: the ring's general dispatch);
- a consumer is lost mid-stream (SIGKILL): the survivor goes on, alone again;
- the ring is full (backpressure: the send waits, pumping releases);
- close() while items are in flight (they are all delivered, then a clean end).

And the producer's steady pump (``ProducerPort.pump_steady``: a send that found every slot
taken reads the lanes and hands their RELEASEs over in one step) hands over to the general
pump at each of its edges: a consumer joining while it runs (its HELLO comes on ZeroMQ, read
at a tick), a consumer lost (its lane's EOF), a bad frame on a lane, and the liveness tick
(a SIGSTOPped consumer is seen stalled while the others' releases are read steadily).

Every consumer checks each item's contents and that its items come in order (a
broadcast consumer: each seq once, none skipped).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any, Callable

import pytest
import torch

import ipcsync
from ipcsync.runtime.producer import slots as slots_module

from peers.common import check, expected

# Each test twice: the steady write step copying natively and with torch (conftest's copy_path).
pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("copy_path")]


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request: pytest.FixtureRequest) -> str:
    return request.param


class SteadyReads:
    """Counts the producer's steady reads that found frames (``LaneHub.read_lanes`` through
    ``ProducerPort.pump_steady``) and keeps what they read."""

    def __init__(self, out: ipcsync.Producer, monkeypatch: pytest.MonkeyPatch) -> None:
        lanes = out.port.chan.lanes
        assert lanes is not None
        real = lanes.read_lanes
        self.count = 0
        self.read: list[Any] = []

        def counted() -> Any:
            got = real()
            if got:
                self.count += 1
                self.read.append(got)
            return got

        monkeypatch.setattr(lanes, "read_lanes", counted)


def _sender(out: ipcsync.Producer, size: int,
            state: Callable[[], Any] = lambda: None) -> Callable[[Callable[[], bool]], int]:
    """``send_until(done)``: send the next items (meta ``{"i": i, ...}``) until ``done()``
    (looked at every 8 items); returns how many were sent in all. One that never gets
    there fails within 90 s, saying ``state()`` and the producer's stats."""
    sent = 0

    def send_until(done: Callable[[], bool]) -> int:
        nonlocal sent
        give_up = time.monotonic() + 90
        while sent % 8 or not done():
            assert sent < 300_000 and time.monotonic() < give_up, (
                f"the producer never got there: {sent} sent, {state()}, {out.stats().as_dict()}")
            out.send(expected(sent, size), meta={"i": sent, "tag": f"item-{sent}"}, timeout=30)
            sent += 1
        return sent

    return send_until


def _msg(i: int, kind: int, device: str) -> dict[str, Any]:
    """Item ``i`` in one of three layouts (``kind``), its values naming ``i``."""
    if kind == 0:
        return {"x": torch.full((4,), i, dtype=torch.int64, device=device)}
    if kind == 1:
        return {"x": torch.full((2, 3), float(i), device=device).t(), "y": [torch.tensor(i, device=device)]}
    return {"z": torch.arange(6, dtype=torch.int32, device=device)[::2] + i}


def _check_msg(item: Any, i: int, kind: int) -> None:
    exp = _msg(i, kind, "cpu")
    got = item.tensors
    assert sorted(got) == sorted(exp), (i, kind, got)
    for k, v in exp.items():
        g = got[k]
        if isinstance(v, list):
            assert [int(t) for t in g] == [int(t) for t in v], (i, k)
        else:
            assert g.dtype == v.dtype and g.shape == v.shape and torch.equal(g.cpu(), v), (i, k)


@pytest.mark.parametrize("layout_ids", [None, 2, 0])
def test_layout_changes_mid_stream(endpoints: Any, device: str, monkeypatch: pytest.MonkeyPatch,
                                   layout_ids: int | None) -> None:
    """Layouts switch every few items, metas switch between none, a scalar and a dict.
    ``layout_ids``: 2 ids for 3 layouts (ids reassigned while the stream runs), 0 (no id
    ever: every READY carries its layout), None: as shipped."""
    if layout_ids is not None:
        monkeypatch.setattr(slots_module, "MAX_LAYOUT_IDS", layout_ids)
    out = endpoints.producer("fp-layout", slots=4, slot_bytes=4096, device=device, heartbeat=None, timeout=10)
    inp = endpoints.consumer("fp-layout", device=device, heartbeat=None, timeout=10)
    out.wait_for_consumers(1, timeout=10)
    plan: list[tuple[int, Any]] = []
    for i in range(60):
        kind = (i // 3) % 3 if i < 45 else i % 3  # runs of three, then a change at every item
        meta = None if i % 4 else ({"i": i} if i % 8 else i)
        plan.append((kind, meta))
    seqs = []
    for start in range(0, len(plan), 3):  # three sends, three receives: the ring never fills
        for i in range(start, start + 3):
            kind, meta = plan[i]
            seqs.append(out.send(_msg(i, kind, device), meta=meta))
        for i in range(start, start + 3):
            item = inp.get(timeout=10)
            assert item is not None, i
            assert item.seq == seqs[i] == i and item.meta == plan[i][1]
            _check_msg(item, i, plan[i][0])
            item.release()
    assert out.stats()["handoffs"] == len(plan)


@pytest.mark.parametrize("policy", ["broadcast", "shard"])
def test_a_consumer_joining_mid_stream(endpoints: Any, procs: Any, policy: str) -> None:
    """The first consumer alone (the fast path), then a second one joins (two consumers:
    the general dispatch), then the stream ends. Broadcast: the first gets every item and
    the newcomer a run of the latest ones, in order; shard: every item exactly once."""
    n, size = 120, 16
    out = endpoints.producer("fp-join", slots=4, slot_bytes=1 << 14, heartbeat=0.5, timeout=30, policy=policy)
    shard = policy == "shard"
    first = procs.start("consume", module="peers.basic", endpoint="fp-join", size=size, sharded=shard)
    out.wait_for_consumers(1, timeout=30)
    for i in range(n // 2):
        out.send(expected(i, size), meta={"i": i, "tag": f"item-{i}"})
    second = procs.start("consume", module="peers.basic", endpoint="fp-join", size=size, sharded=shard)
    out.wait_for_consumers(2, timeout=30)
    for i in range(n // 2, n):
        out.send(expected(i, size), meta={"i": i, "tag": f"item-{i}"})
    out.close()
    _check_join(first.result(), second.result(), n, shard, n // 2)


def _check_join(a: dict[str, Any], b: dict[str, Any], n: int, shard: bool, joined: int) -> None:
    """Consumer ``a`` was there from the start, ``b`` joined by item ``joined``; ``n`` sent."""
    assert a["errors"] == [] and b["errors"] == [], (a, b)
    assert a["end"] == b["end"] == "stop"
    if shard:
        assert a["received"] + b["received"] == n and a["distinct"] + b["distinct"] == n
        assert b["received"] > 0  # the newcomer took part
    else:
        assert a["received"] == n and a["first"] == [0] and a["last"] == [n - 1]
        assert b["last"] == [n - 1] and b["first"][0] <= joined  # every item since it joined


def test_a_consumer_lost_mid_stream(endpoints: Any, procs: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Broadcast to two consumers (the general dispatch); one SIGKILLs itself mid-stream,
    holding slots, while the producer runs steady (its sends wait for releases, read off
    the lanes): its lane's EOF goes to the general pump, which reclaims its slots; the
    survivor, alone again (the fast path), gets every item, in order, intact."""
    size = 16
    out = endpoints.producer("fp-lost", slots=4, slot_bytes=1 << 14, heartbeat=0.2, timeout=30,
                             policy="broadcast")
    survivor = procs.start("consume", module="peers.basic", endpoint="fp-lost", size=size, heartbeat=0.2)
    victim = procs.start("consume", module="peers.basic", endpoint="fp-lost", size=size, heartbeat=0.2,
                         kill_after=20)
    out.wait_for_consumers(2, timeout=30)
    reads = SteadyReads(out, monkeypatch)
    send_until = _sender(out, size)
    send_until(lambda: out.stats()["consumers_lost"] == 1)
    lost_at = reads.count
    n = send_until(lambda: reads.count > lost_at + 2)  # steady again, alone
    victim.read_until(lambda line: line.get("event") == "dying", timeout=30)
    out.close()
    res = survivor.result()
    assert res["errors"] == [] and res["end"] == "stop", res
    assert res["received"] == n and res["first"] == [0] and res["last"] == [n - 1]
    assert out.stats()["consumers_lost"] == 1 and out.consumers == 0


def test_a_full_ring_waits_and_loses_nothing(endpoints: Any, procs: Any) -> None:
    """Two slots and a slow consumer: sends wait for releases (backpressure, the general
    branch of reserve), then go on; every item arrives, in order, intact."""
    n, size = 40, 16
    out = endpoints.producer("fp-full", slots=2, slot_bytes=1 << 14, heartbeat=0.5, timeout=30)
    cons = procs.start("consume", module="peers.basic", endpoint="fp-full", size=size, delay=0.01)
    out.wait_for_consumers(1, timeout=30)
    for i in range(n):
        out.send(expected(i, size), meta={"i": i, "tag": f"item-{i}"})
    assert out.stats()["waiting_s"].get("slot", 0.0) > 0.0  # it did wait for a slot
    out.close()
    res = cons.result()
    assert res["errors"] == [] and res["end"] == "stop", res
    assert res["received"] == n and res["first"] == [0] and res["last"] == [n - 1]


@pytest.mark.parametrize("how", ["send", "slot"])
def test_close_while_items_are_in_flight(endpoints: Any, device: str, how: str) -> None:
    """A burst that fills the ring (items in flight to the consumer, others queued behind
    its credits), then close() at once: the consumer reads each item, in order, intact,
    then its iteration ends cleanly."""
    n, size = 4, 16
    out = endpoints.producer("fp-close", slots=n, slot_bytes=1 << 14, device=device, heartbeat=0.5, timeout=30)
    inp = endpoints.consumer("fp-close", device=device, heartbeat=0.5, timeout=30, credits=2)
    out.wait_for_consumers(1, timeout=30)
    for i in range(n):
        if how == "send":
            out.send(expected(i, size, device), meta={"i": i, "tag": f"item-{i}"})
        else:
            a = expected(i, size, device)["a"]
            with out.slot(a=(tuple(a.shape), a.dtype), meta={"i": i, "tag": f"item-{i}"}) as s:
                s["a"].copy_(a)
    closer = threading.Thread(target=out.close, daemon=True)  # waits for the consumer
    closer.start()
    got = []
    for item in inp:
        i = item.seq
        got.append(i)
        assert item.meta == {"i": i, "tag": f"item-{i}"}
        if how == "send":
            assert check(item, i, size, device) is None
        else:
            assert torch.equal(item["a"].cpu(), expected(i, size, "cpu")["a"])
        item.release()
    closer.join(timeout=30)
    assert not closer.is_alive()
    assert got == list(range(n))


def test_close_lets_go_of_every_plan(endpoints: Any) -> None:
    """The plan last published (kept for the fast path's LRU shortcut) goes at close with
    the others: its destination views hold the arena, which close frees."""
    import sys  # noqa: PLC0415

    out = endpoints.producer("fp-plans", slots=2, slot_bytes=4096, heartbeat=None, timeout=10)
    inp = endpoints.consumer("fp-plans", heartbeat=None, timeout=10)
    out.wait_for_consumers(1, timeout=10)
    out.send({"x": torch.zeros(4)})
    item = inp.get(timeout=10)
    assert item is not None
    item.release()
    del item
    (plan,) = out.port.handoffs.plans.plans.values()
    out.close()
    assert sys.getrefcount(plan) == 2  # ours, and getrefcount's argument: nobody else's


@pytest.mark.parametrize("policy", ["broadcast", "shard"])
def test_a_consumer_joins_while_the_producer_runs_steady(endpoints: Any, procs: Any, monkeypatch: pytest.MonkeyPatch,
                                                         policy: str) -> None:
    """The producer sends without pause (its sends wait for slots, pumping steadily) while
    a second consumer starts: its HELLO (on ZeroMQ, which the steady pump does not read)
    is answered by the general pump at a tick, its handshake and SWITCH follow, and both
    get items, in order, intact: broadcast, the first every item and the newcomer each
    since it joined; shard, each item exactly once."""
    size = 16
    shard = policy == "shard"
    out = endpoints.producer("fp-join-steady", slots=4, slot_bytes=1 << 14, heartbeat=0.5, timeout=30,
                             policy=policy)
    first = procs.start("consume", module="peers.basic", endpoint="fp-join-steady", size=size, sharded=shard)
    out.wait_for_consumers(1, timeout=30)
    reads = SteadyReads(out, monkeypatch)
    send_until = _sender(out, size)
    send_until(lambda: out.stats()["lanes"] == 1 and reads.count > 2)
    before = reads.count
    second = procs.start("consume", module="peers.basic", endpoint="fp-join-steady", size=size, sharded=shard)
    joined = send_until(lambda: out.consumers == 2)
    # Steady reads since it started (on a loaded machine perhaps only after its handshake:
    # which pump sees a given frame is not forced, the outcome is what is checked).
    send_until(lambda: out.stats()["lanes"] == 2 and reads.count > before)
    both = reads.count
    n = send_until(lambda: reads.count > both + 2)  # steady again, with both
    out.close()
    _check_join(first.result(), second.result(), n, shard, joined)


BAD = b"\x92\x7f\x00"  # [127, 0]: no such message type


def test_a_bad_frame_on_a_lane_during_the_steady_pump(endpoints: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two consumers hold every slot; one releases its items, the other writes a frame of
    an unknown type on its lane; the producer's steady pump reads both lanes: the bad frame
    goes to the general pump, which drops its sender with the usual error (its slots
    reclaimed); the other's releases stand and it goes on."""
    out = endpoints.producer("fp-bad-lane", slots=4, slot_bytes=4096, heartbeat=None, timeout=10, policy="broadcast")
    good = endpoints.consumer("fp-bad-lane", heartbeat=None, timeout=10, auto_release=False)
    rogue = endpoints.consumer("fp-bad-lane", heartbeat=None, timeout=10, auto_release=False)
    out.wait_for_consumers(2, timeout=10)
    seq = 0
    while out.stats()["lanes"] < 2 or not good.stats()["lane"] or not rogue.stats()["lane"]:
        assert seq < 5000, "frames never moved to the lanes"
        out.send({"x": torch.full((4,), seq)}, timeout=10)
        for c in (good, rogue):
            item = c.get(timeout=10)
            assert item is not None and item.seq == seq
            item.release()
        seq += 1
    first = seq
    for _ in range(4):  # every slot taken by both
        out.send({"x": torch.full((4,), seq)}, timeout=10)
        seq += 1
    held = {c: [c.get(timeout=10) for _ in range(4)] for c in (good, rogue)}
    reads = SteadyReads(out, monkeypatch)
    port = out.port
    with port.lock:  # nobody else pumps the producer meanwhile
        port.pump()  # the releases of the rounds above, and the lanes seen steady
        for item in held[good]:
            item.release()
        endpoint = good._endpoint
        with endpoint._lock:
            endpoint._link.flush_releases()  # on good's lane now
        endpoint = rogue._endpoint
        with endpoint._lock:
            lane = endpoint._link.chan.lane
            assert lane is not None and lane.send(BAD)
        port.inbound.next_tick = time.monotonic() + 3600  # no tick due: the steady branch is taken
        try:
            port.pump_steady()
        finally:
            port.inbound.next_tick = 0.0
        assert len(port.peers) == 1 and port.ring.free_slots == 4
    assert out.stats()["bad_frames"] == 1 and out.consumers == 1
    (read,) = reads.read  # one steady read found both lanes' frames
    assert len(read) == 2 and any(BAD in frames for _who, frames, _end in read)
    out.send({"x": torch.full((4,), seq)}, timeout=10)
    item = good.get(timeout=10)
    assert item is not None and item.seq == seq and int(item["x"][0]) == seq
    with pytest.raises(ipcsync.IpcSyncError):
        while True:  # its items, then the producer's error
            got = rogue.get(timeout=10)
            assert got is not None and got.seq < seq
    assert [i.seq for i in held[good]] == list(range(first, first + 4))


def test_the_tick_runs_while_the_producer_runs_steady(endpoints: Any, procs: Any,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """One of two sharded consumers is SIGSTOPped holding its one credit's item; the
    producer keeps sending to the other, pumping steadily: its liveness tick still runs
    (the stopped one is seen stalled, and answering again once continued), and every item
    arrives exactly once."""
    size = 16
    out = endpoints.producer("fp-tick", slots=4, slot_bytes=1 << 14, heartbeat=0.2, timeout=30)
    busy = procs.start("consume", module="peers.basic", endpoint="fp-tick", size=size, sharded=True, heartbeat=0.2)
    paused = procs.start("consume", module="peers.basic", endpoint="fp-tick", size=size, sharded=True, heartbeat=0.2,
                         credits=1, progress=1)
    out.wait_for_consumers(2, timeout=30)
    reads = SteadyReads(out, monkeypatch)
    stopped_at = 0
    send_until = _sender(out, size, lambda: f"steady reads {reads.count} ({stopped_at} when stopped)")
    send_until(lambda: out.stats()["handoffs"] >= 32)  # (the paused one takes some)
    paused.read_until(lambda line: line.get("event") == "received", timeout=30)
    os.kill(paused.pid, signal.SIGSTOP)
    try:
        stopped_at = reads.count
        # Both, in either order (a loaded machine may see the stall before the first steady
        # read): the producer reads steadily while one consumer is stopped, and the tick
        # still sees that one stalled.
        send_until(lambda: out.stats()["consumers_stalled"] == 1 and reads.count > stopped_at)
        assert out.stats()["consumers_stalled"] == 1  # (still: the consumer is stopped)
    finally:
        os.kill(paused.pid, signal.SIGCONT)
    n = send_until(lambda: out.stats()["consumers_stalled"] == 0)
    out.close()
    a, b = busy.result(), paused.result()
    assert a["errors"] == [] and b["errors"] == [], (a, b)
    assert a["end"] == b["end"] == "stop"
    assert a["received"] + b["received"] == n and a["distinct"] + b["distinct"] == n
    assert out.stats()["consumers_stalled_total"] >= 1 and out.stats()["consumers_lost"] == 0
