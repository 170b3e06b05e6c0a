"""Step 2 of a handoff, its general branch: order a slot's overwrite after the previous
holders' reads (``runtime.producer.slots`` has the steps; ``Handoffs.begin`` takes this branch
whenever its steady one, one previous reader whose release event is complete already and
no forward of the slot pending, does not apply).

Rule: the writing stream is ordered after each previous holder's release event, as the
endpoint's wait strategy does it (``core.waits``; ``wait="host"``: the host polls it
until complete, pumping, so deaths are noticed); a lost holder's event is never waited
on; a forwarded item of the slot still waiting for downstream events is finished first.
Used under the producer's lock.
"""

from __future__ import annotations

from typing import Any, Callable

from ...core.forwarding import ForwardLedger
from ...core.stats import Stats
from ...core.waits import WaitStrategy
from .handoff_types import ForwardHooks, SlotRecord
from .peers import Peer, PeerTable
from .slot_waits import Waits

__all__ = ["ReaderOrder"]


class ReaderOrder:
    """Step 2's general branch for one producer's slots. ``pub_gen``: the handoffs' list
    (the generation of the item last published in each slot), shared, never copied."""

    def __init__(self, *, peers: PeerTable, ledger: ForwardLedger[Any], wait: WaitStrategy, pub_gen: list[int],
                 shared: bool, timeout: float | None, waits: Waits, stats: Stats) -> None:
        self.peers = peers
        self.ledger = ledger
        self.order_after = wait.order  # (bound once: called per incomplete event)
        self.pub_gen = pub_gen
        self.shared = shared
        self.timeout = timeout  # the producer's default: bounds waits on release events
        self.waits = waits
        self.stats = stats

    def order_after_readers(self, rec: SlotRecord, forwards: ForwardHooks | None) -> None:
        """Step 2: order the overwrite after the previous holders' reads (their release
        events), on ``rec.stream``.

        As the wait strategy orders it (``wait="gpu"``: the stream waits on each event at
        once; ``"host"``: the host polls ``query()``, pumping, so deaths are noticed). A
        holder lost meanwhile is skipped: no wait is ever enqueued on an event a lost peer
        recorded. A forwarded item of this slot still waiting for downstream events is
        finished first (``forwards``: the forwarding port).
        """
        slot, stream = rec.slot, rec.stream
        if self.ledger.pending and slot in self.ledger.pending:
            assert forwards is not None
            forwards.complete(slot)
        peers = self.peers
        for cid in rec.last_holders:
            peer = peers.get(cid)
            if peer is None or not peer.release_events:
                continue
            if self.shared:  # (a flag waits for the generation the peer last got of the slot)
                peer.release_events[slot].value = self.pub_gen[slot]
            # Complete already (query() is ~0.1 us): nothing to order, and no wait to enqueue,
            # which costs far more host time than the query when the event is another
            # process's. The peer re-records this event only after we hand it the slot again,
            # so a completed query() stands until then.
            if peer.release_done[slot]():
                continue
            self.order_after(peer.release_events[slot], stream, self.release_poll(peer, slot))

    def release_poll(self, peer: Peer, slot: int) -> Callable[[Callable[[], bool]], None]:
        """The host wait for ``peer``'s release event of ``slot`` (``WaitStrategy.order``'s
        ``poll``): pumping until ``done()`` or the peer is lost (its event is then never
        waited on); IpcTimeoutError after the producer's timeout."""
        peers, cid = self.peers, peer.identity

        def poll(done: Callable[[], bool]) -> None:
            t = self.timeout
            if not self.waits.wait_until(lambda: peers.get(cid) is not peer or done(),
                                         t, "release_event", self.stats.waited, poll_event=True):
                raise self.waits.timeout_error(
                    f"{peer.label} did not finish with slot {slot}", t,
                    "its GPU work on the slot is still running (or wedged)",
                )

        return poll
