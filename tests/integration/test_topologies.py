"""Fan-out topologies: broadcast with a slow consumer, shard balance, and a consumer
SIGKILLed in fan-out while the others go on, on the CPU backend everywhere and on CUDA
(marked `cuda`) where there is a GPU. Every message's content is checked: no loss, no
duplicate, per-producer order. Forwarding: one copy (zero-copy is in test_forward.py)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

import ipcsync

N = 60


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request: pytest.FixtureRequest) -> str:
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return request.param


def msg(i: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    return {"x": torch.full((32,), float(i), device=device), "i": torch.tensor(i, device=device)}


def ok(item: ipcsync.Item, i: int) -> bool:
    return item.meta == i and int(item["i"]) == i and bool((item["x"] == i).all())


class Reader(threading.Thread):
    """A consumer in a thread: records what it got; ``gate`` holds it before each item."""

    def __init__(self, endpoints: Any, name: str, gate: threading.Event | None = None, delay: float = 0.0,
                 device: str = "cpu") -> None:
        super().__init__(daemon=True)
        self.consumer = endpoints.consumer(name, device=device, timeout=20)
        self.gate, self.delay = gate, delay
        self.got: list[int] = []
        self.bad: list[Any] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for item in self.consumer:
                if self.gate is not None:
                    self.gate.wait(30)
                if not ok(item, item.meta):
                    self.bad.append(item.meta)
                self.got.append(item.meta)
                if self.delay:
                    time.sleep(self.delay)
        except BaseException as exc:  # reported by the test
            self.error = exc


def run_producer(p: ipcsync.Producer, n: int, errors: list[BaseException], device: str = "cpu") -> threading.Thread:
    def go() -> None:
        try:
            for i in range(n):
                p.send(msg(i, device), meta=i, timeout=20)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


@pytest.mark.timeout(60)
def test_broadcast_slow_consumer_holds_the_producer_others_flow_up_to_the_ring(endpoints: Any, device: str) -> None:
    slots = 4
    p = endpoints.producer("topo-bc", slots=slots, slot_bytes=4096, device=device, policy="broadcast")
    gate = threading.Event()
    slow = Reader(endpoints, "topo-bc", gate=gate, device=device)
    fast = [Reader(endpoints, "topo-bc", device=device) for _ in range(2)]
    readers = [slow, *fast]
    errors: list[BaseException] = []
    p.wait_for_consumers(3, timeout=10)
    for r in readers:
        r.start()
    t = run_producer(p, N, errors, device)
    # The slow consumer holds its first item and has the rest queued: every slot is
    # still held by it, so the fast ones get at most the ring's depth, then wait.
    time.sleep(1.0)
    assert all(len(r.got) <= slots for r in fast), [len(r.got) for r in fast]
    assert all(len(r.got) >= 1 for r in fast)
    assert t.is_alive(), "the producer should be waiting for the slow consumer"
    gate.set()
    t.join(30)
    assert not t.is_alive() and not errors, errors
    p.close(timeout=20)
    for r in readers:
        r.join(20)
        assert r.error is None, r.error
        assert r.got == list(range(N)) and not r.bad  # every item, in order, intact


@pytest.mark.timeout(60)
def test_shard_every_item_to_exactly_one_consumer_balanced(endpoints: Any, device: str) -> None:
    p = endpoints.producer("topo-shard", slots=8, slot_bytes=4096, device=device, policy="shard")
    readers = [Reader(endpoints, "topo-shard", delay=0.002, device=device) for _ in range(3)]
    errors: list[BaseException] = []
    p.wait_for_consumers(3, timeout=10)
    for r in readers:
        r.start()
    t = run_producer(p, 300, errors, device)
    t.join(30)
    assert not errors, errors
    p.close(timeout=20)
    for r in readers:
        r.join(20)
        assert r.error is None and not r.bad
        assert r.got == sorted(r.got)  # each consumer sees its share in order
    everything = sorted(i for r in readers for i in r.got)
    assert everything == list(range(300))  # no loss, no duplicate
    assert all(len(r.got) >= 30 for r in readers), [len(r.got) for r in readers]  # all got work


@pytest.mark.timeout(90)
@pytest.mark.parametrize("policy", ["shard", "broadcast"])
def test_consumer_sigkilled_in_fan_out_the_others_go_on(procs: Any, endpoints: Any, runtime_dir: Any, policy: str,
                                                        device: str) -> None:
    p = endpoints.producer("topo-kill", slots=4, slot_bytes=1 << 16, device=device, policy=policy, heartbeat=0.5)
    # The victim dies between items (not mid-record): the producer's streams never wait
    # on a dead peer's event, so on CUDA it goes on serving the survivors.
    victim = procs.start("consume", module="peers.basic", endpoint="topo-kill", kill_after=20, sharded=policy == "shard",
                         size=16, heartbeat=0.5, device=device)
    survivors = [procs.start("consume", module="peers.basic", endpoint="topo-kill", sharded=policy == "shard", size=16,
                             heartbeat=0.5, device=device) for _ in range(2)]
    for c in [victim, *survivors]:
        c.read_until(lambda l: l.get("event") == "connected")
    p.wait_for_consumers(3, timeout=10)
    from peers.common import expected  # tests/integration is on sys.path under pytest

    # Send until the victim has died, then 200 more. (A fixed count is not enough: with
    # "shard" a consumer that a loaded machine slows down holds its credits longer and
    # is dealt fewer items, so it might never reach its 20th.)
    n, after = 0, None
    while after is None or n < after + 200:
        p.send(expected(n, 16, device), meta={"i": n, "tag": f"item-{n}"}, timeout=20)
        n += 1
        if after is None and victim.proc.poll() is not None:
            after = n
        assert n < 50_000, "the victim never received its 20 items"
    victim.read_until(lambda l: l.get("event") == "dying")
    p.close(timeout=20)
    results = [s.result() for s in survivors]
    assert p.stats()["consumers_lost"] == 1
    for r in results:
        assert not r.get("errors"), r
    got = [r["received"] for r in results]
    if policy == "broadcast":
        # Each survivor got every item that was sent after it attached: all of them.
        assert got == [n, n], got
    else:
        # Sharded: the survivors together got everything except what was in flight to the
        # victim when it died (at most its credits): at-most-once, documented.
        assert n - 4 - 20 <= sum(got) <= n, got


@pytest.mark.timeout(60)
def test_forwarding_through_a_middle_stage_copies_once_and_releases_upstream(endpoints: Any) -> None:
    up = endpoints.producer("topo-up", slots=2, slot_bytes=4096, device="cpu")
    down = endpoints.producer("topo-down", slots=2, slot_bytes=4096, device="cpu")
    mid_in = endpoints.consumer("topo-up", device="cpu", timeout=20)
    sink = Reader(endpoints, "topo-down")
    errors: list[BaseException] = []
    sink.start()
    t = run_producer(up, N, errors)

    def middle() -> None:
        try:
            for item in mid_in:
                ipcsync.forward(item, down)  # all of it
                assert item.released  # the upstream slot goes back at once
            down.close(timeout=20)
        except BaseException as exc:
            errors.append(exc)

    m = threading.Thread(target=middle, daemon=True)
    m.start()
    t.join(30)
    up.close(timeout=20)
    m.join(30)
    sink.join(30)
    assert not errors, errors
    assert sink.error is None and not sink.bad
    assert sink.got == list(range(N))


def test_forward_part_of_an_item_and_bad_arguments() -> None:
    with ipcsync.Producer("topo-part", slots=2, slot_bytes=4096, device="cpu") as up, \
            ipcsync.Producer("topo-part-out", slots=2, slot_bytes=4096, device="cpu") as down, \
            ipcsync.Consumer("topo-part", device="cpu", timeout=10) as mid, \
            ipcsync.Consumer("topo-part-out", device="cpu", timeout=10) as sink:
        up.send(msg(7), meta=7)
        item = mid.get(timeout=10)
        assert item is not None
        with pytest.raises(ipcsync.ConfigError, match="Producer"):
            ipcsync.forward(item, mid)  # type: ignore[arg-type]
        ipcsync.forward(item, down, lambda t: {"x": t["x"][:4]}, meta={"from": 7})
        got = sink.get(timeout=10)
        assert got is not None and got.meta == {"from": 7} and got["x"].tolist() == [7.0] * 4
        with pytest.raises(ipcsync.ClosedError, match="released already"):
            ipcsync.forward(item, down)
