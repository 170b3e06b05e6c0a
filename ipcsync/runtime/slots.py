"""The steps of a handoff, each defined once (send(), slot() and zero-copy forwarding all
go through them), with the ordering rule each keeps:

1. ``reserve``: a FREE slot. Rule: a slot is reused only after every consumer it went to
   has released it or is gone (the ring's invariant); backpressure blocks, never drops.
2. ``order_after_readers``: the overwrite is ordered after the previous holders' reads.
   Rule: the writing stream waits on each previous holder's release event (``wait="host"``:
   only once it is complete; a lost holder's event is never waited on).
3. write, then ``ready_events[slot].record(stream)``. Rule: the ready event is recorded on
   the stream that wrote the slot, after the write (inlined by the callers: one line).
4. ``publish``: the slot gets its seq and queued items go out, in seq order, to consumers
   with free credits. Rule: READY goes out after the ready event was recorded, so a
   consumer that waits on the event sees the finished write.
5. ``released``: a consumer's RELEASE. Rule: a stale release never frees a newer item
   (slot and generation must match); a forwarded slot's upstream release follows the
   forwarding rules (``core.forwarding``).

Used under the producer's lock.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, NamedTuple, Protocol

import msgpack

from ..backends import Event
from ..backends.refs import SlotStore
from ..core import protocol as P
from ..core.forwarding import ForeignArena, ForwardLedger
from ..core.layout import LayoutIds, Placement, Plan, PlanCache, Recipe, plan_empty
from ..core.ratelog import RateLog
from ..core.ring import Acquired, Ring
from ..core.stats import Stats
from ..errors import ConfigError, IpcTimeoutError, ProtocolError
from .peers import Peer, PeerTable
from .telemetry import tracer_for

__all__ = ["Waits", "Handoffs", "NAG_S", "CLOSE_LINGER_S", "MAX_PLANS", "MAX_LAYOUT_IDS"]

log = logging.getLogger(__name__)

NAG_S = 5.0  # a wait nobody can end (no consumer) is reported after this long
# close(): how long queued items wait for a consumer once every consumer that attached
# has left; then they are dropped, with a warning naming how many.
CLOSE_LINGER_S = 2.0
MAX_PLANS = 256  # distinct message signatures cached (least recently used dropped first)
# Layout ids in use at once (least recently used reused), within what a consumer caches.
MAX_LAYOUT_IDS = P.MAX_LAYOUT_IDS


class Waits(NamedTuple):
    """The endpoint's wait machinery, as the handoff steps use it (all: lock held)."""

    pump: Callable[[], None]
    wait_until: Callable[..., bool]  # EndpointBase's: (done, timeout, cause, stats_wait, ...)
    timeout_error: Callable[[str, float | None, str], IpcTimeoutError]
    resolve_timeout: Callable[[float | None], float | None]


class ForwardHooks(Protocol):
    """What the handoff steps tell the forwarding port (see runtime.forwarder)."""

    def freed(self, slot: int) -> None: ...

    def complete(self, slot: int) -> None: ...


