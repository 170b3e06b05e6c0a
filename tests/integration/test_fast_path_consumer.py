"""The consumer's fast path hands over to the general path at every edge, losing and
reordering nothing (consumer.Consumer._get, runtime.consumer.upstream.ProducerLink.pump_lane).

Each test first streams items until frames travel on the lane (the steady path), then
crosses one edge: a new layout mid-stream, the producer's BYE after a burst, the producer
SIGKILLed mid-stream, an ERROR frame (abort), close() with items buffered, the reference
rule (a view kept past release() keeps its slot), auto_release and explicit release()
mixed. CPU, and on a GPU machine the ``cuda``-marked variants.
"""

from __future__ import annotations

import gc
import threading
from typing import Any

import pytest
import torch

import ipcsync
from polling import in_call, wait_until

pytestmark = pytest.mark.timeout(120)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _x(i: int, device: str, n: int = 16) -> torch.Tensor:
    return torch.full((n,), float(i), device=device)


def _steady(p: Any, c: Any, device: str, start: int = 0) -> int:
    """Stream items ``start``, ``start + 1``, ... until the consumer's frames travel on the
    lane (and at least 4 items); check each one. Returns the next index."""
    i = start
    while i < start + 4 or not c.stats()["lane"]:
        assert i < start + 5000, "frames never moved to the lane"
        p.send({"x": _x(i, device)}, meta=i, timeout=10)
        item = c.get(timeout=10)
        assert item.meta == i and float(item["x"][0]) == i
        item.release()
        i += 1
    return i


@pytest.mark.parametrize("device", DEVICES)
def test_a_new_layout_mid_stream_is_read_in_order(endpoints: Any, device: str) -> None:
    p = endpoints.producer("fp-layout", slots=8, slot_bytes=8192, device=device)
    c = endpoints.consumer("fp-layout", device=device, timeout=10, auto_release=False)
    p.wait_for_consumers(1, timeout=10)
    i = _steady(p, c, device)
    shapes = ["x", "x", "yz", "yz", "x", "nested", "x", "yz"]  # new layouts mid-burst
    for kind in shapes:
        if kind == "x":
            p.send({"x": _x(i, device)}, meta=(i, kind), timeout=10)
        elif kind == "yz":
            p.send({"y": _x(i, device, 3).to(torch.int32), "z": _x(i, device, 5).t()}, meta=(i, kind), timeout=10)
        else:
            p.send([(_x(i, device, 2),), {"w": _x(i, device, 4).reshape(2, 2)}], meta=(i, kind), timeout=10)
        i += 1
    first = i - len(shapes)
    for k, kind in enumerate(shapes):
        item = c.get(timeout=10)
        assert item.meta == [first + k, kind]
        if kind == "x":
            assert float(item["x"].sum()) == 16 * (first + k)
        elif kind == "yz":
            assert item["y"].dtype == torch.int32 and int(item["y"][2]) == first + k
            assert float(item["z"][4]) == first + k
        else:
            assert isinstance(item.tensors, list) and float(item.tensors[0][0][1]) == first + k
            assert item.tensors[1]["w"].shape == (2, 2) and float(item.tensors[1]["w"][1, 1]) == first + k
        item.release()
    assert c.stats()["lane"]  # still on the fast path after the new layouts
    _steady(p, c, device, i)


def test_the_producers_bye_after_a_burst_ends_the_stream_cleanly_after_every_item(procs: Any,
                                                                                 endpoints: Any) -> None:
    n = 300
    prod = procs.start("produce", module="peers.basic", endpoint="fp-bye", n=n, slots=8, wait_consumers=1)
    prod.read_until(lambda l: l.get("event") == "bound")
    c = endpoints.consumer("fp-bye", device="cpu", timeout=30)
    got = []
    on_lane = False
    for item in c:  # ends (no exception) after the producer's BYE and its last item
        got.append(item.meta["i"])
        assert float(item["a"][1]) == 7 + item.meta["i"]
        # (looked at during the stream: once the producer has gone its lane is closed, and
        # whether the last pump saw that depends on when the producer exited)
        on_lane = on_lane or c.stats()["lane"]
    assert got == list(range(n))
    assert on_lane
    prod.result()


def test_a_producer_killed_mid_stream_ends_the_stream_with_an_error_after_what_arrived(
        procs: Any, endpoints: Any) -> None:
    prod = procs.start("produce", module="peers.basic", endpoint="fp-kill", n=400, slots=16, kill_after=250,
                       wait_consumers=1)
    prod.read_until(lambda l: l.get("event") == "bound")
    c = endpoints.consumer("fp-kill", device="cpu", timeout=30)
    got: list[int] = []
    on_lane = False
    with pytest.raises(ipcsync.PeerLostError):
        for item in c:
            got.append(item.meta["i"])
            assert float(item["a"][1]) == 7 + item.meta["i"]
            if item.meta["i"] == 200:
                on_lane = c.stats()["lane"]
    assert got == list(range(len(got))) and len(got) <= 250  # in order, nothing made up
    assert len(got) >= 250 - 16  # it sent 250 only once we had released all but a ring's worth
    assert on_lane


@pytest.mark.parametrize("device", DEVICES)
def test_an_error_frame_after_items_is_raised_not_lost(endpoints: Any, device: str) -> None:
    """abort() on the lane after a burst: the items come in order, then ProducerFailedError
    (not a PeerLostError: the ERROR is read even though our releases found the lane closed)."""
    p = endpoints.producer("fp-error", slots=8, slot_bytes=8192, device=device)
    c = endpoints.consumer("fp-error", device=device, timeout=10)
    p.wait_for_consumers(1, timeout=10)
    i = _steady(p, c, device)
    for k in range(4):
        p.send({"x": _x(i + k, device)}, meta=i + k, timeout=10)
    p.abort(RuntimeError("boom"))
    got = []
    with pytest.raises(ipcsync.ProducerFailedError, match="boom"):
        for _ in range(6):
            item = c.get(timeout=10)
            assert item is not None and float(item["x"][0]) == item.meta
            got.append(item.meta)
    assert got == list(range(i, i + len(got)))


