"""A consumer on another host joins a producer (``core.remote_session``): a remote edge,
whose SETUP names the edge's rendezvous instead of the producer's memory and events. The
producer's hub of remote edges (``runtime.remote.RemoteHub``) is made at the first such
HELLO; torch.distributed is imported only then."""

from __future__ import annotations

from typing import Any

from ..core import protocol as P
from ..core.producer_session import ProducerSession
from ..core.remote_session import READY_PLACEHOLDER
from .peers import Peer

__all__ = ["join_remote"]


def join_remote(port: Any, identity: bytes, session: ProducerSession, fd: int) -> None:
    """Serve ``session``'s consumer (on another host) from ``port`` (a ``ProducerPort``,
    lock held), or refuse it with the reason if no remote edge can be opened."""
    from .remote import RemoteHub, RemoteWatch  # noqa: PLC0415 (torch.distributed only when used)

    h = port.handoffs
    try:
        if port.remote_hub is None:
            port.remote_hub = RemoteHub(port.endpoint, port.device, h.slot_views, h.ready_events, port.name)
            port.remote_hub.on_sent = port.confirm_from_thread
            # A remote consumer's release events are its sends, complete only later, on
            # any backend: step 2 orders after them from now on.
            h.order_events = True
        edge = port.remote_hub.new_edge(session.label, session.hello.backend)
    except Exception as exc:  # noqa: BLE001 (refuse this consumer, serve the others)
        port.refuse(identity, session.hello.pid, P.ErrorCode.BACKEND.value,
                    f"this producer cannot open a remote edge: {exc}")
        return
    peer = Peer(session, fd, RemoteWatch(session.clock, edge, joined=False))  # joined at its ATTACH
    peer.remote = edge
    port.peers.add(peer)
    setup = port.setup_for(session.hello.version, edge.address.encode(), [READY_PLACEHOLDER] * h.slots)
    port.peers.send(peer, session.setup(setup))
