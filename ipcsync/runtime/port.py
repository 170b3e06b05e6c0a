"""The Producer's runtime endpoint (``ProducerPort``): it owns the producer's state (the
lock, the closed and closing flags, the ring, its memory and events, the consumers)
and does what ``ipcsync.Producer`` (a facade) asks of it.

Its parts, each with one job: ``runtime.slots`` (the handoff steps, each with its
ordering rule), ``runtime.peers`` + ``runtime.admission`` (the consumers, their
sockets, their liveness; ``core.producer_session``: one connection's protocol, sans
I/O), ``runtime.forwarder`` + ``core.forwarding`` (zero-copy forwarding). The port
handles what arrives (the pump: monitor events, frames through each consumer's
``ProducerSession``, the handshake, the liveness tick; the steady pump, ``pump_steady``:
only the lanes' RELEASEs, while nothing else needs a look), and it is what other parts of
ipcsync use: ``Pumpable`` (``runtime.handover``: a Consumer that lent items to this
producer pumps it while it waits), the entry of ``ipcsync.forward`` (``forward``) and of
``Producer.slot()`` blocks (``open_slot``/``close_slot``). Not user API. Used under its
lock except where a method says it takes it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from contextlib import nullcontext
from typing import Any, Callable, NamedTuple, Sequence, TypeVar

import torch
import zmq

from .. import interrupts
from .. import limits as L
from ..backends import backend_for, resolve_device
from ..core import protocol as P
from ..core.forwarding import ForwardLedger
from ..core.layout import ALIGN, plan_message, signature
from ..core.producer_session import Kind, ProducerSession
from ..core.ratelog import best_effort
from ..core.ring import POLICIES, Ring
from ..core.stats import Occupancy, ProducerStats, Stats
from ..core.waits import wait_strategy
from ..errors import ClosedError, ConfigError, IpcTimeoutError, ProtocolError
from . import aio, closing, host
from .admission import credentials_problem, hello_problem, is_remote, watch_for
from .channel import CurveKeys, ProducerChannel, check_transport, resolve_endpoint
from .closing import DEFAULT_LINGER, Linger, failure_text, kept_words
from .endpoint import EndpointBase, check_positive_int
from .forwarder import Forwarder
from .lane import polled_form
from .peers import Peer, PeerTable
from .remote_join import join_remote
from .sharing import DescriptorSharing
from .slot_waits import Waits
from .slots import Handoffs, SlotRecord

__all__ = ["ProducerPort", "SlotTicket", "failure_text"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")


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
        arena = None
        # Memory shared by descriptor (runtime.sharing) wherever the backend can and the
        # endpoint has lanes to carry the descriptors; else by name, with events.
        self.share_problem = backend.descriptor_problem() or (None if chan.lanes is not None else "no lanes")
        try:
            try:
                arena = (backend.create_shared_arena(stride * self.slots) if self.share_problem is None
                         else backend.create_arena(stride * self.slots))
            except ConfigError as exc:  # e.g. /dev/shm too small: name the ring that asked
                raise ConfigError(f"Producer(slots={self.slots}, slot_bytes={self.slot_bytes}): {exc}") from None
            slot_views = [arena.tensor[i * stride: i * stride + self.slot_bytes] for i in range(self.slots)]
            ready_events = [] if self.share_problem is None else [backend.create_event() for _ in range(self.slots)]
        except BaseException:
            chan.close()
            if arena is not None:
                arena.close()
            raise
        self.arena = arena
        self.sharing = DescriptorSharing(backend, arena, self.slots) if self.share_problem is None else None
        self._stats = Stats()
        self.name = name = self.endpoint.name
        self.ipc = self.endpoint.path is not None  # the kernel can name the peer of a connection (SO_PEERCRED)
        self.peers = peers = PeerTable(chan, name, ring, self._ratelog, self.on_gone)
        self.handoffs = h = Handoffs(
            ring=ring, slot_views=slot_views, ready_events=ready_events, slot_bytes=self.slot_bytes,
            peers=peers, ledger=ForwardLedger(self.slots), stats=self._stats, limits=limits,
            wait=waiting, timeout=self._timeout, name=name, ratelog=self._ratelog, backend=backend,
            waits=Waits(self.pump_steady, self._wait_until, self._timeout_error, self._resolve_timeout),
            shared=self.sharing is not None)
        self._plan_get: Callable[[Any], Any] = h.plans.get  # the plan cache's own get (hot path)
        self.forwarder = Forwarder(handoffs=h, peers=peers, backend=backend, device=self.device, lock=self._lock,
                                   enter=self._enter_send, touch=self._touch, default_stream=stream, name=name)
        self.forwarder.remote_capable = not self.ipc  # (remote consumers attach on tcp endpoints only)
        self.attached_total = 0  # consumers that completed the handshake, ever
        self.pid = os.getpid()
        self.remote_hub: Any = None  # runtime.remote.RemoteHub, made at the first remote HELLO
        # Every attached consumer's frames travel on its lane (its SWITCH received), and at
        # least one is attached: set by each general pump (a consumer is added, and its
        # SWITCH read, only there), read by the steady pump.
        self.lanes_steady = False
        self._fds = chan.fds()
        self._lanes_woken = [chan.lanes.fd] if chan.lanes is not None else [-1]  # (what _pump compares)
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

    def pump_steady(self) -> None:
        """The steady pump (a send that found every slot taken; ``_slot_free``): read the
        lanes that have frames and hand each consumer's RELEASEs to the handoffs in one
        call per wake-up (``ProducerSession.release_frames``, then ``Handoffs.released``);
        anything else goes to ``pump``, in order, losing nothing. Lock held.

        Each condition below needs the general pump's look, for the reason beside it.
        ZeroMQ is not read here: after a consumer's SWITCH only its monitor's events and
        newcomers' handshakes come there, read by ``pump`` at the next tick, or in a wait
        (``_wait_until``) as soon as ZeroMQ has input (``io_pending``)."""
        peers = self.peers
        if (not self.lanes_steady  # a consumer's frames come on ZeroMQ (no lane or no SWITCH yet), or none attached
                or self.forwarder.ledger.pending  # forwarded items wait for downstream release events: polled
                or self.handoffs.kept_slots  # slot() tensors that outlived their block: polled
                or self.remote_hub is not None  # remote edges: completed sends to confirm
                or time.monotonic() >= self._next_tick):  # the tick: liveness, heartbeats, monitor, half-open
            self.pump()
            return
        for peer in peers.by_id.values():
            lane = peer.lane
            # Frames queued for it (flush); its connection closed (the liveness rule waits
            # for its process); no lane (gone meanwhile): the general pump.
            if peer.outbox or peer.disconnected or lane is None or lane.tail:
                self.pump()
                return
        lanes = self.chan.lanes
        got = lanes.read_lanes() if lanes is not None else None
        if got is None:  # the listener, a lane's token: LaneHub.poll
            self.pump()
            return
        now = time.monotonic()
        h, peer_of = self.handoffs, peers.get
        for i, (identity, frames, end) in enumerate(got):
            reader, n = peer_of(identity), 0
            if reader is not None:  # (else gone: pump ignores its frames)
                entries: list[tuple[int, int, int]] = []
                n = reader.session.release_frames(frames, now, entries)
                if entries:
                    h.released(reader, entries)  # (frees slots and credits: sends nothing)
            if n < len(frames) or end is not None:
                # Another frame kind, a bad frame, EOF: the rest of this lane and the
                # lanes after it, in order, then everything else.
                self.pump(polled_form([(identity, frames[n:], end), *got[i + 1:]]))
                return
        if h.ring.queued:
            h.dispatch()  # a release gave back a credit a queued item waits for

    def pump(self, taken: Sequence[tuple[str, bytes, Any]] = ()) -> None:
        """Handle everything that has arrived, without blocking (``taken``: what the steady
        pump read off the lanes and left, in ``LaneHub.poll``'s form, handled before what
        the lanes have since). Lock held."""
        chan, peers = self.chan, self.peers
        peers.monitor(chan.events())
        recv, on_frame = chan.recv, self.on_frame
        for _ in range(10_000):  # bounded, so a flood cannot starve the caller
            got = recv()
            if got is None:
                break
            on_frame(*got)
        lanes = chan.lanes
        if lanes is not None:
            # After the ZeroMQ frames: a consumer's SWITCH among them opened its lane for
            # reading, and its lane frames all follow that SWITCH (runtime.lane).
            polled = lanes.poll()
            if taken:
                polled[:0] = taken
            for what, identity, data in polled:
                if what == "frame":
                    if identity in peers.by_id:
                        on_frame(identity, [data], -1)
                else:
                    self.on_lane(what, identity, data)
        peers.apply_disconnects()  # after the frames that arrived before them
        fwd = self.forwarder
        if fwd.ledger.pending:
            fwd.poll()
        if self.handoffs.kept_slots:
            self.handoffs.free_kept_slots()
        self.handoffs.dispatch()
        if self.remote_hub is not None:
            self.confirm_sends()
        peers.flush()
        self.lanes_steady = lanes is not None and bool(peers.by_id) and all(
            p.lane is not None and p.session.switch_received for p in peers.by_id.values())
        now = time.monotonic()
        if now >= self._next_tick:
            self._next_tick = now + self._tick
            peers.tick(now)
            interrupts.protect()  # (back in place if the program's framework put the default back)

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
    def confirm_sends(self) -> None:
        """SENT to each remote consumer whose edge completed sends since its last SENT
        (core.remote_session 7). Only consumers still in the peer table are confirmed, and
        a dropped one's edge is closed (its ledger with it) before its slots are reclaimed."""
        for peer in self.peers:
            edge = peer.remote
            if edge is not None:
                seq = edge.to_confirm()
                if seq is not None:
                    self.peers.send(peer, peer.session.sent(seq))

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
                self.confirm_sends()
        finally:
            lock.release()

    # ------------------------------------------------------------------ frames
    def on_frame(self, identity: bytes, frames: list[bytes], fd: int) -> None:
        peer = self.peers.get(identity)
        if peer is not None and len(frames) == 1:
            # Steady state: a RELEASE from an attached consumer, which leaves it active.
            entries = peer.session.release_entries(frames[0], time.monotonic())
            if entries is not None:
                self.handoffs.released(peer, entries)
                return
        if len(frames) != 1:
            self.peers.bad_frame(identity, peer, ProtocolError(f"expected 1 frame, got {len(frames)}"))
            return
        if peer is None:
            try:
                msg = P.decode(frames[0], self.handoffs.limits)
            except ProtocolError as exc:
                self.peers.bad_frame(identity, None, exc)
                return
            if type(msg) is P.Hello:
                self.on_hello(identity, msg, fd)
            elif type(msg) is not P.Bye:
                self.peers.bad_frame(identity, None, ProtocolError(
                    f"{type(msg).__name__.upper()} from a peer that has not sent HELLO"))
            return
        ev = peer.session.receive_frame(frames[0], time.monotonic())
        kind = ev.kind
        if kind is Kind.RELEASED:
            self.handoffs.released(peer, ev.data)
        elif kind is Kind.ATTACHED:
            self.on_attach(peer, ev.data)
        elif kind is Kind.GOODBYE:
            assert ev.reply is not None
            self.peers.send(peer, ev.reply)
            self.peers.drop(peer)
        elif kind is Kind.PEER_ERROR:
            self.peers.ratelog.warning("peer_error", "ipcsync: %s reported an error: %s: %s",
                                       peer.label, ev.data.code, ev.data.message)
            self.peers.drop(peer)
        elif kind is Kind.BAD_FRAME:
            self.peers.bad_frame(identity, peer, ev.data, ev.reply)
        elif kind is Kind.SWITCHED:
            lanes = self.chan.lanes
            if lanes is None or lanes.read(identity) is None:
                bad = peer.session.bad_frame(ProtocolError("SWITCH, but this consumer's lane is gone"))
                self.peers.bad_frame(identity, peer, bad.data, bad.reply)

    def on_lane(self, what: str, identity: bytes, data: Any) -> None:
        """What the lane hub reported besides frames (see ``LaneHub.poll``)."""
        peer = self.peers.get(identity)
        if peer is None:
            if what == "lane":
                assert self.chan.lanes is not None
                self.chan.lanes.withdraw(identity)
            return
        if what == "lane":
            # Token and credentials checked: our SWITCH goes out after everything queued
            # for it on ZeroMQ, then its frames go on the lane (PeerTable.send).
            if peer.disconnected or peer.session.state in P.ENDED or peer.session.switch_sent:
                return
            why = self.sharing.send_memory(peer, data) if self.sharing is not None else None
            if why is not None:  # (its memory goes first on the lane: runtime.memory_wire's ordering rule)
                bad = peer.session.bad_frame(ProtocolError(why))
                self.peers.bad_frame(identity, peer, bad.data, bad.reply)
                return
            peer.lane_ready = data
            self.peers.send(peer, peer.session.switch())
            if peer.attach_pending and self.peers.get(identity) is peer:
                self.admit(peer)
        elif what == "closed":
            self.peers.on_disconnect(peer, data)  # as a closed ZeroMQ connection
        elif what == "bad":
            bad = peer.session.bad_frame(data)
            self.peers.bad_frame(identity, peer, bad.data, bad.reply)

    @property
    def lanes_used(self) -> int:
        """Consumers whose frames travel on a lane now (both directions switched)."""
        return sum(1 for p in self.peers.by_id.values() if p.lane is not None and p.session.switch_received)

    def on_hello(self, identity: bytes, hello: P.Hello, fd: int) -> None:
        # Monitor events first: a DISCONNECTED of an earlier connection on the same fd must
        # not be applied to this one.
        self.peers.monitor(self.chan.events())
        self.chan.greeted(fd)  # no longer half-open (see ProducerChannel)
        cred = host.peer_credentials(fd) if self.ipc else None
        problem = (hello_problem(hello, self.backend, self.device, remote_ok=not self.ipc)
                   or credentials_problem(hello, cred))
        if problem is not None:
            self.refuse(identity, hello.pid, *problem)
            return
        session = ProducerSession(identity, hello, time.monotonic(), self._heartbeat, self.handoffs.limits)
        if is_remote(hello):
            join_remote(self, identity, session, fd)
            return
        peer = Peer(session, fd, watch_for(hello, cred))
        why = self.sharing.join(peer) if self.sharing is not None else None
        if why is not None:
            self.refuse(identity, hello.pid, P.ErrorCode.BACKEND.value, why)
            return
        self.peers.add(peer)
        h = self.handoffs
        # (The consumer's version: an older one gets its version's SETUP, without a lane.)
        setup = self.setup_for(hello.version, self.arena.export(), self.sharing.setup_events() if self.sharing
                               is not None else [e.handle() for e in h.ready_events])
        self.peers.send(peer, session.setup(setup))
        if self.peers.get(identity) is not peer:
            return  # its connection had closed (a consumer that gave up waiting): dropped, nothing to offer
        lanes = self.chan.lanes
        if lanes is not None and session.lane_capable:
            token = lanes.offer(identity, cred[0] if cred is not None else None)
            self.peers.send(peer, session.lane_offer(lanes.path, token))

    def refuse(self, identity: bytes, pid: int, code: str, text: str) -> None:
        """Refuse a consumer's HELLO: one (rate-limited) line here, an ERROR to it."""
        self.peers.ratelog.warning("hello", "ipcsync producer %r refused consumer pid %d: %s", self.name, pid, text)
        self.peers.send_raw(identity, P.encode(P.Error(code, text)))

    def setup_for(self, version: int, arena: bytes | str, ready_events: list[bytes | str]) -> P.Setup:
        """The SETUP of a connection: our ring in ``arena`` (a handle, or a remote edge's
        address), with ``ready_events`` (handles or placeholders, one per slot)."""
        h = self.handoffs
        return P.Setup(
            version=version, pid=self.pid, start_time=host.start_time(self.pid), pid_ns=host.pid_namespace(),
            backend=self.backend.name, device=self.backend.device_identity(), arenas=[arena],
            arena_bytes=[self.arena.nbytes], slots=[(0, i * self.stride, h.slot_bytes) for i in range(h.slots)],
            ready_events=ready_events, heartbeat_ms=int(self._heartbeat * 1000))

    def on_attach(self, peer: Peer, msg: P.Attach) -> None:
        h = self.handoffs
        bad = peer.session.attach_problem(len(msg.release_events), h.slots)
        if bad is not None:
            self.peers.bad_frame(peer.identity, peer, bad.data, bad.reply)
            return
        if peer.remote is not None:
            # The consumer joined the edge's group before its ATTACH: a short wait.
            why = peer.remote.attach(peer.remote.timeout)
            if why is not None:
                bad = peer.session.bad_frame(ProtocolError(f"remote edge: {why}"))
                self.peers.bad_frame(peer.identity, peer, bad.data, bad.reply)
                return
            peer.set_release_events(list(peer.remote.release_events))
            watch = peer.watch  # (a remote peer's: its RemoteWatch)
            if watch is not None and not isinstance(watch, host.ProcessWatch):
                watch.joined = True  # from now on its silence is loss (its ATTACH: just heard)
        elif self.sharing is not None:
            peer.set_release_events(self.sharing.release_events(peer))
            if not peer.memory_sent:  # (its lane is not checked yet: admitted once its memory went out)
                peer.attach_pending = True
                return
        else:
            try:
                # Opened on our GPU, whichever GPU the consumer records them on (see
                # CudaBackend.open_event).
                peer.set_release_events([self.backend.open_event(e) for e in msg.release_events])
            except Exception as exc:
                bad = peer.session.bad_frame(ProtocolError(f"cannot open release events: {exc}"))
                self.peers.bad_frame(peer.identity, peer, bad.data, bad.reply)
                return
        self.admit(peer)

    def admit(self, peer: Peer) -> None:
        """``peer`` attached (and, sharing by descriptor, has its memory): it takes items."""
        h = self.handoffs
        peer.attach_pending = False
        h.ring.add_consumer(peer.identity, min(peer.session.hello.credits, h.slots))
        self.attached_total += 1
        log.debug("ipcsync producer %r: %s attached", self.name, peer.label)
        if self.closing and h.ring.queued == 0:
            self.say_bye(peer, "producer closed")
        h.dispatch()

    def say_bye(self, peer: Peer, reason: str) -> None:
        frame = peer.session.bye(reason)
        if frame is not None:
            self.peers.send(peer, frame)

    def on_gone(self, peer: Peer) -> None:
        """A peer left the table (PeerTable's ``on_gone``): reclaim what it held."""
        if peer.remote is not None:
            peer.remote.drop()  # aborts what is still pending with it (a lost peer)
        if self.chan.lanes is not None:
            self.chan.lanes.withdraw(peer.identity)
        peer.lane = peer.lane_ready = None
        self.handoffs.reclaim(peer)
        if self.sharing is not None:
            self.sharing.gone(peer)
        if self.forwarder.ledger.pending:
            self.forwarder.poll()  # it may have been the one a forward still waited for
        self.backend.collect()
        self.handoffs.dispatch()

    def _teardown(self, linger_ms: int = 0) -> None:
        """Free everything. Lock held (or the object is being collected). ``linger_ms``: how long frames
        already sent may still go out after the socket is closed."""
        best_effort("producer teardown", self.forwarder.abandon)
        if self.remote_hub is not None:
            best_effort("producer teardown", self.remote_hub.close)
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
        """``ipcsync.forward``'s zero-copy path (see ``runtime.forwarder``). Takes the lock.
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
        # The handoff steps of runtime.slots: begin (1 reserve, 2 order after the previous
        # readers), 3 write, finish (3b record ready, 4 publish). On a steady edge each is
        # its fast branch (see runtime.slots).
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

    async def when_slot_free(self, reserve: Callable[[], _T], timeout: float | None) -> _T:
        """Await a free slot (up to ``timeout``, default the producer's), then ``reserve()``
        (a call that reserves with timeout 0, so it never blocks). Lost to another thread
        in between: wait again. Time over: ``reserve()`` once more; if still no slot is
        free, the sync call's IpcTimeoutError, naming ``timeout`` (not the 0 of that try)."""
        t = self._resolve_timeout(timeout)
        deadline = None if t is None else time.monotonic() + t
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            await aio.wait_for_attempt(self._slot_free, self._fill_poller, left, self._tick, lambda: None,
                                       self._waited_for_slot)
            try:
                return reserve()
            except IpcTimeoutError:
                with self._lock:
                    taken = self.ring.free_slots == 0  # by another thread since we looked
                    if taken and deadline is not None and time.monotonic() >= deadline:
                        raise self.handoffs.slot_waits.no_slot_error(t) from None
                if not taken:
                    raise

    def _slot_free(self) -> tuple[bool, None]:
        """A non-blocking look: is a slot free (after handling what arrived)? Refused on
        a closed or closing producer."""
        with self._lock:
            self._enter_send()
            if self.ring.free_slots == 0:
                self.pump_steady()
            return self.ring.free_slots > 0, None

    def _fill_poller(self, poller: Any) -> None:
        with self._lock:
            self._enter_send()
            poller.add(self._fds, self.io_pending())

    def _waited_for_slot(self, seconds: float) -> None:
        self._stats.waited("slot" if self.ring.consumers() else "consumer", seconds)

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
                if self.ring.queued > 0:
                    # (Nobody left to take queued items: close() drops them, with its warning.)
                    return closing.alone_too_long(self.handoffs, self.attached_total, linger), None
                # Every item sent was delivered: say goodbye now, as close() does before it
                # waits. A consumer gives back at our BYE the slots its program's tensors still
                # view (the reference rule), so a wait for every release before it could be endless.
                for peer in self.peers:
                    self.say_bye(peer, "producer closed")
                return not closing.busy(self.handoffs), None

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
            peers, fwd = self.peers, self.forwarder
            return ProducerStats(
                **self._stats.totals(), role="producer", occupancy=Occupancy.of(self.ring.occupancy()),
                consumers=self.consumers, consumers_attached=self.attached_total, consumers_lost=peers.lost_total,
                consumers_stalled=peers.stalled_now(), consumers_stalled_total=peers.stalled_total,
                bad_frames=peers.bad_frames, forwarded=fwd.forwarded_total, forwarded_held=fwd.ledger.count(),
                layouts_inline=self.handoffs.layouts_inline, lanes=self.lanes_used,
            )

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
            h, fwd = self.handoffs, self.forwarder
            interrupted: BaseException | None = None
            try:
                closing.deliver_queued(h, deadline, lambda: self.attached_total, linger)
                for peer in self.peers:
                    self.say_bye(peer, "producer closed")
                h.slot_waits.wait_nagging(lambda: not closing.busy(h) and not self.peers and not fwd.ledger.pending,
                                          deadline, h.slot_waits.held_words)
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
                if closing.busy(h):
                    log.warning("ipcsync producer %r closing with items not released by consumers "
                                "(slot states %s)", self.name, self.ring.occupancy())
                if (kept := closing.kept_report(h)) is not None:
                    log.warning("ipcsync %s (close() does not wait for it)", kept)
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
        frame = P.encode(P.Error(P.ErrorCode.FAILED.value, text[:1000]))
        for peer in self.peers:
            if not peer.session.bye_received and not peer.disconnected:
                self.peers.send_raw(peer.identity, frame)
        self._mark_closed()
        self._teardown(linger_ms=200)  # the ERROR frames go out before the socket shuts

