"""The producer's peer table: one entry per consumer connection (its session, socket
identity and fd, process watch, release events, outbox), how frames reach it, and how it
leaves (goodbye, protocol error, or loss by the liveness rule of ``core.liveness``: lost
only when its process is provably gone, or its connection closed and it cannot be
watched; silence only makes it stalled). Used under the producer's lock.

- Disconnects (the socket monitor, or a lane's EOF) are applied after the frames that
  arrived before them (``apply_disconnects``): a BYE then a close is a goodbye, not a loss.
- A consumer whose connection closed while its process lives is suspended
  (``on_disconnect``): no new items, its slots kept until its process exits.
- A bad frame (``bad_frame``, rate-limited in the log) gets an ERROR back and ends only
  that peer.
- Heartbeats: a frame sent to a peer sets a flag, and ``tick`` tells its session
  ``spoke(now)``, so a heartbeat goes out only after a quarter heartbeat with nothing sent,
  never while frames flow, at no cost per send."""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Iterable

import zmq

from ...backends import Event
from ...core import protocol as P
from ...core.liveness import HANDSHAKE_S, Verdict
from ...core.protocol import ErrorCode
from ...core.producer_session import ProducerSession, error_frame
from ...core.remote_session import LOSS_HEARTBEATS
from ...core.ratelog import RateLog
from ...core.ring import Ring
from ...errors import ProtocolError
from ..transport.producer_channel import ProducerChannel
from ...system.host import ProcessWatch
from ..transport.lane import Lane

if TYPE_CHECKING:  # (runtime.remote.io is loaded only where a remote edge is: see endpoint)
    from ..remote.io import RemoteWatch

__all__ = ["Peer", "PeerTable"]

log = logging.getLogger(__name__)


class Peer:
    """One consumer connection: its session plus what only I/O knows about it."""

    __slots__ = ("identity", "session", "fd", "watch", "release_events", "release_done", "outbox",
                 "disconnected", "remote", "lane", "lane_ready", "spoke", "flags", "flags_fd", "ready_flags",
                 "memory_sent", "attach_pending")

    def __init__(self, session: ProducerSession, fd: int, watch: ProcessWatch | RemoteWatch | None) -> None:
        self.identity = session.identity
        self.session = session
        self.fd = fd
        # The consumer's process, as the kernel named it where it can (SO_PEERCRED), else as
        # its HELLO claims it when that process exists; None where this producer cannot see
        # it (another PID namespace over tcp). A peer whose process this watch shows alive
        # is never declared lost; silence only makes it "stalled". A remote consumer's: its
        # RemoteWatch (no process to watch on another host).
        self.watch = watch
        self.release_events: list[Event] = []  # per slot, opened from its ATTACH
        self.release_done: list[Callable[[], bool]] = []  # their queries (Event.bound_query)
        self.outbox: deque[bytes] = deque()
        self.disconnected = False  # connection closed without BYE, process alive: holds stay
        # A consumer on another host (core.remote_session): its runtime.remote.io.ProducerEdge,
        # whose SendEvents are its release_events; None for every local consumer.
        self.remote: Any = None
        # Its lane (runtime.transport.lane): ``lane_ready`` once its token and credentials were checked
        # and our SWITCH is queued; ``lane`` once that SWITCH left on ZeroMQ, from when on
        # every frame to it goes on the lane (the ordering rule of runtime.transport.lane).
        self.lane: Lane | None = None
        self.lane_ready: Lane | None = None
        # A frame went out to it since the last tick, which tells the session
        # (``session.spoke``): one flag per send, no call, on the hot path.
        self.spoke = False
        # Memory shared by descriptor (backends.flags): this connection's flag segment, its
        # descriptor until sent (-1 after), its ready flags (one per slot: written when an
        # item is handed to it), whether the memory went out on its lane, and whether its
        # ATTACH came first (then it is admitted once the memory went out). None/-1/False
        # on an edge that shares memory by name.
        self.flags: Any = None
        self.flags_fd = -1
        self.ready_flags: list[Event] | None = None
        self.memory_sent = False
        self.attach_pending = False

    @property
    def label(self) -> str:
        return self.session.label

    def set_release_events(self, events: list[Event]) -> None:
        """Its release events, one per slot (none: it is gone), with their queries."""
        self.release_events = events
        self.release_done = [e.bound_query() for e in events]

    @property
    def stalled(self) -> bool:
        return self.session.clock.stalled


