"""How the endpoints wait under asyncio: the event loop watches the same file descriptors
the blocking waits sleep on (``waiting.Poller``: ``ZMQ_FD`` of each socket, the lender's
eventfd, the sockets of endpoints items were lent to), as ``zmq.asyncio`` does, instead of
a thread per wait.

Every async call is one loop of: a non-blocking attempt under the endpoint's lock (pump,
then take an item / reserve a slot), and, when it got nothing, an ``await`` on
``readable()`` for at most one tick. Rules:

- **The loop never blocks on a peer.** An attempt never sleeps on a socket; the await is
  a future woken by ``loop.add_reader`` or a timer.
- **Cancellation loses nothing.** The only suspension point is ``readable()``, before the
  attempt that takes anything: a cancelled call took nothing (an item stays buffered for
  the next call, a message was not sent). Once an attempt took something, the call returns
  it without awaiting again.
- **Nothing leaks.** ``readable()`` watches private duplicates of the descriptors (so
  tasks waiting on the same socket never replace each other's reader, and an endpoint
  closed meanwhile never leaves the loop watching a closed or reused descriptor number);
  however the await ends (woken, timed out, cancelled), its readers, its timer and its
  duplicates are gone.
- **Liveness and close are seen within a tick**, as in the blocking waits: the await
  wakes at least once a tick and the next attempt pumps (heartbeats, dead peers) and
  raises the endpoint's error (PeerLostError, ClosedError).

Imports neither torch nor zmq.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Iterable, TypeVar

from .waiting import Poller, SourcePort

if TYPE_CHECKING:
    from ..item import Item
    from .handover import Pumpable

__all__ = ["readable", "wait_for_attempt", "close_awaiting", "fill_from_ports", "CallerItems", "AsyncItems"]

T = TypeVar("T")


async def readable(fds: Iterable[int], timeout: float) -> None:
    """Return when any of ``fds`` is readable, or after ``timeout`` seconds, whichever is
    first. Never blocks the loop. Cancellable: the readers, the timer and the duplicated
    descriptors are removed however it ends."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not fut.done():
            fut.set_result(None)

    dups: list[int] = []
    timer = loop.call_later(max(0.0, timeout), wake)
    try:
        for fd in fds:
            d = os.dup(fd)
            dups.append(d)
            loop.add_reader(d, wake)
        await fut
    finally:
        timer.cancel()
        for d in dups:
            try:
                loop.remove_reader(d)
            finally:
                os.close(d)


async def wait_for_attempt(
    attempt: Callable[[], tuple[bool, T]],
    fill: Callable[[Poller], None],
    timeout: float | None,
    tick: float,
    expired: Callable[[], T],
    waited: Callable[[float], None] | None = None,
) -> T:
    """``attempt()`` until it returns ``(True, value)``; return ``value``.

    ``attempt`` never blocks: it pumps and takes what is there, ``(False, None)`` when
    nothing is; it raises the endpoint's errors. Between attempts, ``fill(poller)`` puts
    the descriptors to watch into a ``Poller`` (under the owners' locks, with their pending
    input: then there is no sleep) and the call awaits ``readable()`` for at most ``tick``.
    ``timeout`` (None: forever) over: returns ``expired()``, which makes one last attempt
    or raises the sync call's IpcTimeoutError. ``waited(seconds)``: told how long the call
    was suspended, if it was (the endpoint's ``stats()["waiting_s"]``)."""
    done, value = attempt()
    if done:
        return value
    start = time.monotonic()
    deadline = None if timeout is None else start + timeout
    try:
        while True:
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return expired()
            poller = Poller()
            fill(poller)
            if not poller.ready:
                await readable(poller.fds, tick if deadline is None else min(tick, deadline - now))
            else:
                await asyncio.sleep(0)  # input queued already: let the other tasks run first
            if poller.lent:
                poller.pump_lent()
            done, value = attempt()
            if done:
                return value
    finally:
        if waited is not None:
            waited(time.monotonic() - start)


async def close_awaiting(step: Callable[[bool], tuple[bool, None]], port: SourcePort[Any], timeout: float | None,
                         tick: float, close: Callable[[float | None], None]) -> None:
    """``Consumer.aclose``: ``step(False)`` until the items the consumer forwarded are
    back (up to ``timeout``; None: while their holders live), then ``step(True)`` until
    its goodbye is answered (up to 1 s), awaiting ``port``'s descriptors between
    attempts; then ``close(what is left of timeout)``, which has nothing left to wait
    for. Cancelled (or interrupted) while it waits: ``close(0.0)``, then re-raised."""
    start = time.monotonic()

    def fill(poller: Poller) -> None:
        with port.lock:
            if port.is_closed():
                return
            poller.add(port.io_fds(), port.io_pending())
            lent = port.lent()
        for other in lent:
            poller.lend(other)

    try:
        await wait_for_attempt(lambda: step(False), fill, timeout, tick, lambda: None)
        await wait_for_attempt(lambda: step(True), fill, 1.0 if timeout is None else max(0.2, min(1.0, timeout)),
                               tick, lambda: None)
    except BaseException:
        close(0.0)
        raise
    close(None if timeout is None else max(0.0, timeout - (time.monotonic() - start)))


