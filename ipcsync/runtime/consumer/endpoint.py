"""The Consumer's runtime endpoint (``ConsumerEndpoint``): it owns the consumer's state
(the lock, the closed flag, the session, the link, the lender) and does what
``ipcsync.Consumer`` (a facade) asks of it. Its parts, each built once: the session
(``core.consumer_session``: the protocol rules), the link to the producer
(``runtime.consumer.upstream``; its handshake ``runtime.consumer.upstream_setup``, its loss and teardown
``runtime.consumer.upstream_loss``), the ``Lender`` (``runtime.consumer.foreign``: where each item is, with
the program or lent to a forwarding Producer), the general take (``runtime.consumer.take``:
the ready wait, FanIn's and asyncio's non-blocking take), the release
(``runtime.consumer.release``).

Ordering rules of a handoff (receive):

1. READY for (seq, slot, gen) arrives after the producer recorded the slot's ready event;
2. before the item's tensors are used, the consumer's stream waits on that event
   (``wait="gpu"``: enqueued at once; ``"host"``: the host polls ``query()`` first, so a
   producer that dies mid-record can never wedge the consumer's stream;
   ``Taker.make_item``);
3. ``release()`` records the slot's release event on the consumer's stream, then queues
   RELEASE(seq, slot, gen); queued releases go out in one message at the next call once
   ``release_batch`` gathered, when the consumer has no more buffered items (before it
   waits), at once while another thread waits in a call, or from the service thread
   while the user computes (``Releaser.release``, ``ProducerLink.flush_releases``);
4. after the producer's BYE and the last buffered item, iteration ends; the consumer
   answers BYE once it holds nothing.

After the producer is declared lost, no wait is ever enqueued on its events. Memory shared
by descriptor keeps these rules with flags in place of events (``backends.flags``: the
slot's ready flag reaches the item's generation; the release writes the release flag).

The steady path (an item buffered or on the lane now, its layout known, no error or BYE)
is straight-line code in ``next_item``: release the thread's previous item, send the queued
releases once a batch gathered, take the next entry (else read the lane once,
``ProducerLink.pump_lane``), build the item from its slot's store, count it.
``release()`` is the reference check (one C call), the release event, a queued RELEASE.
Anything else (a wait, an error or BYE, a host-mode wait that must poll, a remote or
forwarded item, ``verify``, a trace, a torch without use counts) takes the general path
(``Taker``).
A Ctrl-C between taking an item's READY and handing the item out puts the entry back
first in line: the next call returns that item.
"""

from __future__ import annotations

import faulthandler
import logging
import math
import os
import threading
import time
import weakref
from functools import partial
from typing import Any, Callable, Coroutine

import torch

from ... import interrupts
from ... import limits as L
from ...backends import backend_for, refs, resolve_device
from ...core import protocol as P
from ...core.consumer_session import ConsumerSession
from ...core.layout import Recipe
from ...core.stats import ConsumerStats, Stats
from ...core.waits import HOST_WAIT, wait_strategy
from ...errors import ClosedError, IpcSyncError
from ...item import Item
from .. import aio
from ..transport.address import resolve_endpoint
from ..transport.consumer_channel import ConsumerChannel
from .release import Releaser
from .take import Taker
from ..transport.curve import CurveKeys, check_transport
from ..endpoint import EndpointBase, Unset, check_positive_int, check_timeout
from .foreign import Lender
from ..telemetry import tracer_for
from .upstream import ProducerLink
from .upstream_loss import remove_stale_files
from .upstream_loss import teardown as teardown_link
from .upstream_loss import tick as tick_link
from .upstream_setup import handshake
from .verify import Verifier
from ..waiting import SourcePort

__all__ = ["ConsumerEndpoint", "aclose", "close_step", "let_go"]

log = logging.getLogger(__name__)
get_ident = threading.get_ident


