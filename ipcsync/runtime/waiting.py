"""How endpoints wait: the one poller every blocking wait sleeps in (an endpoint's own wait,
a Consumer waiting while items it forwarded are out, FanIn waiting on all its sources).
How a stream is ordered after a peer's event (``wait="gpu"`` / ``"host"``) is
``core.waits``.

The poller sleeps in ``select`` on the OS file descriptors behind ZeroMQ sockets
(``ZMQ_FD``: edge-triggered, safe to wait on from any thread) and on each channel's lane
epoll descriptor (``runtime.transport.lane.LaneMux``: readable while a lane has input). An fd may not signal
again for input that is already queued, so every socket is checked for pending input
(``ZMQ_EVENTS``) first, under its owner's lock, and the poller does not sleep then.

Lent endpoints (``Pumpable``: the forwarding Producers an item was lent to) are polled
too, since the releases the wait may depend on arrive on their sockets: their locks are
only ever tried (whoever holds one is pumping that endpoint already), held to read their
sockets, and their ``pump()`` runs after the sleep.

``Wake``: an eventfd another thread sets to end a poll (a remote edge's receive thread;
a forwarding consumer's lender).
"""

from __future__ import annotations

import logging
import os
import select
from typing import TYPE_CHECKING, Any, Callable, Generic, Iterable, TypeVar

from ..interrupts import wait_point

if TYPE_CHECKING:  # (this module loads neither torch nor zmq)
    from .handover import Pumpable

__all__ = ["EVENT_SPIN_S", "Poller", "SourcePort", "Wake"]

log = logging.getLogger(__name__)

# How long a wait on a GPU event polls it without sleeping first: such an event is usually
# complete within microseconds, and the shortest sleep lasts ~60 us (timer slack).
EVENT_SPIN_S = 50e-6


class Poller:
    """One wait on the sockets of several endpoints. Fill it (``add`` under each owner's
    lock, ``lend`` for lent endpoints), then ``wait``, then ``pump_lent``."""

    __slots__ = ("fds", "ready", "lent")

    def __init__(self) -> None:
        self.fds: list[int] = []
        self.ready = False  # input is queued somewhere already: do not sleep
        self.lent: list["Pumpable"] = []

    def add(self, fds: Iterable[int], pending: bool) -> None:
        """An endpoint's fds and whether it has input queued now (its lock held)."""
        self.fds.extend(fds)
        if pending:
            self.ready = True

    def lend(self, other: "Pumpable") -> bool:
        """Poll ``other``'s sockets and lanes too (its lock only tried); False if it is closed."""
        lock = other.lock
        if not lock.acquire(blocking=False):
            return True  # whoever holds it is pumping it
        try:
            if other.closed:
                return False
            if other.io_pending():
                self.ready = True
            self.fds.extend(other.io_fds())
        finally:
            lock.release()
        self.lent.append(other)
        return True

    @wait_point
    def wait(self, timeout: float, unlocked: Callable[[Callable[[], Any]], Any] | None = None) -> None:
        """Sleep until a socket has input or ``timeout`` passes, in ``unlocked`` (which
        runs the sleep with the caller's lock released) when given."""
        if self.ready:
            return
        fds, t = self.fds, max(0.0, timeout)
        if unlocked is None:
            select.select(fds, (), (), t)
        else:
            unlocked(lambda: select.select(fds, (), (), t))

    def pump_lent(self) -> None:
        """Handle what arrived on the lent endpoints (each lock only tried)."""
        for other in self.lent:
            lock = other.lock
            if not lock.acquire(blocking=False):
                continue
            try:
                if not other.closed:
                    other.pump()
            except Exception as exc:  # its own calls report its errors
                log.debug("ipcsync: pumping a forwarding producer: %s", exc)
            finally:
                lock.release()


ItemT = TypeVar("ItemT")


class SourcePort(Generic[ItemT]):
    """One endpoint as a reader of several sees it (FanIn over its Consumers): its lock,
    whether it is closed, its wait fds and pending input (lock held), the endpoints it
    lent items to, and ``poll()``, which takes the lock itself: ``(True, item)``,
    ``(True, None)`` at the end of the stream, or ``(False, None)`` when nothing arrived."""

    __slots__ = ("lock", "is_closed", "io_fds", "io_pending", "lent", "poll")

    def __init__(self, lock: Any, is_closed: Callable[[], bool], io_fds: Callable[[], Iterable[int]],
                 io_pending: Callable[[], bool], lent: Callable[[], Iterable["Pumpable"]],
                 poll: Callable[[], tuple[bool, ItemT | None]]) -> None:
        self.lock, self.is_closed, self.io_fds, self.io_pending = lock, is_closed, io_fds, io_pending
        self.lent, self.poll = lent, poll


class Wake:
    """An eventfd that another thread writes to wake our poll. Closed when collected, not
    at teardown: a thread that still holds a reference may be writing to it, and a closed
    fd number can be reused by anything."""

    __slots__ = ("fd",)

    def __init__(self) -> None:
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)

    def set(self) -> None:
        try:
            os.eventfd_write(self.fd, 1)
        except OSError:
            pass

    def clear(self) -> None:
        try:
            os.eventfd_read(self.fd)
        except OSError:  # not set (EAGAIN)
            pass

    def __del__(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass
