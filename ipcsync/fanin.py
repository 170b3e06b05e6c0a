"""FanIn: one consumer's view of several producers, merged fairly.

Rules:

- each source is an ordinary Consumer (its own handshake, slots, events, liveness), so a
  source's items arrive in that source's order, and ``item.source`` names it;
- merging is round robin among the sources that have an item ready: after an item from
  source k, the next scan starts at k + 1, so a busy source cannot starve a slower one;
- the merged stream ends when every source has ended (its producer closed and everything
  it sent was received); a source whose producer dies raises PeerLostError from the
  FanIn, like a single Consumer would, and again on every later call (the merged stream
  never goes on silently without a source);
- waiting for the next item pumps every live source (under its lock), then sleeps in
  the one poller of ``runtime.waiting`` on all their sockets (and those of the Producers
  their items were forwarded to) with no lock held, so a source's ``stats()`` or
  ``close()`` from another thread is never blocked by the wait. Sources are used only
  through their ``port`` (``SourcePort``).
"""

from __future__ import annotations

import math
import time
from types import TracebackType
from typing import Any, Coroutine, Iterator, Sequence

from . import limits
from .core.stats_types import FanInStats, frozen_map
from .runtime import aio
from .runtime.endpoint import UNSET, check_timeout
from .runtime.transport.channel import resolve_endpoint
from .runtime.waiting import Poller
from .consumer import Consumer, Item
from .errors import ClosedError, ConfigError, IpcSyncError, IpcTimeoutError, PeerLostError, ProtocolError

__all__ = ["FanIn"]

_TICK = 0.05


