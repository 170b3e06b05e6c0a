"""Zero-copy forwarding (``ipcsync.forward``): a middle stage passes on all or part of a
received item without a copy; downstream consumers read the upstream producer's memory,
and the upstream slot is released only once every downstream holder released the item.

Every test runs on each backend (``device``: "cpu" everywhere, "cuda" marked `cuda`,
skipped without a GPU; on CUDA with memory shared by name, the path that forwards without
a copy: memory shared by descriptor travels by copy, tests/integration/test_cuda_shared.py). Stages run in child processes started through the ``procs``
fixture (own process groups, killed at teardown, /dev/shm checked for leaks) or, where
the test must watch an endpoint closely, in the test process itself (endpoints closed in
``finally``). Child roles are the functions ``role_*`` below and tests/integration/peers.py's
``produce`` / ``consume`` (which check every item's content, meta and order).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from typing import Any

import pytest
import torch

import ipcsync
from conftest import use_legacy_cuda
from peers.common import check, expected, say

pytestmark = pytest.mark.timeout(90)

SIZE = 16  # expected(i, SIZE): the upstream's item i


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "cuda":  # zero-copy forwarding: CUDA memory shared by name
        use_legacy_cuda(monkeypatch)
    return str(request.param)


@pytest.fixture
def legacy_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    use_legacy_cuda(monkeypatch)


def start_role(procs: Any, role: str, **args: Any) -> Any:
    """Start ``role_<role>(args)`` of this module in a child tracked by ``procs``."""
    return procs.start("role_" + role, module="test_forward", **args)


def part(t: Any) -> dict[str, Any]:
    """The part of expected(i) the partial forward sends: a slice and a strided view."""
    return {"a": t["a"][3:11], "c": t["c"]}


def check_part(got: Any, i: int, device: str) -> str | None:
    exp = part(expected(i, SIZE, device))
    for k in ("a", "c"):
        g, e = got[k], exp[k]
        if g.shape != e.shape or g.stride() != e.stride() or not torch.equal(g, e):
            return f"item {i}: part {k} differs"
    return None


# --------------------------------------------------------------------------- child roles
def role_middle(a: dict[str, Any]) -> None:
    """Forward every item of ``up`` to ``down`` (``part``: only part(); ``copy``: forward's
    copy=), then close ``down`` (waits for downstream releases) and ``up``."""
    device = a.get("device", "cpu")
    hb = a.get("heartbeat", 1.0)
    out = ipcsync.Producer(a["down"], slots=a.get("slots", 4), slot_bytes=1 << 16, device=device,
                           policy=a.get("policy", "shard"), wait=a.get("out_wait", "host"),
                           heartbeat=hb, timeout=30)
    inp = ipcsync.Consumer(a["up"], device=device, wait=a.get("in_wait", "gpu"), heartbeat=hb, timeout=30)
    say(event="ready", pid=os.getpid())
    if a.get("wait_consumers"):
        out.wait_for_consumers(a["wait_consumers"], timeout=30)
    n, end = 0, "stop"
    try:
        for item in inp:
            meta = {"from": item.meta, "n": n} if a.get("part") else item.meta
            ipcsync.forward(item, out, part if a.get("part") else None, copy=a.get("copy", False),
                            meta=meta, timeout=30)
            n += 1
    except ipcsync.PeerLostError as exc:
        end = "peer-lost"
        say(event="peer-lost", message=str(exc))
    out.close(timeout=30)
    stats = out.stats()
    inp.close()
    say(event="done", end=end, forwarded=n, zero_copy=stats["forwarded"], lost=stats["consumers_lost"])


def role_part_sink(a: dict[str, Any]) -> None:
    """Consume partial forwards, checking each against part(expected(i))."""
    device = a.get("device", "cpu")
    errors: list[str] = []
    got: list[int] = []
    with ipcsync.Consumer(a["endpoint"], device=device, timeout=30) as inp:
        say(event="connected")
        for item in inp:
            i = item.meta["from"]["i"]
            if item.meta["n"] != len(got) or (got and i != got[-1] + 1):
                errors.append(f"order: {item.meta} after {got[-1:]}")
            err = check_part(item.tensors, i, device)
            if err:
                errors.append(err)
            got.append(i)
        lost = inp.stats()["forwarded_lost"]
    say(event="done", received=len(got), distinct=len(set(got)), errors=errors[:20], lost=lost)


# --------------------------------------------------------------------------- chains
@pytest.mark.long
@pytest.mark.parametrize("part_only", [False, True], ids=["all", "part"])
def test_chain_forwards_every_item_without_a_copy(procs: Any, device: str, part_only: bool) -> None:
    n = 300
    up = procs.start("produce", module="peers.basic", endpoint="fw-up", n=n, size=SIZE, slots=4, device=device)
    up.read_until(lambda l: l.get("event") == "bound")
    mid = start_role(procs, "middle", up="fw-up", down="fw-down", device=device, part=part_only,
                     wait_consumers=1, slots=3)
    mid.read_until(lambda l: l.get("event") == "ready")
    if part_only:
        sink = start_role(procs, "part_sink", endpoint="fw-down", device=device)
    else:
        sink = procs.start("consume", module="peers.basic", endpoint="fw-down", size=SIZE, device=device)
    r = sink.result(timeout=60)
    assert not r["errors"], r["errors"]
    assert r["received"] == n and r["distinct"] == n  # no loss, no duplicate, in order
    m = mid.result(timeout=60)
    assert m["end"] == "stop" and m["forwarded"] == n
    assert m["zero_copy"] == n  # every one without a copy
    assert up.result(timeout=60)["sent"] == n


def test_forward_copy_modes_in_process(device: str) -> None:
    """copy=None forwards zero-copy when it can, else copies; copy=True always copies;
    downstream items zero-copy lie in the upstream producer's own arena."""
    P = dict(slots=4, slot_bytes=4096, device=device, timeout=10)
    with ipcsync.Producer("fwm-up", **P) as up, ipcsync.Producer("fwm-down", **P) as down, \
            ipcsync.Consumer("fwm-up", device=device, timeout=10) as mid, \
            ipcsync.Consumer("fwm-down", device=device, timeout=10) as sink:
        for i in range(3):
            up.send({"x": torch.arange(8, device=device) + i}, meta=i)
        a = mid.get()
        ipcsync.forward(a, down)  # zero-copy
        assert a.released
        got = sink.get()
        assert got.meta == 0 and got["x"].tolist() == list(range(8))
        (described,) = sink.session.foreign.values()  # FOREIGN: the original arena
        assert described.handle == mid.session.setup.arenas[0] and described.pid == os.getpid()
        b = mid.get()
        ipcsync.forward(b, down, lambda t: {"y": t["x"] * 2})  # computed: copied
        got2 = sink.get()
        assert got2.meta == 1 and got2["y"].tolist() == [2 * (k + 1) for k in range(8)]
        c = mid.get()
        ipcsync.forward(c, down, copy=True)
        got3 = sink.get()
        assert got3["x"].tolist() == [k + 2 for k in range(8)]
        assert down.stats()["forwarded"] == 1
        for g in (got, got2, got3):
            g.release()


