"""A Producer's port: its internal composition, as other parts of ipcsync use it (not user
API). It is ``Pumpable`` (``runtime.handover``: a Consumer that lent items to this
producer pumps it while it waits), the entry of ``ipcsync.forward`` (``forward``) and of
``Producer.slot()`` blocks (``open_slot``/``close_slot``), and it handles what arrives:
monitor events, frames (through each consumer's ``ProducerSession``), the handshake, the
liveness tick. Used under the producer's lock except where a method says it takes it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable, NamedTuple, Sequence

import zmq

from ..backends import Arena, Backend
from ..core import protocol as P
from ..core.producer_session import Kind, ProducerSession
from ..core.remote_session import READY_PLACEHOLDER
from ..core.ratelog import best_effort
from ..errors import ProtocolError, SlotKeptError
from . import host
from .admission import credentials_problem, hello_problem, is_remote, watch_for
from .channel import ProducerChannel
from .forwarder import Forwarder
from .peers import Peer, PeerTable
from .slots import Handoffs, SlotRecord

__all__ = ["ProducerPort", "SlotTicket"]

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


class ProducerPort:
    """See the module docstring. ``gate``: refuses a send on a closed or closing producer
    (and notes that the user's thread is here); ``check_open``: refuses any call on a
    closed one."""

    def __init__(self, *, owner: Any, lock: threading.Lock, chan: ProducerChannel, peers: PeerTable,
                 handoffs: Handoffs, forwarder: Forwarder, backend: Backend, arena: Arena, stride: int,
                 heartbeat: float, tick: float, gate: Callable[[], None], check_open: Callable[[], None],
                 default_stream: Any, name: str, ipc: bool) -> None:
        self.owner = owner  # the Producer (its public ``closed`` only)
        self.lock = lock
        self.chan = chan
        self.peers = peers
        self.handoffs = handoffs
        self.forwarder = forwarder
        self.backend = backend
        self.arena = arena
        self.stride = stride
        self.heartbeat = heartbeat
        self.tick = tick
        self.next_tick = 0.0
        self.gate = gate
        self.check_open = check_open
        self.default_stream = default_stream
        self.name = name
        self.ipc = ipc  # the kernel can name the peer of a connection (SO_PEERCRED)
        self.closing = False
        self.attached_total = 0  # consumers that completed the handshake, ever
        self.pid = os.getpid()
        self.remote_hub: Any = None  # runtime.remote.RemoteHub, made at the first remote HELLO
        forwarder.remote_capable = not ipc  # (remote consumers attach on tcp endpoints only)

    # ------------------------------------------------------------------ Pumpable
    @property
    def closed(self) -> bool:
        return bool(self.owner.closed)

    def io_fds(self) -> Sequence[int]:
        return self.chan.fds()

    def io_pending(self) -> bool:
        return self.chan.pending()

    def pump(self) -> None:
        """Handle everything that has arrived, without blocking. Lock held."""
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
            for what, identity, data in lanes.poll():
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
        now = time.monotonic()
        if now >= self.next_tick:
            self.next_tick = now + self.tick
            peers.tick(now)

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
        lock = self.lock
        while not lock.acquire(timeout=0.005):
            if stopped():
                return
        try:
            if not self.owner.closed:
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
            peer.lane_ready = data
            self.peers.send(peer, peer.session.switch())
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
        problem = (hello_problem(hello, self.backend, self.owner.device, remote_ok=not self.ipc)
                   or credentials_problem(hello, cred))
        if problem is not None:
            code, text = problem
            self.peers.ratelog.warning("hello", "ipcsync producer %r refused consumer pid %d: %s",
                                       self.name, hello.pid, text)
            self.peers.send_raw(identity, P.encode(P.Error(code, text)))
            return
        session = ProducerSession(identity, hello, time.monotonic(), self.heartbeat, self.handoffs.limits)
        if is_remote(hello):
            self.on_remote_hello(identity, session, fd)
            return
        peer = Peer(session, fd, watch_for(hello, cred))
        self.peers.add(peer)
        h = self.handoffs
        setup = P.Setup(
            version=hello.version,  # the consumer's: an older one gets its version's SETUP (no lane)
            pid=self.pid,
            start_time=host.start_time(self.pid),
            pid_ns=host.pid_namespace(),
            backend=self.backend.name,
            device=self.backend.device_identity(),
            arenas=[self.arena.export()],
            arena_bytes=[self.arena.nbytes],
            slots=[(0, i * self.stride, h.slot_bytes) for i in range(h.slots)],
            ready_events=[e.handle() for e in h.ready_events],
            heartbeat_ms=int(self.heartbeat * 1000),
        )
        self.peers.send(peer, session.setup(setup))
        lanes = self.chan.lanes
        if lanes is not None and session.lane_capable:
            token = lanes.offer(identity, cred[0] if cred is not None else None)
            self.peers.send(peer, session.lane_offer(lanes.path, token))

    def on_remote_hello(self, identity: bytes, session: ProducerSession, fd: int) -> None:
        """A consumer on another host (core.remote_session): a remote edge, whose SETUP
        names the edge's rendezvous instead of our memory and events."""
        from .remote import RemoteHub, RemoteWatch  # noqa: PLC0415 (torch.distributed only when used)

        h = self.handoffs
        try:
            if self.remote_hub is None:
                self.remote_hub = RemoteHub(self.owner.endpoint, self.owner.device, h.slot_views, h.ready_events,
                                            self.name)
                self.remote_hub.on_sent = self.confirm_from_thread
                # A remote consumer's release events are its sends, complete only later, on
                # any backend: step 2 orders after them from now on.
                h.order_events = True
            edge = self.remote_hub.new_edge(session.label, session.hello.backend)
        except Exception as exc:  # noqa: BLE001 (refuse this consumer, serve the others)
            text = f"this producer cannot open a remote edge: {exc}"
            self.peers.ratelog.warning("hello", "ipcsync producer %r refused remote consumer %s: %s",
                                       self.name, session.label, text)
            self.peers.send_raw(identity, P.encode(P.Error(P.ErrorCode.BACKEND.value, text)))
            return
        peer = Peer(session, fd, RemoteWatch(session.clock, edge, joined=False))  # joined at its ATTACH
        peer.remote = edge
        self.peers.add(peer)
        setup = P.Setup(
            version=session.hello.version, pid=self.pid, start_time=host.start_time(self.pid),
            pid_ns=host.pid_namespace(), backend=self.backend.name, device=self.backend.device_identity(),
            arenas=[edge.address.encode()], arena_bytes=[self.arena.nbytes],
            slots=[(0, i * self.stride, h.slot_bytes) for i in range(h.slots)],
            ready_events=[READY_PLACEHOLDER] * h.slots, heartbeat_ms=int(self.heartbeat * 1000),
        )
        self.peers.send(peer, session.setup(setup))

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
            peer.release_events = list(peer.remote.release_events)
            watch = peer.watch  # (a remote peer's: its RemoteWatch)
            if watch is not None and not isinstance(watch, host.ProcessWatch):
                watch.joined = True  # from now on its silence is loss (its ATTACH: just heard)
        else:
            try:
                # Opened on our GPU, whichever GPU the consumer records them on (see
                # CudaBackend.open_event).
                peer.release_events = [self.backend.open_event(e) for e in msg.release_events]
            except Exception as exc:
                bad = peer.session.bad_frame(ProtocolError(f"cannot open release events: {exc}"))
                self.peers.bad_frame(peer.identity, peer, bad.data, bad.reply)
                return
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
        if self.forwarder.ledger.pending:
            self.forwarder.poll()  # it may have been the one a forward still waited for
        self.backend.collect()
        self.handoffs.dispatch()

    def teardown(self, linger_ms: int = 0) -> None:
        """Free everything (the Producer's ``_teardown``). ``linger_ms``: how long frames
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
        with self.lock:
            self.gate()
            plan, recipe = h.empty_plan_for(spec)
            s = stream if stream is not None else self.default_stream
            rec = h.begin(timeout, s)
            try:
                store = h.slot_store(rec.slot).for_item()
                views = recipe.build_in(store)
                store.seal()
            except BaseException:
                h.ring.abort(rec.slot)
                raise
        return _new_tuple(SlotTicket, (rec, plan, s, store)), views

    def close_slot(self, ticket: SlotTicket, meta: Any, ok: bool) -> None:
        """Steps 3b-4 for a ``Producer.slot()`` block that ended (``ok``: without raising;
        else the slot is given back): ``Handoffs.finish``. Takes the lock."""
        h = self.handoffs
        slot = ticket.rec.slot
        with self.lock:
            if ticket.store.in_use():
                # A tensor of the block outlived it: a write through it would change the
                # item after it was sent. Not sent; the slot waits until it is gone.
                h.kept_slots[slot] = ticket.store
                if ok:
                    raise SlotKeptError(
                        f"a tensor taken from this Producer.slot() block on {self.name!r} is "
                        "still referenced after the block ended, so the item was not sent (a write through "
                        "it would change an item already sent); keep no reference to s[name] past the "
                        "block: del it before the block ends, or use s[name] without naming it")
                return
            if not ok:  # the block raised: nothing is sent
                h.ring.abort(slot)
                return
            self.check_open()  # (and notes that the user's thread was here)
            try:
                # The block wrote on its own stream, or the current one at its end.
                h.finish(ticket.rec, ticket.plan, meta, ticket.stream)
            except BaseException:
                h.ring.abandon(slot)
                raise
