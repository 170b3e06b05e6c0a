"""FanIn: several producers merged into one stream (round robin among ready sources,
per-source order, ``item.source`` labels, ends when every source ended, PeerLostError when
a source's producer dies).

Producers run either in child processes (tests/integration/peers/ roles, through the ``procs``
fixture, which kills them at teardown and fails the test on leaked shared memory) or in
threads of the test process (each endpoint has its own service thread). The ``fan`` fixture
tracks producers, feeder threads and FanIns, and shuts them down at teardown (feeders
stopped, endpoints closed, threads joined with a timeout).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any, Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ipcsync
from ipcsync.errors import ClosedError, ConfigError, IpcTimeoutError, PeerLostError
from ipcsync.fanin import FanIn
from polling import wait_until

pytestmark = pytest.mark.timeout(60)


def msg(tag: int, i: int) -> dict[str, torch.Tensor]:
    return {"x": torch.tensor([tag, i], dtype=torch.int64), "y": torch.full((4,), float(i))}


def producer(name: str, **kw: Any) -> ipcsync.Producer:
    kw.setdefault("slots", 4)
    kw.setdefault("slot_bytes", 4096)
    kw.setdefault("timeout", 10.0)
    return ipcsync.Producer(name, device="cpu", **kw)


class Feeder:
    """A Producer fed from a thread: waits for its consumer, sends items ``start..n-1``
    (``msg(tag, i)``), then closes unless told not to. Errors are kept for the test."""

    def __init__(self, prod: ipcsync.Producer, tag: int, n: int, start: int = 0,
                 close: bool = True, wait_consumer: bool = True) -> None:
        self.prod, self.tag, self.n, self.start, self.close = prod, tag, n, start, close
        self.wait_consumer = wait_consumer
        self.error: BaseException | None = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            if self.wait_consumer:
                self.prod.wait_for_consumers(1, timeout=10)
            for i in range(self.start, self.n):
                while not self.stop.is_set():
                    try:
                        self.prod.send(msg(self.tag, i), meta={"tag": self.tag, "i": i}, timeout=0.2)
                        break
                    except IpcTimeoutError:
                        continue
                if self.stop.is_set():
                    return
            if self.close:
                self.prod.close(timeout=10)
        except ClosedError as exc:
            # The test closed the producer from its own thread while a send() waited:
            # that send raises ClosedError (a wait never holds the endpoint).
            if not self.stop.is_set():
                self.error = exc
        except BaseException as exc:  # reported by join()
            self.error = exc

    def begin(self) -> "Feeder":
        self.thread.start()
        return self

    def join(self, timeout: float = 10.0) -> None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"feeder {self.tag} still running"
        if self.error is not None:
            raise self.error


class Fan:
    """Producers (through the ``endpoints`` fixture), their feeder threads and FanIns of
    one test; ``shutdown()`` (also at teardown) stops the feeders, closes every endpoint
    and joins the threads."""

    def __init__(self, endpoints: Any) -> None:
        self.endpoints = endpoints
        self.feeders: list[Feeder] = []

    def producer(self, name: str, **kw: Any) -> ipcsync.Producer:
        return self.endpoints.add(producer(name, **kw))

    def feed(self, *args: Any, **kw: Any) -> Feeder:
        feeder = Feeder(*args, **kw)
        self.feeders.append(feeder)
        return feeder.begin()

    def fanin(self, *args: Any, **kw: Any) -> FanIn:
        return self.endpoints.add(FanIn(*args, **kw))

    def shutdown(self) -> None:
        for f in self.feeders:
            f.stop.set()
        self.endpoints.close()
        for f in self.feeders:
            f.thread.join(10)
        assert not any(f.thread.is_alive() for f in self.feeders), "a feeder thread did not end"


@pytest.fixture
def fan(endpoints: Any) -> Iterator[Fan]:
    f = Fan(endpoints)
    yield f
    f.shutdown()




def check_exactly_once(got: list[tuple[str, int, int, int]], counts: dict[str, int],
                       tags: dict[str, int]) -> None:
    """``got``: (item.source, meta tag, tensor tag, i) in arrival order."""
    per: dict[str, list[int]] = {label: [] for label in counts}
    for source, meta_tag, tensor_tag, i in got:
        assert source in counts, f"unknown source label {source!r}"
        assert meta_tag == tensor_tag == tags[source], f"item from {source} carries tag {meta_tag}/{tensor_tag}"
        per[source].append(i)
    for label, n in counts.items():
        assert per[label] == list(range(n)), f"source {label}: got {per[label][:20]}... (n={len(per[label])})"
    assert len(got) == sum(counts.values())


# --------------------------------------------------------------------------- merging
def test_three_child_producers_exactly_once_in_order_labelled(procs, endpoints, runtime_dir):
    counts = {"alpha": 50, "beta": 120, "gamma": 7}
    tags = {"alpha": 1, "beta": 2, "gamma": 3}
    peers = {label: procs.start("tagged_produce", module="peers.basic", endpoint=f"fi-{label}", n=n, tag=tags[label],
                               label=label, slots=4)
             for label, n in counts.items()}
    got: list[tuple[str, int, int, int]] = []
    sizes_ok = True
    fi = endpoints.fanin([f"fi-{label}" for label in counts], sources=list(counts), device="cpu",
                         timeout=30, idle_timeout=20)
    assert fi.sources == list(counts)
    for item in fi:
        x = item["x"]
        sizes_ok &= bool(torch.equal(item["y"], torch.full((8,), float(item.meta["i"]))))
        got.append((item.source, tags[item.meta["src"]], int(x[0]), int(x[1])))
        assert int(x[1]) == item.meta["i"]
    # The stream ended cleanly: get() keeps answering None, iteration stays ended.
    assert fi.get(timeout=1) is None
    assert list(fi) == []
    stats = fi.stats()
    fi.close()  # before the producers' exit: their close waits for this consumer
    check_exactly_once(got, counts, tags)
    assert sizes_ok
    assert stats["handoffs"] == sum(counts.values())
    assert {k: v["handoffs"] for k, v in stats["sources"].items()} == counts
    for label, peer in peers.items():
        done = peer.result(timeout=30)
        assert done["sent"] == counts[label]
        assert done["stats"]["handoffs"] == counts[label]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(counts=st.lists(st.integers(0, 25), min_size=1, max_size=4),
       slots=st.integers(1, 4), hold=st.booleans())
def test_property_every_item_once_per_source_order(fan, runtime_dir, counts, slots, hold):
    """Any number of sources (some sending nothing), any ring size: every item exactly
    once, each source's items in order, then a clean end."""
    labels = [f"s{k}" for k in range(len(counts))]
    tags = {label: k + 10 for k, label in enumerate(labels)}
    want = dict(zip(labels, counts))
    got = []
    try:  # one fixture for every example: each example shuts its endpoints down
        for label, n in want.items():
            fan.feed(fan.producer(f"prop-{label}", slots=slots), tags[label], n)
        fi = fan.fanin([f"prop-{label}" for label in labels], sources=labels, device="cpu",
                   timeout=10, idle_timeout=10)
        kept = []
        for item in fi:
            got.append((item.source, item.meta["tag"], int(item["x"][0]), int(item["x"][1])))
            if hold:
                kept.append(item)  # auto_release frees it at the next iteration anyway
        for f in fan.feeders:
            f.join()
        assert all(it.released for it in kept)
    finally:
        fan.shutdown()
    check_exactly_once(got, want, tags)


