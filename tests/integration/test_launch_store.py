"""``launch.store.BoundedStore``: every call on the rendezvous store answered within its
bound, against a fake store whose calls can be held (as a paused node 0 holds them)."""

from __future__ import annotations

import threading
import time
from typing import Iterator

import pytest

from ipcsync.launch.store import BoundedStore, StoreUnresponsive


class HeldStore:
    """A dict store; while ``hold`` is clear every call waits for it."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.hold = threading.Event()
        self.hold.set()

    def _wait(self) -> None:
        assert self.hold.wait(30)

    def set(self, key: str, value: bytes) -> None:
        self._wait()
        self.data[key] = value

    def get(self, key: str) -> bytes:
        self._wait()
        if key not in self.data:
            raise RuntimeError(f"key {key} not found")
        return self.data[key]

    def check(self, keys: list[str]) -> bool:
        self._wait()
        return all(k in self.data for k in keys)

    def add(self, key: str, amount: int) -> int:
        self._wait()
        value = int(self.data.get(key, b"0")) + amount
        self.data[key] = str(value).encode()
        return value

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        self._wait()
        now = self.data.get(key)
        if now is None and expected == b"" or now == expected:
            self.data[key] = desired
            return desired
        return now if now is not None else expected


@pytest.fixture
def held() -> Iterator[tuple[HeldStore, BoundedStore]]:
    raw = HeldStore()
    store = BoundedStore(raw, 0.3, "the test store")
    try:
        yield raw, store
    finally:
        raw.hold.set()
        store.close()


@pytest.mark.timeout(30)
def test_calls_answer_and_their_errors_reach_the_caller(held: tuple[HeldStore, BoundedStore]) -> None:
    raw, store = held
    store.set("a", b"1")
    assert store.get("a") == b"1" and store.check(["a"]) and not store.check(["a", "b"])
    assert store.add("n", 2) == 2 and store.add("n", 0) == 2
    assert store.compare_set("k", b"", b"mine") == b"mine"
    assert store.compare_set("k", b"", b"theirs") == b"mine"  # the first claim holds
    with pytest.raises(RuntimeError, match="key b not found"):
        store.get("b")
    assert store.unresponsive is None and store.check(["a"])  # an error is not silence


@pytest.mark.timeout(30)
def test_a_call_not_answered_within_the_bound_makes_the_store_unresponsive(
        held: tuple[HeldStore, BoundedStore]) -> None:
    # An unbounded call waits as long as the store is held: the test's timeout fails it.
    raw, store = held
    raw.hold.clear()
    t0 = time.monotonic()
    with pytest.raises(StoreUnresponsive, match="the test store did not answer for 0.3 s"):
        store.check(["a"])
    assert 0.3 <= time.monotonic() - t0
    # At once from now on, even once it answers again: the call never reaches the store
    # (one queued behind the stuck check would wait out the bound again, then run).
    with pytest.raises(StoreUnresponsive, match="the test store did not answer for 0.3 s"):
        store.set("a", b"1")
    raw.hold.set()
    with pytest.raises(StoreUnresponsive):
        store.submit(lambda s: s.check(["a"]))
    store.close()  # the thread ends after the calls queued before it
    store._thread.join(5)
    assert not store._thread.is_alive() and raw.data == {}


@pytest.mark.timeout(30)
def test_a_submitted_call_never_blocks_and_is_overdue_past_the_bound(held: tuple[HeldStore, BoundedStore]) -> None:
    raw, store = held
    job = store.submit(lambda s: s.add("n", 1))
    assert job.done.wait(5) and job.result() == 1 and not store.overdue(job)
    raw.hold.clear()
    # submit() returns while its call is unanswered (one that waited for the answer would
    # wait as long as the store is held: the test's timeout).
    job = store.submit(lambda s: s.add("n", 1))
    assert not job.done.is_set()
    patient = BoundedStore(raw, 3600, "a patient store")  # the same call, well within its bound
    try:
        assert not patient.overdue(patient.submit(lambda s: s.add("n", 1)))
        assert patient.unresponsive is None
    finally:
        patient.close()
    time.sleep(0.35)
    assert store.overdue(job) and store.unresponsive == "the test store did not answer for 0.3 s"


@pytest.mark.timeout(30)
def test_close_ends_the_thread_and_drops_the_store(held: tuple[HeldStore, BoundedStore]) -> None:
    raw, store = held
    store.set("a", b"1")
    store.close()
    store._thread.join(5)
    assert not store._thread.is_alive() and store.raw is None
    with pytest.raises(StoreUnresponsive, match="is closed"):
        store.check(["a"])
