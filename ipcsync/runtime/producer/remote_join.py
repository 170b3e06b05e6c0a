"""A consumer on another host joins a producer (``core.remote_session``): a remote edge,
whose SETUP names the edge's rendezvous instead of the producer's memory and events. The
producer's hub of remote edges (``runtime.remote.io.RemoteHub``) is made at the first such
HELLO; torch.distributed is imported only then. And what confirms its sends: SENT
(``confirm_sends``, core.remote_session 7)."""

from __future__ import annotations

from typing import Any

from ...core import protocol as P
from ...core.producer_session import ProducerSession
from ...core.remote_session import READY_PLACEHOLDER
from .peers import Peer, PeerTable

__all__ = ["join_remote", "confirm_sends"]


def join_remote(port: Any, identity: bytes, session: ProducerSession, fd: int) -> None:
    """Serve ``session``'s consumer (on another host) from ``port`` (a ``ProducerPort``,
    lock held), or refuse it with the reason if no remote edge can be opened."""
    from ..remote.io import RemoteHub, RemoteWatch  # noqa: PLC0415 (torch.distributed only when used)

    h, inbound = port.handoffs, port.inbound
    try:
        if inbound.remote_hub is None:
            inbound.remote_hub = RemoteHub(port.endpoint, port.device, h.slot_views, h.ready_events, port.name)
            inbound.remote_hub.on_sent = port.confirm_from_thread
            # A remote consumer's release events are its sends, complete only later, on
            # any backend: step 2 orders after them from now on.
            h.order_events = True
        edge = inbound.remote_hub.new_edge(session.label, session.hello.backend)
    except Exception as exc:  # noqa: BLE001 (refuse this consumer, serve the others)
        port.connections.refuse(identity, session.hello.pid, P.ErrorCode.BACKEND.value,
                                f"this producer cannot open a remote edge: {exc}")
        return
    peer = Peer(session, fd, RemoteWatch(session.clock, edge, joined=False))  # joined at its ATTACH
    peer.remote = edge
    port.peers.add(peer)
    setup = port.connections.setup_for(session.hello.version, edge.address.encode(),
                                       [READY_PLACEHOLDER] * h.slots)
    port.peers.send(peer, session.setup(setup))


def confirm_sends(peers: PeerTable) -> None:
    """SENT to each remote consumer whose edge completed sends since its last SENT
    (core.remote_session 7). Only consumers still in the peer table are confirmed, and
    a dropped one's edge is closed (its ledger with it) before its slots are reclaimed."""
    for peer in peers:
        edge = peer.remote
        if edge is not None:
            seq = edge.to_confirm()
            if seq is not None:
                peers.send(peer, peer.session.sent(seq))
