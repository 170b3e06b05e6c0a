"""The Producer's runtime endpoint (``ProducerPort``): it owns the producer's state (the
lock, the closed and closing flags, the ring, its memory and events, the consumers)
and does what ``ipcsync.Producer`` (a facade) asks of it.

Its parts, each with one job: ``runtime.producer.memory`` (the arena, made once),
``runtime.producer.slots`` (the handoff steps, each with its ordering rule), ``runtime.producer.peers``
(the consumers, their sockets, their liveness; ``core.producer_session``: one
connection's protocol, sans I/O), ``runtime.producer.connections`` + ``runtime.producer.admission`` (a
consumer from HELLO to leaving), ``runtime.producer.forwarder`` + ``core.forwarding`` (zero-copy
forwarding), ``runtime.producer.aio_slot`` (an asyncio call's wait for a slot),
``runtime.producer.closing`` (close's bounded waits), ``runtime.producer.stats``; what
arrives is handled by ``runtime.producer.inbound`` (the pump and the steady pump, bound
as the port's own ``pump`` and ``pump_steady``). The port is what other parts of
ipcsync use: ``Pumpable`` (``runtime.handover``: a Consumer that lent items to this
producer pumps it while it waits), the entry of ``ipcsync.forward`` (``forward``) and of
``Producer.slot()`` blocks (``open_slot``/``close_slot``). Not user API. Used under its
lock except where a method says it takes it.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import nullcontext
from typing import Any, Callable, NamedTuple, Sequence

import torch
import zmq

from ... import limits as L
from ...backends import backend_for, resolve_device
from ...core import protocol as P
from ...core.forwarding import ForwardLedger
from ...core.layout import ALIGN, plan_message, signature
from ...core.ratelog import best_effort
from ...core.ring import POLICIES, Ring
from ...core.stats import ProducerStats, Stats
from ...core.waits import wait_strategy
from ...errors import ClosedError, ConfigError
from .. import aio
from . import closing
from .aio_slot import AsyncSlotWait
from ..transport.channel import CurveKeys, ProducerChannel, check_transport, resolve_endpoint
from .closing import DEFAULT_LINGER, Linger, failure_text, kept_words
from .connections import Connections
from ..endpoint import EndpointBase, check_positive_int
from .forwarder import Forwarder
from .inbound import Inbound
from .peers import Peer, PeerTable
from .stats import producer_stats
from .remote_join import confirm_sends, join_remote
from .memory import make_producer_memory
from .slot_waits import Waits
from .slots import Handoffs, SlotRecord

__all__ = ["ProducerPort", "SlotTicket", "failure_text"]

log = logging.getLogger(__name__)


class SlotTicket(NamedTuple):
    """What ``open_slot`` reserved for one ``Producer.slot()`` block: the slot's record,
    the plan, the stream the caller chose (None: the current one at the block's end)
    and the slot's store, whose use count tells whether a view outlived the block."""

    rec: SlotRecord
    plan: Any
    stream: Any
    store: Any


_new_tuple = tuple.__new__  # SlotTicket(*fields) without a namedtuple's Python-level __new__


class ProducerPort(EndpointBase):
    """See the module docstring; the arguments are ``ipcsync.Producer``'s, checked here.
    ``closing`` (set by ``close``/``aclose``/``abort``): new sends are refused and a
    consumer that attaches now is told goodbye once nothing is queued."""

    _role = "producer"

    def __init__(self, endpoint: str, *, slots: int, slot_bytes: int, device: str | torch.device | None,
                 policy: str, wait: str, timeout: float | None, heartbeat: float | None, stream: Any,
                 curve: CurveKeys | None, insecure: bool, limits: P.Limits) -> None:
        super().__init__(endpoint, timeout, heartbeat)
        self._closed = True  # until every part is built (nothing for __del__ to tear down before)
        self.slots = check_positive_int("slots", slots, L.MAX_SLOTS)
        self.slot_bytes = check_positive_int("slot_bytes", slot_bytes, 1 << 40)
        if policy not in POLICIES:
            raise ConfigError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.policy = policy
        waiting = wait_strategy(wait)  # how a slot's overwrite is ordered after its readers
        self.wait_mode = waiting.name
        self.device = resolve_device(device)
        self.endpoint = resolve_endpoint(endpoint)
        check_transport(self.endpoint, curve, insecure, "producer")
        self._stream = stream  # the default stream of every call (None: the current one)
        self.backend = backend = backend_for(self.device)
        self.ring = ring = Ring(self.slots, policy)
        self.closing = False
        self.stride = stride = (self.slot_bytes + ALIGN - 1) // ALIGN * ALIGN
        self.chan = chan = ProducerChannel(self.endpoint, limits.max_frame, curve)
        try:
            memory = make_producer_memory(backend, chan.lanes is not None, self.slots, self.slot_bytes, stride)
        except BaseException:
            chan.close()
            raise
        self.arena, self.share_problem, slot_views, ready_events, self.sharing = memory
        self._stats = Stats()
        self.name = name = self.endpoint.name
        self.ipc = ipc = self.endpoint.path is not None  # the kernel can name the peer of a connection (SO_PEERCRED)
        self.peers = peers = PeerTable(chan, name, ring, self._ratelog, self._on_gone)
        self.inbound = inbound = Inbound(chan, peers, self._tick)
        # The pumps are the inbound's own methods (no frame of the port's per call).
        self.pump_steady = inbound.pump_steady
        self.pump = inbound.pump
        self.handoffs = h = Handoffs(
            ring=ring, slot_views=slot_views, ready_events=ready_events, slot_bytes=self.slot_bytes,
            peers=peers, ledger=ForwardLedger(self.slots), stats=self._stats, limits=limits,
            wait=waiting, timeout=self._timeout, name=name, ratelog=self._ratelog, backend=backend,
            waits=Waits(self.pump_steady, self._wait_until, self._timeout_error, self._resolve_timeout),
            shared=self.sharing is not None)
        self._plan_get: Callable[[Any], Any] = h.plans.get  # the plan cache's own get (hot path)
        self.forwarder = Forwarder(handoffs=h, peers=peers, backend=backend, device=self.device, lock=self._lock,
                                   enter=self._enter_send, touch=self._touch, default_stream=stream, name=name)
        self.forwarder.remote_capable = not ipc  # (remote consumers attach on tcp endpoints only)
        self.connections = Connections(
            chan=chan, peers=peers, handoffs=h, forwarder=self.forwarder, backend=backend, device=self.device,
            arena=self.arena, stride=stride, sharing=self.sharing, ipc=ipc, heartbeat=self._heartbeat, name=name,
            closing=lambda: self.closing, join_remote=lambda *a: join_remote(self, *a))
        inbound.serve(h, self.forwarder, self.connections)
        self._fds = chan.fds()
        self._lanes_woken = [chan.lanes.fd] if chan.lanes is not None else [-1]  # (what _pump compares)
        self.when_slot_free = AsyncSlotWait(
            lock=self._lock, ring=ring, stats=self._stats, enter=self._enter_send, pump=self.pump_steady,
            fds=self._fds, io_pending=self.io_pending, tick=self._tick, resolve_timeout=self._resolve_timeout,
            no_slot_error=h.slot_waits.no_slot_error).when_slot_free  # (Producer.asend, aslot)
        self._closed = False
        self._start_service()

    # ------------------------------------------------------------------ Pumpable
    @property
    def lock(self) -> threading.Lock:
        return self._lock

    def io_fds(self) -> Sequence[int]:
        return self._fds

    def io_pending(self) -> bool:
        return self.chan.pending()

    _io_fds = io_fds  # (EndpointBase's hooks)
    _io_pending = io_pending

    @property
    def remote_hub(self) -> Any:
        """The ``runtime.remote.io.RemoteHub`` of this producer's remote edges (None: none yet)."""
        return self.inbound.remote_hub

    def _pump(self) -> None:
        """EndpointBase's hook (its waits, the service thread): the steady pump when the
        last wait's select woke on the lanes' epoll alone, or on nothing (it timed out):
        ``io_pending`` had found nothing queued on ZeroMQ before that select, and a ZeroMQ
        fd that did not signal has nothing new behind it. The general pump otherwise."""
        woken, self._woken = self._woken, None
        if woken is not None and (not woken or woken == self._lanes_woken):
            self.pump_steady()
        else:
            self.pump()

    # ------------------------------------------------------------------ remote edges
    def confirm_from_thread(self, stopped: Callable[[], bool]) -> None:
        """An edge's completion thread saw a send complete: confirm it now, under the lock
        (a thread holding the lock confirms at its next pump instead, if ``stopped``:
        the edge is closing, perhaps under the lock)."""
        lock = self._lock
        while not lock.acquire(timeout=0.005):
            if stopped():
                return
        try:
            if not self._closed:
                confirm_sends(self.peers)
        finally:
            lock.release()

    # ------------------------------------------------------------------ consumers
    def _on_gone(self, peer: Peer) -> None:
        self.connections.on_gone(peer)  # (PeerTable's on_gone: the table is built before the connections)

    def _teardown(self, linger_ms: int = 0) -> None:
        """Free everything. Lock held (or the object is being collected). ``linger_ms``: how long frames
        already sent may still go out after the socket is closed."""
        best_effort("producer teardown", self.forwarder.abandon)
        if self.inbound.remote_hub is not None:
            best_effort("producer teardown", self.inbound.remote_hub.close)
        self.peers.close()
        if linger_ms:
            try:
                self.chan.sock.setsockopt(zmq.LINGER, linger_ms)
            except zmq.ZMQError:
                pass
        # Every view of the arena goes (the plans' cached destinations and slot() views
        # too), so closing it frees its memory now: on CUDA torch's IPC bookkeeping of the
        # export is settled here, not left for the interpreter's exit, where torch would
        # warn "Producer process has been terminated before all shared CUDA tensors released".
        self.handoffs.forget_plans()
        self.handoffs.free_kept_slots(all_of_them=True)
        self.handoffs.stores = []
        self.handoffs.slot_views.clear()
        best_effort("producer teardown", self.chan.close, self.arena.close, self.backend.collect, self.backend.close)

    # ------------------------------------------------------------------ entries
    def forward(self, item: Any, message: Any, meta: Any = None, timeout: float | None = None,
                stream: Any = None) -> int:
        """``ipcsync.forward``'s zero-copy path (see ``runtime.producer.forwarder``). Takes the lock.
        CannotForward: nothing was sent and ``item`` is untouched."""
        # The item's lender, reached only through the ForwardOrigin protocol; this port is
        # the Pumpable it polls while the item is out.
        return self.forwarder.forward(item, message, meta, timeout, stream, self, item.origin)

    def open_slot(self, spec: dict[str, Any], timeout: float | None, stream: Any) -> tuple[SlotTicket, Any]:
        """Steps 1-2 for a ``Producer.slot()`` block (``Handoffs.begin``); returns the
        ticket and the slot's views, for the block to write (step 3). Takes the lock."""
        h = self.handoffs
        with self._lock:
            self._enter_send()
            plan, recipe = h.empty_plan_for(spec)
            s = stream if stream is not None else self._stream
            rec = h.begin(timeout, s)
            try:
                store = h.slot_store(rec.slot).for_item()
                views = recipe.build_in(store)
                store.seal()
            except BaseException:
                h.ring.abort(rec.slot)
                raise
        return _new_tuple(SlotTicket, (rec, plan, s, store)), views

    def close_slot(self, ticket: SlotTicket, meta: Any, ok: bool, held: Sequence[str] = (), fields: Any = None) -> None:
        """Steps 3b-4 for a ``Producer.slot()`` block that ended (``ok``: without raising;
        else the slot is given back): ``Handoffs.finish``. ``held``: the fields (of
        ``fields``) whose tensor the program still names. Takes the lock."""
        h = self.handoffs
        slot = ticket.rec.slot
        with self._lock:
            store = ticket.store
            if store.ptr() != store.addr or store.in_use():
                what = kept_words(self.name, fields or {}, held) if store.in_use() else ""
                if h.unsendable(store, slot, ok, what):
                    return  # moved, or a tensor of the block outlived it: not sent
            if not ok:  # the block raised: nothing is sent
                h.ring.abort(slot)
                return
            self._check_open()  # (and notes that the user's thread was here)
            if self.closing:
                # close() began while the block ran (another thread): its consumers may
                # have had their goodbye, so an item published now could reach nobody.
                h.ring.abort(slot)
                raise ClosedError(
                    f"producer {self.name!r} began closing (close() in another thread) while this "
                    "Producer.slot() block ran: its item was not sent; finish sending before close()")
            try:
                # The block wrote on its own stream, or the current one at its end.
                h.finish(ticket.rec, ticket.plan, meta, ticket.stream)
            except BaseException:
                h.ring.abandon(slot)
                raise

    # ------------------------------------------------------------------ what the Producer asks
    def send(self, message: Any, meta: Any = None, *, timeout: float | None = None, stream: Any = None) -> int:
        """``Producer.send``: its steps and its result (the facade binds this method)."""
        # The handoff steps of runtime.producer.slots: begin (1 reserve, 2 order after the previous
        # readers), 3 write, finish (3b record ready, 4 publish). On a steady edge each is
        # its fast branch (see runtime.producer.slots).
        with self._lock:
            if self._closed or self.closing:
                self._refuse_send()
            key, tensors = signature(message)
            plan = self._plan_get(key)
            h = self.handoffs
            if plan is None:
                plan = h.planner.new_plan(key, plan_message(message, self.slot_bytes, h.planner.check_layout))
            s = stream if stream is not None else self._stream
            rec = h.begin(timeout, s)
            try:
                # 3. write, on the stream begin resolved (the current one): one C call for
                # a flat plan (with 3b where it records too), else torch's copy.
                recorded = False
                if s is not None:
                    self._write_on(s, plan, rec.slot, tensors)
                elif plan.flat is None:
                    plan.write(rec.slot, h.slot_views[rec.slot], tensors)
                else:
                    recorded = h.write_flat(rec, plan, tensors)
                return h.finish(rec, plan, meta, rec.stream, recorded=recorded)
            except BaseException:
                self.ring.abandon(rec.slot)
                raise
            finally:
                self._last_call = time.monotonic()

    def _write_on(self, stream: Any, plan: Any, slot: int, tensors: list[torch.Tensor]) -> None:
        """Step 3 on a stream the caller chose: the copy runs on ``stream``, so the caching
        allocator must not reuse a source's memory before it has run."""
        with (torch.cuda.stream(stream) if self.device.type == "cuda" else nullcontext()):
            plan.write(slot, self.handoffs.slot_views[slot], tensors)
            for t in tensors:
                if t.is_cuda:
                    t.record_stream(stream)

    def _refuse_send(self) -> None:
        self._check_open()
        if self.closing:
            raise ClosedError(f"producer {self.name!r} is closing (close() was called, perhaps in another "
                              "thread): it sends nothing more; send before close(), or make a new Producer")

    def _enter_send(self) -> None:
        """A send-like call starts: refused on a closed or closing producer. Lock held."""
        if self._closed or self.closing:
            self._refuse_send()
        self._last_call = time.monotonic()

    def _touch(self) -> None:
        self._last_call = time.monotonic()

    async def aclose(self, timeout: float | None, linger: Linger) -> None:
        """``Producer.aclose``: what ``close`` does, awaited on the event loop."""
        t = self._resolve_timeout(timeout)
        deadline = None if t is None else time.monotonic() + t
        with self._lock:
            if self._closed:
                return
            self.closing = True

        def drained() -> tuple[bool, None]:
            with self._lock:
                if self._closed:
                    return True, None
                self.pump()
                conn = self.connections
                return closing.settled(self.handoffs, conn.attached_total, linger, conn.bye_all), None

        def fill(poller: Any) -> None:
            with self._lock:
                if not self._closed:
                    poller.add(self._fds, self.io_pending())

        await aio.wait_for_attempt(drained, fill, t, self._tick, lambda: None)
        self.close(None if deadline is None else max(0.0, deadline - time.monotonic()), linger)

    def flush(self, timeout: float | None) -> None:
        """``Producer.flush``."""
        with self._call():
            t = self._resolve_timeout(timeout)
            if not self._wait_until(lambda: not closing.busy(self.handoffs), t):  # (a kept slot() slot sent nothing)
                raise self._timeout_error("items still in flight", t, f"slot states: {self.ring.occupancy()}")

    def wait_for_consumers(self, n: int, timeout: float | None) -> None:
        """``Producer.wait_for_consumers``."""
        with self._call():
            t = self._resolve_timeout(timeout)
            if not self._wait_until(lambda: len(self.ring.consumers()) >= n, t):
                raise self._timeout_error(f"fewer than {n} consumers attached", t,
                                          f"is a consumer running on endpoint {self.name!r}?")

    @property
    def consumers(self) -> int:
        """Consumers attached now."""
        return len(self.ring.consumers())

    def stats(self) -> ProducerStats:
        """``Producer.stats``."""
        with self._lock:
            return producer_stats(self._stats, self.handoffs, self.connections, self.forwarder)

    def close(self, timeout: float | None = None, linger: Linger = DEFAULT_LINGER) -> None:
        """``Producer.close``: deliver what is queued, BYE every consumer, wait for their
        releases and goodbyes, then free everything. A close() already under way in
        another thread is waited for (up to ``timeout``), not run twice. Interrupted
        (Ctrl-C) inside its wait, it ends the stream as ``abort`` does, then re-raises: the
        producer is closed, its consumers told it failed."""
        me = threading.get_ident()
        with self._lock:
            if self._closed or self._closing_elsewhere(self._resolve_timeout(timeout)):
                return
            self.closing = True
            if not self._begin_close():
                return
            t = self._resolve_timeout(timeout)
            deadline = None if t is None else time.monotonic() + t
            h, fwd, conn = self.handoffs, self.forwarder, self.connections
            interrupted: BaseException | None = None
            try:
                closing.drain(h, deadline, lambda: conn.attached_total, linger, conn.bye_all,
                              lambda: not closing.busy(h) and not self.peers and not fwd.ledger.pending)
            except Exception as exc:  # close never fails because of a peer
                log.debug("ipcsync producer close: %s", exc)
            except BaseException as exc:  # KeyboardInterrupt, SystemExit: no clean end
                interrupted = exc
            if self._closed or self._closer != me:
                return  # an abort() in another thread ended our wait: it finishes the job
            if interrupted is not None:
                self._fail(failure_text(interrupted))
            else:
                fwd.abandon()
                closing.report_left(h, self.name)
                self._mark_closed()
                self._teardown()
        self._stop_service()
        if interrupted is not None:
            raise interrupted

    def abort(self, error: BaseException | str | None = None) -> None:
        """``Producer.abort``: ERROR ``failed`` to every consumer, then free everything."""
        text = failure_text(error)
        with self._lock:
            if self._closed:
                return
            self.closing = True
            if not self._begin_close(timeout=1.0):
                return
            self._fail(text)
        self._stop_service()

    def _fail(self, text: str) -> None:
        """End the stream as failed: ERROR ``failed`` (``text``) to every consumer still
        here, then free everything. Lock held."""
        self.connections.tell_failed(text)
        self._mark_closed()
        self._teardown(linger_ms=200)  # the ERROR frames go out before the socket shuts