def test_a_forward_interrupted_after_its_commit_stays_forwarded(device: str) -> None:
    """A Ctrl-C landing while a zero-copy forward hands its committed item out raises
    itself; the item stays forwarded (downstream's now, not handed back to the caller)
    and arrives intact. Before, the cleanup gave the committed slot back (ValueError in
    place of the interrupt) and returned the item to the caller too."""
    P = dict(slots=4, slot_bytes=4096, device=device, timeout=10)
    with ipcsync.Producer("fwi-up", **P) as up, ipcsync.Producer("fwi-down", **P) as down, \
            ipcsync.Consumer("fwi-up", device=device, timeout=10) as mid, \
            ipcsync.Consumer("fwi-down", device=device, timeout=10) as sink:
        up.send({"x": torch.arange(8, device=device)}, meta=0)
        a = mid.get()
        down.wait_for_consumers(1)  # (else the item waits queued, and the pump hands it out)
        h = down.port.handoffs
        deliver, calls = h.deliver, []

        def interrupted(*args: Any) -> None:  # the step after the commit, then a Ctrl-C
            deliver(*args)
            calls.append(1)
            if len(calls) == 1:
                raise KeyboardInterrupt

        h.deliver = interrupted
        with pytest.raises(KeyboardInterrupt):
            ipcsync.forward(a, down, copy=False)
        assert a.released and down.stats()["forwarded"] == 1
        got = sink.get()
        assert got.meta == 0 and got["x"].tolist() == list(range(8))
        got.release()