class Handoffs:
    """The ring of slots, what each slot holds, and the handoff steps over them."""

    def __init__(self, *, ring: Ring, slot_views: list[Any], ready_events: list[Event], slot_bytes: int,
                 peers: PeerTable, ledger: ForwardLedger[Any], stats: Stats, limits: P.Limits,
                 wait_mode: str, timeout: float | None, waits: Waits, name: str, ratelog: RateLog) -> None:
        self.ring = ring
        self.slots = ring.nslots
        self.slot_views = slot_views
        self.ready_events = ready_events
        self.slot_bytes = slot_bytes
        self.peers = peers
        self.ledger = ledger
        self.stats = stats
        self.limits = limits
        self.wait_mode = wait_mode
        self.timeout = timeout  # the producer's default: bounds waits on release events
        self.waits = waits
        self.name = name
        self.ratelog = ratelog
        self.plans = PlanCache(MAX_PLANS)
        self.layout_ids = LayoutIds(MAX_LAYOUT_IDS)
        self.layouts_inline = 0  # READY/FREADY frames that carried their layout
        self.enc = P.Encoder()
        self.forwards: ForwardHooks | None = None  # set by the forwarding port
        # Per slot, the item it holds: [layout_id, meta, seq, gen, sent_ns, full READY frame
        # or None until first needed, short READY frame (without the layout), forwarding
        # (foreign arena, region offset, region bytes) or None, layout version, layout].
        self.items: list[list[Any] | None] = [None] * self.slots
        self.trace = tracer_for(name)  # None unless ipcsync-run --trace: the hooks skip
        self._alone_since: float | None = None  # since when close() has no consumer to wait for
        # slot() blocks build their views from the slot's own storage (made at its first
        # block), whose use count tells whether a tensor of the block outlived it; such a
        # slot stays WRITING, unsent, in ``kept_slots`` until that tensor is gone.
        self.stores: list[SlotStore | None] = [None] * self.slots
        self.kept_slots: dict[int, SlotStore] = {}

    # ------------------------------------------------------------------ slot() blocks
    def slot_store(self, slot: int) -> SlotStore:
        store = self.stores[slot]
        if store is None:
            store = self.stores[slot] = SlotStore(self.slot_views[slot])
        return store

    def free_kept_slots(self, all_of_them: bool = False) -> None:
        """Give back each kept slot nothing references any more (``all_of_them``: every
        one, at close: nothing is sent after it)."""
        for slot, store in list(self.kept_slots.items()):
            if all_of_them or not store.in_use():
                del self.kept_slots[slot]
                self.ring.abort(slot)

    # ------------------------------------------------------------------ plans
    def new_plan(self, key: Any, placement: Placement) -> Plan:
        """A plan for ``placement``, cached under ``key`` (None: not cached). ConfigError,
        and nothing cached, for a layout the consumers' decoder would refuse."""
        plan = Plan(placement, 0)
        encoded = msgpack.packb(plan.layout, use_bin_type=True)
        # Forwarded items' layouts travel in FREADY, which consumers cache apart from READY's.
        lkey = (type(key) is tuple and bool(key) and key[0] == "forward", encoded)
        if lkey not in self.layout_ids:  # (every layout that has an id was checked)
            self.check_layout(plan.layout)
        plan.layout_size = len(encoded)
        plan.layout_key = lkey
        self.assign_layout(plan)
        self.plans.put(key, plan)
        return plan

    def check_layout(self, layout: list[Any]) -> None:
        """ConfigError for a layout the consumers' decoder would refuse: the hard limits of
        ``ipcsync.Limits``, which no slot size can lift (so placements check them before
        the slot's size: ``plan_message(..., check_layout=)``)."""
        try:
            P.sendable_layout(layout, self.limits)
        except ProtocolError as exc:
            lim = self.limits
            raise ConfigError(
                f"this message cannot be sent: its consumers would refuse its layout ({exc}); "
                f"a message holds at most {lim.max_tensors} tensors and {lim.max_items} "
                f"entries in one dict/list, nests at most {lim.max_depth} deep and is "
                f"described in at most {lim.max_frame} bytes (ipcsync.Limits)"
            ) from None

    def assign_layout(self, plan: Plan) -> None:
        """Give ``plan`` its layout's id (see core.layout.LayoutIds): ids of items still in
        a slot are never reassigned."""
        plan.layout_id, plan.layout_version = self.layout_ids.assign(
            plan.layout_key, lambda: [item[0] for item in self.items if item is not None])

    def empty_plan_for(self, spec: dict[str, Any]) -> tuple[Plan, Recipe]:
        """The plan (and in-place views' recipe) of a ``slot()`` spec."""
        try:
            parts: list[Any] = ["slot"]
            for k, v in spec.items():
                parts.append((k, tuple(v[0]), v[1]))
            key: Any = tuple(parts)
            plan = self.plans.get(key)
        except (TypeError, IndexError):  # malformed: let plan_empty say what is wrong
            key, plan = None, None
        if plan is None:
            plan = self.new_plan(key, plan_empty(spec, self.slot_bytes, self.check_layout))
            plan.recipe = Recipe(plan.layout, self.slot_bytes)
        assert plan.recipe is not None
        return plan, plan.recipe

    def forward_plan(self, layout: list[Any], data_bytes: int) -> Plan:
        key = ("forward", msgpack.packb(layout, use_bin_type=True))
        plan = self.plans.get(key)
        if plan is None:
            plan = self.new_plan(key, Placement(layout, [], data_bytes))
        return plan

    # ------------------------------------------------------------------ close
    def wait_nagging(self, done: Callable[[], bool], deadline: float | None, words: Callable[[], str]) -> None:
        """close(): ``wait_until(done)`` until ``deadline``, logging ``words()`` (what it is
        waiting for) after NAG_S and then every NAG_S."""
        nag = time.monotonic() + NAG_S
        while True:
            step_end = nag if deadline is None else min(nag, deadline)
            if self.waits.wait_until(done, max(0.0, step_end - time.monotonic())):
                return
            if deadline is not None and time.monotonic() >= deadline:
                return
            log.warning("ipcsync producer %r close() is waiting: %s (close(timeout=...) bounds "
                        "this; abort() ends the stream at once)", self.name, words())
            nag = time.monotonic() + NAG_S

    def deliver_queued(self, deadline: float | None, attached_ever: Callable[[], int]) -> None:
        """close(): wait (nagging) until every queued item went out, up to ``deadline``.

        When every consumer that attached has left (none attached now, ``attached_ever()``
        > 0) the items wait only CLOSE_LINGER_S for one to attach; then they are dropped
        with a warning naming how many: nobody is left to take them, and a close() must
        neither lose them silently nor stall for its whole timeout. A producer that no
        consumer ever attached to waits for one until ``deadline`` (either side may start
        first). Items dropped at ``deadline`` are warned about the same way."""
        ring = self.ring
        done = lambda: ring.queued == 0 or self.alone_too_long(attached_ever())  # noqa: E731
        self.wait_nagging(done, deadline, self.queued_words)
        if ring.queued and not ring.consumers():
            dropped = ring.drop_queued()
            for slot in dropped:
                self.items[slot] = None
            ever = attached_ever()
            why = (f"every consumer that attached ({ever}) had left and none attached within "
                   f"{CLOSE_LINGER_S:g} s" if ever else "no consumer attached before close()'s timeout")
            log.warning("ipcsync producer %r closed with %d queued item(s) that no consumer took: dropped "
                        "(%s); to deliver them, keep a consumer attached until close() returns",
                        self.name, len(dropped), why)

    def alone_too_long(self, attached_ever: int) -> bool:
        """Every consumer that attached (``attached_ever`` of them) has left, and none has
        attached for CLOSE_LINGER_S: queued items have nobody to wait for."""
        if not attached_ever or self.ring.consumers():
            self._alone_since = None
            return False
        now = time.monotonic()
        if self._alone_since is None:
            self._alone_since = now
        return now - self._alone_since >= CLOSE_LINGER_S

    def queued_words(self) -> str:
        n = self.ring.queued
        if not self.ring.consumers():
            return f"{n} item(s) sent but no consumer is attached to take them"
        return f"{n} item(s) queued for consumers whose credits are all in use"

    def held_words(self) -> str:
        held = [f"{p.label} holds {len(self.ring.held_by(p.identity))} item(s)"
                + (" (stalled)" if p.stalled else "") for p in self.peers]
        return "; ".join(held) or f"slot states {self.ring.occupancy()}"

    # ------------------------------------------------------------------ 1. reserve
    def reserve(self, timeout: float | None) -> Acquired:
        """Step 1: a FREE slot, waiting up to ``timeout`` while consumers hold every slot.
        (Callers try ``ring.acquire()`` inline first: that is the common case.)"""
        acq = self.ring.acquire()
        return acq if acq is not None else self._wait_for_slot(timeout)

    def _wait_for_slot(self, timeout: float | None) -> Acquired:
        w = self.waits
        t = w.resolve_timeout(timeout)
        # Every slot is taken: the releases that already arrived usually free one (what
        # wait_until would do first, without its set-up).
        w.pump()
        acq = self.ring.acquire()
        if acq is not None:
            return acq
        cause = "consumer" if not self.ring.consumers() else "slot"
        done = lambda: self.ring.free_slots > 0  # noqa: E731
        waited = self.stats.waited
        if cause == "consumer" and (t is None or t > NAG_S):
            # Nobody to take the items: say so after a few seconds (a producer alone waits
            # for a consumer as long as it takes, as mp.Queue.put waits for a reader).
            ok = w.wait_until(done, NAG_S, cause, waited, pumped=True)
            if not ok:
                log.warning("ipcsync producer %r: send() is waiting for a consumer to connect "
                            "(all %d slots hold items nobody has taken); start a Consumer on %r, or "
                            "pass timeout= to give up", self.name, self.slots, self.name)
                ok = w.wait_until(done, None if t is None else t - NAG_S, cause, waited)
        else:
            ok = w.wait_until(done, t, cause, waited, pumped=True)
        if not ok:
            raise self.no_slot_error(t)
        acq = self.ring.acquire()
        assert acq is not None
        return acq

    def no_slot_error(self, timeout: float | None) -> IpcTimeoutError:
        """No slot freed within ``timeout``, the wait the user asked for (an asyncio call
        reports its whole wait, not the last non-blocking try)."""
        forwarded = self.ledger.count()
        return self.waits.timeout_error(
            "no free slot", timeout,
            f"all {self.slots} slots are held ({self.ring.occupancy()}) by "
            f"{len(self.ring.consumers())} consumer(s); consumers must release items "
            "(or connect), or raise timeout/slots"
            + (f"; {forwarded} of them hold items forwarded without a copy, which also hold "
               "their upstream slots until released" if forwarded else ""),
        )

    # ------------------------------------------------------------------ 2. order after readers
    def order_after_readers(self, acq: Acquired, stream: Any) -> None:
        """Step 2: order the overwrite after the previous holders' reads (their release events).

        ``wait="gpu"``: the stream waits on each event at once. ``"host"``: poll ``query()``
        (pumping, so deaths are noticed) and enqueue only completed events. A holder lost
        meanwhile is skipped: no wait is ever enqueued on an event a lost peer recorded.
        A forwarded item of this slot still waiting for downstream events is finished first.
        """
        if self.ledger.pending and acq.slot in self.ledger.pending:
            assert self.forwards is not None
            self.forwards.complete(acq.slot)
        peers = self.peers
        for cid in acq.last_holders:
            peer = peers.get(cid)  # type: ignore[arg-type]
            if peer is None or not peer.release_events:
                continue
            ev = peer.release_events[acq.slot]
            # Complete already (query() is ~0.1 us): nothing to order, and no wait to enqueue,
            # which costs far more host time than the query when the event is another
            # process's. The peer re-records this event only after we hand it the slot again,
            # so a completed query() stands until then.
            if ev.query():
                continue
            if self.wait_mode == "host":
                t = self.timeout
                if not self.waits.wait_until(lambda: peers.get(cid) is not peer or ev.query(),  # type: ignore[arg-type]
                                             t, "release_event", self.stats.waited, poll_event=True):
                    raise self.waits.timeout_error(
                        f"{peer.label} did not finish with slot {acq.slot}", t,
                        "its GPU work on the slot is still running (or wedged)",
                    )
                continue  # complete, or its recorder is lost: no wait either way
            ev.wait(stream)

    # ------------------------------------------------------------------ 4. publish
    def publish(self, acq: Acquired, plan: Plan, meta: Any,
                fwd: tuple[ForeignArena, int, int] | None = None) -> int:
        """Step 4: commit the slot written (and its ready event recorded) and send what is
        queued. ``fwd``: (foreign arena, region offset, region bytes) of a zero-copy forward.
        Returns the item's seq; ConfigError (nothing committed) for a meta the consumers
        would refuse."""
        ring = self.ring
        seq = ring.next_seq
        slot, gen = acq.slot, acq.gen
        sent_ns = time.monotonic_ns()
        lid = plan.layout_id
        if lid:
            # Inlined LayoutIds.current(): this runs once per send.
            ids = self.layout_ids
            if ids.versions[lid] != plan.layout_version:  # its id went to another layout
                self.assign_layout(plan)
                lid = plan.layout_id
            else:
                ids.ids.move_to_end(plan.layout_key)
        ck = plan.cache_key
        if ck is not None:  # inlined PlanCache.touch()
            plans = self.plans.plans
            if plans.get(ck) is plan:
                plans.move_to_end(ck)
        try:
            # Cached layouts: encode the short frame now (what consumers that know the
            # layout get); the full one only if a consumer needs it (see dispatch).
            if fwd is None:
                frame = self.enc.ready(seq, slot, gen, sent_ns, lid, None if lid else plan.layout, meta)
            else:
                frame = self.enc.forward_ready(seq, slot, gen, sent_ns, lid, None if lid else plan.layout,
                                               meta, fwd[0].fid, fwd[1], fwd[2])
        except (TypeError, ValueError, OverflowError) as exc:
            raise ConfigError(f"meta is not msgpack-able: {exc}") from None
        try:
            # What the consumers' decoder accepts, under the same limits (the layout was
            # checked when its plan was made).
            P.check_outgoing(frame, meta, plan.layout_size if lid else 0, self.limits)
        except ProtocolError as exc:
            lim = self.limits
            raise ConfigError(
                f"this message cannot be sent: its consumers would refuse it ({exc}); meta holds "
                f"at most {lim.max_items} entries in one dict/list and nests at most "
                f"{lim.max_depth} deep, and layout and meta together fit in {lim.max_frame} "
                "bytes (ipcsync.Limits): send less meta or fewer tensors"
            ) from None
        committed = ring.commit(slot)
        assert committed == seq
        self.items[slot] = [lid, meta, seq, gen, sent_ns, None if lid else frame, frame if lid else None, fwd,
                            plan.layout_version, plan.layout]
        self.stats.count(plan.data_bytes)
        if self.trace is not None:
            self.trace.sent(seq, slot, sent_ns, plan.data_bytes)
        self.dispatch()  # (it returns at once when nothing is queued)
        return seq

    def dispatch(self) -> None:
        """Queued items to consumers with free credits, in seq order (a forwarded item's
        FOREIGN first, to a consumer that does not know that arena's current version)."""
        ring = self.ring
        if not ring.queued:
            return
        peers = self.peers
        trace = self.trace
        for cid, _seq, slot, _gen in ring.dispatch():
            peer = peers.get(cid)  # type: ignore[arg-type]
            if peer is None:  # lost by an earlier send of this loop; the ring freed its slots
                continue
            item = self.items[slot]
            assert item is not None
            lid = item[0]
            fwd = item[7]
            session = peer.session
            if fwd is not None:  # forwarded zero-copy: the consumer must know the arena first
                foreign = fwd[0]
                if session.needs_foreign(foreign.fid, foreign.version):
                    peers.send(peer, foreign.frame)
            if lid and session.layouts.get(lid) == item[8]:  # it has this layout under lid (inlined)
                frame = item[6]
            else:
                frame = item[5]
                if frame is None:
                    layout = item[9]
                    if fwd is None:
                        frame = self.enc.ready(item[2], slot, item[3], item[4], lid, layout, item[1])
                    else:
                        frame = self.enc.forward_ready(item[2], slot, item[3], item[4], lid, layout, item[1],
                                                       fwd[0].fid, fwd[1], fwd[2])
                    item[5] = frame
                session.needs_layout(lid, item[8])  # records it
                self.layouts_inline += 1
            if trace is not None:  # (before the send: the consumer may stamp its receipt at once)
                trace.ready(_seq, peer.label)
            peers.send(peer, frame)
            if peer.remote is not None:  # on another host: the bytes follow by torch.distributed
                peer.remote.send(slot, item[9], item[2])

    # ------------------------------------------------------------------ 5. release
    def released(self, peer: Peer, entries: list[tuple[int, int, int]]) -> None:
        """Step 5: a consumer's RELEASE entries (seq, slot, gen)."""
        now_ns = time.monotonic_ns()
        latency = self.stats.latency
        bad: ProtocolError | None = None
        nbad = 0
        trace = self.trace
        for seq, slot, gen in entries:
            try:
                freed = self.ring.release(peer.identity, seq, slot, gen)
            except ProtocolError as exc:
                # Rejected, not fatal: a stale release can never free a newer item.
                nbad += 1
                bad = bad or exc
                continue
            if freed:
                item = self.items[slot]
                self.items[slot] = None
                if item is not None:
                    latency((now_ns - item[4]) / 1e9)  # item[4]: sent_ns
                    if trace is not None:
                        trace.freed(seq, now_ns)
                    if item[7] is not None:
                        assert self.forwards is not None
                        self.forwards.freed(slot)
        if nbad:  # one (rate-limited) line per RELEASE, however many entries it got wrong
            self.peers.bad_frames += nbad
            self.ratelog.warning("release", "ipcsync producer %r ignored %d of %d release entries from %s: %s",
                                 self.name, nbad, len(entries), peer.label, bad)

    def reclaim(self, peer: Peer) -> None:
        """``peer`` left: the slots only it held are free (a forwarded one's upstream release
        never waits on the departed peer's events: it is out of the peer table). A remote
        peer's sends still running may read them after they are written again: it was told
        ERROR ``dropped`` first and is never confirmed such a send (core.remote_session 7),
        so it never serves what they carry."""
        for slot in self.ring.remove_consumer(peer.identity):
            self.items[slot] = None
            if self.ledger.held[slot] is not None:
                assert self.forwards is not None
                self.forwards.freed(slot)

    def downstream_waits(self, slot: int) -> list[tuple[Peer, Event]]:
        """The release event of each connected consumer that released ``slot``."""
        waits = []
        for cid in self.ring.released_by(slot):
            peer = self.peers.get(cid)  # type: ignore[arg-type]
            if peer is not None and peer.release_events:
                waits.append((peer, peer.release_events[slot]))
        return waits