class ConsumerEndpoint(EndpointBase):
    """See the module docstring; the arguments are ``ipcsync.Consumer``'s, checked here."""

    _role = "consumer"

    def __init__(
        self, endpoint: str, *, device: str | torch.device | None, wait: str, timeout: float | None,
        connect_timeout: float | None | Unset, idle_timeout: float | None, heartbeat: float | None,
        credits: int | None, auto_release: bool, stream: Any, curve: CurveKeys | None, insecure: bool,
        limits: P.Limits, keep_refs_check: bool, verify: bool,
    ) -> None:
        super().__init__(endpoint, timeout, heartbeat)
        wait_for = wait_strategy(wait)  # how an item's ready event is waited on
        self.idle_timeout = check_timeout("idle_timeout", idle_timeout)
        if isinstance(connect_timeout, Unset):
            connect_timeout = L.DEFAULT_CONNECT_TIMEOUT if timeout is None else timeout
        connect = check_timeout("connect_timeout", connect_timeout)
        credits = check_positive_int("credits", credits, 1 << 20) if credits is not None else 1 << 20
        self.auto_release = bool(auto_release)
        check_refs = bool(keep_refs_check)
        # A torch that cannot count references: a storage per item (backends.refs).
        per_item = check_refs and not refs.checks_references()
        self._verify = Verifier(endpoint) if verify else None
        self.device = resolve_device(device)
        self.endpoint = resolve_endpoint(endpoint)
        check_transport(self.endpoint, curve, insecure, "consumer")
        self._stream = stream
        self._backend = backend_for(self.device)
        if self.device.type == "cpu" and not faulthandler.is_enabled():
            # Received items are mapped read-only (backends.cpu): an in-place op on one
            # is a SIGSEGV, and this shows the line that did it.
            try:
                faulthandler.enable()
            except (RuntimeError, ValueError, OSError):  # no usable stderr (a daemon)
                pass
        self._stats = Stats()
        trace = tracer_for(self.endpoint.name)  # None unless ipcsync-run --trace
        self.session = s = ConsumerSession(self.endpoint.name, self._backend.name, self._heartbeat, limits,
                                           time.monotonic())
        # Per task calling aget, its items (auto-released at that task's next aget).
        self._caller_items = aio.CallerItems()
        self._chan = ConsumerChannel(self.endpoint, b"c" + os.urandom(15), limits.max_frame, curve)
        self._link = link = ProducerLink(self.endpoint, self._chan, s, self._backend, stream, self._ratelog)
        link.credits, link.check_refs = credits, check_refs
        # Weakly: items never keep the consumer alive (unreferenced, it is torn down at once).
        # The lender owns where each item is (held, each thread's current, lent) and the
        # label items carry (``source``: the endpoint as given; FanIn relabels it).
        ref = weakref.ref(self)
        self._lender = lender = link.lender = Lender(self._lock, self.device, stream, partial(_release, ref), link,
                                                     partial(_is_closed, ref), endpoint)
        self._memory = link.memory  # (the link's part, which it fills at SETUP: the per-item paths read it)
        self._taken = self._stats.taken.append  # a handoff's (bytes, latency ns): Stats.settle
        self._releaser = Releaser(link, lender, self._backend, stream, check_refs, trace)
        self._release_locked: Callable[[Item, Any], None] = (
            self._release_verified if verify else self._releaser.release)
        self._takes = takes = Taker(link, lender, self._stats, stream, wait_for, self._timeout, per_item,
                                    self._verify, trace, self._pump, self._call, self._wait_until)
        # The steady path's branch to the general item (a bound method, as a method of ours
        # would be: no call or attribute more per item).
        self._make_item = takes.make_item
        # The steady path builds an item straight from its READY entry: a local edge (not
        # remote), no per-item storage, no verify, no trace (each of those: make_item).
        self._flat = False
        self._lane_woken = [-1]  # (set once the handshake is done)
        self._awaiting = 0  # asyncio calls (aget, async for) waiting for an item now
        try:
            self._fds = self._chan.fds()
            with self._lock:
                handshake(link, credits, self._heartbeat, self._wait_until, connect)
                if link.remote is not None:
                    # A producer on another host: its items' recvs are polled with the control
                    # channel pumped, so its death ends a wait at once (runtime.remote.io); a gloo
                    # edge's completion thread wakes that wait (its Wake among our fds).
                    takes.wait = HOST_WAIT
                    if link.remote.wake is not None:
                        self._fds = [*self._fds, link.remote.wake.fd]
                        takes.data_wakes = True
        except BaseException:
            self._closed = True
            self._teardown()
            raise
        self._flat = (link.remote is None and not per_item and self._verify is None and trace is None)
        mux = self._chan.mux  # what a wait that woke on the lane alone found readable
        self._lane_woken = [mux.fd] if mux is not None and not takes.data_wakes else [-1]
        self._start_service()

    # ------------------------------------------------------------------ what the Consumer asks
    def get(self, timeout: float | None) -> Item | None:
        """``Consumer.get``: ``next_item`` with ``timeout`` resolved (None: the consumer's)."""
        return self.next_item(self._resolve_timeout(timeout))

    def iteration_timeout(self) -> float | None:
        """Iteration's own timeout (``idle_timeout``; None: as long as the producer lives)."""
        t = self.idle_timeout
        return None if t is None or math.isinf(t) else t

    def next_item(self, timeout: float | None) -> Item | None:
        """``get`` and iteration: the next item, or None at the end of the stream.

        The steady path, straight-line: release this thread's previous item
        (``auto_release``); send the queued releases once a batch gathered; take the next
        buffered READY entry, or pump once (the lane's frames, ``ProducerLink.pump_lane``;
        everything at a tick) and take it then; build the item from its slot's storage
        (``Recipe.build_in``: views made once per slot and layout); its ready event needs
        nothing (complete on record) or is complete already. Anything else (nothing
        arrived: wait; an error, BYE, a host-mode or remote wait, a forwarded item,
        verify, trace, a per-item storage) takes the general path (``Taker``:
        ``wait_for_item``, ``make_item``)."""
        with self._lock:
            if self._closed:
                self._check_open()
            try:
                lender = self._lender
                cur = lender.pop_current(get_ident(), None)
                if cur is not None and self.auto_release and not cur.released:
                    self._release_locked(cur, None)
                s = self.session
                if len(s.pending) >= s.release_batch:
                    self._link.flush_releases()
                try:
                    entry = s.take_ready()
                except IndexError:
                    if s.error is not None or s.bye_received:
                        return self._takes.wait_for_item(timeout)
                    if time.monotonic() < self._next_tick:
                        self._link.pump_lane()
                    else:
                        self._pump()
                    try:
                        entry = s.take_ready()
                    except IndexError:
                        return self._takes.wait_for_item(timeout, pumped=True)
                seq, slot, gen, sent_ns, meta, recipe = entry
                try:
                    mem = self._memory
                    if mem.shared:  # (a flag's event waits for the item's generation)
                        mem.ready_events[slot].value = gen
                    if (self._flat and recipe.__class__ is Recipe
                            and (mem.complete_on_record or mem.ready_done[slot]())):
                        store = mem.stores[slot]
                        if store.ptr() != store.addr:  # its storage was moved: not the slot's any more
                            store = mem.renew(slot)
                        mem.seqs[slot] = seq  # (what a write fault in the slot names)
                        item = Item(lender, lender.source, seq, slot, gen, meta, recipe.build_in(store),
                                    recipe.nbytes, store, recipe.extent)
                        lender.hold(seq, item)
                        self._taken((recipe.nbytes, time.monotonic_ns() - sent_ns))
                    else:
                        item = self._make_item(entry, timeout)
                    lender.set_current(get_ident(), item)
                except KeyboardInterrupt:
                    self._takes.untake(entry)
                    raise
                return item
            finally:
                self._last_call = time.monotonic()

    # ------------------------------------------------------------------ asyncio
    def aget(self, timeout: float | None) -> Coroutine[Any, Any, Item | None]:
        """``Consumer.aget``: the calling task's previous items released now
        (``auto_release``), the wait in the coroutine."""
        caller = self._caller_items.caller()
        if self.auto_release:
            self._caller_items.release_previous(caller)
        return self._aget(caller, timeout)

    async def _aget(self, caller: Any, timeout: float | None) -> Item | None:
        item = await self._anext_item(self._resolve_timeout(timeout))
        self._caller_items.remember(caller, item)
        return item

    def aiter(self) -> aio.AsyncItems:
        """``async for item in consumer``'s iterator (``Consumer.__aiter__``)."""
        return aio.AsyncItems(self._anext_item, self.iteration_timeout(), self.auto_release)

    async def _anext_item(self, timeout: float | None) -> Item | None:
        """The next item (None: the stream ended), awaiting without blocking the loop."""
        port = self.source_port()
        self._awaiting += 1  # (a release meanwhile goes out at once: see _release)
        try:
            return await aio.wait_for_attempt(
                self._takes.poll, lambda poller: aio.fill_from_ports(poller, (port,), self._closed_error), timeout,
                self._tick, lambda: self._takes.last_attempt(timeout), partial(self._stats.waited, "producer"))
        finally:
            self._awaiting -= 1

    def _closed_error(self) -> Exception:
        return ClosedError(f"this {self._role} was closed while this call waited")

    def stats(self) -> ConsumerStats:
        """``Consumer.stats``."""
        with self._lock:
            clock = self.session.clock
            return ConsumerStats(
                **self._stats.totals(), role="consumer", held=self._lender.held_count(), buffered=self.session.buffered(),
                kept=len(self._link.kept), kept_moved=self._link.kept.moved,
                kept_moved_bytes=self._link.kept.moved_bytes, forwarded_out=len(self._lender.forwarded),
                forwarded_lost=self._link.downstream.lost, producer_stalled=clock.stalled,
                producer_stalled_total=clock.stalls, lane=self._chan.lane_used,
            )

    def source_port(self) -> SourcePort[Item]:
        """What FanIn uses of this consumer (``Consumer.port``)."""
        return SourcePort(self._lock, partial(_is_closed, weakref.ref(self)), self._io_fds, self._io_pending,
                          self._lender.lent, self._takes.poll)

    @property
    def setup(self) -> P.Setup | None:
        """The producer's SETUP (None before the handshake)."""
        return self.session.setup

    @property
    def wait_mode(self) -> str:
        """How items' ready events are waited on: ``"gpu"`` or ``"host"`` (always ``"host"``
        from a producer on another host: its items' transfers are polled)."""
        return self._takes.wait.name

    @property
    def source(self) -> str:
        """What ``Item.source`` says: the endpoint as given, or a FanIn's label (the
        lender's, where items are made)."""
        return self._lender.source

    @source.setter
    def source(self, value: str) -> None:
        self._lender.source = value

    def close(self, timeout: float | None = None, forwarded_wait: bool = True, bye_waited: bool = False) -> None:
        """``Consumer.close`` (``forwarded_wait``: wait up to ``timeout`` for items this consumer
        forwarded zero-copy, else give them back at once; ``bye_waited``: ``aclose`` waited for
        the BYE's ack). A close() already under way in another thread is waited for (up to
        ``timeout``); interrupted (Ctrl-C) inside its waits, it still closes, then re-raises."""
        interrupted: BaseException | None = None
        with self._lock:
            if self._closed or self._closing_elsewhere(self._resolve_timeout(timeout)):
                return
            if not self._begin_close(timeout=1.0):
                return
            s, link, lender = self.session, self._link, self._lender
            try:
                let_go(self)
                if lender.forwarded:
                    t = self._resolve_timeout(timeout if forwarded_wait else 0.0)
                    lender.close(lambda done: self._wait_until(done, t), self.endpoint.name)
                if s.exchanging and s.error is None and not s.bye_acked and not (bye_waited and s.bye_sent):
                    link.say_bye()
                    t = self._resolve_timeout(timeout)
                    t = max(1.0 if t is None else min(t, 1.0), 0.2)  # the ack is a round trip away
                    # Our RELEASE and BYE frames are delivered once the producer acks the
                    # BYE; only then may the socket close (linger 0 drops unsent frames).
                    self._wait_until(lambda: s.bye_acked or s.error is not None or not link.producer_alive(), t)
                    if not s.bye_acked and not link.producer_alive():
                        remove_stale_files(link, 0.0)  # it died after its BYE
            except IpcSyncError as exc:
                log.debug("ipcsync consumer close: %s", exc)
            except BaseException as exc:  # KeyboardInterrupt, SystemExit: closed all the same
                interrupted = exc
            self._mark_closed()
            self._teardown()
        self._stop_service()
        if interrupted is not None:
            raise interrupted

    # ------------------------------------------------------------------ release
    def _release_verified(self, item: Item, stream: Any) -> None:
        """``_release_locked`` with ``verify=True``: the item's checksum is taken again
        before its release event, and a finished comparison that found a change raises
        (not while closing: close() logs it)."""
        if item.released:
            return
        assert self._verify is not None
        self._verify.released(item, stream if stream is not None else self._stream)
        self._releaser.release(item, stream)
        if self._closer is None:
            self._verify.check()
        else:
            try:
                self._verify.check()
            except IpcSyncError as exc:
                log.warning("ipcsync consumer %r closing: %s", self.endpoint.name, exc)

    # ------------------------------------------------------------------ EndpointBase hooks
    def _pump(self) -> None:
        """Everything at a tick (ZeroMQ, liveness, stats); between ticks, after a wait
        whose select found only the lane readable (or nothing), the lane alone: ZeroMQ's
        fds were drained (``_io_pending``: ``ZMQ_EVENTS`` read) before that select, and
        an fd that did not signal has nothing new behind it (ZMQ_FD signals each arrival
        of commands until they are processed). After the SWITCH the producer sends only
        on the lane, so ZeroMQ then brings monitor events only. First, but not in the service
        thread (a call's stream), what ``Lender.drop`` queued goes back."""
        if self._lender.dropped and threading.current_thread() is not self._service:
            self._lender.release_dropped(self._release_locked)
        woken, self._woken = self._woken, None
        now = time.monotonic()
        if now >= self._next_tick:
            self._next_tick = now + self._tick
            self._link.pump()
            tick_link(self._link, now)
            self._stats.settle()
            interrupts.protect()  # (back in place if the program's framework put the default back)
        elif woken is not None and (not woken or woken == self._lane_woken):
            self._link.pump_lane()
        else:
            self._link.pump()

    def _service_pump(self) -> None:
        # The user's thread is away (computing): nothing to batch with, flush now.
        self._link.flush_releases()
        self._pump()

    def _io_fds(self) -> list[int]:
        wake = self._lender.wake
        return self._fds if wake is None else [*self._fds, wake.fd]

    def _io_pending(self) -> bool:
        return self._chan.pending()

    def _raise_if_broken(self) -> None:
        if (error := self.session.error) is not None:
            raise error

    def _lent(self) -> list[Any]:
        return self._lender.lent()

    def _teardown(self) -> None:
        self._lender.wake = None  # (closed when collected; see foreign.Wake)
        teardown_link(self._link)