def test_chain_of_two_middle_stages_passes_the_original_memory_on(device: str) -> None:
    """A forwarded item forwarded again: the last consumer reads the first producer's arena,
    and the first slot is released only after the last consumer released the item."""
    P = dict(slots=1, slot_bytes=4096, device=device, timeout=10)
    with ipcsync.Producer("fw2-a", **P) as pa, ipcsync.Producer("fw2-b", **P) as pb, \
            ipcsync.Producer("fw2-c", **P) as pc, \
            ipcsync.Consumer("fw2-a", device=device, timeout=10) as ca, \
            ipcsync.Consumer("fw2-b", device=device, timeout=10) as cb, \
            ipcsync.Consumer("fw2-c", device=device, timeout=10, auto_release=False) as cc:
        pa.send({"x": torch.full((4,), 5.0, device=device)}, meta="m")
        ipcsync.forward(ca.get(), pb, copy=False)
        ipcsync.forward(cb.get(), pc, lambda t: {"z": t["x"][1:]}, copy=False)
        item = cc.get()
        assert item.meta == "m" and item["z"].tolist() == [5.0] * 3
        (described,) = cc.session.foreign.values()
        assert described.handle == ca.session.setup.arenas[0]  # the first producer's memory
        with pytest.raises(ipcsync.IpcTimeoutError):
            pa.send({"x": torch.zeros(4, device=device)}, timeout=0.5)  # its only slot is held
        item.release()
        pa.send({"x": torch.zeros(4, device=device)}, meta="next", timeout=10)
        assert pa.stats()["handoffs"] == 2


# --------------------------------------------------------------------------- holding
def test_upstream_slot_is_held_while_a_downstream_consumer_holds_the_item(procs: Any, endpoints: Any, device: str) -> None:
    """The upstream producer (here) blocks once its ring is full of items that a slow
    downstream consumer (here) holds; each downstream release frees one upstream slot, and
    the held items are never overwritten meanwhile."""
    slots = 2
    up = endpoints.producer("fwh-up", slots=slots, slot_bytes=1 << 16, device=device, timeout=10)
    mid = start_role(procs, "middle", up="fwh-up", down="fwh-down", device=device, wait_consumers=1, slots=4)
    mid.read_until(lambda l: l.get("event") == "ready")
    sink = endpoints.consumer("fwh-down", device=device, auto_release=False, timeout=20)
    up.wait_for_consumers(1, timeout=10)
    for i in range(slots):
        up.send(expected(i, SIZE, device), meta={"i": i, "tag": f"item-{i}"})
    held = [sink.get(timeout=20) for _ in range(slots)]
    assert [h.meta["i"] for h in held] == [0, 1]
    t0 = time.monotonic()
    with pytest.raises(ipcsync.IpcTimeoutError):  # every upstream slot is held downstream
        up.send(expected(2, SIZE, device), meta={"i": 2, "tag": "item-2"}, timeout=0.7)
    assert time.monotonic() - t0 >= 0.69
    assert up.stats()["occupancy"]["in_flight"] == slots
    held[0].release()  # frees exactly one upstream slot
    up.send(expected(2, SIZE, device), meta={"i": 2, "tag": "item-2"}, timeout=10)
    with pytest.raises(ipcsync.IpcTimeoutError):
        up.send(expected(3, SIZE, device), meta={"i": 3, "tag": "item-3"}, timeout=0.5)
    assert check(held[1], 1, SIZE, device) is None  # not overwritten while held
    third = sink.get(timeout=20)
    assert check(third, 2, SIZE, device) is None
    held[1].release()
    third.release()
    up.send(expected(3, SIZE, device), meta={"i": 3, "tag": "item-3"}, timeout=10)
    last = sink.get(timeout=20)
    assert check(last, 3, SIZE, device) is None
    last.release()
    up.close(timeout=20)
    assert sink.get(timeout=20) is None  # the middle closed after the upstream
    m = mid.result(timeout=30)
    assert m["forwarded"] == 4 and m["zero_copy"] == 4


