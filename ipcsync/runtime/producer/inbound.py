"""What arrives at a producer, handled in order, without blocking: the general pump
(``pump``: monitor events, ZeroMQ frames, then lane frames and events, disconnects, then
what they made due: forwards to release upstream, kept slots to free, queued items to
dispatch, sends to confirm, frames to flush, and the liveness tick) and the steady pump
(``pump_steady``: only the lanes' RELEASEs, while nothing else needs a look). A steady
RELEASE goes straight to the handoffs (``Handoffs.released``); any other frame to the
consumer's connection (``runtime.producer.connections``).

Rules: frames are handled in the order they arrived, ZeroMQ's before the lanes' (a
consumer's SWITCH opens its lane for reading, and its lane frames all follow it); a
disconnect is applied after the frames that arrived before it; the steady pump leaves
nothing unread: whatever it does not handle goes to the general pump, in order. Used
under the producer's lock (``ProducerPort`` binds both pumps as its own).
"""

from __future__ import annotations

import time
from typing import Any, Sequence

from ... import interrupts
from ..transport.channel import ProducerChannel
from .connections import Connections
from .forwarder import Forwarder
from ..transport.lane import polled_form
from .peers import PeerTable
from .remote_join import confirm_sends
from .slots import Handoffs

__all__ = ["Inbound"]


class Inbound:
    """One producer's pumps (see the module docstring). Built before the handoffs (whose
    waits pump through it), then given the parts it hands frames to (``serve``).
    ``remote_hub``: the producer's ``runtime.remote.io.RemoteHub``, made at the first remote
    HELLO (``runtime.producer.remote_join``); ``tick``: seconds between liveness ticks."""

    def __init__(self, chan: ProducerChannel, peers: PeerTable, tick: float) -> None:
        self.chan = chan
        self.peers = peers
        self.tick = tick
        self.next_tick = 0.0
        self.remote_hub: Any = None
        # Every attached consumer's frames travel on its lane (its SWITCH received), and at
        # least one is attached: set by each general pump (a consumer is added, and its
        # SWITCH read, only there), read by the steady pump.
        self.lanes_steady = False
        self.handoffs: Handoffs  # (set by serve)
        self.forwarder: Forwarder
        self.connections: Connections

    def serve(self, handoffs: Handoffs, forwarder: Forwarder, connections: Connections) -> None:
        """The parts frames go to, once the port has built them."""
        self.handoffs = handoffs
        self.forwarder = forwarder
        self.connections = connections

    def pump_steady(self) -> None:
        """The steady pump (a send that found every slot taken; ``AsyncSlotWait.slot_free``):
        read the lanes that have frames and hand each consumer's RELEASEs to the handoffs in
        one call per wake-up (``ProducerSession.release_frames``, then ``Handoffs.released``);
        anything else goes to ``pump``, in order, losing nothing. Lock held.

        Each condition below needs the general pump's look, for the reason beside it.
        ZeroMQ is not read here: after a consumer's SWITCH only its monitor's events and
        newcomers' handshakes come there, read by ``pump`` at the next tick, or in a wait
        (the port's ``_wait_until``) as soon as ZeroMQ has input (``io_pending``)."""
        peers = self.peers
        if (not self.lanes_steady  # a consumer's frames come on ZeroMQ (no lane or no SWITCH yet), or none attached
                or self.forwarder.ledger.pending  # forwarded items wait for downstream release events: polled
                or self.handoffs.kept_slots  # slot() tensors that outlived their block: polled
                or self.remote_hub is not None  # remote edges: completed sends to confirm
                or time.monotonic() >= self.next_tick):  # the tick: liveness, heartbeats, monitor, half-open
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
        recv, on_frame, on_lane = chan.recv, self.on_frame, self.connections.on_lane
        for _ in range(10_000):  # bounded, so a flood cannot starve the caller
            got = recv()
            if got is None:
                break
            on_frame(*got)
        lanes = chan.lanes
        if lanes is not None:
            # After the ZeroMQ frames: a consumer's SWITCH among them opened its lane for
            # reading, and its lane frames all follow that SWITCH (runtime.transport.lane).
            polled = lanes.poll()
            if taken:
                polled[:0] = taken
            for what, identity, data in polled:
                if what == "frame":
                    if identity in peers.by_id:
                        on_frame(identity, [data], -1)
                else:
                    on_lane(what, identity, data)
        peers.apply_disconnects()  # after the frames that arrived before them
        fwd = self.forwarder
        if fwd.ledger.pending:
            fwd.poll()
        if self.handoffs.kept_slots:
            self.handoffs.free_kept_slots()
        self.handoffs.dispatch()
        if self.remote_hub is not None:
            confirm_sends(peers)
        peers.flush()
        self.lanes_steady = lanes is not None and bool(peers.by_id) and all(
            p.lane is not None and p.session.switch_received for p in peers.by_id.values())
        now = time.monotonic()
        if now >= self.next_tick:
            self.next_tick = now + self.tick
            peers.tick(now)
            interrupts.protect()  # (back in place if the program's framework put the default back)

    def on_frame(self, identity: bytes, frames: list[bytes], fd: int) -> None:
        """A ZeroMQ frame (or a lane frame the general pump read) from ``identity``."""
        peer = self.peers.get(identity)
        if peer is not None and len(frames) == 1:
            # Steady state: a RELEASE from an attached consumer, which leaves it active.
            entries = peer.session.release_entries(frames[0], time.monotonic())
            if entries is not None:
                self.handoffs.released(peer, entries)
                return
        self.connections.on_frame(identity, peer, frames, fd)  # anything else: control frames