@pytest.mark.parametrize("device", DEVICES)
def test_close_with_items_buffered_gives_every_slot_back(endpoints: Any, device: str) -> None:
    slots = 4
    p = endpoints.producer("fp-close", slots=slots, slot_bytes=8192, device=device)
    c = endpoints.consumer("fp-close", device=device, timeout=10)
    p.wait_for_consumers(1, timeout=10)
    i = _steady(p, c, device)
    for k in range(slots):
        p.send({"x": _x(i + k, device)}, meta=i + k, timeout=10)
    held = c.get(timeout=10)
    assert held.meta == i
    assert wait_until(lambda: c.stats()["buffered"] == slots - 1, 10)  # (the service thread pumps)
    c.close()
    # Every slot came back: a new consumer gets a full ring's worth without a release.
    c2 = endpoints.consumer("fp-close", device=device, timeout=10, auto_release=False)
    p.wait_for_consumers(1, timeout=10)
    for k in range(slots):
        p.send({"x": _x(100 + k, device)}, meta=100 + k, timeout=10)
    assert [c2.get(timeout=10).meta for _ in range(slots)] == [100 + k for k in range(slots)]


@pytest.mark.parametrize("device", DEVICES)
def test_the_reference_rule_holds_on_the_fast_path(endpoints: Any, device: str) -> None:
    """A view kept past release() keeps its slot: the producer never writes it, however
    many items go by; once the view is gone the slot goes back."""
    p = endpoints.producer("fp-refs", slots=2, slot_bytes=8192, device=device)
    c = endpoints.consumer("fp-refs", device=device, timeout=10, auto_release=False)
    p.wait_for_consumers(1, timeout=10)
    i = _steady(p, c, device)
    p.send({"x": _x(i, device)}, meta=i, timeout=10)
    item = c.get(timeout=10)
    kept = item["x"][2:5]  # a view of the slot
    item.release()
    p.send({"x": _x(i + 1, device)}, meta=i + 1, timeout=10)  # the other slot
    nxt = c.get(timeout=10)
    assert nxt.meta == i + 1
    nxt.release()
    with pytest.raises(ipcsync.IpcTimeoutError):
        # One slot is free (item i + 1's), taken now; the kept one never comes back.
        p.send({"x": _x(i + 2, device)}, meta=i + 2, timeout=10)
        p.send({"x": _x(i + 3, device)}, meta=i + 3, timeout=0.5)
    assert c.stats()["kept"] == 1
    assert torch.equal(kept.cpu(), torch.full((3,), float(i)))  # never overwritten
    assert c.get(timeout=10).meta == i + 2
    del kept, item
    gc.collect()
    # The slot goes back at a pump (the service thread's, while this thread is away).
    assert wait_until(lambda: c.stats()["kept"] == 0, 10)
    p.send({"x": _x(i + 3, device)}, meta=i + 3, timeout=10)
    assert c.get(timeout=10).meta == i + 3


@pytest.mark.parametrize("device", DEVICES)
def test_auto_release_and_explicit_release_mixed(endpoints: Any, device: str) -> None:
    """Every slot comes back whichever way it is released: a lost release would make a
    send time out (4 slots, 200 items)."""
    p = endpoints.producer("fp-mixed", slots=4, slot_bytes=8192, device=device)
    c = endpoints.consumer("fp-mixed", device=device, timeout=10)  # auto_release
    p.wait_for_consumers(1, timeout=10)
    i = _steady(p, c, device)
    it = iter(c)
    got = []
    for r in range(50):
        for k in range(3):  # the 4th slot may still be held by the current item
            p.send({"x": _x(i + 3 * r + k, device)}, meta=i + 3 * r + k, timeout=10)
        for k in range(3):
            item = next(it)
            assert float(item["x"][0]) == item.meta
            got.append(item.meta)
            if item.meta % 2:
                item.release()  # explicit; the others: at the next step
    assert got == list(range(i, i + 150))
    assert c.stats()["lane"] and c.stats()["held"] <= 1


@pytest.mark.parametrize("device", DEVICES)
def test_a_release_then_no_call_still_reaches_the_producer(endpoints: Any, device: str) -> None:
    # Releases are queued and sent in batches; a consumer that releases fewer than a batch
    # and then calls nothing for a long time (computing, or waiting on something else) must
    # not starve its producer: the service thread sends them.
    out = endpoints.producer("fpc-idle-rel", slots=4, slot_bytes=4096, device=device)
    inp = endpoints.consumer("fpc-idle-rel", auto_release=False, device=device, timeout=10)
    for i in range(4):
        out.send({"x": torch.full((4,), float(i), device=device)}, meta=i)
    items = [inp.get(timeout=10) for _ in range(4)]
    result: dict[str, Any] = {}

    def send() -> None:
        try:
            result["seq"] = out.send({"x": torch.zeros(4, device=device)}, meta=4, timeout=30)
        except BaseException as exc:  # noqa: BLE001 (asserted below)
            result["error"] = exc

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    assert wait_until(lambda: in_call(sender, "send", "runtime/producer/port.py"), 30)  # no slot free: it waits
    items[0].release()  # one release, fewer than a batch; then this thread calls nothing
    sender.join(30)
    assert not sender.is_alive() and result.get("seq") == 4, result