def test_broadcast_downstream_releases_upstream_only_after_both(procs: Any, endpoints: Any, device: str) -> None:
    up = endpoints.producer("fwb-up", slots=1, slot_bytes=1 << 16, device=device, timeout=10)
    mid = start_role(procs, "middle", up="fwb-up", down="fwb-down", device=device, policy="broadcast",
                     wait_consumers=2, slots=2)
    mid.read_until(lambda l: l.get("event") == "ready")
    sinks = [endpoints.consumer("fwb-down", device=device, auto_release=False, timeout=20) for _ in range(2)]
    up.wait_for_consumers(1, timeout=10)
    for i in range(3):
        up.send(expected(i, SIZE, device), meta={"i": i, "tag": f"item-{i}"}, timeout=10)
        a, b = sinks[0].get(timeout=20), sinks[1].get(timeout=20)
        assert check(a, i, SIZE, device) is None and check(b, i, SIZE, device) is None
        first, second = (a, b) if i % 2 == 0 else (b, a)
        first.release()
        with pytest.raises(ipcsync.IpcTimeoutError):  # the other one still holds it
            up.send(expected(i + 1, SIZE, device), meta={"i": i + 1, "tag": "x"}, timeout=0.5)
        assert check(second, i, SIZE, device) is None
        second.release()
        up.flush(timeout=10)  # both released: the upstream slot comes back
    up.close(timeout=20)
    for s in sinks:
        assert s.get(timeout=20) is None
    assert mid.result(timeout=30)["zero_copy"] == 3


# --------------------------------------------------------------------------- failures
@pytest.mark.long
def test_downstream_consumer_sigkilled_holding_forwarded_items(procs: Any, device: str) -> None:
    """A downstream consumer dies holding forwarded items: the middle reclaims its slots and
    releases the upstream items (never waiting on the dead consumer's events); the other
    downstream consumer gets everything, the upstream finishes."""
    n = 200
    up = procs.start("produce", module="peers.basic", endpoint="fwk-up", n=n, size=SIZE, slots=4, device=device, heartbeat=0.5)
    up.read_until(lambda l: l.get("event") == "bound")
    mid = start_role(procs, "middle", up="fwk-up", down="fwk-down", device=device, policy="broadcast",
                     wait_consumers=2, slots=4, heartbeat=0.5)
    mid.read_until(lambda l: l.get("event") == "ready")
    victim = procs.start("consume", module="peers.basic", endpoint="fwk-down", size=SIZE, device=device, kill_after=15,
                         heartbeat=0.5, delay=0.01)
    survivor = procs.start("consume", module="peers.basic", endpoint="fwk-down", size=SIZE, device=device, heartbeat=0.5)
    victim.read_until(lambda l: l.get("event") == "dying", timeout=60)
    r = survivor.result(timeout=60)
    assert not r["errors"], r["errors"]
    assert r["received"] == n and r["distinct"] == n
    m = mid.result(timeout=60)
    assert m["end"] == "stop" and m["forwarded"] == n and m["lost"] == 1
    assert up.result(timeout=60)["sent"] == n


def test_upstream_sigkilled_while_downstream_holds_forwarded_items(procs: Any, endpoints: Any, device: str) -> None:
    """The upstream producer dies while a downstream consumer holds forwarded items: the
    held items stay readable (their memory stays mapped), the middle gets PeerLostError,
    closes its producer once they are released, and the downstream stream ends cleanly."""
    up = procs.start("produce", module="peers.basic", endpoint="fwd-up", n=2, size=SIZE, slots=2, device=device,
                     heartbeat=0.5, linger=60)
    up.read_until(lambda l: l.get("event") == "bound")
    mid = start_role(procs, "middle", up="fwd-up", down="fwd-down", device=device, wait_consumers=1,
                     heartbeat=0.5, in_wait="host")
    mid.read_until(lambda l: l.get("event") == "ready")
    sink = endpoints.consumer("fwd-down", device=device, auto_release=False, timeout=20, heartbeat=0.5)
    held = [sink.get(timeout=20) for _ in range(2)]
    up.kill()
    mid.read_until(lambda l: l.get("event") == "peer-lost", timeout=30)
    for i, h in enumerate(held):
        assert check(h, i, SIZE, device) is None  # still readable, unchanged
        h.release()
    assert sink.get(timeout=20) is None  # the middle closed: a clean end
    m = mid.result(timeout=30)
    assert m["end"] == "peer-lost" and m["forwarded"] == 2


