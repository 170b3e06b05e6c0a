"""The steps of a handoff, each written once, with the ordering rule each keeps. ``send()``,
``slot()`` blocks, zero-copy forwarding and the asyncio calls all compose them the same
way: ``begin`` (steps 1-2), their own write (step 3), ``finish`` (steps 3b-4).

1. reserve (``begin``): a FREE slot. Rule: a slot is reused only after every consumer it
   went to has released it or is gone (the ring's invariant); backpressure blocks, never
   drops.
2. order after the previous readers (``begin``; its general branch: ``runtime.producer.reader_order``). Rule: the writing
   stream is ordered after each previous holder's release event, as the endpoint's wait
   strategy does it (``core.waits``; ``wait="host"``: the host polls it until complete);
   a lost holder's event is never waited on.
3. write: the caller's (a copy, the user's block, or for a forward the downstream wait on
   the upstream ready event). Rule: on the stream ``begin`` resolved (or the caller's).
3b. record ready (``finish``): the slot's ready event recorded on ``stream``. Rule: recorded on the
   stream that wrote the slot, after the write.
4. publish (``finish``, ``deliver``): the slot gets its seq and goes out, in seq order, to
   consumers with free credits. Rule: READY goes out after the ready event was recorded, so
   a consumer that waits on the event sees the finished write.
5. release (``released``): a consumer's RELEASE. Rule: a stale release never frees a newer
   item (slot and generation must match); a forwarded slot's upstream release follows the
   forwarding rules (``core.forwarding``).

Two speeds, one set of steps: on a steady edge (the message's plan cached, a slot free,
one consumer that knows the layout, a scalar or no meta) each step is a few attribute
updates and the calls that do the work; per-layout work (plan, destination views, layout
checks and frame room) was done when the plan was made, and the LRU touches happen only
when the plan in use changes. Anything else (no free slot, a new or reassigned layout,
several consumers or items queued, a forward, a meta to check) takes the general branch of
the same step. A host-synchronous backend (CPU: events complete once recorded) skips the
record and the order-after-readers waits, which have nothing to do there, unless a remote
consumer's release events (sends still running) are in play.

The parts a handoff is built from, each in its own module: ``runtime.producer.handoff_types``
(``SlotRecord``), ``runtime.producer.slot_waits`` (a send's wait for a free slot, close()'s waits,
their reports), ``runtime.producer.reader_order`` (step 2's general branch), ``runtime.producer.planner``
(plans and the checks that consumers accept them). Used under the producer's lock.
"""

from __future__ import annotations

import time
from typing import Any

from ...backends import Backend, Event
from ...backends import native
from ...backends.base import CurrentStream
from ...backends.refs import SlotStore
from ...core import protocol as P
from ...core.forwarding import ForeignArena, ForwardLedger
from ...core.layout import LayoutIds, Plan, PlanCache
from ...core.ratelog import RateLog
from ...core.ring import Ring
from ...core.stats import Stats
from ...core.waits import WaitStrategy
from ...errors import BackendError, ConfigError, SlotKeptError
from .handoff_types import ForwardHooks, SlotRecord
from .peers import Peer, PeerTable
from .planner import Planner
from .reader_order import ReaderOrder
from .slot_waits import SlotWaits, Waits
from ..telemetry import tracer_for

__all__ = ["Handoffs", "SlotRecord", "MAX_PLANS", "MAX_LAYOUT_IDS"]

MAX_PLANS = 256  # distinct message signatures cached (least recently used dropped first)
# Layout ids in use at once (least recently used reused), within what a consumer caches.
MAX_LAYOUT_IDS = P.MAX_LAYOUT_IDS


_READY = P.READY_TYPE
_ACTIVE = P.State.ACTIVE  # the one state in which the producer's machine sends data (core.states)


