"""What Producer and Consumer share: the endpoint lock, the service thread, option checks,
timeouts.

Threading model. All protocol work happens in ``_pump`` under ``_lock``; the socket is
only ever used by the thread holding the lock (ZeroMQ sockets may move between threads
behind a full memory barrier, which the lock provides). The user's thread pumps inside
every call. While the user's thread is away (no call for ``_tick`` seconds) the service
thread pumps instead, so handshakes are answered, releases and heartbeats flow and dead
peers are noticed even when the user computes for minutes between calls. The hot path
therefore costs one uncontended lock, not a thread handoff.
"""

from __future__ import annotations

import atexit
import logging
import math
import threading
import time
import weakref
from contextlib import contextmanager
from typing import Callable, Iterator

from .errors import ClosedError, ConfigError, IpcTimeoutError

log = logging.getLogger("ipcsync")

WAIT_MODES = ("gpu", "host")
# How long a wait on a GPU event polls it without sleeping first: such an event is usually
# complete within microseconds, and the shortest sleep lasts ~60 us (timer slack).
_EVENT_SPIN_S = 50e-6


def check_timeout(name: str, value: float | None) -> float | None:
    if value is None:
        return None
    if not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
        raise ConfigError(f"{name} must be a non-negative number of seconds or None, got {value!r}")
    return float(value)


def check_positive_int(name: str, value: int, limit: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= limit:
        raise ConfigError(f"{name} must be an integer from 1 to {limit}, got {value!r}")
    return value


def check_wait(value: str) -> str:
    if value not in WAIT_MODES:
        raise ConfigError(f"wait must be one of {WAIT_MODES}, got {value!r}")
    return value


class _Endpoint:
    """Base of Producer and Consumer: lock, service thread, closed state."""

    _role = "endpoint"

    def __init__(self, endpoint: str, timeout: float | None, heartbeat: float | None) -> None:
        self._timeout = check_timeout("timeout", timeout)
        hb = check_timeout("heartbeat", heartbeat)
        if hb is not None and hb < 0.01:
            raise ConfigError(f"heartbeat must be at least 0.01 s (or None to disable), got {hb}")
        self._heartbeat = hb or 0.0
        self._tick = min(0.05, self._heartbeat / 4) if self._heartbeat else 0.05
        self._lock = threading.Lock()
        self._closed = False
        self._last_call = time.monotonic()
        self._next_tick = 0.0
        self._stop = threading.Event()
        self._service: threading.Thread | None = None
        self._endpoint_name = endpoint

    # ------------------------------------------------------------------ to implement
    def _pump(self) -> None:
        """Handle everything that has arrived, without blocking. Lock held."""
        raise NotImplementedError

    def _service_pump(self) -> None:
        """What the service thread does while the user's thread is away. Lock held."""
        self._pump()

    def _wait_io(self, timeout: float) -> None:
        """Block up to ``timeout`` for socket activity. Lock held."""
        raise NotImplementedError

    def _raise_if_broken(self) -> None:
        """Raise the pending error (peer lost, protocol error), if any. Lock held."""

    def _teardown(self) -> None:
        """Free sockets, memory and events. Lock held (or the object is being collected)."""
        raise NotImplementedError

    def close(self, timeout: float | None = None) -> None:
        raise NotImplementedError

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Unreferenced without close(): free what we hold, without saying goodbye.
        if not getattr(self, "_closed", True):
            try:
                self._closed = True
                self._teardown()
            except Exception:
                pass

    # ------------------------------------------------------------------ helpers
    def _start_service(self) -> None:
        ref = weakref.ref(self)
        self._service = threading.Thread(
            target=_service_loop, args=(ref, self._stop, self._tick),
            name=f"ipcsync-{self._role}-{self._endpoint_name}", daemon=True,
        )
        self._service.start()
        atexit.register(_close_at_exit, ref)

    def _stop_service(self) -> None:
        self._stop.set()
        t = self._service
        if t is not None and t is not threading.current_thread():
            t.join(timeout=2.0)

    @contextmanager
    def _call(self) -> Iterator[None]:
        """Enter a public call: take the lock, refuse if closed."""
        with self._lock:
            self._check_open()
            try:
                yield
            finally:
                self._last_call = time.monotonic()

    def _check_open(self) -> None:
        """Refuse a call on a closed endpoint; note that the user's thread is here. Lock held."""
        if self._closed:
            raise ClosedError(f"this {self._role} is closed; create a new one")
        self._last_call = time.monotonic()

    def _resolve_timeout(self, timeout: float | None) -> float | None:
        t = self._timeout if timeout is None else check_timeout("timeout", timeout)
        return None if t is None or math.isinf(t) else t

    def _wait_until(
        self, done: Callable[[], bool], timeout: float | None, cause: str | None = None,
        stats_wait: Callable[[str, float], None] | None = None, poll_event: bool = False,
        pumped: bool = False,
    ) -> bool:
        """Pump until ``done()`` or the timeout; True if done. Raises the endpoint's pending
        error (e.g. PeerLostError) as soon as it appears. Lock held.

        ``poll_event``: ``done()`` waits on a GPU event, whose completion makes no socket
        activity to wake on, so poll it: without sleeping for up to 50 us, then with a
        short backoff (10 us doubling to 1 ms) instead of sleeping a whole tick in the
        socket poll.

        ``pumped``: the caller has just pumped and seen ``done()`` false: start waiting.
        """
        if not pumped:
            if done():  # e.g. an item already buffered: no socket work on this call
                return True
            self._pump()
            if done():
                return True
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        backoff = 1e-5
        try:
            if poll_event:
                spin_end = time.perf_counter() + (_EVENT_SPIN_S if timeout is None else min(_EVENT_SPIN_S, timeout))
                while time.perf_counter() < spin_end:
                    if done():
                        return True
            while True:
                self._raise_if_broken()
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    return False
                step = self._tick if deadline is None else min(self._tick, deadline - now)
                if poll_event and backoff < 1e-3:
                    time.sleep(min(backoff, step))
                    backoff *= 2
                else:
                    self._wait_io(min(step, 1e-3) if poll_event else step)
                self._pump()
                if done():
                    return True
        finally:
            if stats_wait is not None and cause is not None:
                stats_wait(cause, time.monotonic() - start)

    def _timeout_error(self, what: str, timeout: float | None, hint: str) -> IpcTimeoutError:
        return IpcTimeoutError(f"{what} within {timeout} s; {hint}")

    @property
    def closed(self) -> bool:
        """True once ``close()`` has been called."""
        return self._closed


def _service_loop(ref: "weakref.ref[_Endpoint]", stop: threading.Event, tick: float) -> None:
    while not stop.wait(tick):
        ep = ref()
        if ep is None:
            return
        try:
            if time.monotonic() - ep._last_call < tick or not ep._lock.acquire(blocking=False):
                continue
            try:
                if not ep._closed:
                    ep._service_pump()
            finally:
                ep._lock.release()
        except Exception:  # never let the service thread die silently
            log.exception("ipcsync service thread error (%s)", ep._role)
        finally:
            del ep


def _close_at_exit(ref: "weakref.ref[_Endpoint]") -> None:
    ep = ref()
    if ep is not None and not ep._closed:
        try:
            ep.close(timeout=1.0)
        except Exception:
            pass
