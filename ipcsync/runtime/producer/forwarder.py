"""The forwarding producer's half of zero-copy forwarding (``ipcsync.forward``): send a
received item on without a copy, and release it upstream when the last downstream holder
is done. The bookkeeping and its invariants are ``core.forwarding``; the handoff steps
are ``runtime.producer.slots``; the lending consumer is reached only through ``ForwardOrigin``
(``runtime.handover``), obtained from the item's public ``origin``.

``Forwarder.forward``: take the item from its origin, check it can go on without a copy
(one backend, the item on the producer's device, every attached consumer ``can_reach`` it;
else ``CannotForward`` and the caller copies), then the handoff steps writing nothing:
``begin`` (reserve, order after the previous readers), a wait on the upstream ready event
(forwarding invariant 2), ``finish`` (record ours, a FOREIGN first where needed, then a
FREADY). ``freed``, ``poll``, ``complete`` and ``abandon`` carry out invariants 3-5, as the
producer's wait strategy says. A ``tcp://`` producer copies when a remote consumer is
attached or the item would wait queued; memory shared by descriptor is never forwarded
without a copy (``runtime.consumer.foreign``).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from ...backends import Backend, Event
from ...core import protocol as P
from ...core.forwarding import ForeignRegistry, Forwarded, ForwardLedger
from ...core.layout import place_views
from ..handover import CannotForward, ForwardOrigin, ForwardSource, Pumpable
from .peers import Peer, PeerTable
from .slots import Handoffs

__all__ = ["Forwarder", "forward_key"]

log = logging.getLogger(__name__)

Wait = tuple[Peer, Event]


def forward_key(src: ForwardSource) -> tuple[Any, ...]:
    """Which arena an item lies in (its owner's export, which names it for good)."""
    return (src.backend, src.pid, src.start_time, src.handle)


def _complete(w: Wait) -> bool:
    return w[1].query()


class Forwarder:
    """Forwards items zero-copy into the slots of one producer (see the module docstring)."""

    def __init__(self, *, handoffs: Handoffs, peers: PeerTable, backend: Backend, device: Any,
                 lock: threading.Lock, enter: Callable[[], None], touch: Callable[[], None],
                 default_stream: Any, name: str) -> None:
        self.handoffs = handoffs
        self.peers = peers
        self.ledger: ForwardLedger[Wait] = handoffs.ledger
        self.registry = ForeignRegistry(handoffs.limits.max_foreign)
        self.backend = backend
        self.device = device
        self.lock = lock
        self.enter = enter  # refuses a send on a closed (or closing) producer; lock held
        self.touch = touch  # the user's thread was here
        self.default_stream = default_stream
        self.name = name
        self.reach: dict[tuple[Any, Any], bool] = {}
        self.forwarded_total = 0
        # A tcp producer (set by its port): a consumer on another host may attach at any
        # time, and one must never be handed a zero-copy forward (see ``check_queued``).
        self.remote_capable = False
        handoffs.forwards = self

    def _live(self, w: Wait) -> bool:
        return self.peers.get(w[0].identity) is w[0]

    # ------------------------------------------------------------------ forwarding
    def forward(self, item: Any, message: Any, meta: Any, timeout: float | None, stream: Any,
                out: Pumpable, origin: ForwardOrigin) -> int:
        """Send ``message`` (views of received ``item``, lent by ``origin``) without a copy;
        returns its seq. Raises CannotForward (nothing sent, the item untouched) when
        zero-copy is not possible, and what send() raises otherwise. Takes the lock."""
        info = origin.take(item, out)  # ownership moves; undone below if we do not send
        published = False
        try:
            placed = place_views(message, info.region)
            if isinstance(placed, str):
                raise CannotForward(placed)
            layout, data_bytes = placed
            h = self.handoffs
            with self.lock:
                self.enter()
                try:
                    self.check(origin, info)
                    plan = h.planner.forward_plan(layout, data_bytes)
                    foreign = self.registry.arena_for(forward_key(info), lambda fid: P.encode(P.Foreign(
                        fid, info.backend, info.device, info.pid, info.start_time, info.handle, info.arena_bytes)))
                    if foreign is None:
                        raise CannotForward(
                            f"items of {self.registry.max_foreign} other arenas are in flight already")
                    # Steps 1-2. Nothing is written to our slot, but its previous holders'
                    # release events are waited on as for a send: they re-record them for
                    # this item, perhaps on another stream, and a later send to the slot
                    # waits only on their latest record.
                    rec = h.begin(timeout, stream if stream is not None else self.default_stream)
                    slot = rec.slot
                    try:
                        s = rec.stream
                        if s is None:  # (a host-synchronous backend: its events ignore streams)
                            s = self.backend.current_stream()
                        if self.ledger.pending and slot in self.ledger.pending:
                            self.complete(slot)  # (begin did, where it had readers to order after)
                        # (The waits above pump: a remote consumer may have come meanwhile.)
                        self.check_queued()
                        # Step 3 (forwarding invariant 2): the downstream ready wait covers
                        # the upstream write through ours.
                        info.ready_event.wait(s)
                        self.ledger.hold(slot, Forwarded(item, origin, s, foreign))
                        seq = h.finish(rec, plan, meta, s, (foreign, info.offset, info.nbytes))  # 3b-4
                    except BaseException:
                        if h.ring.abandon(slot):
                            self.ledger.unhold(slot)
                        else:  # committed, then interrupted in its dispatch: it went out
                            published = True
                            self.ledger.published(slot)
                            self.forwarded_total += 1
                        raise
                    published = True
                    self.ledger.published(slot)
                    self.forwarded_total += 1
                    return seq
                finally:
                    self.touch()
        except BaseException:
            if not published:  # (a published item is downstream's now, whatever came after)
                origin.undo(item)
            raise

    def check_queued(self) -> None:
        """CannotForward (the item travels by copy) if a consumer on another host is here,
        or, on a producer that can take such consumers, if the item would wait queued: a
        remote consumer attaching meanwhile would be handed it (it cannot open another
        host's memory). Lock held, just before the item is published."""
        if not self.remote_capable:
            return
        for peer in self.peers:
            if peer.remote is not None:
                raise CannotForward(f"{peer.label} is on another host: its items travel by copy")
        if not self.handoffs.ring.would_dispatch():
            raise CannotForward("no consumer can take the item now, and on a tcp endpoint a consumer on "
                                "another host could attach before one does: it travels by copy")

    def check(self, origin: ForwardOrigin, info: ForwardSource) -> None:
        """CannotForward unless the consumers of this producer can open ``info``'s memory."""
        backend = self.backend
        for peer in self.peers:
            if peer.remote is not None:
                raise CannotForward(f"{peer.label} is on another host: its items travel by copy")
        if info.backend != backend.name:
            raise CannotForward(f"the item is in {info.backend} memory and this producer is on {self.device}")
        if origin.device != self.device:
            raise CannotForward(
                f"the item was received on {origin.device} and this producer is on {self.device}; "
                "forward on the device the item was received on")
        for peer in self.peers:  # (whether a reader reaches the memory is the backend's rule)
            key = (peer.session.hello.device, info.device)
            ok = self.reach.get(key)
            if ok is None:
                ok = self.reach[key] = backend.can_reach(peer.session.hello.device, info.device)
            if not ok:
                raise CannotForward(
                    f"{peer.label} runs on device {peer.session.hello.device}, which cannot read (or "
                    f"this process cannot tell whether it can read) the item's device {info.device}")

    # ------------------------------------------------------------------ upstream release
    def downstream_waits(self, slot: int) -> list[Wait]:
        """The release event of each connected consumer that released ``slot``, set to
        wait for the generation it was handed (the slot's last published one)."""
        h = self.handoffs
        waits = []
        released: frozenset[Any] = h.ring.released_by(slot)  # (the ring's consumer ids: identities)
        for cid in released:
            peer = self.peers.get(cid)
            if peer is not None and peer.release_events:
                ev = peer.release_events[slot]
                ev.value = h.pub_gen[slot]
                waits.append((peer, ev))
        return waits

    def freed(self, slot: int) -> None:
        """Every downstream holder of forwarded ``slot`` has released it or is gone:
        release the upstream item now (wait="host": once their release events are
        complete). Lock held."""
        done = self.ledger.freed(slot, self.downstream_waits(slot), _complete,
                                 host=self.handoffs.wait.polls)
        if done is not None:
            self._finish(*done)

    def _finish(self, fwd: Forwarded, waits: list[Wait]) -> None:
        for w in waits:
            if self._live(w):  # never wait on a lost peer's event
                w[1].wait(fwd.stream)
        fwd.origin.done(fwd.item, fwd.stream)

    def poll(self) -> None:
        """wait="host": release upstream the forwarded items whose downstream release
        events have completed (lost holders no longer count). Lock held."""
        for slot, waits in self.ledger.poll(self._live, _complete):
            done = self.ledger.finish(slot, waits)
            if done is not None:
                self._finish(*done)

    def complete(self, slot: int) -> None:
        """Slot ``slot`` is acquired again while its forwarded item still waits for
        downstream release events (wait="host"): finish that first, since its holders
        re-record those events only for a later item of this slot. Lock held."""
        def done() -> bool:
            self.poll()
            return slot not in self.ledger.pending

        h = self.handoffs
        t = h.timeout
        if not h.waits.wait_until(done, t, "release_event", h.stats.waited, poll_event=True):
            raise h.waits.timeout_error(
                f"downstream consumers did not finish with forwarded slot {slot}", t,
                "their GPU work on the item is still running (or wedged)")

    def abandon(self) -> None:
        """close()/teardown: release upstream every forwarded item still here. Holders that
        released it are waited on as usual (wait="host": only events already complete,
        never wedging the close); holders still holding it are warned about. Lock held."""
        h = self.handoffs
        held = 0
        for slot in self.ledger.outstanding_slots():
            waits = [w for w in self.downstream_waits(slot) if h.wait.may_enqueue(w[1])]
            if h.ring.holders[slot] or slot in self.ledger.pending:
                held += 1
            done = self.ledger.finish(slot, waits)
            if done is not None:
                self._finish(*done)
        if held:
            log.warning(
                "ipcsync producer %r closing with %d forwarded item(s) still held by consumers; "
                "released upstream anyway: the upstream producer may now overwrite memory they read",
                self.name, held)
