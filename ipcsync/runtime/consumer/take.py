"""The general path of a consumer's take (``Taker``); the steady path is the straight line
of ``ConsumerEndpoint.next_item`` (``runtime.consumer.endpoint``), which comes here for
anything else, lock held.

- ``make_item``: the item of a READY entry, handed out only once its data may be read
  (ordering rule 2 of a receive): the consumer's stream waits on the slot's ready event
  or flag (``wait="gpu"``: enqueued at once; ``"host"``, and every remote item: polled
  with the control channel pumped, ``poll_event``). A bounded wait that runs out puts
  the entry back first in line (IpcTimeoutError); nothing is lost or released.
- ``untake``: a Ctrl-C between taking an entry and handing its item out puts the entry
  back first in line; the next call returns that item.
- ``wait_for_item``: the blocking take (``get``, iteration): waits for an item, the end
  of the stream or an error; a ring stalled by the program's own items (held, or kept
  and not movable) past the consumer's timeout is an error, never a hang.
- ``take_nowait``: the non-blocking core of every take (a buffered READY, or the end of
  the stream); ``wait_for_item`` waits, then takes through it; ``poll`` pumps, then takes
  through it.
- ``poll``: the non-blocking take that ``FanIn`` and the asyncio calls wrap
  (``waiting.SourcePort``, ``aio.wait_for_attempt``); ``last_attempt`` is their final
  try at the timeout."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, ContextManager

from ...core.stats import Stats
from ...core.waits import WaitStrategy
from ...errors import IpcTimeoutError
from ...item import Item
from .foreign import ForeignUse, Lender
from ..telemetry import EdgeTracer
from .upstream import ProducerLink
from .verify import Verifier

__all__ = ["Taker", "Entry"]

get_ident = threading.get_ident

Entry = tuple[int, int, int, int, Any, Any]  # a READY entry: (seq, slot, gen, sent_ns, meta, recipe)


class Taker:
    """One consumer's general take, built once from its parts: ``link`` (the session, the
    memory, the kept items), ``lender`` (the items out, and the label they carry),
    ``stats``, ``stream``, ``wait`` (how a ready event is waited on; a remote edge's is
    ``HOST_WAIT``), ``timeout`` (the consumer's: how long a ring stalled by the program
    may last), ``per_item`` (a storage per item: a torch that cannot count references),
    ``verify``, ``trace``; and the consumer's own calls: ``pump`` (everything that
    arrived), ``call`` (enter a public call: the lock, refused if closed) and
    ``wait_until`` (pump until done, the lock released while it sleeps).
    ``data_wakes``: a remote gloo edge's Wake is among the consumer's fds (set at the
    handshake): its data's readiness wakes the waits, so they need not poll."""

    __slots__ = ("link", "lender", "session", "memory", "name", "stream", "wait", "timeout", "per_item", "verify",
                 "trace", "waited", "taken", "pump", "call", "wait_until", "data_wakes")

    def __init__(self, link: ProducerLink, lender: Lender, stats: Stats, stream: Any, wait: WaitStrategy,
                 timeout: float | None, per_item: bool, verify: Verifier | None, trace: EdgeTracer | None,
                 pump: Callable[[], None], call: Callable[[], ContextManager[None]],
                 wait_until: Callable[..., bool]) -> None:
        self.link, self.lender, self.session, self.memory = link, lender, link.session, link.memory
        self.name = link.endpoint.name
        self.stream, self.wait, self.timeout = stream, wait, timeout
        self.per_item, self.verify, self.trace = per_item, verify, trace
        self.waited = stats.waited
        self.taken = stats.taken.append  # a handoff's (bytes, latency ns): Stats.settle
        self.pump, self.call, self.wait_until = pump, call, wait_until
        self.data_wakes = False

    def raise_if_broken(self) -> None:
        """Raise the session's error (producer lost, protocol broken), if any."""
        if (error := self.session.error) is not None:
            raise error

    # ------------------------------------------------------------------ one item
    def make_item(self, entry: Entry, timeout: float | None = None, asked: float | None = None) -> Item:
        """The item of READY ``entry``, once its data may be read (its ready event). The
        wait for that event (``wait="host"``, and every remote item: its transfer) is
        bounded by ``timeout``: past it the entry goes back, first in line, for the next
        call, and IpcTimeoutError is raised (naming ``asked``, the whole call's timeout,
        when given); nothing is lost or released. (A Ctrl-C here or before the caller
        handed the item out: the caller's ``untake``.)"""
        seq, slot, gen, sent_ns, meta, recipe = entry
        # Built from the slot's own storage (a forwarded item: its region's), whose use
        # count tells at release whether the program still views it (the reference rule).
        # A store whose storage was moved (``share_memory_()`` on an earlier item's tensor,
        # a kept item moved out of the ring) views its region no more: a fresh one.
        if type(recipe) is ForeignUse:
            store = recipe.store if not recipe.store.moved() else recipe.renew()
        else:
            store = self.memory.stores[slot]
            if store.moved():
                store = self.memory.renew(slot)
            self.memory.seqs[slot] = seq  # (what a write fault in the slot names)
        if self.per_item:
            store = store.for_item()
        lender = self.lender
        item = Item(lender, lender.source, seq, slot, gen, meta, recipe.build_in(store), recipe.nbytes, store,
                    recipe.extent)
        if self.per_item:
            store.seal()
        # Held before any wait below: a host-mode wait pumps, and a pump that saw the
        # producer's BYE with nothing held would say BYE under this item.
        lender.hold(seq, item)
        ev = self.memory.ready_events[slot]
        ev.value = gen  # (a flag's event waits for the item's generation; events ignore it)
        # Complete already (the producer re-records it only after we release the slot):
        # nothing to wait for. Tested here, not in the strategy: a call less per item.
        if not ev.query():
            try:
                self.wait.order(ev, self.stream, lambda done: self.poll_event(done, timeout, asked))
            except IpcTimeoutError:
                lender.unhold(seq, None)
                self.session.requeue(entry)
                raise
        if self.verify is not None:
            self.verify.received(item, recipe.extent, self.stream)
        now = time.monotonic_ns()
        self.taken((recipe.nbytes, now - sent_ns))
        if self.trace is not None:
            self.trace.received(seq, now)
        return item

    def untake(self, entry: Entry) -> None:
        """A KeyboardInterrupt (Ctrl-C) landed between taking READY ``entry`` and handing
        its item out: nobody holds that item, so the entry goes back first in line for the
        next call, as a timed-out wait's does, and nothing keeps its slot."""
        lender, tid = self.lender, get_ident()
        item = lender.unhold(entry[0], None)
        if item is not None and lender.current.get(tid) is item:
            lender.pop_current(tid, None)
        self.session.requeue(entry)

    def poll_event(self, done: Any, timeout: float | None = None, asked: float | None = None) -> None:
        """``wait="host"``: the ready event is polled with the socket pumped."""
        s = self.session
        # (Without a Wake nothing wakes the socket wait when the data is ready: poll.)
        if not self.wait_until(lambda: s.error is not None or done(), timeout, "event", self.waited,
                               poll_event=not self.data_wakes):
            self.raise_if_broken()
            raise IpcTimeoutError(
                f"an item from the producer on {self.name!r} arrived but its data was not ready "
                f"within {timeout if asked is None else asked} s (a remote transfer still running, or the "
                "producer's stream behind); "
                "it stays first in line for the next call")
        self.raise_if_broken()  # complete now: nothing to enqueue

    # ------------------------------------------------------------------ takes
    def wait_for_item(self, timeout: float | None, pumped: bool = False) -> Item | None:
        """``next_item`` with nothing buffered, or an error or BYE: wait up to ``timeout``
        for an item (``pumped``: the caller has just pumped and found none); None at the
        end of the stream. The thread's previous item was released by the caller."""
        s = self.session
        deadline = None if timeout is None else time.monotonic() + timeout
        if not s.ready and not s.bye_received and s.error is None:
            # A ring stalled by this program's own items (held, or kept and not movable)
            # can bring nothing: past the consumer's timeout that is an error, never a hang.
            link, limit = self.link, self.timeout
            link.kept.stuck_since = None  # (measured within this call)
            self.wait_until(lambda: bool(s.ready) or s.bye_received or s.error is not None or link.stuck(limit),
                            timeout, "producer", self.waited, pumped=pumped)
            if not s.ready and not s.bye_received and link.kept.stuck(limit):
                self.raise_if_broken()
                raise self.stuck_error()
        self.raise_if_broken()
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        got, item = self.take_nowait(left, timeout, current=True)
        if got:
            return item
        raise IpcTimeoutError(
            f"no item from the producer on {self.name!r} within {timeout} s; "
            f"it is alive but sent nothing (pass a larger timeout, or None to wait){self.link.stall_text()}")

    def stuck_error(self) -> IpcTimeoutError:
        """The ring has been full of this program's own items for the consumer's timeout
        (``Kept.stuck``): no item can come."""
        return IpcTimeoutError(
            f"no item can come from the producer on {self.name!r}: for {self.timeout} s (this "
            f"consumer's timeout) the ring has been full of items this program holds or keeps"
            f"{self.link.stall_text()}")

    def poll(self) -> tuple[bool, Item | None]:
        """``port.poll``: see SourcePort."""
        with self.call():
            self.pump()
            self.raise_if_broken()
            s = self.session
            if not s.ready and not s.bye_received and self.link.stuck(self.timeout):
                raise self.stuck_error()  # (FanIn, asyncio: as next_item)
            # A gloo remote item whose transfer is still running is not waited for here:
            # the reader (FanIn) serves its other sources meanwhile, and our Wake (among
            # the fds it waits on) or the SENT frame wakes it when this one is ready.
            try:
                return self.take_nowait(0.0 if self.data_wakes else None)
            except IpcTimeoutError:
                return False, None  # (the entry is first in line again)

    def take_nowait(self, timeout: float | None, asked: float | None = None,
                    current: bool = False) -> tuple[bool, Item | None]:
        """The non-blocking core of every take, lock held, pumped already: ``(True, item)``
        for the first buffered READY (its data waited for up to ``timeout``, ``make_item``;
        ``current``: it becomes the calling thread's current item, as ``get`` and iteration
        hand out), ``(True, None)`` at the end of the stream, ``(False, None)`` when nothing
        is buffered. A Ctrl-C before the item is handed out puts its entry back."""
        s = self.session
        if s.ready:
            entry = s.take_ready()
            try:
                item = self.make_item(entry, timeout, asked)
                if current:
                    self.lender.set_current(get_ident(), item)
            except KeyboardInterrupt:
                self.untake(entry)
                raise
            return True, item
        if s.bye_received:
            self.pump()  # answers BYE once nothing is held
            return True, None
        return False, None

    def last_attempt(self, timeout: float | None) -> Item | None:
        """The asyncio wait's last try at its ``timeout``: an item, None (the end), or
        IpcTimeoutError."""
        got, item = self.poll()
        if got:
            return item
        raise IpcTimeoutError(
            f"no item from the producer on {self.name!r} within {timeout} s; "
            f"it is alive but sent nothing (pass a larger timeout, or None to wait){self.link.stall_text()}")
