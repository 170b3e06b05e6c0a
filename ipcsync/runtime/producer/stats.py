"""``Producer.stats()``: the counters of a producer's parts gathered into one typed
snapshot (``core.stats.ProducerStats``). Read under the producer's lock."""

from __future__ import annotations

from ...core.stats import Occupancy, ProducerStats, Stats
from .connections import Connections
from .forwarder import Forwarder
from .slots import Handoffs

__all__ = ["producer_stats"]


def producer_stats(stats: Stats, handoffs: Handoffs, connections: Connections, forwarder: Forwarder) -> ProducerStats:
    """The snapshot now: the handoffs' totals and occupancy, the consumers (attached,
    lost, stalled, on a lane), bad frames, forwards."""
    ring, peers = handoffs.ring, connections.peers
    return ProducerStats(
        **stats.totals(), role="producer", occupancy=Occupancy.of(ring.occupancy()),
        consumers=len(ring.consumers()), consumers_attached=connections.attached_total,
        consumers_lost=peers.lost_total, consumers_stalled=peers.stalled_now(),
        consumers_stalled_total=peers.stalled_total, bad_frames=peers.bad_frames,
        forwarded=forwarder.forwarded_total, forwarded_held=forwarder.ledger.count(),
        layouts_inline=handoffs.layouts_inline, lanes=connections.lanes_used,
    )