class FanIn:
    """Receives from several producers as one stream: one Consumer per endpoint, merged
    round robin among the sources that have an item ready (a busy source cannot starve a
    slower one); each source's items keep their order, and ``item.source`` names the
    source. The stream ends when every source has ended; a source whose producer dies
    raises PeerLostError from the FanIn, and again on every later call.

    Args:
        endpoints: the producers' endpoints (at least one).
        sources: labels for ``item.source``, one per endpoint (default: the endpoints).
        timeout: default for blocking calls (None, the default: as long as a source lives).
        connect_timeout: how long each source's handshake waits for its producer
            (default: ``timeout`` when given, else 30 s).
        idle_timeout: how long iteration waits for the next item (None: as long as a
            source lives).
        auto_release: release the previous item at the next iteration.
        **options: passed to every source's Consumer (device, wait, heartbeat, ...);
            ``curve`` may also be a list with one ``CurveKeys`` (or None) per endpoint.

    Raises ConfigError for no endpoints, two endpoints of one producer, or as many
    labels (or CURVE keys) as endpoints not given; a source's Consumer errors.
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        sources: Sequence[str] | None = None,
        timeout: float | None = limits.DEFAULT_TIMEOUT,
        connect_timeout: Any = UNSET,
        idle_timeout: float | None = None,
        auto_release: bool = True,
        **options: Any,
    ) -> None:
        endpoints = list(endpoints)
        if not endpoints:
            raise ConfigError("FanIn needs at least one endpoint")
        labels = list(sources) if sources is not None else list(endpoints)
        if len(labels) != len(endpoints):
            raise ConfigError(f"FanIn got {len(endpoints)} endpoints but {len(labels)} source labels")
        urls = [resolve_endpoint(ep).url for ep in endpoints]
        if len(set(urls)) != len(urls):
            raise ConfigError(f"FanIn endpoints must be distinct producers, got {endpoints} ({urls})")
        self._timeout = check_timeout("timeout", timeout)
        self._idle_timeout = check_timeout("idle_timeout", idle_timeout)
        self.auto_release = bool(auto_release)
        self._consumers: list[Consumer] = []
        try:
            # ``curve`` may be one CurveKeys per endpoint (None for an ipc one): each
            # tcp producer has its own server key.
            curve = options.pop("curve", None)
            curves = list(curve) if isinstance(curve, (list, tuple)) else [curve] * len(endpoints)
            if len(curves) != len(endpoints):
                raise ConfigError(f"FanIn got {len(endpoints)} endpoints but {len(curves)} CURVE keys")
            for ep, label, keys in zip(endpoints, labels, curves):
                c = Consumer(ep, timeout=timeout, connect_timeout=connect_timeout, auto_release=False,
                             curve=keys, **options)
                c.source = label
                self._consumers.append(c)
        except BaseException:
            self.close()
            raise
        self._ports = [c.port for c in self._consumers]
        self._live = list(range(len(self._consumers)))  # sources not yet ended, scan order
        self._next = 0
        self._current: Item | None = None
        self._error: IpcSyncError | None = None  # a source broke: the merged stream stays broken
        self._closed = False
        self._caller_items = aio.CallerItems()  # aget's items, per calling task
        self._waited = 0.0  # seconds blocked in _wait: no source had an item

    # ------------------------------------------------------------------ public API
    @property
    def sources(self) -> list[str]:
        """The sources' labels, in the order of ``endpoints``."""
        return [c.source for c in self._consumers]

    @property
    def consumers(self) -> list[Consumer]:
        """The per-source Consumers (for their stats, device, ...)."""
        return list(self._consumers)

    def get(self, timeout: float | None = None) -> Item | None:
        """The next item from any source, or None once every source has ended. Raises
        IpcTimeoutError after ``timeout`` (default: the FanIn's), PeerLostError if a
        source's producer died, ClosedError after close()."""
        t = self._timeout if timeout is None else check_timeout("timeout", timeout)
        return self._next_item(None if t is None or math.isinf(t) else t)

    def __iter__(self) -> Iterator[Item]:
        return self

    def __next__(self) -> Item:
        t = self._idle_timeout
        item = self._next_item(None if t is None or math.isinf(t) else t)
        if item is None:
            raise StopIteration
        return item

    def aget(self, timeout: float | None = None) -> Coroutine[Any, Any, Item | None]:
        """``get()`` for asyncio (``await fan.aget()``): the same result (None once every
        source ended), ``timeout`` and errors; the event loop runs other tasks while it
        waits on all the sources. Cancellation-safe: a cancelled ``aget`` took nothing (the next ``aget``/``get``
        returns what it waited for). With ``auto_release`` the items ``aget`` returned to
        the calling task are released when that task calls ``aget`` again, whichever task
        runs the call (``runtime.aio.CallerItems``)."""
        caller = self._caller_items.caller()
        if self.auto_release:
            self._caller_items.release_previous(caller)
        return self._aget(caller, timeout)

    async def _aget(self, caller: Any, timeout: float | None) -> Item | None:
        t = self._timeout if timeout is None else check_timeout("timeout", timeout)
        item = await self._anext_item(None if t is None or math.isinf(t) else t)
        self._caller_items.remember(caller, item)
        return item

    def __aiter__(self) -> aio.AsyncItems:
        """``async for item in fanin``: like ``for``, on the event loop (``idle_timeout``
        applies; each ``async for`` has its own current item)."""
        t = self._idle_timeout
        return aio.AsyncItems(self._anext_item, None if t is None or math.isinf(t) else t, self.auto_release)

    def stats(self) -> FanInStats:
        """A frozen snapshot (``FanInStats``) of the totals over the sources, read by
        attribute or as a read-only mapping (``as_dict()`` for JSON): ``role``
        (``"fanin"``), ``handoffs``, ``bytes``, ``elapsed_s`` (the longest-lived source's),
        ``rate_per_s``, ``bytes_per_s``, ``waiting_s`` (``producer``: seconds blocked with
        no item from any source), and ``sources``: each source's own
        ``Consumer.stats()`` by label."""
        per = {c.source: c.stats() for c in self._consumers}
        handoffs = sum(s.handoffs for s in per.values())
        nbytes = sum(s.bytes for s in per.values())
        elapsed = max((s.elapsed_s for s in per.values()), default=1e-9)
        return FanInStats(handoffs=handoffs, bytes=nbytes, elapsed_s=elapsed, rate_per_s=handoffs / elapsed,
                          bytes_per_s=nbytes / elapsed, waiting_s=frozen_map({"producer": self._waited}),
                          role="fanin", sources=frozen_map(per))

    def close(self, timeout: float | None = None) -> None:
        """Close every source: ``Consumer.close`` with ``timeout``. Idempotent."""
        self._closed = True
        for c in self._consumers:
            c.close(timeout)

    async def aclose(self, timeout: float | None = None) -> None:
        """``close()`` for asyncio: every source's ``Consumer.aclose`` with ``timeout``,
        awaited without blocking the event loop. Idempotent. Cancelled while it waits,
        every source still closes (at once), then it re-raises."""
        self._closed = True
        try:
            for c in self._consumers:
                await c.aclose(timeout)
        except BaseException:
            for c in self._consumers:
                c.close(0.0)
            raise

    @property
    def closed(self) -> bool:
        """True once ``close()`` has been called."""
        return self._closed

    def __enter__(self) -> "FanIn":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> "FanIn":
        """``async with FanIn([...]) as inp``: the FanIn (its sources connected)."""
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        """``aclose()`` on a clean exit; an exception closes every source at once."""
        if exc_type is None:
            await self.aclose()
        else:
            for c in self._consumers:
                c.close(0.0)

    # ------------------------------------------------------------------ internals
    def _next_item(self, timeout: float | None) -> Item | None:
        if self._closed:
            raise ClosedError("this FanIn is closed; create a new one")
        if self._error is not None:
            raise self._error
        cur = self._current
        if cur is not None and self.auto_release and not cur.released:
            cur.release()
        self._current = None
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._live:
            item = self._scan()
            if item is not None:
                self._current = item
                return item
            if not self._live:
                break
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise IpcTimeoutError(
                    f"no item from any of {len(self._live)} live sources within {timeout} s "
                    "(pass a larger timeout, or None to wait)"
                )
            self._wait(_TICK if deadline is None else min(_TICK, deadline - now))
        return None

    def _scan(self) -> Item | None:
        """One round-robin pass over the live sources, starting after the last one served."""
        n = len(self._live)
        for k in range(n):
            pos = (self._next + k) % n
            try:
                got, item = self._ports[self._live[pos]].poll()
            except (PeerLostError, ProtocolError) as exc:
                self._error = exc  # sticky, like a Consumer's: no silent merge without a source
                raise
            if got and item is None:  # this source ended
                del self._live[pos]
                self._next = pos % len(self._live) if self._live else 0
                return self._scan() if self._live else None
            if got:
                self._next = (pos + 1) % n
                return item
        return None

    def _wait(self, timeout: float) -> None:
        """Block until any live source's socket is readable, or ``timeout``, holding no
        source's lock while blocked."""
        poller = Poller()
        self._fill(poller)
        start = time.monotonic()
        poller.wait(timeout)
        self._waited += time.monotonic() - start
        poller.pump_lent()

    def _fill(self, poller: Poller) -> None:
        """The live sources' fds and pending input (each under its lock), and the producers
        their items were lent to."""
        aio.fill_from_ports(poller, [self._ports[i] for i in self._live], _closed_directly)

    # ------------------------------------------------------------------ asyncio internals
    async def _anext_item(self, timeout: float | None) -> Item | None:
        """The next item (None: every source ended), awaiting without blocking the loop."""
        return await aio.wait_for_attempt(self._attempt, self._fill, timeout, _TICK,
                                          lambda: self._last_attempt(timeout))

    def _attempt(self) -> tuple[bool, Item | None]:
        """One non-blocking step: ``(True, item)``, ``(True, None)`` once every source
        ended, ``(False, None)`` when no source has an item now."""
        if self._closed:
            raise ClosedError("this FanIn is closed; create a new one")
        if self._error is not None:
            raise self._error
        item = self._scan() if self._live else None
        if item is not None or not self._live:
            return True, item
        return False, None

    def _last_attempt(self, timeout: float | None) -> Item | None:
        got, item = self._attempt()
        if got:
            return item
        raise IpcTimeoutError(
            f"no item from any of {len(self._live)} live sources within {timeout} s "
            "(pass a larger timeout, or None to wait)"
        )


def _closed_directly() -> Exception:
    return ClosedError("a FanIn source was closed directly; close the FanIn instead")
