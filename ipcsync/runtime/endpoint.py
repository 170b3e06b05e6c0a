"""What the runtime endpoints of Producer and Consumer (``runtime.producer.port.ProducerPort``,
``runtime.consumer.endpoint.ConsumerEndpoint``; the public classes are facades over them)
share: the endpoint lock, the service thread, option checks, timeouts, and the endpoints'
life across exit and fork.

Threading model. All protocol work happens in ``_pump`` under ``_lock``; the sockets are
only ever used by the thread holding the lock (ZeroMQ sockets may move between threads
behind a full memory barrier, which the lock provides). The user's thread pumps inside
every call. While the user's thread is away (no call for ``_tick`` seconds) the service
thread pumps instead, so handshakes are answered, releases and heartbeats flow and dead
peers are noticed even when the user computes for minutes between calls. The hot path
therefore costs one uncontended lock, not a thread handoff.

Blocking never holds the lock: a call that must wait pumps under the lock, then releases
it and sleeps in ``select`` on the OS file descriptors behind its sockets (ZeroMQ's
``ZMQ_FD``, safe to wait on from any thread), at most one tick at a time. So ``stats()``
and ``close()`` from another thread answer at once, and ``close()`` from another thread
makes a blocked call raise ClosedError within a tick (close waits until every such call
has left before it frees anything).

Thread rules, for every public method: any method may be called from any thread. Calls
are serialized by the lock; waits are not. Iterating one Consumer from several threads
is safe: each thread's ``next()`` releases only that thread's previous item.

Exit and fork. One ``atexit`` hook closes every endpoint still open (bounded). A process
forked while endpoints exist gets none of them: in the child they are marked as
belonging to the parent, every call raises ClosedError, and nothing is closed, unlinked
or said on the parent's behalf (``os.register_at_fork``). A producer whose program is
dying of an unhandled exception aborts at exit instead of closing.

Close. ``close()`` marks itself started, and every call blocked in another thread raises
ClosedError at its next wake-up; nothing is freed before they left. A second ``close()``
while one runs in another thread waits for it instead of starting over; ``abort()`` takes
over a running close. A ``close()`` interrupted in its waits (Ctrl-C, SystemExit) still
ends closed, then re-raises (a producer's as ``abort`` does). A send, ``slot()`` entry or
forward that starts while a close is under way raises ClosedError ("is closing").
``reacquire`` takes the lock back after a wait however the wait ended (KeyboardInterrupt
included), exactly once.

Hot binding. ``bind_hot`` binds a facade's hot method, for one instance, to the runtime
endpoint's method of the same signature (a ``functools.partial``, called in C, carrying
the method's docstring): the facade adds no Python frame to the steady path.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import select
import sys
import threading
import time
import weakref
from contextlib import contextmanager
from functools import partial
from types import TracebackType
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from .. import interrupts
from ..core.ratelog import RateLog
from ..errors import ClosedError, ConfigError, IpcTimeoutError
from ..interrupts import wait_point
from ..logs import apply_env_level
from .waiting import EVENT_SPIN_S, Poller

if TYPE_CHECKING:
    from .handover import Pumpable

log = logging.getLogger(__name__)



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


def bind_hot(facade: Any, name: str, bound: Callable[..., Any]) -> None:
    """Bind ``facade.<name>`` (a public method of the facade's class) to ``bound``, the
    runtime endpoint's method of the same signature, for this instance: a call then runs
    no Python frame of the facade's (the hot path's call budget,
    tests/unit/test_call_counts.py). The binding carries the class method's docstring, so
    ``help()`` and ``inspect.signature`` of the instance's method say what the class's
    do; ``functools.partial`` is called in C."""
    hot = partial(bound)
    hot.__doc__ = getattr(type(facade), name).__doc__
    facade.__dict__[name] = hot


# Every endpoint open in this process, for the one atexit hook and for fork.
_open_endpoints: "weakref.WeakSet[EndpointBase]" = weakref.WeakSet()


class _Reacquire:
    """``with _Reacquire(lock):`` takes ``lock`` and leaves it taken. Its ``__enter__`` is
    the lock's own ``acquire`` (a C call: the property hands it over uncalled), which the
    with statement calls with no signal handler run between its return and the block's
    first line; so the block runs exactly when the lock was taken."""

    __slots__ = ("_acquire",)

    def __init__(self, lock: threading.Lock) -> None:
        self._acquire = lock.acquire

    @property
    def __enter__(self) -> Callable[[], bool]:
        return self._acquire

    def __exit__(self, *exc: object) -> None:
        return None


def reacquire(lock: threading.Lock) -> BaseException | None:
    """Take ``lock`` back after a wait, whatever signals do meanwhile: a handler's exception
    raised while the lock is awaited (it was not taken) makes it wait again; one raised
    after it was taken (a signal handled at the call's return) leaves it taken. Returns
    with the lock held, and the first such exception (KeyboardInterrupt, say) for the
    caller to raise, else None.

    A plain ``lock.acquire()`` retried on an exception cannot tell these apart: a Ctrl-C
    handled as the acquire returns leaves the lock held, and the retry then waits for ever
    on a lock its own thread holds (the endpoint wedged, no heartbeat, no error to its
    peers). Here the held flag is set inside a with block that only a taken lock enters:
    CPython runs no signal handler between a with statement's ``__enter__`` and its block
    (3.10-3.13; 3.14 with CPython gh-148874's fix)."""
    interrupted: BaseException | None = None
    held = False
    while not held:
        try:
            with _Reacquire(lock):
                held = True
        except BaseException as exc:  # a signal handler raised, before or after the lock was taken
            interrupted = interrupted or exc
    return interrupted


class EndpointBase:
    """Base of the runtime endpoints: lock, service thread, closed state."""

    _role = "endpoint"

    def __init__(self, endpoint: str, timeout: float | None, heartbeat: float | None) -> None:
        apply_env_level()  # $IPCSYNC_LOG_LEVEL, once per process, unless logging is configured
        self._timeout = check_timeout("timeout", timeout)
        hb = check_timeout("heartbeat", heartbeat)
        if hb is not None and hb < 0.01:
            raise ConfigError(f"heartbeat must be at least 0.01 s (or None to disable), got {hb}")
        self._heartbeat = hb or 0.0
        self._tick = min(0.05, self._heartbeat / 4) if self._heartbeat else 0.05
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._closed = False
        self._last_call = time.monotonic()
        self._next_tick = 0.0
        self._stop = threading.Event()
        self._service: threading.Thread | None = None
        self._endpoint_name = endpoint
        self._owner_pid = os.getpid()  # a forked child is not the owner (see _forget_in_child)
        self.blocked_calls = 0  # calls blocked in _unlocked() right now (lock released)
        self._closer: int | None = None  # thread ident running close(), once it started
        self._ratelog = RateLog(log)  # warnings a peer can trigger
        # The fds the last wait's select found readable (``_block``), for the next
        # ``_pump`` to read only what signalled; None: unknown (pump everything).
        self._woken: list[int] | None = None

    # ------------------------------------------------------------------ to implement
    # Handle everything that has arrived, without blocking. Lock held. A method, or an
    # attribute holding the runtime's own pump (no Python frame of the facade's).
    _pump: Callable[[], None]

    def _service_pump(self) -> None:
        """What the service thread does while the user's thread is away. Lock held."""
        self._pump()

    def _io_fds(self) -> Sequence[int]:
        """OS file descriptors that become readable on socket activity (``ZMQ_FD`` of
        each ZeroMQ socket, edge-triggered). Lock held."""
        raise NotImplementedError

    def _io_pending(self) -> bool:
        """True if a socket has something to read now (``ZMQ_EVENTS``): then its fd may
        not signal again until it is read, so do not block. Lock held."""
        raise NotImplementedError

    def _lent(self) -> Sequence["Pumpable"]:
        """Other endpoints whose sockets a wait polls and pumps too (see
        ``waiting.Poller.lend``): the forwarding Producers holding items we lent. Lock held."""
        return ()

    def _raise_if_broken(self) -> None:
        """Raise the pending error (peer lost, protocol error), if any. Lock held."""

    def _teardown(self) -> None:
        """Free sockets, memory and events. Lock held (or the object is being collected)."""
        raise NotImplementedError

    def close(self, timeout: float | None = None) -> None:
        raise NotImplementedError

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __del__(self) -> None:
        # Unreferenced without close(): free what we hold, without saying goodbye. Never
        # in a forked child: what it inherited is the parent's.
        if not getattr(self, "_closed", True) and getattr(self, "_owner_pid", None) == os.getpid():
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
        _open_endpoints.add(self)
        interrupts.protect()  # (a Ctrl-C in the main thread lands where our state is whole)

    @wait_point
    def _stop_service(self) -> None:
        self._stop.set()
        _open_endpoints.discard(self)
        if not _open_endpoints:
            interrupts.unprotect()
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
            if self._owner_pid != os.getpid():
                raise ClosedError(
                    f"this {self._role} belongs to process {self._owner_pid}; a forked child "
                    "cannot use its parent's endpoints: create new ones in the child"
                )
            raise ClosedError(f"this {self._role} is closed; create a new one")
        self._last_call = time.monotonic()

    def _check_not_closing(self) -> None:
        """Inside a wait: another thread's close() ends it with ClosedError. Lock held."""
        closer = self._closer
        if closer is not None and closer != threading.get_ident():
            raise ClosedError(f"this {self._role} was closed by another thread while this call waited")

    @wait_point
    def _begin_close(self, timeout: float = 2.0) -> bool:
        """close(): mark it started, then wait (up to ``timeout``) until every call blocked
        in another thread has left; they raise ClosedError. False: the endpoint was closed
        meanwhile (by the close() whose wait this one ended): nothing is left to do. Lock held."""
        self._closer = threading.get_ident()
        if self.blocked_calls:
            self._cond.wait_for(lambda: self.blocked_calls == 0, timeout)
        return not self._closed

    @wait_point
    def _closing_elsewhere(self, timeout: float | None) -> bool:
        """close(): another thread's close() is under way. Wait until it ends (up to
        ``timeout``; it is bounded by its own) instead of starting a second one, whose
        start would end the first one's wait and whose teardown would run twice. True
        if one was under way. Lock held."""
        closer = self._closer
        if closer is None or closer == threading.get_ident() or self._closed:
            return False
        self._cond.wait_for(lambda: self._closed or self._closer is None, timeout)
        return True

    def _mark_closed(self) -> None:
        """The endpoint is closed: calls see it, and a close() waiting for this one
        (``_closing_elsewhere``) returns. Lock held."""
        self._closed = True
        self._cond.notify_all()

    def _unlocked(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` (a blocking wait) with the lock released; take it back however ``fn``
        ends (a KeyboardInterrupt included) before returning or raising. Lock held."""
        self.blocked_calls += 1
        self._last_call = time.monotonic()
        self._lock.release()
        try:
            return fn()
        finally:
            interrupted = reacquire(self._lock)
            self.blocked_calls -= 1
            self._last_call = time.monotonic()
            if self._closer is not None:
                self._cond.notify_all()
            if interrupted is not None:
                raise interrupted

    @wait_point
    def _block(self, timeout: float) -> None:
        """Wait up to ``timeout`` for socket activity, without the lock. Lock held."""
        if self._io_pending():
            return
        lent = self._lent()
        if not lent:  # the common case: only our own sockets, no Poller to build
            fds, t = self._io_fds(), max(0.0, timeout)
            # (_io_pending found nothing queued, so a ZeroMQ fd not readable now has
            # nothing new behind it: see ``_woken``.)
            self._woken = self._unlocked(lambda: select.select(fds, (), (), t))[0]
            return
        poller = Poller()
        poller.add(self._io_fds(), False)
        for other in lent:
            poller.lend(other)
        poller.wait(timeout, self._unlocked)
        if poller.lent:
            poller.pump_lent()

    def _resolve_timeout(self, timeout: float | None) -> float | None:
        t = self._timeout if timeout is None else check_timeout("timeout", timeout)
        return None if t is None or math.isinf(t) else t

    @wait_point
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
        self._woken = None  # (what an earlier wait's select found says nothing now)
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
                spin_end = time.perf_counter() + (EVENT_SPIN_S if timeout is None else min(EVENT_SPIN_S, timeout))
                while time.perf_counter() < spin_end:
                    if done():
                        return True
            while True:
                self._raise_if_broken()
                self._check_not_closing()
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    return False
                step = self._tick if deadline is None else min(self._tick, deadline - now)
                if poll_event and backoff < 1e-3:
                    pause = min(backoff, step)
                    self._unlocked(lambda: time.sleep(pause))
                    backoff *= 2
                else:
                    self._block(min(step, 1e-3) if poll_event else step)
                self._check_not_closing()
                if self._closed:
                    raise ClosedError(f"this {self._role} was closed while this call waited")
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


def _service_loop(ref: "weakref.ref[EndpointBase]", stop: threading.Event, tick: float) -> None:
    while not stop.wait(tick):
        ep = ref()
        if ep is None:
            return
        try:
            # A call blocked in another thread pumps for itself (at least once a tick).
            if (ep.blocked_calls or time.monotonic() - ep._last_call < tick
                    or not ep._lock.acquire(blocking=False)):
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


@atexit.register
def _close_all_at_exit() -> None:
    """Close every endpoint this process still has open, each bounded to a second. If the
    program is ending by an unhandled exception (the interpreter printed it and kept it
    in ``sys.last_value``), a producer aborts with it instead: its consumers must not
    see a clean end of a stream whose program failed."""
    failed = getattr(sys, "last_value", None)
    for ep in list(_open_endpoints):
        if not ep._closed and ep._owner_pid == os.getpid():
            try:
                abort = getattr(ep, "abort", None)
                if failed is not None and abort is not None:
                    abort(failed)
                else:
                    ep.close(timeout=1.0)
            except BaseException:
                pass
    remote = sys.modules.get("ipcsync.runtime.remote.io")  # (loaded only where remote edges were)
    if remote is not None:
        remote.settle_at_exit()


def _forget_in_child() -> None:
    """After fork, in the child: the inherited endpoints are the parent's. Mark them closed
    without touching anything (their sockets, memory and peers stay the parent's), so no
    call, no collection and no exit hook of the child acts on them."""
    for ep in list(_open_endpoints):
        ep._closed = True
        ep._service = None
        try:
            # The parent's lock may have been held by one of its threads at the fork.
            ep._lock = threading.Lock()
            ep._cond = threading.Condition(ep._lock)
        except Exception:
            pass
    _open_endpoints.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


class Unset:
    """The type of a keyword argument's "not given" default (where None means forever)."""

    def __repr__(self) -> str:
        return "<default>"


UNSET = Unset()
