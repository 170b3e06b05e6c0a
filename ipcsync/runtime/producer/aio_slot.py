"""An asyncio call's wait for a free slot (``Producer.asend``, ``Producer.aslot``): the
event loop awaits what a blocking send would wait for (``runtime.aio``), then the call
reserves without blocking. The lock is taken only for each look, never across an await."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Sequence, TypeVar

from ...core.ring import Ring
from ...core.stats import Stats
from ...errors import IpcTimeoutError
from .. import aio

__all__ = ["AsyncSlotWait"]

_T = TypeVar("_T")


class AsyncSlotWait:
    """One producer's asyncio wait for a slot. ``enter``: refuses a send on a closed or
    closing producer (lock held); ``pump``: the steady pump; ``fds``, ``io_pending``: what
    its waits select on; ``no_slot_error``: the sync call's timeout error."""

    def __init__(self, *, lock: threading.Lock, ring: Ring, stats: Stats, enter: Callable[[], None],
                 pump: Callable[[], None], fds: Sequence[int], io_pending: Callable[[], bool], tick: float,
                 resolve_timeout: Callable[[float | None], float | None],
                 no_slot_error: Callable[[float | None], IpcTimeoutError]) -> None:
        self.lock = lock
        self.ring = ring
        self.stats = stats
        self.enter = enter
        self.pump = pump
        self.fds = fds
        self.io_pending = io_pending
        self.tick = tick
        self.resolve_timeout = resolve_timeout
        self.no_slot_error = no_slot_error

    async def when_slot_free(self, reserve: Callable[[], _T], timeout: float | None) -> _T:
        """Await a free slot (up to ``timeout``, default the producer's), then ``reserve()``
        (a call that reserves with timeout 0, so it never blocks). Lost to another thread
        in between: wait again. Time over: ``reserve()`` once more; if still no slot is
        free, the sync call's IpcTimeoutError, naming ``timeout`` (not the 0 of that try)."""
        t = self.resolve_timeout(timeout)
        deadline = None if t is None else time.monotonic() + t
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            await aio.wait_for_attempt(self.slot_free, self.fill_poller, left, self.tick, lambda: None,
                                       self.waited_for_slot)
            try:
                return reserve()
            except IpcTimeoutError:
                with self.lock:
                    taken = self.ring.free_slots == 0  # by another thread since we looked
                    if taken and deadline is not None and time.monotonic() >= deadline:
                        raise self.no_slot_error(t) from None
                if not taken:
                    raise

    def slot_free(self) -> tuple[bool, None]:
        """A non-blocking look: is a slot free (after handling what arrived)? Refused on
        a closed or closing producer."""
        with self.lock:
            self.enter()
            if self.ring.free_slots == 0:
                self.pump()
            return self.ring.free_slots > 0, None

    def fill_poller(self, poller: Any) -> None:
        with self.lock:
            self.enter()
            poller.add(self.fds, self.io_pending())

    def waited_for_slot(self, seconds: float) -> None:
        self.stats.waited("slot" if self.ring.consumers() else "consumer", seconds)
