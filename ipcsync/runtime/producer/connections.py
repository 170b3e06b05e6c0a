"""A producer's consumers, connection by connection, from HELLO to leaving: who may
attach (``runtime.producer.admission``), the SETUP that describes our ring, the lane and SWITCH,
ATTACH and admission, the control frames (BYE, ERROR, bad frames), and what a consumer's
leaving frees. The steady RELEASE is not here: the port hands it straight to the
handoffs (``ProducerPort.on_frame``, ``pump_steady``).

Rules kept here: a consumer is watched by the kernel's pid for its connection, never the
one its HELLO claims (``admission.watch_for``); sharing by descriptor, its memory goes
out on its lane before our SWITCH, and it is admitted (takes items) only once that
memory went out (``runtime.transport.memory_wire``); a consumer that attaches while the producer
closes is told goodbye once nothing is queued. Used under the producer's lock.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable

from ...backends import Backend
from ...core import protocol as P
from ...core.producer_session import Kind, ProducerSession
from ...errors import ProtocolError
from ...system import host
from .admission import credentials_problem, hello_problem, is_remote, watch_for
from ..transport.channel import ProducerChannel
from .forwarder import Forwarder
from .peers import Peer, PeerTable
from .sharing import DescriptorSharing
from .slots import Handoffs

__all__ = ["Connections"]

log = logging.getLogger(__name__)


class Connections:
    """The consumers' connections of one producer (see the module docstring).
    ``closing()``: whether the producer is closing; ``join_remote(identity, session, fd)``:
    serves a consumer on another host (``runtime.producer.remote_join``)."""

    def __init__(self, *, chan: ProducerChannel, peers: PeerTable, handoffs: Handoffs, forwarder: Forwarder,
                 backend: Backend, device: Any, arena: Any, stride: int, sharing: DescriptorSharing | None,
                 ipc: bool, heartbeat: float, name: str, closing: Callable[[], bool],
                 join_remote: Callable[[bytes, ProducerSession, int], None]) -> None:
        self.chan = chan
        self.peers = peers
        self.handoffs = handoffs
        self.forwarder = forwarder
        self.backend = backend
        self.device = device
        self.arena = arena
        self.stride = stride
        self.sharing = sharing
        self.heartbeat = heartbeat
        self.name = name
        self.closing = closing
        self.join_remote = join_remote
        self.limits = handoffs.limits
        self.ipc = ipc  # the kernel can name the peer of a connection (SO_PEERCRED)
        self.pid = os.getpid()
        self.attached_total = 0  # consumers that completed the handshake, ever

    # ------------------------------------------------------------------ frames
    def on_frame(self, identity: bytes, peer: Peer | None, frames: list[bytes], fd: int) -> None:
        """A frame that is not a steady RELEASE (``peer``: its sender, None if unknown)."""
        peers = self.peers
        if len(frames) != 1:
            peers.bad_frame(identity, peer, ProtocolError(f"expected 1 frame, got {len(frames)}"))
            return
        if peer is None:
            try:
                msg = P.decode(frames[0], self.limits)
            except ProtocolError as exc:
                peers.bad_frame(identity, None, exc)
                return
            if type(msg) is P.Hello:
                self.on_hello(identity, msg, fd)
            elif type(msg) is not P.Bye:
                peers.bad_frame(identity, None, ProtocolError(
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
            peers.send(peer, ev.reply)
            peers.drop(peer)
        elif kind is Kind.PEER_ERROR:
            peers.ratelog.warning("peer_error", "ipcsync: %s reported an error: %s: %s",
                                  peer.label, ev.data.code, ev.data.message)
            peers.drop(peer)
        elif kind is Kind.BAD_FRAME:
            peers.bad_frame(identity, peer, ev.data, ev.reply)
        elif kind is Kind.SWITCHED:
            lanes = self.chan.lanes
            if lanes is None or lanes.read(identity) is None:
                bad = peer.session.bad_frame(ProtocolError("SWITCH, but this consumer's lane is gone"))
                peers.bad_frame(identity, peer, bad.data, bad.reply)

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
            if why is not None:  # (its memory goes first on the lane: runtime.transport.memory_wire's ordering rule)
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

    # ------------------------------------------------------------------ joining
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
        session = ProducerSession(identity, hello, time.monotonic(), self.heartbeat, self.limits)
        if is_remote(hello):
            self.join_remote(identity, session, fd)
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
            ready_events=ready_events, heartbeat_ms=int(self.heartbeat * 1000))

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
        if self.closing() and h.ring.queued == 0:
            self.say_bye(peer, "producer closed")
        h.dispatch()

    # ------------------------------------------------------------------ leaving
    def say_bye(self, peer: Peer, reason: str) -> None:
        frame = peer.session.bye(reason)
        if frame is not None:
            self.peers.send(peer, frame)

    def bye_all(self) -> None:
        """close(): BYE every consumer (each gives back at it the slots its program still
        views, the reference rule)."""
        for peer in self.peers:
            self.say_bye(peer, "producer closed")

    def tell_failed(self, text: str) -> None:
        """abort(): ERROR ``failed`` (``text``) to every consumer still here."""
        frame = P.encode(P.Error(P.ErrorCode.FAILED.value, text[:1000]))
        for peer in self.peers:
            if not peer.session.bye_received and not peer.disconnected:
                self.peers.send_raw(peer.identity, frame)

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