class Handoffs:
    """The ring of slots, what each slot holds, and the handoff steps over them."""

    def __init__(self, *, ring: Ring, slot_views: list[Any], ready_events: list[Event], slot_bytes: int,
                 peers: PeerTable, ledger: ForwardLedger[Any], stats: Stats, limits: P.Limits,
                 wait: WaitStrategy, timeout: float | None, waits: Waits, name: str, ratelog: RateLog,
                 backend: Backend, shared: bool = False) -> None:
        self.ring = ring
        self.slots = ring.nslots
        self.slot_views = slot_views
        self.ready_events = ready_events
        self.record_ready = [e.bound_record() for e in ready_events]  # (step 3b, per slot)
        # Memory shared by descriptor (runtime.producer.sharing): no ready event to record at 3b;
        # each consumer's ready flag is written as the item is handed to it (deliver), and
        # step 2 waits for its release flag to reach the generation it last got of the slot
        # (``pub_gen``: the generation of the item last published in each slot).
        self.shared = shared
        self.pub_gen = [0] * ring.nslots
        self.slot_bytes = slot_bytes
        self.peers = peers
        self.ledger = ledger
        self.stats = stats
        self.limits = limits
        self.wait = wait  # how a stream is ordered after a consumer's release event
        self.timeout = timeout  # the producer's default: bounds waits on release events
        self.waits = waits
        self.name = name
        self.ratelog = ratelog
        self.layouts_inline = 0  # READY/FREADY frames that carried their layout
        self.enc = P.Encoder()
        self.forwards: ForwardHooks | None = None  # set by the forwarding port
        self.records = [SlotRecord(i) for i in range(self.slots)]
        # Host-synchronous backend: no ready event to record, no stream to resolve.
        self.host_sync = backend.host_sync
        # The current stream, looked up again only when its key changed (steps 2-3b, and
        # a slot() block's at its end).
        self.streams = CurrentStream(backend)
        # Step 2 has work to do: events that complete on the GPU, or (set by the port) a
        # remote consumer's release events, sends that complete later, on any backend.
        self.order_events = shared or not backend.host_sync
        # The plan last published: most recently used in both LRUs (plans, layout ids) and
        # its layout id still its own. Reset by whatever else reorders them.
        self.mru_plan: Plan | None = None
        self.trace = tracer_for(name)  # None unless ipcsync-run --trace: the hooks skip
        self.alone_since: float | None = None  # since when close() has no consumer to wait for (runtime.producer.closing)
        # slot() blocks build their views from the slot's own storage (made at its first
        # block), whose use count tells whether a tensor of the block outlived it; such a
        # slot stays WRITING, unsent, in ``kept_slots`` until that tensor is gone.
        self.stores: list[SlotStore | None] = [None] * self.slots
        self.kept_slots: dict[int, SlotStore] = {}
        self.kept_what: dict[int, str] = {}  # kept slot -> which tensor (runtime.producer.closing.kept_words)
        # Step 3 in one C call for a plan with ``flat`` bytes (backends.native): on a host
        # slot a memcpy, on a CUDA slot the copy and step 3b's record together. None: off,
        # not built, or no CUDA runtime found; plans then keep no ``flat`` (torch copies).
        device = slot_views[0].device if slot_views else None
        self.device = device
        self.host_copy = native.host_copy() if device is not None and device.type == "cpu" else None
        self.copy_record = (native.cuda_copy_record() if device is not None and device.type == "cuda"
                            and not shared else None)
        self.slot_ptrs = [v.data_ptr() for v in slot_views] if self.host_copy or self.copy_record else []
        # Per slot: (cudaEvent_t, device index) of its ready event, once torch created it.
        self.ready_raw: list[tuple[int, int] | None] = [None] * self.slots
        self.plans = PlanCache(MAX_PLANS)
        self.layout_ids = LayoutIds(MAX_LAYOUT_IDS)
        # The parts (cold, or bound once below where a steady path calls them).
        self.planner = planner = Planner(
            plans=self.plans, layout_ids=self.layout_ids, assign=self.assign_layout, limits=limits, enc=self.enc,
            slot_bytes=slot_bytes, slot_ptrs=self.slot_ptrs, device=device)
        self.encode = planner.encode  # (finish, an item with meta: no hop through the planner)
        self.empty_plan_for = planner.empty_plan_for  # (each slot() block)
        self.slot_waits = SlotWaits(ring=ring, peers=peers, ledger=ledger, stats=stats, waits=waits, name=name)
        self.readers = ReaderOrder(peers=peers, ledger=ledger, wait=wait, pub_gen=self.pub_gen, shared=shared,
                                   timeout=timeout, waits=waits, stats=stats)

    # ------------------------------------------------------------------ slot() blocks
    def slot_store(self, slot: int) -> SlotStore:
        """The slot's store, made at its first block, and again after its storage was
        moved (``SlotStore.moved``: a program's ``share_memory_()`` on a view kept from an
        earlier block), so no block writes anywhere but into the slot."""
        store = self.stores[slot]
        if store is None or store.ptr() != store.addr:
            store = self.stores[slot] = SlotStore(self.slot_views[slot])
        return store

    def unsendable(self, store: SlotStore, slot: int, ok: bool, what: str) -> bool:
        """At a ``slot()`` block's end (``ok``: it did not raise): True if its item must
        not be sent. Its store was moved (``share_memory_()`` on a tensor of the block:
        what the block wrote after that is not in the slot): the slot is given back, and
        a ConfigError says so. A tensor of the block outlived it (a write through it would
        change the item after it was sent): the slot stays out, in ``kept_slots``, until
        that tensor is gone, and a SlotKeptError says so (``what``: which tensor, its fix)."""
        if store.moved():
            self.ring.abort(slot)
            if ok:
                raise ConfigError(
                    f"a tensor of this Producer.slot() block on {self.name!r} was moved out of its slot "
                    "(share_memory_(), or pickling it for a multiprocessing queue, moves a tensor's bytes into "
                    "new memory), so what the block wrote is not in the slot and the item was not sent; "
                    "write into s[name] in place and send the item through this producer")
            return True
        if not store.in_use():
            return False
        self.kept_slots[slot] = store
        self.kept_what[slot] = what
        if ok:
            raise SlotKeptError(what)
        return True

    def free_kept_slots(self, all_of_them: bool = False) -> None:
        """Give back each kept slot nothing references (or views: a moved store) any more
        (``all_of_them``: every one, at close: nothing is sent after it)."""
        for slot, store in list(self.kept_slots.items()):
            if all_of_them or store.moved() or not store.in_use():
                del self.kept_slots[slot]
                self.kept_what.pop(slot, None)
                self.ring.abort(slot)

    # ------------------------------------------------------------------ plans
    def forget_plans(self) -> None:
        """Teardown: drop every plan (and with them their destination views of the slots)."""
        self.plans.clear()
        self.mru_plan = None

    def use_plan(self, plan: Plan) -> None:
        """``plan`` is about to be published and is not ``mru_plan``: most recently used
        in both LRUs now, with its layout id reassigned if the id went to another layout."""
        if plan.layout_id and not self.layout_ids.current(plan.layout_key, plan.layout_id, plan.layout_version):
            self.assign_layout(plan)  # its id went to another layout meanwhile
        self.plans.touch(plan)
        self.mru_plan = plan

    def assign_layout(self, plan: Plan) -> None:
        """Give ``plan`` its layout's id (see core.layout.LayoutIds): ids of items still in
        a slot are never reassigned."""
        self.mru_plan = None
        plan.layout_id, plan.layout_version = self.layout_ids.assign(
            plan.layout_key, lambda: [r.layout_id for r in self.records if r.live])

    # ------------------------------------------------------------------ 1-2. begin
    def begin(self, timeout: float | None, stream: Any) -> SlotRecord:
        """Steps 1 and 2: reserve a FREE slot (waiting up to ``timeout`` while consumers
        hold every slot), resolve the stream (``stream``, else the current one), and order
        the slot's overwrite after its previous readers on it. The slot is given back if
        step 2 fails. Returns the slot's record: the caller writes (step 3), then calls
        ``finish`` (or ``ring.abandon(rec.slot)`` if it fails)."""
        if timeout is not None:  # bad input is refused whether or not the call has to wait
            self.waits.resolve_timeout(timeout)
        # 1. reserve. Rule: only a FREE slot, one every earlier holder released or left.
        acq = self.ring.acquire() or self.slot_waits.wait_for_slot(timeout)
        rec = self.records[acq.slot]
        rec.gen = acq.gen
        rec.last_holders = acq.last_holders
        if stream is None and not self.host_sync:  # resolved once: steps 2, 3 and 3b use it
            cs = self.streams
            stream = cs.now if cs.key() == cs.seen else cs.resolve()
        rec.stream = stream
        # 2. order after the previous readers. Rule: the overwrite waits for their release
        # events (a lost reader's never); a forward of this slot still waiting downstream is
        # finished first. Nothing to do with no previous reader still attached, or with
        # events complete once recorded and no forward pending.
        holders: frozenset[Any] = acq.last_holders  # (consumer identities)
        if holders and (self.order_events or self.ledger.pending):
            # Its steady branch: one previous reader, whose release event is complete
            # already (a query, ~0.1 us), and no forward of the slot pending: nothing to order.
            peer = self.peers.get(next(iter(holders))) if len(holders) == 1 and not self.ledger.pending else None
            if self.shared and peer is not None and peer.release_events:  # (a flag: the generation it got)
                peer.release_events[acq.slot].value = self.pub_gen[acq.slot]
            if peer is None or not peer.release_done or not peer.release_done[acq.slot]():
                try:
                    self.readers.order_after_readers(rec, self.forwards)
                except BaseException:
                    self.ring.abort(rec.slot)
                    raise
        return rec

    # ------------------------------------------------------------------ 3. write
    def write_flat(self, rec: SlotRecord, plan: Plan, tensors: list[Any]) -> bool:
        """Step 3 for ``send`` of a plan with ``flat`` bytes (one dense tensor, see
        core.layout.Plan; a plan without them is ``Plan.write``, torch's copy): copy
        ``tensors[0]`` into slot ``rec`` on ``rec.stream`` (begin's: the current stream)
        in one C call (backends.native). Returns True when step 3b was done too (the ready
        event recorded): pass it to ``finish`` as ``recorded``.

        Rule: the copy is enqueued on ``rec.stream``, the stream step 2 ordered after the
        previous readers' release events, and the ready event is recorded on that same
        stream after it."""
        flat = plan.flat
        slot = rec.slot
        assert flat is not None
        dst = self.slot_ptrs[slot] + flat[0]  # (our own slot and our plan's checked offset)
        if self.host_copy is not None:
            self.host_copy(dst, tensors[0].data_ptr(), flat[1])
            return False
        raw = self.ready_raw[slot] or self.raw_ready(slot)
        if raw is None:  # (torch creates the event at its first record: this item by torch)
            plan.write(slot, self.slot_views[slot], tensors)
            return False
        assert self.copy_record is not None
        try:
            self.copy_record(dst, tensors[0].data_ptr(), flat[1], rec.stream.cuda_stream, raw[0], raw[1])
        except RuntimeError as exc:
            raise BackendError(f"the copy into slot {slot} of producer {self.name!r} failed: {exc}; "
                               "the item was not sent (IPCSYNC_NATIVE=0 copies with torch instead)") from None
        return True

    def raw_ready(self, slot: int) -> tuple[int, int] | None:
        """Slot ``slot``'s ready event as (cudaEvent_t, device index), kept once torch has
        created it; None before."""
        raw = self.ready_raw[slot] = self.ready_events[slot].native_handle()
        return raw

    # ------------------------------------------------------------------ 3b-4. finish
    def finish(self, rec: SlotRecord, plan: Plan, meta: Any, stream: Any,
               fwd: tuple[ForeignArena, int, int] | None = None, recorded: bool = False) -> int:
        """Steps 3b and 4 for slot ``rec`` (written): record its ready event on ``stream``
        (unless ``recorded``: ``write`` did), commit it and send what can go out. ``fwd``:
        (foreign arena, region offset, region bytes) of a zero-copy forward. Returns the
        item's seq; ConfigError (nothing committed) for a meta the consumers would refuse."""
        slot = rec.slot
        # 3b. record ready. Rule: on the stream that wrote the slot, after the write (shared
        # by descriptor: each consumer's ready flag, written at deliver on that stream).
        if not (self.host_sync or recorded):
            if stream is None:  # (a slot() block's: the current stream at its end)
                cs = self.streams
                stream = cs.now if cs.key() == cs.seen else cs.resolve()
            if self.shared:
                rec.stream = stream
            else:
                self.record_ready[slot](stream)
        if plan is not self.mru_plan:
            self.use_plan(plan)
        ring = self.ring
        # The seq ``publish`` gives this item, read once before it: the frame naming it is
        # built and checked before the commit (a refused meta commits nothing).
        seq = ring.next_seq
        sent_ns = time.monotonic_ns()
        lid = plan.layout_id
        if lid and meta is None and fwd is None:
            # The steady READY: its consumers' limits were checked for the layout (room).
            frame = self.enc.plain([_READY, seq, slot, rec.gen, sent_ns, lid, None, None])
            if len(frame) > plan.room:
                self.planner.check_frame(frame, meta, plan)
        else:
            frame = self.encode(rec, seq, sent_ns, plan, meta, fwd)
        # 4. publish. Rule: after the record (3b), in seq order; what the ring hands out
        # now goes out now, the rest when a consumer has a credit (dispatch).
        cid = ring.publish(slot)[1]
        self.pub_gen[slot] = rec.gen  # (published: what its holders will release)
        rec.seq, rec.sent_ns, rec.meta, rec.fwd = seq, sent_ns, meta, fwd
        rec.layout_id, rec.layout_version, rec.layout = lid, plan.layout_version, plan.layout
        if lid:
            rec.short, rec.full = frame, None
        else:
            rec.short, rec.full = None, frame
        rec.live = True
        stats = self.stats  # (two adds: Stats.count, without its call)
        stats.handoffs += 1
        stats.bytes += plan.data_bytes
        if self.trace is not None:
            self.trace.sent(seq, slot, sent_ns, plan.data_bytes)
        if cid is not None:
            self.deliver(cid, rec)
        elif ring.queued:
            self.dispatch()
        return seq

    def dispatch(self) -> None:
        """Queued items to consumers with free credits, in seq order."""
        if not self.ring.queued:
            return
        records = self.records
        for cid, _seq, slot, _gen in self.ring.dispatch():
            self.deliver(cid, records[slot])

    def deliver(self, cid: Any, rec: SlotRecord) -> None:
        """Send the item of ``rec``, which the ring handed to consumer ``cid``: the short
        READY to a consumer that has its layout's id at its version, else the full one
        (recorded as sent); a forwarded item's FOREIGN first, to a consumer that does not
        know that arena's current version; a remote consumer's bytes after its READY."""
        peers = self.peers
        peer = peers.get(cid)
        if peer is None:  # lost by an earlier send of a dispatch loop; the ring freed its slots
            return
        session = peer.session
        if session.conv.state is not _ACTIVE:  # every data frame through the state check: ProtocolError (ours)
            session.check_send(P.MsgType.READY)
        fwd = rec.fwd
        if fwd is not None:  # forwarded zero-copy: the consumer must know the arena first
            foreign = fwd[0]
            if session.needs_foreign(foreign.fid, foreign.version):
                peers.send(peer, foreign.frame)
        lid, short = rec.layout_id, rec.short  # (short is None exactly when lid is 0)
        frame: bytes | None  # (bytes by the send: encoded below when not built yet)
        if short is not None and session.layouts.get(lid) == rec.layout_version:  # it has this layout under lid
            frame = short
        else:
            frame = rec.full
            if frame is None:
                if fwd is None:
                    frame = self.enc.ready(rec.seq, rec.slot, rec.gen, rec.sent_ns, lid, rec.layout, rec.meta)
                else:
                    frame = self.enc.forward_ready(rec.seq, rec.slot, rec.gen, rec.sent_ns, lid, rec.layout,
                                                   rec.meta, fwd[0].fid, fwd[1], fwd[2])
                rec.full = frame
            session.needs_layout(lid, rec.layout_version)  # records it
            self.layouts_inline += 1
        if self.trace is not None:  # (before the send: the consumer may stamp its receipt at once)
            self.trace.ready(rec.seq, peer.label)
        flags = peer.ready_flags
        if flags is not None:  # shared by descriptor: its ready flag, after the write, before the notice
            ev = flags[rec.slot]
            ev.value = rec.gen
            ev.record(rec.stream)
        peers.send(peer, frame)
        if peer.remote is not None:  # on another host: the bytes follow by torch.distributed
            peer.remote.send(rec.slot, rec.layout, rec.seq)

    # ------------------------------------------------------------------ 5. release
    def released(self, peer: Peer, entries: list[tuple[int, int, int]]) -> None:
        """Step 5: a consumer's RELEASE entries (seq, slot, gen), batched: one ring call
        for the whole RELEASE. Rule: a stale or foreign entry is rejected and frees
        nothing (it can never free a newer item); the others stand."""
        freed, bad = self.ring.release_all(peer.identity, entries)
        if freed:
            now_ns = time.monotonic_ns()
            latency = self.stats.latencies.append  # (Stats.latency, without its call)
            trace = self.trace
            records = self.records
            for seq, slot in freed:
                rec = records[slot]
                if not rec.live:
                    continue
                latency((now_ns - rec.sent_ns) / 1e9)
                if trace is not None:
                    trace.freed(seq, now_ns)
                if rec.fwd is not None:
                    rec.vacate()
                    assert self.forwards is not None
                    self.forwards.freed(slot)
                else:  # vacate's work, without its call: its frames and layout are rewritten
                    rec.live = False  # at the next finish; the meta is the user's, dropped now
                    rec.meta = None
        if bad:  # one (rate-limited) line per RELEASE, however many entries it got wrong
            self.peers.bad_frames += len(bad)
            self.ratelog.warning("release", "ipcsync producer %r ignored %d of %d release entries from %s: %s",
                                 self.name, len(bad), len(entries), peer.label, bad[0])

    def reclaim(self, peer: Peer) -> None:
        """``peer`` left: the slots only it held are free (a forwarded one's upstream release
        never waits on the departed peer's events: it is out of the peer table). A remote
        peer's sends still running may read them after they are written again: it was told
        ERROR ``dropped`` first and is never confirmed such a send (core.remote_session 7),
        so it never serves what they carry."""
        for slot in self.ring.remove_consumer(peer.identity):
            self.records[slot].vacate()
            if self.ledger.held[slot] is not None:
                assert self.forwards is not None
                self.forwards.freed(slot)