class PeerTable:
    """Consumers by socket identity. ``on_gone(peer)``: a peer left the table (reclaim what
    it held); called once per peer, after its last words were flushed."""

    def __init__(self, chan: ProducerChannel, name: str, ring: Ring, ratelog: RateLog,
                 on_gone: Callable[[Peer], None]) -> None:
        self.chan = chan
        self.name = name  # the endpoint's, for messages
        self.ring = ring
        self.ratelog = ratelog
        self.on_gone = on_gone
        self.by_id: dict[bytes, Peer] = {}
        self.get = self.by_id.get  # (the dict's own get: no Python frame on the hot paths)
        self.fd_peer: dict[int, bytes] = {}
        self.disconnected: list[bytes] = []  # identities whose connection closed
        self.lost_total = 0  # consumers that died, ever
        self.stalled_total = 0  # times a live consumer fell silent past 1.5 heartbeats
        self.bad_frames = 0
        self.bad_by_peer: dict[bytes, int] = {}
        self.handshake_s = HANDSHAKE_S  # HELLO -> ATTACH, else the peer is dropped

    def __len__(self) -> int:
        return len(self.by_id)

    def __iter__(self) -> Any:
        return iter(list(self.by_id.values()))

    def add(self, peer: Peer) -> None:
        self.by_id[peer.identity] = peer
        if peer.fd >= 0:
            self.fd_peer[peer.fd] = peer.identity

    def stalled_now(self) -> int:
        return sum(p.session.clock.stalled for p in self.by_id.values())

    # ------------------------------------------------------------------ sending
    def send(self, peer: Peer, frame: bytes, queue: bool = True) -> bool:
        """Send ``frame`` to ``peer``: on its lane once it has one, else on ZeroMQ. True if
        it went out (or nothing reaches the peer any more: its holds wait for its exit).
        ``queue`` (the default): in order after what the peer has queued, and queued if
        the socket would block. Without it (``flush``, the tick): only an attempt, False
        if the socket would block. One method for both, with no call in between: every
        READY goes through here."""
        if queue and peer.outbox:
            peer.outbox.append(frame)
            return False
        if peer.disconnected:
            return True
        lane = peer.lane
        if lane is not None:
            try:
                ok = lane.send(frame)
            except OSError as exc:  # EPIPE, ECONNRESET: as a closed connection
                self.on_disconnect(peer, f"its lane closed ({exc})")
                return True
        else:
            try:
                ok = self.chan.send(peer.identity, frame)
            except zmq.ZMQError as exc:  # EHOSTUNREACH: the peer's connection is gone
                self.on_disconnect(peer, f"unreachable ({exc})")
                return True
            if ok and frame is P.SWITCH_FRAME:
                # Our last frame on ZeroMQ to this peer has left: the rest go on the lane.
                peer.lane, peer.lane_ready = peer.lane_ready, None
        if ok:
            peer.spoke = True
        elif queue:
            peer.outbox.append(frame)
        return ok

    def send_raw(self, identity: bytes, frame: bytes) -> None:
        """A last word to a connection that is (or will be) no peer of ours; never raises.
        To a peer on a lane it goes on the lane, after what was sent before."""
        peer = self.by_id.get(identity)
        if peer is not None and peer.lane is not None:
            try:
                peer.lane.send(frame)
            except OSError:
                pass
            return
        try:
            self.chan.send(identity, frame)
        except zmq.ZMQError:
            pass

    def flush(self) -> None:
        for peer in list(self.by_id.values()):
            while peer.outbox and peer.identity in self.by_id:
                if not self.send(peer, peer.outbox[0], queue=False):
                    break
                if peer.outbox:
                    peer.outbox.popleft()
            lane = peer.lane
            if lane is not None and lane.tail and peer.identity in self.by_id:
                try:
                    lane.flush()
                except OSError as exc:
                    self.on_disconnect(peer, f"its lane closed ({exc})")

    # ------------------------------------------------------------------ connections
    def monitor(self, events: Iterable[tuple[int, int]]) -> None:
        """Socket monitor events: a closed connection is applied by ``apply_disconnects``."""
        for event, fd in events:
            if event == zmq.EVENT_DISCONNECTED:
                identity = self.fd_peer.pop(fd, None)
                if identity is not None:
                    self.disconnected.append(identity)

    def apply_disconnects(self) -> None:
        """After the frames that arrived before them (a BYE followed by a close is a
        goodbye, not a loss)."""
        while self.disconnected:
            peer = self.by_id.get(self.disconnected.pop())
            if peer is not None:
                self.on_disconnect(peer, "disconnected")

    def bad_frame(self, identity: bytes, peer: Peer | None, exc: ProtocolError,
                  reply: bytes | None = None) -> None:
        """Log (rate-limited), answer ERROR, and end the connection of a known peer. Never
        raises; never touches another peer's state."""
        self.bad_frames += 1
        n = self.bad_by_peer[identity] = self.bad_by_peer.get(identity, 0) + 1
        if len(self.bad_by_peer) > 1024:  # bounded memory under a flood of identities
            self.bad_by_peer.clear()
        who = peer.label if peer else f"unknown peer {identity.hex()[:16]}"
        self.ratelog.warning("frame", "ipcsync producer %r rejected a frame from %s (%d so far): %s",
                             self.name, who, n, exc)
        self.send_raw(identity, reply if reply is not None else error_frame(exc))
        if peer is not None:
            self.drop(peer)

    def drop(self, peer: Peer) -> None:
        """Forget a peer that said goodbye or broke the protocol; reclaim its slots."""
        if self.by_id.get(peer.identity) is not peer:
            return
        self.flush()  # last words (ERROR, BYE) go out before we forget the peer
        del self.by_id[peer.identity]
        if self.fd_peer.get(peer.fd) == peer.identity:
            del self.fd_peer[peer.fd]
        peer.session.close()
        self.bad_by_peer.pop(peer.identity, None)
        self.on_gone(peer)  # never waits on the departed peer's events: it is out of the table
        peer.set_release_events([])
        if peer.watch is not None:
            peer.watch.close()

    def lose(self, peer: Peer, why: str) -> None:
        """A consumer died (or cannot be watched and closed its connection): reclaim what
        it held, serve the others."""
        if peer.identity not in self.by_id:
            return
        held = len(self.ring.held_by(peer.identity))
        if not peer.session.bye_received and peer.session.state not in P.ENDED:
            self.lost_total += 1
            self.ratelog.warning("lost", "ipcsync producer %r lost %s (%s); reclaimed %d slot(s)",
                                 self.name, peer.label, why, held)
            if peer.remote is not None:
                # A remote consumer may be alive (paused): tell it, ahead of anything it
                # would read next, so it serves none of the items it still has buffered.
                self.send_raw(peer.identity, P.encode(P.Error(
                    ErrorCode.DROPPED.value, f"this consumer was dropped ({why}); the items the producer "
                    "had sent it and it had not yet received are lost")))
        self.drop(peer)

    def on_disconnect(self, peer: Peer, why: str) -> None:
        """The consumer's connection closed without BYE. Memory a consumer can still read
        is never reused while its process lives, so a consumer whose process we watch is
        lost only once it has exited (at once if it already has; else its holds stay and
        nothing more is sent to it until the tick sees it gone). One we cannot watch is
        lost now: a closed connection is all we can know."""
        if peer.identity not in self.by_id:
            return
        # A remote consumer reads no memory of ours: its closed connection is loss at once.
        watch = peer.watch if peer.remote is None else None
        exited = watch is not None and watch.gone()
        if watch is None or exited or not peer.session.may_hold:
            self.lose(peer, "process exited" if exited else why)
            return
        if not peer.disconnected:
            peer.disconnected = True
            self.ring.suspend(peer.identity)
            held = len(self.ring.held_by(peer.identity))
            log.warning("ipcsync producer %r: %s closed its connection without goodbye (%s) but its "
                        "process still runs; its %d slot(s) stay held until it exits",
                        self.name, peer.label, why, held)

    # ------------------------------------------------------------------ liveness
    def tick(self, now: float) -> None:
        """Liveness, once a tick (the rule: ``core.liveness``): lost only when provably
        gone (or never ATTACHed within the handshake limit: it holds nothing); silent past
        1.5 heartbeats is stalled: logged, counted, waited for, never reclaimed. A
        heartbeat goes to each peer we have not spoken to for a while."""
        for peer in list(self.by_id.values()):
            # (A peer is remote exactly when its watch is a RemoteWatch, not a ProcessWatch.)
            watch = peer.watch
            gone = watch is not None and watch.gone()
            # (A remote consumer joining its edge cannot speak: neither stalled nor lost.)
            watching = not peer.disconnected and (watch is None or isinstance(watch, ProcessWatch) or watch.joined)
            verdict, why = peer.session.tick(now, gone, watching, self.handshake_s)
            if verdict is Verdict.LOST:
                if gone and watch is not None and not isinstance(watch, ProcessWatch):
                    why = watch.why()  # (silence or a failed edge: no process to have exited)
                self.lose(peer, why)
                continue
            if verdict is Verdict.STALLED:
                self.stalled_total += 1
                if peer.remote is not None:
                    self.ratelog.warning(
                        "stalled",
                        "ipcsync producer %r: remote %s has been silent for %.1f s (heartbeat %.2f s); it is "
                        "lost if still silent past %d heartbeats", self.name, peer.label,
                        peer.session.clock.silent_for(now), peer.session.clock.heartbeat, LOSS_HEARTBEATS)
                else:
                    self.ratelog.warning(
                        "stalled",
                        "ipcsync producer %r: %s has been silent for %.1f s (heartbeat %.2f s) but its "
                        "process is alive: stalled (paused, GC, SIGSTOP?); its %d slot(s) stay held",
                        self.name, peer.label, peer.session.clock.silent_for(now), peer.session.clock.heartbeat,
                        len(self.ring.held_by(peer.identity)))
            elif verdict is Verdict.ANSWERING:
                log.info("ipcsync producer %r: %s is answering again", self.name, peer.label)
            if peer.spoke:
                # Something went out since the last tick: no heartbeat is due for a while.
                # (At most a tick late, so a heartbeat may come a tick later than due.)
                peer.spoke = False
                peer.session.spoke(now)
            if not peer.outbox:
                frame = peer.session.heartbeat(now)
                if frame is not None:
                    self.send(peer, frame, queue=False)

    def close(self) -> None:
        """Teardown: forget every peer without a word."""
        for peer in self.by_id.values():
            if peer.watch is not None:
                peer.watch.close()
        self.by_id.clear()
        self.fd_peer.clear()