# --------------------------------------------------------------------------- fairness
def test_round_robin_when_every_source_has_items_ready(fan, runtime_dir):
    slots = 6
    labels = ["a", "b", "c"]
    prods = [fan.producer(f"fair-{label}", slots=slots) for label in labels]
    # Pre-fill every ring before the consumer exists: `slots` items queued per source.
    for k, p in enumerate(prods):
        for i in range(slots):
            p.send(msg(k, i), meta={"tag": k, "i": i}, timeout=2)
    # ... and keep them busy afterwards (each sends more as soon as a slot frees).
    feeders = [fan.feed(p, k, 1000, start=slots, close=False) for k, p in enumerate(prods)]
    fi = fan.fanin([f"fair-{label}" for label in labels], sources=labels, device="cpu", timeout=10)
    # Every source has delivered its queued items (the service threads pump meanwhile).
    assert wait_until(lambda: all(c.stats()["buffered"] == slots for c in fi.consumers)), \
        [c.stats()["buffered"] for c in fi.consumers]
    order = []
    for _ in range(3 * slots):
        item = fi.get(timeout=5)
        order.append((item.source, item.meta["i"]))
    sources = [s for s, _ in order]
    # No source twice in a row while the others have items ready; every round of three
    # serves each source once, in the same rotation.
    assert all(a != b for a, b in zip(sources, sources[1:])), sources
    rounds = [sources[r:r + 3] for r in range(0, len(sources), 3)]
    assert all(sorted(r) == labels for r in rounds), rounds
    assert all(r == rounds[0] for r in rounds), rounds
    # Per-source order within the merge.
    for label in labels:
        assert [i for s, i in order if s == label] == list(range(slots))
    fan.shutdown()
    for f in feeders:
        assert f.error is None, f.error