def test_items_whose_memory_is_gone_are_dropped_downstream(procs: Any, endpoints: Any, device: str,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """A consumer that attaches after the upstream producer died cannot open the forwarded
    memory: the items are dropped with a warning and released, never a crash or a wedge."""
    if device == "cuda":
        pytest.skip("here the sink shares the middle's process, whose CUDA import it reuses")
    out = endpoints.producer("fwg-down", slots=2, slot_bytes=4096, device="cpu", timeout=10, heartbeat=0.5)
    up = procs.start("produce", module="peers.basic", endpoint="fwg-up", n=1, size=SIZE, slots=2, heartbeat=0.5, linger=60)
    up.read_until(lambda l: l.get("event") == "bound")
    mid = endpoints.consumer("fwg-up", device="cpu", timeout=10, heartbeat=0.5)
    item = mid.get(timeout=10)
    ipcsync.forward(item, out, copy=False)  # queued: no consumer yet
    up.kill()
    deadline = time.monotonic() + 10  # mid, which sees it die, reclaims its arena
    while any(n.startswith(f"ipcsync-{up.pid}-") for n in os.listdir("/dev/shm")):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    with caplog.at_level(logging.WARNING, logger="ipcsync"):
        sink = endpoints.consumer("fwg-down", device="cpu", timeout=10, heartbeat=0.5)
        with pytest.raises(ipcsync.IpcTimeoutError):
            sink.get(timeout=0.5)
    assert sink.stats()["forwarded_lost"] == 1
    assert "dropped forwarded item" in caplog.text
    out.flush(timeout=10)  # the dropped item was released
    with pytest.raises(ipcsync.PeerLostError):
        mid.get(timeout=10)


# --------------------------------------------------------------------------- errors
def test_copy_false_says_why_zero_copy_is_impossible(device: str) -> None:
    P = dict(slots=4, slot_bytes=4096, device=device, timeout=10)
    with ipcsync.Producer("fwe-up", **P) as up, ipcsync.Producer("fwe-down", **P) as down, \
            ipcsync.Consumer("fwe-up", device=device, timeout=10, auto_release=False) as mid:
        up.send({"x": torch.arange(6, device=device, dtype=torch.float32),
                 "z": torch.ones(3, dtype=torch.complex64, device=device)}, meta=0)
        item = mid.get()
        with pytest.raises(ipcsync.ConfigError, match="not a view of the received item"):
            ipcsync.forward(item, down, lambda t: {"y": t["x"] + 1}, copy=False)
        with pytest.raises(ipcsync.ConfigError, match="not a view of the received item"):
            ipcsync.forward(item, down, lambda t: {"x": t["x"], "new": torch.zeros(2, device=device)},
                            copy=False)
        with pytest.raises(ipcsync.ConfigError, match="conj"):
            ipcsync.forward(item, down, lambda t: {"z": t["z"].conj()}, copy=False)
        with pytest.raises(ipcsync.ConfigError, match="copy must be"):
            ipcsync.forward(item, down, copy="yes")  # type: ignore[arg-type]
        # Nothing was taken: the item is still ours, and still forwardable.
        assert not item.released and item["x"].tolist() == [0, 1, 2, 3, 4, 5]
        assert down.stats()["forwarded"] == 0 and down.stats()["occupancy"]["free"] == 4
        # Zero-size views need no memory: they travel anywhere.
        ipcsync.forward(item, down, lambda t: {"x": t["x"][2:4], "e": torch.empty(0, device=device)},
                        copy=False)
        assert item.released
        with pytest.raises(ipcsync.ClosedError, match="released already"):
            ipcsync.forward(item, down, copy=False)
        # A forwarded item nobody took: closing the forwarding producer gives it back upstream.
        down.close(timeout=0)
        assert mid.stats()["forwarded_out"] == 0


def test_copy_false_after_the_upstream_producer_is_gone(procs: Any, device: str) -> None:
    up = procs.start("produce", module="peers.basic", endpoint="fwx-up", n=1, size=SIZE, slots=2, device=device,
                     heartbeat=0.5, linger=60)
    up.read_until(lambda l: l.get("event") == "bound")
    with ipcsync.Producer("fwx-down", slots=2, slot_bytes=1 << 16, device=device, timeout=10) as down, \
            ipcsync.Consumer("fwx-up", device=device, timeout=10, heartbeat=0.5, auto_release=False) as mid:
        item = mid.get(timeout=10)
        up.kill()
        deadline = time.monotonic() + 10
        while mid.session.error is None:  # noticed by its service thread
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with pytest.raises(ipcsync.ConfigError, match="producer is gone"):
            ipcsync.forward(item, down, copy=False)
        with pytest.raises(ipcsync.ConfigError, match="ipcsync.Producer"):
            ipcsync.forward(item, mid, copy=False)  # type: ignore[arg-type]


def test_consumer_closed_first_waits_for_forwarded_items(endpoints: Any, device: str,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """Closing the middle's Consumer while items it forwarded are held downstream waits for
    them (the forwarding Producer gives them back as they are released). Its close has no
    deadline here, so only the give-back ends that wait (one that missed it would never
    return: the test's timeout), and nothing is released over the sink's head (the
    warning a close that gave up logs)."""
    P = dict(slots=2, slot_bytes=4096, device=device, timeout=10)
    up = endpoints.producer("fwc-up", **P)
    down = endpoints.producer("fwc-down", **P)
    mid = endpoints.consumer("fwc-up", device=device, timeout=10)
    sink = endpoints.consumer("fwc-down", device=device, timeout=10, auto_release=False)
    up.send({"x": torch.ones(4, device=device)}, meta=1)
    ipcsync.forward(mid.get(), down, copy=False)
    held = sink.get()
    timer = threading.Timer(0.5, held.release)
    timer.start()
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="ipcsync"):
        mid.close(timeout=math.inf)
    assert 0.4 <= time.monotonic() - t0  # it waited for the release (a clock cannot run fast)
    assert held.released
    assert "still held downstream" not in caplog.text, caplog.text
    timer.join()
    up.close(timeout=5)
    assert up.stats()["occupancy"]["free"] == 2


# --------------------------------------------------------------------------- wait="host"
class _GatedEvent:
    """Stands in for a downstream release event that completes only when ``gate`` opens
    (what a CUDA event whose GPU work is still running looks like to ``query()``)."""

    def __init__(self, gate: threading.Event) -> None:
        self.gate = gate
        self.waited = 0

    def query(self) -> bool:
        return self.gate.is_set()

    def bound_query(self) -> Any:
        return self.query

    def wait(self, stream: Any = None) -> None:
        assert self.gate.is_set(), "a wait was enqueued on an incomplete event (wait='host')"
        self.waited += 1


def _gate_release_events(down: ipcsync.Producer, gate: threading.Event) -> _GatedEvent:
    ev = _GatedEvent(gate)
    with down.port.lock:
        (peer,) = down.port.peers
        peer.set_release_events([ev] * down.slots)
    return ev


def test_host_wait_releases_upstream_once_downstream_release_events_complete() -> None:
    """wait="host" (CPU events stand in for incomplete CUDA events): the upstream item is
    released only once the downstream release event completes, promptly (polled), and
    at the latest when the middle's slot is needed again."""
    P = dict(slot_bytes=4096, device="cpu", timeout=10)
    with ipcsync.Producer("fwp-up", slots=2, **P) as up, \
            ipcsync.Producer("fwp-down", slots=1, wait="host", **P) as down, \
            ipcsync.Consumer("fwp-up", device="cpu", timeout=10) as mid, \
            ipcsync.Consumer("fwp-down", device="cpu", timeout=10, auto_release=False) as sink:
        down.wait_for_consumers(1)
        gate = threading.Event()
        ev = _gate_release_events(down, gate)
        up.send({"x": torch.full((4,), 1.0)}, meta=0)
        ipcsync.forward(mid.get(), down, copy=False)
        item = sink.get()
        item.release()
        time.sleep(0.3)  # RELEASE processed, event incomplete: the upstream slot stays held
        assert 0 in down.port.forwarder.ledger.pending and up.stats()["occupancy"]["in_flight"] == 1
        gate.set()  # completes: released upstream by the next pump
        up.flush(timeout=5)
        assert not down.port.forwarder.ledger.pending and ev.waited == 1

        # Again, but the middle's only slot is needed before the event completes: the
        # forward waits for it (polling, never enqueueing an incomplete event).
        gate = threading.Event()
        up.send({"x": torch.full((4,), 2.0)}, meta=1)
        ipcsync.forward(mid.get(), down, copy=False)
        ev = _gate_release_events(down, gate)  # (re-recorded for this item: incomplete)
        sink.get().release()
        up.send({"x": torch.full((4,), 3.0)}, meta=2)
        nxt = mid.get()
        time.sleep(0.2)
        assert 0 in down.port.forwarder.ledger.pending  # still waiting for the downstream event
        opener = threading.Timer(0.4, gate.set)
        opener.start()
        t0 = time.monotonic()
        ipcsync.forward(nxt, down, copy=False)  # blocks until the gate opens
        assert time.monotonic() - t0 >= 0.1
        opener.join()
        last = sink.get()
        assert last.meta == 2 and last["x"].tolist() == [3.0] * 4
        assert ev.waited >= 1
        last.release()
        up.flush(timeout=5)


def test_host_wait_holder_lost_while_its_event_is_pending(endpoints: Any) -> None:
    """A downstream consumer lost while the upstream release waits on its (incomplete)
    release event: the event is never waited on, the upstream item is released."""
    P = dict(slot_bytes=4096, device="cpu", timeout=10)
    with ipcsync.Producer("fwl-up", slots=2, **P) as up, \
            ipcsync.Producer("fwl-down", slots=2, wait="host", **P) as down, \
            ipcsync.Consumer("fwl-up", device="cpu", timeout=10) as mid:
        sink = endpoints.consumer("fwl-down", device="cpu", timeout=10, auto_release=False)
        down.wait_for_consumers(1)
        gate = threading.Event()
        ev = _gate_release_events(down, gate)
        up.send({"x": torch.ones(4)}, meta=0)
        ipcsync.forward(mid.get(), down, copy=False)
        sink.get().release()
        time.sleep(0.2)
        assert down.port.forwarder.ledger.pending
        sink.close()  # the holder goes away
        up.flush(timeout=5)  # the holder is gone: released without its event
        assert not down.port.forwarder.ledger.pending and ev.waited == 0 and not gate.is_set()


# --------------------------------------------------------------------------- GPU races
@pytest.mark.cuda
@pytest.mark.parametrize("in_wait", ["gpu", "host"])
def test_cuda_forwarded_item_is_read_after_the_upstream_write(procs: Any, in_wait: str, legacy_cuda: None) -> None:
    """The upstream fills its slot after ~1 s of GPU work and returns at once; the
    downstream consumer, two hops away, must read the final values (ready ordering is
    transitive through the middle's ready event)."""
    up = procs.start("race_produce", module="peers.gpu", endpoint="fwr-up", sleep=1.0, values=[42.0])
    mid = start_role(procs, "middle", up="fwr-up", down="fwr-down", device="cuda", wait_consumers=1,
                     in_wait=in_wait)
    mid.read_until(lambda l: l.get("event") == "ready")
    down = procs.start("race_consume", module="peers.gpu", endpoint="fwr-down")
    r = down.result(timeout=90)
    assert r["items"] == [{"expected": 42.0, "min": 42.0, "max": 42.0}], r
    assert mid.result(timeout=60)["zero_copy"] == 1
    assert up.result(timeout=60)["drained"]


@pytest.mark.cuda
@pytest.mark.parametrize("out_wait", ["gpu", "host"])
def test_cuda_upstream_slot_is_not_overwritten_before_downstream_gpu_reads(procs: Any, out_wait: str,
                                                                            legacy_cuda: None) -> None:
    """One upstream slot; the downstream consumer queues ~1 s of GPU work before reading
    each item and releases at once: the upstream's next write into that slot must wait
    for that read (release ordering through the middle), so each item reads its value."""
    up = procs.start("race_produce", module="peers.gpu", endpoint="fwo-up", slots=1, sleep=0.0, values=[1.0, 2.0, 3.0])
    mid = start_role(procs, "middle", up="fwo-up", down="fwo-down", device="cuda", wait_consumers=1,
                     out_wait=out_wait)
    mid.read_until(lambda l: l.get("event") == "ready")
    down = procs.start("race_consume", module="peers.gpu", endpoint="fwo-down", slow=1.0)
    r = down.result(timeout=120)
    assert r["items"] == [{"expected": v, "min": v, "max": v} for v in (1.0, 2.0, 3.0)], r
    assert mid.result(timeout=60)["zero_copy"] == 3
    assert up.result(timeout=60)["drained"]