def let_go(ep: ConsumerEndpoint) -> None:
    """Release everything ``ep`` holds (items, kept slots, buffered entries) and send
    those releases: what its close does before the goodbye. Lock held."""
    for item in ep._lender.held_items():
        ep._release_locked(item, None)
    ep._link.give_up_kept()
    ep.session.give_back_buffered()
    ep._link.flush_releases()


async def aclose(ep: ConsumerEndpoint, timeout: float | None) -> None:
    """``Consumer.aclose``: ``close``'s waits awaited on the event loop
    (``aio.close_awaiting`` over ``close_step``), then ``close``."""
    await aio.close_awaiting(partial(close_step, ep), ep.source_port(), ep._resolve_timeout(timeout), ep._tick,
                             lambda t: ep.close(t, forwarded_wait=False, bye_waited=True))


def close_step(ep: ConsumerEndpoint, goodbye: bool) -> tuple[bool, None]:
    """``aclose``'s attempts (``(True, None)``: done): the items ``ep`` forwarded are
    back; then (``goodbye``) everything held is let go, BYE sent and answered (or the
    producer is gone). Takes the lock."""
    with ep._lock:
        s, lender, link = ep.session, ep._lender, ep._link
        if ep._closed or s.error is not None or (goodbye and (not s.exchanging or s.bye_acked)):
            return True, None
        if goodbye and not s.bye_sent:
            let_go(ep)
            if lender.forwarded:  # (their wait ran out: close() gives them back, saying so)
                return True, None
            link.say_bye()
        ep._pump()
        done = (s.bye_acked or s.error is not None or not link.producer_alive()) if goodbye else not lender.forwarded
        return done, None


def _release(ref: "weakref.ref[ConsumerEndpoint]", item: Item, stream: Any) -> None:
    """``Item.release`` (``item.origin.release``)."""
    c = ref()
    if c is not None:
        with c._lock:
            c._last_call = time.monotonic()
            if not item.released and not c._closed:
                c._release_locked(item, stream)
                if c.blocked_calls or c._awaiting:
                    # A call (thread or task) waits for items: the producer may be waiting
                    # for this slot, and the batch would go out only at that call's tick.
                    c._link.flush_releases()


def _is_closed(ref: "weakref.ref[ConsumerEndpoint]") -> bool:
    c = ref()
    return c is None or c._closed