def test_busy_source_does_not_starve_one_with_fewer_items(fan, runtime_dir):
    """Source a has 8 items ready, b has 2, c none (alive, idle): b's items are not
    delayed behind a's backlog; the merge alternates while both have items."""
    prods = {"a": fan.producer("busy-a", slots=8), "b": fan.producer("busy-b", slots=8), "c": fan.producer("busy-c", slots=8)}
    for i in range(8):
        prods["a"].send(msg(0, i), meta={"tag": 0, "i": i}, timeout=2)
    for i in range(2):
        prods["b"].send(msg(1, i), meta={"tag": 1, "i": i}, timeout=2)
    fi = fan.fanin(["busy-a", "busy-b", "busy-c"], sources=["a", "b", "c"], device="cpu", timeout=10)
    assert wait_until(lambda: [c.stats()["buffered"] for c in fi.consumers] == [8, 2, 0])
    sources = [fi.get(timeout=5).source for _ in range(10)]
    assert sources == ["a", "b", "a", "b"] + ["a"] * 6, sources
    with pytest.raises(IpcTimeoutError):
        fi.get(timeout=0.1)  # c is alive but sent nothing


# --------------------------------------------------------------------------- peer loss
def test_source_sigkilled_midstream_raises_peer_lost_fast(procs, fan, runtime_dir):
    """A source killed mid-stream ends the merged stream with PeerLostError while the other
    sources still have items: its death is noticed (the process is gone), not waited out.
    A FanIn that did not notice would go on merging the live sources (a million items
    each, then an endless wait), and the test's timeout fails it."""
    victim = procs.start("tagged_produce", module="peers.basic", endpoint="kill-v", n=1_000_000, tag=9, label="v",
                        slots=4, heartbeat=1.0)
    prods = [fan.producer("kill-a", heartbeat=1.0), fan.producer("kill-b", heartbeat=1.0)]
    feeders = [fan.feed(p, k, 1_000_000, close=False) for k, p in enumerate(prods)]
    fi = fan.fanin(["kill-a", "kill-v", "kill-b"], sources=["a", "v", "b"], device="cpu", timeout=30)
    from_victim = 0
    for item in fi:
        from_victim += item.source == "v"
        if from_victim == 50:
            break
    os.kill(victim.pid, signal.SIGKILL)
    with pytest.raises(PeerLostError) as info:
        for item in fi:
            pass
    assert f"pid {victim.pid}" in str(info.value)
    # The error sticks (the merged stream cannot silently continue without a source).
    with pytest.raises(PeerLostError):
        fi.get(timeout=1)
    fi.close()
    fi.close()  # idempotent
    assert fi.closed
    with pytest.raises(ClosedError):
        fi.get(timeout=1)
    fan.shutdown()
    victim.proc.wait(timeout=10)
    assert victim.proc.returncode == -signal.SIGKILL
    for f in feeders:
        assert f.error is None, f.error
    # The consumer that noticed the death removed the dead producer's socket files, and the
    # live producers removed theirs at close.
    assert wait_until(lambda: os.listdir(runtime_dir) == [], 5), os.listdir(runtime_dir)


# --------------------------------------------------------------------------- API edges
def test_get_timeout_end_and_closed(fan, runtime_dir):
    prods = [fan.producer("api-a"), fan.producer("api-b")]
    fi = fan.fanin(["api-a", "api-b"], device="cpu", timeout=10)
    assert fi.sources == ["api-a", "api-b"]  # default labels: the endpoints
    # The call's own timeout, not the FanIn's 10 s, is the one waited out: the error names it.
    t0 = time.monotonic()
    with pytest.raises(IpcTimeoutError, match=r"within 0\.2 s") as info:
        fi.get(timeout=0.2)
    assert isinstance(info.value, TimeoutError)
    assert 0.18 <= time.monotonic() - t0  # it waited (a clock cannot run fast)
    with pytest.raises(TimeoutError, match=r"within 0(\.0)? s"):
        fi.get(timeout=0)  # 0 is no wait, not "unset" (which would be the FanIn's 10 s)
    with pytest.raises(ConfigError):
        fi.get(timeout=-1)
    prods[0].send(msg(0, 0), meta={"tag": 0, "i": 0})
    item = fi.get(timeout=5)
    assert item.source == "api-a" and item.meta == {"tag": 0, "i": 0}
    item.release()
    for p in prods:
        p.close(timeout=5)  # the consumers answer the goodbye from their service threads
    assert fi.get(timeout=5) is None
    assert fi.get(timeout=0) is None  # stays ended, without waiting
    assert list(fi) == []
    fi.close()
    assert fi.closed
    with pytest.raises(ClosedError):
        fi.get(timeout=1)
    with pytest.raises(ClosedError):
        next(iter(fi))
    with pytest.raises(ClosedError):
        for _ in fi:
            pass
    fi.close()  # idempotent


