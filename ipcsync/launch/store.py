"""A c10d store client whose every call is bounded in time.

``TCPStore``'s client bounds only connecting, ``get`` and ``wait`` by its timeout: ``check``,
``add``, ``set`` and ``compare_set`` wait in ``recv()`` for as long as the server takes. A
server that is alive but does not answer (node 0's launcher paused by SIGSTOP, its host
swapping or cut off without a reset) would hold the caller forever, and with it a
launcher's supervision of its stages.

Invariants:
- calls run one at a time, in order, on one daemon thread (``ipcsync-store``); the
  caller waits at most ``bound`` seconds for its own call;
- a call not answered in time makes the store unresponsive for good: that call and
  every later one raise ``StoreUnresponsive`` at once. The thread stays in its
  ``recv()`` until the server answers or the process exits; nothing waits for it.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable

from ..system.bounded import Job, within

__all__ = ["BoundedStore", "Job", "StoreUnresponsive", "bounded"]


class StoreUnresponsive(RuntimeError):
    """The store did not answer a call within the bound (its process may be paused)."""


_CLOSE = Job(lambda: None)


def bounded(fn: Callable[[], Any], bound: float, what: str) -> Any:
    """``fn()``'s value, waited for at most ``bound`` seconds (for a store's constructor:
    a client's validates the server with a ``recv()`` that a server that never answers,
    such as another service on that port, holds for ever); StoreUnresponsive past it."""
    try:
        return within(fn, bound, "ipcsync-store-connect")
    except TimeoutError:
        raise StoreUnresponsive(f"{what} did not answer for {bound:g} s") from None


class BoundedStore:
    """``store``'s calls, each answered within ``bound`` seconds or ``StoreUnresponsive``;
    ``what`` names the store in that error."""

    def __init__(self, store: Any, bound: float, what: str) -> None:
        self.raw = store
        self.bound = bound
        self.what = what
        self.unresponsive: str | None = None  # why, once it is
        self._jobs: queue.SimpleQueue[Job] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="ipcsync-store", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _CLOSE:
                self.raw = None  # node 0: its server stops with its last reference
                return
            job.run()

    def close(self) -> None:
        """End the thread after the calls queued before (at once when none is stuck)."""
        self.unresponsive = self.unresponsive or f"{self.what} is closed"
        self._jobs.put(_CLOSE)

    def submit(self, fn: Callable[[Any], Any]) -> Job:
        """Queue ``fn(store)``; the caller watches ``job.done`` (see ``overdue``)."""
        if self.unresponsive is not None:
            raise StoreUnresponsive(self.unresponsive)
        job = Job(lambda: fn(self.raw))
        self._jobs.put(job)
        return job

    def overdue(self, job: Job) -> bool:
        """True (and the store unresponsive from now on) if ``job`` is past the bound
        without an answer."""
        if job.done.is_set():
            return False
        if time.monotonic() - job.submitted < self.bound:
            return False
        self.unresponsive = f"{self.what} did not answer for {self.bound:g} s"
        return True

    def call(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(store)``'s value, waited for at most the bound."""
        job = self.submit(fn)
        if not job.done.wait(self.bound):
            self.overdue(job)
            raise StoreUnresponsive(self.unresponsive or f"{self.what} did not answer for {self.bound:g} s")
        return job.result()

    # the calls NodeGroup makes
    def set(self, key: str, value: bytes) -> None:
        self.call(lambda s: s.set(key, value))

    def get(self, key: str) -> bytes:
        return bytes(self.call(lambda s: s.get(key)))

    def check(self, keys: list[str]) -> bool:
        return bool(self.call(lambda s: s.check(keys)))

    def add(self, key: str, amount: int) -> int:
        return int(self.call(lambda s: s.add(key, amount)))

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return bytes(self.call(lambda s: s.compare_set(key, expected, desired)))