def fill_from_ports(poller: Poller, ports: Iterable[SourcePort[Any]], closed: Callable[[], Exception]) -> None:
    """``fill`` for readers of Consumers (one, or a FanIn's): each port's fds and pending
    input under its lock, then the endpoints its items were lent to. A closed port raises
    ``closed()``."""
    lent: list[Pumpable] = []
    for port in ports:
        with port.lock:
            if port.is_closed():
                raise closed()
            poller.add(port.io_fds(), port.io_pending())
            lent.extend(port.lent())
    for other in lent:
        poller.lend(other)


class CallerItems:
    """``aget()``'s auto-release, per caller: the items ``aget`` returned to a caller are
    released when that caller calls ``aget`` again (as ``get()``'s are per thread).

    The caller is the task that *calls* ``aget()`` (the running task when the call
    expression is evaluated; the thread, outside a running loop), not the task that runs
    the coroutine: ``asyncio.wait_for(inp.aget(), T)`` (a task of its own per call on
    Python 3.11) and ``await asyncio.create_task(inp.aget())`` are keyed by the task that
    wrote them, so the usual timeout idioms give back the caller's previous item instead
    of stalling the ring with items whose task is gone. Rules:

    - **"Previous" is per caller**: many tasks on one consumer each hold what they got
      until they call again; one task never releases another task's item.
    - **The release happens at the call**, in the caller, before the coroutine exists:
      a call whose coroutine is cancelled before it starts (``wait_for(..., 0)``) still
      gave back the previous items, and took nothing.
    - **Every item of a round is kept until the next round**: ``gather(inp.aget(),
      inp.aget())`` in one task holds both results; both go back at that task's next call
      (``remember`` adds to the caller's list, ``release_previous`` takes the whole list).
    - A task that ends without calling again keeps its items until they are released
      (explicitly, or when their consumer closes), as before.
    """

    __slots__ = ("by_task", "by_thread")

    def __init__(self) -> None:
        self.by_task: "weakref.WeakKeyDictionary[asyncio.Task[Any], list[Item]]" = weakref.WeakKeyDictionary()
        self.by_thread: dict[int, list["Item"]] = {}

    @staticmethod
    def caller() -> "asyncio.Task[Any] | int":
        """Who calls: the running task, or this thread when no loop runs here."""
        try:
            task = asyncio.current_task()
        except RuntimeError:  # no running loop in this thread
            task = None
        return task if task is not None else threading.get_ident()

    def release_previous(self, caller: "asyncio.Task[Any] | int") -> None:
        """Release what ``aget`` returned to ``caller`` since its last call."""
        held = self.by_thread.pop(caller, None) if isinstance(caller, int) else self.by_task.pop(caller, None)
        for item in held or ():
            item.release()

    def remember(self, caller: "asyncio.Task[Any] | int", item: "Item | None") -> None:
        if item is None:
            return
        table: Any = self.by_thread if isinstance(caller, int) else self.by_task
        table.setdefault(caller, []).append(item)


class AsyncItems:
    """The iterator of ``async for item in consumer`` (or a FanIn): one per loop, so
    each task iterating has its own current item. ``auto_release``: the item it returned
    last is released at the next step, when the stream ends, and when the iterator is
    left for good:

    - ``aclose()`` releases it at once and ends the iterator (``contextlib.aclosing``);
    - an iterator dropped while it holds an item (``break``, an exception out of the
      loop: a caught Ctrl-C or CancelledError, a new ``asyncio.run``) hands that item
      to its consumer when it is collected (``Lender.drop``: no lock, no I/O, so a
      finalizer may run in any thread, with or without a loop), and the consumer
      releases it at its next take, whatever task, loop or thread takes (or at close).

    Without ``auto_release`` the program releases its items itself, and none of this
    applies."""

    __slots__ = ("_next_item", "_timeout", "_auto_release", "_current", "_closed")

    def __init__(self, next_item: Callable[[float | None], Awaitable["Item | None"]], timeout: float | None,
                 auto_release: bool) -> None:
        self._next_item, self._timeout, self._auto_release = next_item, timeout, auto_release
        self._current: "Item | None" = None
        self._closed = False

    def __aiter__(self) -> "AsyncItems":
        return self

    async def __anext__(self) -> "Item":
        cur, self._current = self._current, None
        if cur is not None and self._auto_release:
            cur.release()
        if self._closed:
            raise StopAsyncIteration
        item = await self._next_item(self._timeout)
        if item is None:
            raise StopAsyncIteration
        self._current = item
        return item

    async def aclose(self) -> None:
        """End this iteration: its current item is released now (``auto_release``), and
        a later step ends at once. Idempotent."""
        self._closed = True
        cur, self._current = self._current, None
        if cur is not None and self._auto_release:
            cur.release()

    def __del__(self) -> None:
        cur = self._current
        if cur is not None and self._auto_release and not cur.released:
            self._current = None
            try:
                cur.origin.drop(cur)
            except Exception:  # (interpreter shutdown: nothing is left to release to)
                pass