def test_idle_timeout_bounds_iteration(fan, runtime_dir):
    fan.producer("idle-a")
    fi = fan.fanin(["idle-a"], device="cpu", timeout=10, idle_timeout=0.2)
    t0 = time.monotonic()
    with pytest.raises(IpcTimeoutError, match=r"within 0\.2 s"):  # idle_timeout, not the 10 s timeout
        next(fi)
    assert 0.18 <= time.monotonic() - t0  # it waited (a clock cannot run fast)


def test_source_closed_directly_refused(fan, runtime_dir):
    fan.producer("direct-a")
    fan.producer("direct-b")
    fi = fan.fanin(["direct-a", "direct-b"], device="cpu", timeout=10)
    fi.consumers[1].close()
    with pytest.raises(ClosedError):
        fi.get(timeout=0.2)


def test_missing_producer_fails_handshake_and_frees_the_others(fan, runtime_dir):
    p = fan.producer("present")
    # The handshake waits the FanIn's timeout, not the 30 s connect default: the error names it.
    with pytest.raises(IpcTimeoutError, match=r"'absent'.* within 0\.3 s"):
        fan.fanin(["present", "absent"], device="cpu", timeout=0.3)
    # The consumer already connected to "present" was closed again.
    assert wait_until(lambda: p.consumers == 0, 3)
    assert p.stats()["consumers_attached"] == 1


@pytest.mark.parametrize("args, kwargs, match", [
    ([], {}, "at least one endpoint"),
    (["dup", "dup"], {}, "distinct"),
    (["a", "b"], {"sources": ["x"]}, "2 endpoints but 1 source labels"),
    (["a"], {"sources": ["x", "y"]}, "1 endpoints but 2 source labels"),
    (["a"], {"timeout": -1}, "timeout"),
    (["a"], {"idle_timeout": float("nan")}, "idle_timeout"),
    (["a"], {"wait": "sometimes"}, "wait must be one of"),
])
def test_bad_arguments_raise_config_error_at_once(runtime_dir, monkeypatch, args, kwargs, match):
    """Rejected before any handshake: no producer exists, yet the error comes at once (no
    source connects, so no handshake waits; the work is checked, not the time)."""
    from ipcsync.runtime.consumer import endpoint as consumer_endpoint

    def no_handshake(*a: Any, **kw: Any) -> None:
        raise AssertionError(f"a source connected before the arguments were checked: {a[:1]}")

    monkeypatch.setattr(consumer_endpoint, "ConsumerChannel", no_handshake)
    with pytest.raises(ConfigError, match=match):
        FanIn(args, **{"device": "cpu", "timeout": 5, **kwargs})
    assert os.listdir(runtime_dir) == []


def test_auto_release_and_idle_timeout_belong_to_fanin(fan, runtime_dir):
    """auto_release/idle_timeout are FanIn's own: its per-source Consumers never release on
    their own (the FanIn does). Note: they are named parameters, so they can never reach
    ``**options``; FanIn's "pass auto_release/idle_timeout to FanIn itself" check there is
    unreachable."""
    fan.producer("own-a")
    fan.producer("own-b")
    fi = fan.fanin(["own-a", "own-b"], device="cpu", timeout=10, **{"auto_release": False, "idle_timeout": 3})
    assert fi.auto_release is False
    assert all(c.auto_release is False for c in fi.consumers)
    fi.close()
    fi = fan.fanin(["own-a", "own-b"], device="cpu", timeout=10)
    assert fi.auto_release is True
    assert all(c.auto_release is False for c in fi.consumers)


def test_aliased_endpoints_rejected(fan, runtime_dir):
    """A bare name and its ipc:// path are one producer: FanIn must refuse them like any
    duplicate instead of connecting twice to the same producer."""
    fan.producer("alias")
    with pytest.raises(ConfigError, match="distinct"):
        fan.fanin(["alias", f"ipc://{runtime_dir}/alias.sock"], device="cpu", timeout=5)


# --------------------------------------------------------------------------- releases
def test_auto_release_holding_items_never_deadlocks(fan, runtime_dir):
    n = 20
    prods = [fan.producer("hold-a", slots=2), fan.producer("hold-b", slots=2)]
    feeders = [fan.feed(p, k, n) for k, p in enumerate(prods)]
    held: list[ipcsync.Item] = []
    fi = fan.fanin(["hold-a", "hold-b"], sources=["a", "b"], device="cpu", timeout=10, idle_timeout=10)
    for item in fi:
        if held:
            assert held[-1].released, "the previous item was not released at the next iteration"
        assert not item.released
        held.append(item)  # never released by hand
    for f in feeders:
        f.join()
    fan.shutdown()
    assert len(held) == 2 * n
    assert all(it.released for it in held)
    with pytest.raises(ClosedError):
        held[0]["x"]


def test_without_auto_release_held_items_apply_backpressure(fan, runtime_dir):
    """auto_release=False: holding every slot of a source stalls that source (nothing is
    dropped); releasing lets the rest through."""
    n = 10
    prods = [fan.producer("bp-a", slots=2), fan.producer("bp-b", slots=2)]
    feeders = [fan.feed(p, k, n) for k, p in enumerate(prods)]
    got: list[tuple[str, int]] = []
    fi = fan.fanin(["bp-a", "bp-b"], sources=["a", "b"], device="cpu", timeout=10, auto_release=False)
    held = []
    while True:
        try:
            item = fi.get(timeout=0.5)
        except IpcTimeoutError:
            break
        held.append(item)
    # Two slots per producer: two items each, then nothing until something is released.
    assert sorted((it.source, it.meta["i"]) for it in held) == [("a", 0), ("a", 1), ("b", 0), ("b", 1)]
    got += [(it.source, it.meta["i"]) for it in held]
    for it in held:
        it.release()
    while (item := fi.get(timeout=10)) is not None:
        got.append((item.source, item.meta["i"]))
        item.release()
    for f in feeders:
        f.join()
    fan.shutdown()
    for label in "ab":
        assert [i for s, i in got if s == label] == list(range(n))


@pytest.mark.timeout(30)
def test_producer_close_waits_for_item_held_by_fanin(fan, runtime_dir):
    prods = [fan.producer("late-a", heartbeat=0.5), fan.producer("late-b", heartbeat=0.5)]
    fi = fan.fanin(["late-a", "late-b"], sources=["a", "b"], device="cpu", timeout=10, heartbeat=0.5)
    prods[0].send(msg(0, 0), meta={"tag": 0, "i": 0})
    item = fi.get(timeout=5)
    closer = threading.Thread(target=prods[0].close, kwargs={"timeout": 10}, daemon=True)
    t0 = time.monotonic()
    closer.start()
    time.sleep(2.0)  # four heartbeats of the consumer, still holding the item
    assert closer.is_alive(), f"close() returned after {time.monotonic() - t0:.2f} s with the item held"
    item.release()
    closer.join(5)
    assert not closer.is_alive()
    assert prods[0].stats()["consumers_lost"] == 0


# --------------------------------------------------------------------------- stats
def test_stats_sum_over_sources(fan, runtime_dir):
    counts = {"p": 13, "q": 5, "r": 0}
    prods = [fan.producer(f"st-{label}") for label in counts]
    feeders = [fan.feed(p, k, n) for k, (p, n) in enumerate(zip(prods, counts.values()))]
    fi = fan.fanin([f"st-{label}" for label in counts], sources=list(counts), device="cpu",
               timeout=10, idle_timeout=10)
    received = sum(1 for _ in fi)
    for f in feeders:
        f.join()
    stats = fi.stats()
    fan.shutdown()
    assert received == sum(counts.values())
    assert stats["role"] == "fanin"
    assert stats["handoffs"] == received
    assert sorted(stats["sources"]) == sorted(counts)
    assert {k: v["handoffs"] for k, v in stats["sources"].items()} == counts
    assert stats["bytes"] == sum(v["bytes"] for v in stats["sources"].values()) > 0
    assert stats["elapsed_s"] > 0 and stats["rate_per_s"] >= 0
