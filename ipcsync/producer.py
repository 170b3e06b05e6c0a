"""The public Producer: owns the slots, binds the endpoint, serves any number of consumers.

Ordering rules of a handoff (send):

1. acquire a FREE slot (blocking, with a timeout, while consumers hold every slot);
2. wait for the release events of the consumers that held the slot's previous item (on
   the CPU backend they are complete; on CUDA the wait goes on the producer's stream);
3. copy the message into the slot on the stream and record the slot's ready event there;
4. commit the slot (it gets its seq) and dispatch queued items, in seq order, to consumers
   with free credits; READY goes out after the ready event was recorded, so a consumer
   that waits on the event sees the finished copy.

A slot is reused only after every consumer it went to has released it or is gone.

Zero-copy forwarding (``ipcsync.forward``; ``_forward_zero_copy``): the item stays in the
upstream producer's memory. We acquire one of our slots as for a send (credits,
backpressure and the ring unchanged) but write nothing into it; its READY is a FREADY
naming a foreign arena (the upstream arena's own export handle, described to each
consumer once by FOREIGN) and the item's region in it. Ordering invariants:

- ready: the forwarding stream waits on the item's upstream ready event (again: it may
  not be the stream the Consumer waited on), then records our slot's ready event, so a
  downstream wait on ours covers the upstream write transitively;
- release: when the last downstream holder of the slot has released it (or is gone),
  and only then, the upstream item is released, on the forwarding stream, after that
  stream was ordered on the release event of every downstream holder that released it
  (``wait="gpu"``: ``wait_event`` at once, when the RELEASE is processed; ``"host"``:
  once ``query()`` says each is complete, polled at every pump, and at the latest
  before the slot is acquired again, since a consumer re-records its release event only
  for a later item of that slot); a holder declared lost is skipped: no wait is ever
  enqueued on an event a lost peer recorded. The upstream release itself is the
  Consumer's ``_forward_done``;
- ``close()``: forwarded items still held downstream when it gives up waiting are
  released upstream anyway, with a warning (their readers may then see the memory
  overwritten): close the forwarding Producer while downstream consumers still run.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict, deque
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, ContextManager, Mapping, Sequence

import msgpack
import torch
import zmq

from .runtime import host as _host
from . import limits
from .core import protocol as P
from .core.liveness import stall_change
from .runtime.endpoint import EndpointBase, check_positive_int, check_wait
from .backends import Event, backend_for, resolve_device
from .runtime.channel import CurveKeys, ProducerChannel, check_transport, resolve_endpoint
from .runtime.handover import CannotForward
from .errors import ConfigError, ProtocolError
from .core.layout import ALIGN, Placement, Plan, Recipe, place_views, plan_empty, plan_message, signature
from .core.ring import POLICIES, Acquired, Ring
from .core.stats import Stats
from .item import SlotWriter, _SlotContext

__all__ = ["Producer", "SlotWriter"]

log = logging.getLogger("ipcsync")

DEFAULT_SLOT_BYTES = limits.DEFAULT_SLOT_BYTES
_MAX_PLANS = 256  # distinct message signatures cached (least recently used dropped first)
# Layout ids in use at once (least recently used reused; see _layout_id_for). Within what a
# consumer caches: P.MAX_LAYOUT_IDS.
_MAX_LAYOUT_IDS = P.MAX_LAYOUT_IDS
_MAX_SLOTS = limits.MAX_SLOTS
# A consumer that said HELLO must ATTACH within this long (nothing is held before ATTACH).
_HANDSHAKE_S = 30.0
# close() says what it is still waiting for after this long, then every _CLOSE_NAG_S.
_CLOSE_NAG_S = 5.0


@dataclass
class _Peer:
    """One consumer connection, as the producer sees it."""

    identity: bytes
    fd: int
    hello: P.Hello
    conv: P.Conversation
    last_recv: float
    # The consumer's process, as the kernel named it where it can (SO_PEERCRED), else as
    # its HELLO claims it when that process exists; None where this producer cannot see
    # it (another PID namespace over tcp). Liveness rule: a peer whose process this
    # watch shows alive is never declared lost; silence only makes it "stalled".
    watch: _host.ProcessWatch | None = None
    hello_at: float = 0.0
    stalled: bool = False  # silent past 1.5 heartbeats, process alive
    disconnected: bool = False  # connection closed without BYE, process alive: holds stay
    last_send: float = 0.0
    release_events: list[Event] = field(default_factory=list)
    outbox: deque[bytes] = field(default_factory=deque)
    bye_sent: bool = False
    bye_received: bool = False
    layouts: dict[int, int] = field(default_factory=dict)  # layout id -> version this consumer has
    foreign: dict[int, int] = field(default_factory=dict)  # foreign id -> version sent (FOREIGN)

    @property
    def label(self) -> str:
        return f"consumer pid {self.hello.pid}"


class _Foreign:
    """A foreign arena (another producer's, which items forwarded zero-copy lie in) under
    a small id. The id is reused for another arena (version + 1) only once no forwarded
    item of this one is in flight, so a consumer never holds items of a replaced arena."""

    __slots__ = ("fid", "version", "key", "frame", "outstanding", "used")

    def __init__(self, fid: int, version: int, key: Any, frame: bytes, used: int) -> None:
        self.fid, self.version, self.key, self.frame = fid, version, key, frame
        self.outstanding = 0  # forwarded items in our slots that lie in it
        self.used = used  # recency, for reuse


class _Forward:
    """A zero-copy forwarded item held in one of our slots."""

    __slots__ = ("item", "source", "stream", "foreign")

    def __init__(self, item: Any, source: Any, stream: Any, foreign: _Foreign) -> None:
        self.item, self.source, self.stream, self.foreign = item, source, stream, foreign


class Producer(EndpointBase):
    """Binds ``endpoint`` and hands messages (nested dicts/lists/tuples of tensors plus
    msgpack-able ``meta``) to the consumers that connect to it.

    Args:
        endpoint: a bare name (a private ipc socket), ``ipc:///abs/path`` or ``tcp://host:port``.
        slots: number of slots in the ring (items in flight at once).
        slot_bytes: capacity of one slot; a larger message is refused with a ConfigError.
        device: ``"cpu"`` or ``"cuda[:N]"``; default: the current CUDA device if any, else cpu.
        policy: with several consumers, ``"shard"`` (each item to one consumer, balanced by
            free credits) or ``"broadcast"`` (every item to every consumer).
        wait: how the producer waits on consumers' release events before reusing a slot
            (CUDA): ``"host"`` (default: poll until complete; a consumer that
            dies mid-record can never wedge the producer's stream; free in steady state,
            since a slot is reused long after its release) or ``"gpu"`` (enqueue at once).
        timeout: default for every blocking call (seconds). None (the default) or inf:
            wait as long as the consumers being waited for live, as ``mp.Queue.put``
            does; a consumer whose process is gone ends the wait.
        heartbeat: seconds between liveness messages when idle. A consumer silent for
            1.5x its heartbeat is reported as stalled (logged, ``stats()["consumers_stalled"]``)
            but keeps its slots while its process lives: a consumer is lost only when its
            process is provably gone, or it closed its connection and cannot be watched.
        stream: CUDA stream for copies and events (default: the current stream at each call).
        curve: CURVE keys (``ipcsync.CurveKeys``) for a ``tcp://`` endpoint; a tcp endpoint
            without them is refused unless ``insecure=True``. ipc endpoints need neither:
            only the same user can connect (file modes and the kernel's peer credentials).
        insecure: accept a plain tcp:// control channel (one interface only, never ``*``).
    """

    _role = "producer"

    def __init__(
        self,
        endpoint: str,
        *,
        slots: int = limits.DEFAULT_SLOTS,
        slot_bytes: int = DEFAULT_SLOT_BYTES,
        device: str | torch.device | None = None,
        policy: str = "shard",
        wait: str = "host",
        timeout: float | None = limits.DEFAULT_TIMEOUT,
        heartbeat: float | None = limits.DEFAULT_HEARTBEAT,
        stream: Any = None,
        curve: CurveKeys | None = None,
        insecure: bool = False,
        limits: P.Limits = P.DEFAULT_LIMITS,
    ) -> None:
        super().__init__(endpoint, timeout, heartbeat)
        self.slots = check_positive_int("slots", slots, _MAX_SLOTS)
        self.slot_bytes = check_positive_int("slot_bytes", slot_bytes, 1 << 40)
        if policy not in POLICIES:
            raise ConfigError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.policy = policy
        self.wait_mode = check_wait(wait)
        self.device = resolve_device(device)
        self.endpoint = resolve_endpoint(endpoint)
        check_transport(self.endpoint, curve, insecure, "producer")
        self._limits = limits
        self._stream = stream
        self._backend = backend_for(self.device)
        self._ring = Ring(self.slots, policy)
        self._peers: dict[bytes, _Peer] = {}
        self._fd_peer: dict[int, bytes] = {}
        self._disconnected: list[bytes] = []  # identities whose connection closed
        # Per slot, the item it holds: [layout_id, meta, seq, gen, sent_ns, full READY frame
        # or None until first needed, short READY frame (without the layout), forwarding
        # (foreign arena, region offset, region bytes) or None].
        self._items: list[list[Any] | None] = [None] * self.slots
        # Zero-copy forwarding (see the module docstring): per slot, the forwarded item it
        # holds; slots whose downstream release events are still polled (wait="host"); the
        # foreign arenas by key and by id.
        self._fwd: list[_Forward | None] = [None] * self.slots
        self._fwd_pending: dict[int, list[tuple[_Peer, Event]]] = {}
        self._foreign: dict[Any, _Foreign] = {}
        self._foreign_ids: list[_Foreign] = []
        self._foreign_clock = 0
        self._reach: dict[tuple[Any, Any], bool] = {}
        self._forwarded_total = 0
        self._plans: OrderedDict[Any, Plan] = OrderedDict()  # LRU: least recently used first
        # (forwarded, encoded layout) -> layout id, least recently used first; per id, the
        # version of its current assignment (a consumer whose version differs gets it inline).
        self._layout_ids: OrderedDict[tuple[bool, bytes], int] = OrderedDict()
        self._layout_versions = [0] * (P.MAX_LAYOUT_IDS + 1)
        self._layout_clock = 0
        self._next_layout_id = 1
        self._layouts_inline = 0  # READY/FREADY frames that carried their layout
        self._stats = Stats()
        self._enc = P.Encoder()  # used under the lock
        self._bad_frames = 0
        self._attached_total = 0  # consumers that completed the handshake, ever
        self._lost_total = 0  # consumers that died, ever
        self._stalled_total = 0  # times a live consumer fell silent past 1.5 heartbeats
        self._bad_by_peer: dict[bytes, int] = {}
        self._closing = False
        self._stride = (self.slot_bytes + ALIGN - 1) // ALIGN * ALIGN
        self._chan = ProducerChannel(self.endpoint, limits.max_frame, curve)
        try:
            try:
                self._arena = self._backend.create_arena(self._stride * self.slots)
            except ConfigError as exc:  # e.g. /dev/shm too small: name the ring that asked
                raise ConfigError(f"Producer(slots={self.slots}, slot_bytes={self.slot_bytes}): {exc}") from None
            self._slot_views = [
                self._arena.tensor[i * self._stride : i * self._stride + self.slot_bytes]
                for i in range(self.slots)
            ]
            self._ready_events = [self._backend.create_event() for _ in range(self.slots)]
        except BaseException:
            self._chan.close()
            if hasattr(self, "_arena"):
                self._arena.close()
            raise
        self._pid = os.getpid()
        self._fds = self._chan.fds()
        self._start_service()

    # ------------------------------------------------------------------ public API
    def send(
        self,
        message: Any,
        meta: Any = None,
        *,
        timeout: float | None = None,
        stream: Any = None,
    ) -> int:
        """Copy ``message`` into a free slot and hand it to a consumer. Returns its seq.

        Blocks while every slot is in use (backpressure: nothing is dropped or
        overwritten), up to ``timeout`` (default: the producer's). On CUDA the copy and the
        ready event go on ``stream`` (default: current) and the call returns without a host
        sync. Raises ConfigError for a message that does not fit a slot or a bad meta,
        IpcTimeoutError when no slot frees in time, ClosedError after close().
        """
        # The hot path: an explicit lock rather than the _call() context manager, and the
        # helpers of the common case inlined.
        with self._lock:
            if self._closed or self._closing:
                self._refuse_send()
            key, tensors = signature(message)
            plan = self._plans.get(key)
            if plan is None:
                plan = self._new_plan(key, plan_message(message, self.slot_bytes))
            acq = self._ring.acquire() or self._acquire(timeout)
            slot = acq.slot
            s = stream if stream is not None else self._stream
            try:
                if s is None:
                    # Resolved once: the waits, the copy and the record all go on the
                    # current stream.
                    cur = self._backend.current_stream()
                    if acq.last_holders:
                        self._prepare_slot(acq, cur)
                    plan.write(slot, self._slot_views[slot], tensors)
                    self._ready_events[slot].record(cur)
                else:
                    with self._on_stream(s):
                        self._prepare_slot(acq, s)
                        plan.write(slot, self._slot_views[slot], tensors)
                        # The copy runs on `s`: keep the caching allocator from reusing a
                        # source's memory before it has run.
                        for t in tensors:
                            if t.is_cuda:
                                t.record_stream(s)
                        self._ready_events[slot].record(s)
                return self._commit(acq, plan, meta)
            except BaseException:
                self._ring.abort(slot)
                raise
            finally:
                self._last_call = time.monotonic()

    def slot(
        self,
        fields: Mapping[str, tuple[Sequence[int], torch.dtype]] | None = None,
        *,
        meta: Any = None,
        timeout: float | None = None,
        stream: Any = None,
        **named_fields: tuple[Sequence[int], torch.dtype],
    ) -> ContextManager[SlotWriter]:
        """Zero-copy send: reserve a slot, yield its tensors to write in place, send on exit.

        ``with out.slot(x=((64, 3, 224, 224), torch.uint8)) as s: s["x"].copy_(src)``.
        Fields are ``name=(shape, dtype)`` (or a ``fields`` mapping); the tensors are
        contiguous. Set ``s.meta`` to change the meta. If the block raises, nothing is sent
        and the slot is given back.
        """
        if fields:
            spec = dict(fields)
            spec.update(named_fields)
        else:
            spec = named_fields
        return _SlotContext(self, spec, meta, timeout, stream)

    def _slot_enter(self, ctx: "_SlotContext") -> SlotWriter:
        with self._lock:
            if self._closed or self._closing:
                self._refuse_send()
            self._last_call = time.monotonic()
            plan, recipe = self._empty_plan_for(ctx.spec)
            acq = self._ring.acquire() or self._acquire(ctx.timeout)
            try:
                if acq.last_holders:
                    s = ctx.stream if ctx.stream is not None else self._stream
                    self._prepare_slot(acq, s if s is not None else self._backend.current_stream())
                writer = SlotWriter(recipe.build(acq.slot, self._slot_views[acq.slot]), ctx.meta)
            except BaseException:
                self._ring.abort(acq.slot)
                raise
        ctx.acq, ctx.plan, ctx.writer = acq, plan, writer
        return writer

    def _slot_exit(self, ctx: "_SlotContext", ok: bool) -> None:
        acq = ctx.acq
        ctx.writer.tensors = None
        with self._lock:
            if not ok:  # the block raised: nothing is sent
                self._ring.abort(acq.slot)
                return
            if self._closed:
                self._check_open()
            try:
                self._ready_events[acq.slot].record(ctx.stream if ctx.stream is not None else self._stream)
                self._commit(acq, ctx.plan, ctx.writer.meta)
            except BaseException:
                self._ring.abort(acq.slot)
                raise
            finally:
                self._last_call = time.monotonic()

    def flush(self, timeout: float | None = None) -> None:
        """Block until every item sent so far has been released by its consumers (or they
        are gone). IpcTimeoutError after ``timeout``."""
        with self._call():
            t = self._resolve_timeout(timeout)
            if not self._wait_until(lambda: not self._ring.busy(), t):
                raise self._timeout_error(
                    "items still in flight", t, f"slot states: {self._ring.occupancy()}"
                )

    def wait_for_consumers(self, n: int = 1, timeout: float | None = None) -> None:
        """Block until at least ``n`` consumers are attached. IpcTimeoutError after ``timeout``."""
        with self._call():
            t = self._resolve_timeout(timeout)
            if not self._wait_until(lambda: len(self._ring.consumers()) >= n, t):
                raise self._timeout_error(
                    f"fewer than {n} consumers attached", t,
                    f"is a consumer running on endpoint {self.endpoint.name!r}?",
                )

    @property
    def consumers(self) -> int:
        """Number of consumers attached now."""
        return len(self._ring.consumers())

    def stats(self) -> dict[str, Any]:
        """Handoffs, bytes, rate, send-to-release latency percentiles, time spent waiting
        by cause, slot occupancy, consumers (attached now, ever, lost, stalled now: silent
        but alive), rejected frames."""
        with self._lock:
            return self._stats.snapshot(
                role="producer",
                occupancy=self._ring.occupancy(),
                consumers=len(self._ring.consumers()),
                consumers_attached=self._attached_total,
                consumers_lost=self._lost_total,
                consumers_stalled=sum(p.stalled for p in self._peers.values()),
                consumers_stalled_total=self._stalled_total,
                bad_frames=self._bad_frames,
                forwarded=self._forwarded_total,
                forwarded_held=sum(f is not None for f in self._fwd),
                layouts_inline=self._layouts_inline,
            )

    def close(self, timeout: float | None = None) -> None:
        """Finish and shut down: a successful end of the stream. Items already sent (and
        queued ones, to a consumer that attaches meanwhile) are delivered; consumers end
        their iteration cleanly after the last one. Waits up to ``timeout`` (default: the
        producer's; None: as long as the consumers holding items live) for them to be
        released, saying on whom it waits every few seconds, then frees the slots and the
        endpoint. Idempotent; never raises for peers that are gone. A call blocked in
        another thread raises ClosedError."""
        with self._lock:
            if self._closed:
                return
            self._closing = True
            self._begin_close()
            t = self._resolve_timeout(timeout)
            deadline = None if t is None else time.monotonic() + t
            try:
                self._wait_nagging(lambda: self._ring.queued == 0, deadline, self._queued_words)
                for peer in list(self._peers.values()):
                    self._say_bye(peer, "producer closed")
                self._wait_nagging(
                    lambda: not self._ring.busy() and not self._peers and not self._fwd_pending,
                    deadline, self._held_words,
                )
            except Exception as exc:  # close never fails because of a peer
                log.debug("ipcsync producer close: %s", exc)
            self._abandon_forwards()
            if self._ring.busy():
                log.warning(
                    "ipcsync producer %r closing with items not released by consumers "
                    "(slot states %s)", self.endpoint.name, self._ring.occupancy(),
                )
            self._closed = True
            self._teardown()
        self._stop_service()

    def abort(self, error: BaseException | str | None = None) -> None:
        """End the stream as failed, at once: no wait for items in flight. Consumers get
        ``ProducerFailedError`` (a ``PeerLostError``) carrying ``error`` (an exception's
        type and message, or a text) instead of a clean end; items they hold stay
        readable, items not yet received are dropped. What a ``with`` block does when
        it exits by an exception (Ctrl-C included). Idempotent, bounded (< 1 s)."""
        if isinstance(error, BaseException):
            text = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        else:
            text = error or "aborted"
        with self._lock:
            if self._closed:
                return
            self._closing = True
            self._begin_close(timeout=1.0)
            frame = P.encode(P.Error("failed", text[:1000]))
            for peer in list(self._peers.values()):
                if not peer.bye_received and not peer.disconnected:
                    try:
                        self._chan.send(peer.identity, frame)
                    except zmq.ZMQError:
                        pass
            self._closed = True
            self._teardown(linger_ms=200)  # the ERROR frames go out before the socket shuts
        self._stop_service()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort(exc)

    def _wait_nagging(self, done: Any, deadline: float | None, words: Any) -> None:
        """``_wait_until(done)`` until ``deadline``, logging ``words()`` (what close is
        waiting for) after _CLOSE_NAG_S and then every _CLOSE_NAG_S. Lock held."""
        nag = time.monotonic() + _CLOSE_NAG_S
        while True:
            step_end = nag if deadline is None else min(nag, deadline)
            if self._wait_until(done, max(0.0, step_end - time.monotonic())):
                return
            if deadline is not None and time.monotonic() >= deadline:
                return
            log.warning("ipcsync producer %r close() is waiting: %s (close(timeout=...) bounds "
                        "this; abort() ends the stream at once)", self.endpoint.name, words())
            nag = time.monotonic() + _CLOSE_NAG_S

    def _queued_words(self) -> str:
        n = self._ring.queued
        if not self._ring.consumers():
            return f"{n} item(s) sent but no consumer is attached to take them"
        return f"{n} item(s) queued for consumers whose credits are all in use"

    def _held_words(self) -> str:
        held = [f"{p.label} holds {len(self._ring.held_by(p.identity))} item(s)"
                + (" (stalled)" if p.stalled else "") for p in self._peers.values()]
        return "; ".join(held) or f"slot states {self._ring.occupancy()}"

    def __enter__(self) -> "Producer":
        return self

    # ------------------------------------------------------------------ send internals
    def _refuse_send(self) -> None:
        self._check_open()
        if self._closing:
            raise ConfigError("send() during close()")

    def _on_stream(self, stream: Any) -> Any:
        if stream is None or self.device.type != "cuda":
            return nullcontext()
        return torch.cuda.stream(stream)

    def _acquire(self, timeout: float | None) -> Acquired:
        """A slot, once ``ring.acquire()`` found none free: wait up to ``timeout``."""
        t = self._resolve_timeout(timeout)
        # Every slot is taken: the releases that already arrived usually free one (what
        # _wait_until would do first, without its set-up).
        self._pump()
        acq = self._ring.acquire()
        if acq is not None:
            return acq
        cause = "consumer" if not self._ring.consumers() else "slot"
        done = lambda: self._ring.free_slots > 0  # noqa: E731
        waited = self._stats.waited
        if cause == "consumer" and (t is None or t > _CLOSE_NAG_S):
            # Nobody to take the items: say so after a few seconds (a producer alone waits
            # for a consumer as long as it takes, as mp.Queue.put waits for a reader).
            ok = self._wait_until(done, _CLOSE_NAG_S, cause, waited, pumped=True)
            if not ok:
                log.warning("ipcsync producer %r: send() is waiting for a consumer to connect "
                            "(all %d slots hold items nobody has taken); start a Consumer on %r, or "
                            "pass timeout= to give up", self.endpoint.name, self.slots, self.endpoint.name)
                ok = self._wait_until(done, None if t is None else t - _CLOSE_NAG_S, cause, waited)
        else:
            ok = self._wait_until(done, t, cause, waited, pumped=True)
        if not ok:
            forwarded = sum(f is not None for f in self._fwd)
            raise self._timeout_error(
                "no free slot", t,
                f"all {self.slots} slots are held ({self._ring.occupancy()}) by "
                f"{len(self._ring.consumers())} consumer(s); consumers must release items "
                "(or connect), or raise timeout/slots"
                + (f"; {forwarded} of them hold items forwarded without a copy, which also hold "
                   "their upstream slots until released" if forwarded else ""),
            )
        acq = self._ring.acquire()
        assert acq is not None
        return acq

    def _prepare_slot(self, acq: Acquired, stream: Any) -> None:
        """Order the overwrite after the previous holders' reads (their release events).

        ``wait="gpu"``: the stream waits on each event at once. ``"host"``: poll ``query()``
        (pumping, so deaths are noticed) and enqueue only completed events. A holder lost
        meanwhile is skipped: no wait is ever enqueued on an event a lost peer recorded.
        """
        if self._fwd_pending and acq.slot in self._fwd_pending:
            self._complete_forward(acq.slot)
        for cid in acq.last_holders:
            peer = self._peers.get(cid)  # type: ignore[call-overload]
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
                t = self._timeout
                if not self._wait_until(lambda: self._peers.get(cid) is not peer or ev.query(),  # type: ignore[call-overload]
                                        t, "release_event", self._stats.waited, poll_event=True):
                    raise self._timeout_error(
                        f"{peer.label} did not finish with slot {acq.slot}", t,
                        "its GPU work on the slot is still running (or wedged)",
                    )
                continue  # complete, or its recorder is lost: no wait either way
            ev.wait(stream)

    def _empty_plan_for(self, spec: dict[str, Any]) -> tuple[Plan, Recipe]:
        try:
            parts: list[Any] = ["slot"]
            for k, v in spec.items():
                parts.append((k, tuple(v[0]), v[1]))
            key: Any = tuple(parts)
            plan = self._plans.get(key)
        except (TypeError, IndexError):  # malformed: let plan_empty say what is wrong
            key, plan = None, None
        if plan is None:
            plan = self._new_plan(key, plan_empty(spec, self.slot_bytes))
            plan.recipe = Recipe(plan.layout, self.slot_bytes)
        assert plan.recipe is not None
        return plan, plan.recipe

    def _new_plan(self, key: Any, placement: Any) -> Plan:
        """A plan for ``placement``, cached under ``key`` (None: not cached). ConfigError,
        and nothing cached, for a layout the consumers' decoder would refuse."""
        plan = Plan(placement, 0)
        encoded = msgpack.packb(plan.layout, use_bin_type=True)
        # Forwarded items' layouts travel in FREADY, which consumers cache apart from READY's.
        lkey = (type(key) is tuple and bool(key) and key[0] == "forward", encoded)
        if lkey not in self._layout_ids:  # (every layout that has an id was checked)
            try:
                P.sendable_layout(plan.layout, self._limits)
            except ProtocolError as exc:
                lim = self._limits
                raise ConfigError(
                    f"this message cannot be sent: its consumers would refuse its layout ({exc}); "
                    f"a message holds at most {lim.max_tensors} tensors and {lim.max_items} "
                    f"entries in one dict/list, nests at most {lim.max_depth} deep and is "
                    f"described in at most {lim.max_frame} bytes (ipcsync.Limits)"
                ) from None
        plan.layout_size = len(encoded)
        plan.layout_key = lkey
        plan.cache_key = key
        self._layout_id_for(plan)
        if key is not None:
            self._plans[key] = plan
            if len(self._plans) > _MAX_PLANS:
                self._plans.popitem(last=False)
        return plan

    def _layout_id_for(self, plan: Plan) -> None:
        """Give ``plan`` its layout's id: the one the layout has (now most recently used),
        else a fresh one, else the least recently used id that no slot's item uses, else 0
        (the layout then travels in every frame).

        Reassigning id k bumps its version. ``_dispatch`` sends a consumer a frame without
        the layout only when that consumer's recorded version of k is the item's; otherwise
        the frame carries the layout and the record is updated. Frames to one consumer
        arrive in order, so every short frame naming k follows the last frame that carried
        k's layout to it, which is that item's layout: correct whatever is in flight. Ids
        of items still in a slot (queued, or in flight to consumers that have not released
        them) are not reassigned anyway, so such frames stay short. Lock held."""
        ids = self._layout_ids
        key = plan.layout_key
        lid = ids.get(key)
        if lid is not None:
            ids.move_to_end(key)
        else:
            lid = 0
            if self._next_layout_id <= _MAX_LAYOUT_IDS:
                lid = self._next_layout_id
                self._next_layout_id += 1
            else:
                in_use = {item[0] for item in self._items if item is not None}
                for old_key, old in ids.items():  # least recently used first
                    if old not in in_use:
                        del ids[old_key]
                        lid = old
                        break
            if lid:
                ids[key] = lid
                self._layout_clock += 1
                self._layout_versions[lid] = self._layout_clock
        plan.layout_id = lid
        plan.layout_version = self._layout_versions[lid] if lid else 0

    def _commit(self, acq: Acquired, plan: Plan, meta: Any, fwd: tuple[_Foreign, int, int] | None = None) -> int:
        """``fwd``: (foreign arena, region offset, region bytes) of a zero-copy forward."""
        ring = self._ring
        seq = ring.next_seq
        slot, gen = acq.slot, acq.gen
        sent_ns = time.monotonic_ns()
        lid = plan.layout_id
        if lid:
            if self._layout_versions[lid] != plan.layout_version:  # its id went to another layout
                self._layout_id_for(plan)
                lid = plan.layout_id
            else:
                self._layout_ids.move_to_end(plan.layout_key)
        ck = plan.cache_key
        if ck is not None and self._plans.get(ck) is plan:
            self._plans.move_to_end(ck)
        try:
            # Cached layouts: encode the short frame now (what consumers that know the
            # layout get); the full one only if a consumer needs it (see _dispatch).
            if fwd is None:
                frame = self._enc.ready(seq, slot, gen, sent_ns, lid, None if lid else plan.layout, meta)
            else:
                frame = self._enc.forward_ready(seq, slot, gen, sent_ns, lid, None if lid else plan.layout,
                                                meta, fwd[0].fid, fwd[1], fwd[2])
        except (TypeError, ValueError, OverflowError) as exc:
            raise ConfigError(f"meta is not msgpack-able: {exc}") from None
        try:
            # What the consumers' decoder accepts, under the same limits (the layout was
            # checked when its plan was made).
            P.check_outgoing(frame, meta, plan.layout_size if lid else 0, self._limits)
        except ProtocolError as exc:
            lim = self._limits
            raise ConfigError(
                f"this message cannot be sent: its consumers would refuse it ({exc}); meta holds "
                f"at most {lim.max_items} entries in one dict/list and nests at most "
                f"{lim.max_depth} deep, and layout and meta together fit in {lim.max_frame} "
                "bytes (ipcsync.Limits): send less meta or fewer tensors"
            ) from None
        committed = ring.commit(slot)
        assert committed == seq
        # [layout id, meta, seq, gen, sent_ns, frame with the layout (None until needed),
        #  frame without it, forwarding, layout version, layout]
        self._items[slot] = [lid, meta, seq, gen, sent_ns, None if lid else frame, frame if lid else None, fwd,
                             plan.layout_version, plan.layout]
        stats = self._stats
        stats.handoffs += 1
        stats.bytes += plan.data_bytes
        self._dispatch()
        return seq

    def _dispatch(self) -> None:
        ring = self._ring
        if not ring.queued:
            return
        for cid, _seq, slot, _gen in ring.dispatch():
            peer = self._peers.get(cid)  # type: ignore[call-overload]
            if peer is None:  # lost by an earlier send of this loop; the ring freed its slots
                continue
            item = self._items[slot]
            assert item is not None
            lid = item[0]
            fwd = item[7]
            if fwd is not None:  # forwarded zero-copy: the consumer must know the arena first
                foreign = fwd[0]
                if peer.foreign.get(foreign.fid) != foreign.version:
                    peer.foreign[foreign.fid] = foreign.version
                    self._send(peer, foreign.frame)
            if lid and peer.layouts.get(lid) == item[8]:  # it has this layout under lid
                frame = item[6]
            else:
                frame = item[5]
                if frame is None:
                    layout = item[9]
                    if fwd is None:
                        frame = self._enc.ready(item[2], slot, item[3], item[4], lid, layout, item[1])
                    else:
                        frame = self._enc.forward_ready(item[2], slot, item[3], item[4], lid, layout, item[1],
                                                        fwd[0].fid, fwd[1], fwd[2])
                    item[5] = frame
                if lid:
                    peer.layouts[lid] = item[8]
                self._layouts_inline += 1
            self._send(peer, frame)

    # ------------------------------------------------------------------ zero-copy forwarding
    def _forward_zero_copy(self, item: Any, message: Any, meta: Any, timeout: float | None,
                           stream: Any) -> int:
        """Send ``message`` (views of received ``item``) without a copy; returns its seq.
        Raises CannotForward (nothing sent, the item untouched) when zero-copy is not
        possible, and what send() raises otherwise."""
        src = item._consumer
        info = src._forward_take(item, self)  # ownership moves; undone below if we do not send
        try:
            placed = place_views(message, info.region)
            if type(placed) is str:
                raise CannotForward(placed)
            layout, data_bytes = placed  # type: ignore[misc]
            with self._lock:
                if self._closed or self._closing:
                    self._refuse_send()
                try:
                    self._forward_check(src, info)
                    plan = self._forward_plan(layout, data_bytes)
                    foreign = self._foreign_for(info)
                    acq = self._ring.acquire() or self._acquire(timeout)
                    slot = acq.slot
                    try:
                        s = stream if stream is not None else self._stream
                        if s is None:
                            s = self._backend.current_stream()
                        # Nothing is written to our slot, but its previous holders' release
                        # events are waited on as for a send: they re-record them for this
                        # item, perhaps on another stream, and a later send to the slot waits
                        # only on their latest record.
                        if acq.last_holders:
                            self._prepare_slot(acq, s)
                        elif self._fwd_pending and slot in self._fwd_pending:
                            self._complete_forward(slot)
                        # The downstream ready wait covers the upstream write through ours.
                        info.ready_event.wait(s)
                        self._ready_events[slot].record(s)
                        self._fwd[slot] = _Forward(item, src, s, foreign)
                        seq = self._commit(acq, plan, meta, (foreign, info.offset, info.nbytes))
                    except BaseException:
                        self._fwd[slot] = None
                        self._ring.abort(slot)
                        raise
                    foreign.outstanding += 1
                    self._forwarded_total += 1
                    return seq
                finally:
                    self._last_call = time.monotonic()
        except BaseException:
            src._forward_undo(item)
            raise

    def _forward_check(self, src: Any, info: Any) -> None:
        """CannotForward unless the consumers of this producer can open ``info``'s memory."""
        if info.backend != self._backend.name:
            raise CannotForward(f"the item is in {info.backend} memory and this producer is on {self.device}")
        if self._backend.name == "cuda":
            if src.device != self.device:
                raise CannotForward(
                    f"the item was received on {src.device} and this producer is on {self.device}; "
                    "forward on the device the item was received on")
            for peer in self._peers.values():
                key = (peer.hello.device, info.device)
                ok = self._reach.get(key)
                if ok is None:
                    ok = self._reach[key] = self._backend.can_reach(peer.hello.device, info.device)
                if not ok:
                    raise CannotForward(
                        f"{peer.label} runs on GPU {peer.hello.device}, which cannot read (or this "
                        f"process cannot tell whether it can read) the item's GPU {info.device}")

    def _forward_plan(self, layout: list[Any], data_bytes: int) -> Plan:
        key = ("forward", msgpack.packb(layout, use_bin_type=True))
        plan = self._plans.get(key)
        if plan is None:
            plan = self._new_plan(key, Placement(layout, [], data_bytes))
        return plan

    def _foreign_for(self, info: Any) -> _Foreign:
        """The foreign arena entry (and id) for ``info``'s arena, made on first use."""
        self._foreign_clock += 1
        key = _forward_key(info)
        f = self._foreign.get(key)
        if f is not None:
            f.used = self._foreign_clock
            return f
        if len(self._foreign_ids) < self._limits.max_foreign:
            fid, version = len(self._foreign_ids), 0
        else:
            idle = [f for f in self._foreign_ids if f.outstanding == 0]
            if not idle:
                raise CannotForward(
                    f"items of {self._limits.max_foreign} other arenas are in flight already")
            old = min(idle, key=lambda f: f.used)
            del self._foreign[old.key]
            fid, version = old.fid, old.version + 1
        frame = P.encode(P.Foreign(fid, info.backend, info.device, info.pid, info.start_time,
                                   info.handle, info.arena_bytes))
        f = _Foreign(fid, version, key, frame, self._foreign_clock)
        if fid == len(self._foreign_ids):
            self._foreign_ids.append(f)
        else:
            self._foreign_ids[fid] = f
        self._foreign[key] = f
        return f

    def _forward_freed(self, slot: int) -> None:
        """Every downstream holder of forwarded slot ``slot`` has released it or is gone:
        release the upstream item now (wait="host": once their release events are
        complete). Lock held."""
        if self._fwd[slot] is None:  # abandoned at close already
            return
        waits = self._downstream_waits(slot)
        if self.wait_mode == "host" and not all(ev.query() for _, ev in waits):
            self._fwd_pending[slot] = waits
            return
        self._finish_forward(slot, waits)

    def _downstream_waits(self, slot: int) -> list[tuple[_Peer, Event]]:
        """The release event of each connected consumer that released forwarded ``slot``."""
        waits = []
        for cid in self._ring.released_by(slot):
            peer = self._peers.get(cid)  # type: ignore[call-overload]
            if peer is not None and peer.release_events:
                waits.append((peer, peer.release_events[slot]))
        return waits

    def _finish_forward(self, slot: int, waits: list[tuple[_Peer, Event]]) -> None:
        fwd = self._fwd[slot]
        self._fwd[slot] = None
        self._fwd_pending.pop(slot, None)
        if fwd is None:
            return
        for peer, ev in waits:
            if self._peers.get(peer.identity) is peer:  # never wait on a lost peer's event
                ev.wait(fwd.stream)
        fwd.foreign.outstanding -= 1
        fwd.source._forward_done(fwd.item, fwd.stream)

    def _poll_forwards(self) -> None:
        """wait="host": release upstream the forwarded items whose downstream release
        events have completed (lost holders no longer count). Lock held."""
        for slot, waits in list(self._fwd_pending.items()):
            live = [(p, ev) for p, ev in waits if self._peers.get(p.identity) is p]
            if all(ev.query() for _, ev in live):
                self._finish_forward(slot, live)
            else:
                self._fwd_pending[slot] = live

    def _complete_forward(self, slot: int) -> None:
        """Slot ``slot`` is acquired again while its forwarded item still waits for
        downstream release events (wait="host"): finish that first, since its holders
        re-record those events only for a later item of this slot. Lock held."""
        def done() -> bool:
            self._poll_forwards()
            return slot not in self._fwd_pending

        t = self._timeout
        if not self._wait_until(done, t, "release_event", self._stats.waited, poll_event=True):
            raise self._timeout_error(
                f"downstream consumers did not finish with forwarded slot {slot}", t,
                "their GPU work on the item is still running (or wedged)")

    def _abandon_forwards(self) -> None:
        """close()/teardown: release upstream every forwarded item still here. Holders that
        released it are waited on as usual (wait="host": only events already complete,
        never wedging the close); holders still holding it are warned about. Lock held."""
        left = [slot for slot, f in enumerate(self._fwd) if f is not None]
        if not left:
            return
        held = 0
        for slot in left:
            waits = [(peer, ev) for peer, ev in self._downstream_waits(slot)
                     if self.wait_mode == "gpu" or ev.query()]
            if self._ring.holders[slot] or slot in self._fwd_pending:
                held += 1
            self._finish_forward(slot, waits)
        if held:
            log.warning(
                "ipcsync producer %r closing with %d forwarded item(s) still held by consumers; "
                "released upstream anyway: the upstream producer may now overwrite memory they read",
                self.endpoint.name, held)

    # ------------------------------------------------------------------ I/O
    def _send(self, peer: _Peer, frame: bytes) -> None:
        if peer.outbox or not self._try_send(peer, frame):
            peer.outbox.append(frame)

    def _try_send(self, peer: _Peer, frame: bytes) -> bool:
        if peer.disconnected:
            return True  # nothing reaches it any more; its holds wait for its exit
        try:
            ok = self._chan.send(peer.identity, frame)
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the peer's connection is gone
            self._on_disconnect(peer, f"unreachable ({exc})")
            return True
        if ok:
            peer.last_send = time.monotonic()
        return ok

    def _flush_outboxes(self) -> None:
        for peer in list(self._peers.values()):
            while peer.outbox and peer.identity in self._peers:
                if not self._try_send(peer, peer.outbox[0]):
                    break
                if peer.outbox:
                    peer.outbox.popleft()

    def _pump(self) -> None:
        chan = self._chan
        for ev, fd in chan.events():
            self._on_monitor(ev, fd)
        recv, on_frame = chan.recv, self._on_frame
        for _ in range(10_000):  # bounded, so a flood cannot starve the caller
            got = recv()
            if got is None:
                break
            on_frame(*got)
        # Disconnects are applied after the frames that arrived before them (a BYE
        # followed by a close is a goodbye, not a loss).
        while self._disconnected:
            peer = self._peers.get(self._disconnected.pop())
            if peer is not None:
                self._on_disconnect(peer, "disconnected")
        if self._fwd_pending:
            self._poll_forwards()
        self._dispatch()
        self._flush_outboxes()
        now = time.monotonic()
        if now >= self._next_tick:
            self._next_tick = now + self._tick
            self._tick_peers(now)

    def _on_monitor(self, event: int, fd: int) -> None:
        if event == zmq.EVENT_DISCONNECTED:
            identity = self._fd_peer.pop(fd, None)
            if identity is not None:
                self._disconnected.append(identity)

    def _on_frame(self, identity: bytes, frames: list[bytes], fd: int) -> None:
        peer = self._peers.get(identity)
        if peer is not None and len(frames) == 1 and peer.conv.state == "active":
            # Steady state: a RELEASE from an attached consumer, which leaves it active.
            entries = P.decode_release(frames[0], self._limits)
            if entries is not None:
                peer.last_recv = time.monotonic()
                self._on_release(peer, entries)
                return
        if len(frames) != 1:
            self._bad_frame(identity, peer, ProtocolError(f"expected 1 frame, got {len(frames)}"))
            return
        try:
            msg = P.decode(frames[0], self._limits)
        except ProtocolError as exc:
            self._bad_frame(identity, peer, exc)
            return
        if peer is None:
            if type(msg) is P.Hello:
                self._on_hello(identity, msg, fd)
            elif type(msg) is not P.Bye:
                self._bad_frame(identity, None, ProtocolError(
                    f"{type(msg).__name__.upper()} from a peer that has not sent HELLO"))
            return
        peer.last_recv = time.monotonic()
        if type(msg) is P.Hello and msg == peer.hello and peer.conv.state == "await_attach":
            # The same HELLO again: ZeroMQ kept the consumer's first HELLO queued across a
            # reconnect (its previous producer died unanswered) and the consumer sent one
            # more on connecting. SETUP is already on its way; nothing to do.
            return
        try:
            peer.conv.receive(msg)
        except ProtocolError as exc:
            self._bad_frame(identity, peer, exc)
            return
        kind = type(msg)
        if kind is P.Release:
            self._on_release(peer, msg.entries)  # type: ignore[union-attr]
        elif kind is P.Attach:
            self._on_attach(peer, msg)  # type: ignore[arg-type]
        elif kind is P.Bye:
            # Always acknowledged: the consumer closes its socket (linger 0) only after
            # this ack, which proves its earlier frames (releases, BYE) arrived.
            peer.bye_received = True
            peer.bye_sent = True
            self._send(peer, P.encode(P.Bye("ack")))
            self._drop(peer)
        elif kind is P.Error:
            self._ratelog.warning("peer_error", "ipcsync: %s reported an error: %s: %s",
                                  peer.label, msg.code, msg.message)  # type: ignore[union-attr]
            self._drop(peer)

    def _bad_frame(self, identity: bytes, peer: _Peer | None, exc: ProtocolError) -> None:
        """Log (rate-limited), answer ERROR, and end the connection of a known peer. Never
        raises; never touches another peer's state."""
        self._bad_frames += 1
        n = self._bad_by_peer[identity] = self._bad_by_peer.get(identity, 0) + 1
        if len(self._bad_by_peer) > 1024:  # bounded memory under a flood of identities
            self._bad_by_peer.clear()
        who = peer.label if peer else f"unknown peer {identity.hex()[:16]}"
        self._ratelog.warning("frame", "ipcsync producer %r rejected a frame from %s (%d so far): %s",
                              self.endpoint.name, who, n, exc)
        code = "version" if isinstance(exc, P.VersionMismatch) else "protocol"
        try:
            self._chan.send(identity, P.encode(P.Error(code, str(exc)[:1000])))
        except zmq.ZMQError:
            pass
        if peer is not None:
            self._drop(peer)

    def _on_hello(self, identity: bytes, hello: P.Hello, fd: int) -> None:
        # Monitor events first: a DISCONNECTED of an earlier connection on the same fd must
        # not be applied to this one.
        for ev, efd in self._chan.events():
            self._on_monitor(ev, efd)
        self._chan.greeted(fd)  # no longer half-open (see ProducerChannel)
        cred = _host.peer_credentials(fd) if self.endpoint.path is not None else None
        problem = self._hello_problem(hello) or self._credentials_problem(hello, cred)
        if problem is not None:
            code, text = problem
            self._ratelog.warning("hello", "ipcsync producer %r refused consumer pid %d: %s",
                                  self.endpoint.name, hello.pid, text)
            try:
                self._chan.send(identity, P.encode(P.Error(code, text)))
            except zmq.ZMQError:
                pass
            return
        now = time.monotonic()
        peer = _Peer(identity, fd, hello, P.Conversation("producer"), last_recv=now,
                     watch=self._watch_for(hello, cred), hello_at=now)
        peer.conv.receive(hello)
        self._peers[identity] = peer
        if fd >= 0:
            self._fd_peer[fd] = identity
        setup = P.Setup(
            version=P.PROTOCOL_VERSION,
            pid=self._pid,
            start_time=_host.start_time(self._pid),
            pid_ns=_host.pid_namespace(),
            backend=self._backend.name,
            device=self._backend.device_identity(),
            arenas=[self._arena.export()],
            arena_bytes=[self._arena.nbytes],
            slots=[(0, i * self._stride, self.slot_bytes) for i in range(self.slots)],
            ready_events=[e.handle() for e in self._ready_events],
            heartbeat_ms=int(self._heartbeat * 1000),
        )
        self._send(peer, P.encode(setup))

    def _credentials_problem(self, hello: P.Hello, cred: tuple[int, int, int] | None) -> tuple[str, str] | None:
        """On ipc endpoints the kernel says who connected (SO_PEERCRED): only our own
        user, and only the process the HELLO names: in our PID namespace its pid must be
        the kernel's; a HELLO claiming another namespace must name the one the kernel
        shows that process in. Only the kernel's word is trusted: liveness watches the
        kernel's pid, whatever the HELLO says (see _watch_for). (The socket file is 0600
        in a 0700 directory already; this also holds for ipc:// paths the user chose.)
        ``cred``: the connection's (pid, uid, gid), None where the OS cannot say (tcp)."""
        if cred is None:
            return None
        pid, uid, _gid = cred
        if uid != os.getuid():
            return "uid", f"connection from uid {uid}; this producer accepts only its own user ({os.getuid()})"
        ours = _host.pid_namespace()
        if hello.pid_ns == ours:
            if pid != hello.pid:
                return "identity", f"HELLO claims pid {hello.pid} but the connection belongs to pid {pid}"
        elif pid > 0:
            try:
                theirs = os.readlink(f"/proc/{pid}/ns/pid")
            except OSError:
                theirs = None  # cannot tell; the watch still uses the kernel's pid
            if theirs is not None and theirs != hello.pid_ns:
                return "identity", (f"HELLO claims PID namespace {hello.pid_ns!r} but the connecting "
                                    f"process (pid {pid} here) runs in {theirs!r}")
        return None

    def _watch_for(self, hello: P.Hello, cred: tuple[int, int, int] | None) -> _host.ProcessWatch | None:
        """How to tell when this consumer's process has exited: the kernel's pid for the
        connection where there is one (ipc), else the HELLO's (pid, start time) if that
        process exists in our PID namespace; None if we cannot see it."""
        if cred is not None and cred[0] > 0:
            return _host.ProcessWatch(cred[0])
        if hello.pid_ns == _host.pid_namespace() and _host.read_start_time(hello.pid) == hello.start_time:
            return _host.ProcessWatch(hello.pid, hello.start_time)
        return None

    def _hello_problem(self, hello: P.Hello) -> tuple[str, str] | None:
        if hello.boot_id != _host.boot_id():
            return "host", (
                "consumer runs on another host or boot; shared memory and CUDA IPC need "
                "both processes on one machine"
            )
        if hello.backend != self._backend.name:
            return "backend", (
                f"producer uses the {self._backend.name} backend (device {self.device}) but "
                f"the consumer asked for {hello.backend}; use the same kind of device on both sides"
            )
        if self._backend.name == "cuda":
            # A consumer on another GPU of this host is welcome: it checks on SETUP that it
            # can see ours and has peer access to it (GPUs are matched by UUID, not index).
            if hello.pid_ns != _host.pid_namespace():
                return "host", "CUDA IPC needs both processes in one PID namespace"
        if hello.credits < 1:
            return "credits", "consumer credits must be at least 1"
        return None

    def _on_attach(self, peer: _Peer, msg: P.Attach) -> None:
        if len(msg.release_events) != self.slots:
            self._bad_frame(peer.identity, peer, ProtocolError(
                f"ATTACH carries {len(msg.release_events)} release events for {self.slots} slots"))
            return
        try:
            # Opened on our GPU, whichever GPU the consumer records them on (see
            # CudaBackend.open_event).
            peer.release_events = [self._backend.open_event(h) for h in msg.release_events]
        except Exception as exc:
            self._bad_frame(peer.identity, peer, ProtocolError(f"cannot open release events: {exc}"))
            return
        self._ring.add_consumer(peer.identity, min(peer.hello.credits, self.slots))
        self._attached_total += 1
        log.debug("ipcsync producer %r: %s attached", self.endpoint.name, peer.label)
        if self._closing and self._ring.queued == 0:
            self._say_bye(peer, "producer closed")
        self._dispatch()

    def _on_release(self, peer: _Peer, entries: list[tuple[int, int, int]]) -> None:
        now_ns = time.monotonic_ns()
        latencies = self._stats.latencies
        bad: ProtocolError | None = None
        nbad = 0
        for seq, slot, gen in entries:
            try:
                freed = self._ring.release(peer.identity, seq, slot, gen)
            except ProtocolError as exc:
                # Rejected, not fatal: a stale release can never free a newer item.
                nbad += 1
                bad = bad or exc
                continue
            if freed:
                item = self._items[slot]
                self._items[slot] = None
                if item is not None:
                    latencies.append((now_ns - item[4]) / 1e9)  # item[4]: sent_ns
                    if item[7] is not None:
                        self._forward_freed(slot)
        if nbad:  # one (rate-limited) line per RELEASE, however many entries it got wrong
            self._bad_frames += nbad
            self._ratelog.warning("release", "ipcsync producer %r ignored %d of %d release entries from %s: %s",
                                  self.endpoint.name, nbad, len(entries), peer.label, bad)

    def _say_bye(self, peer: _Peer, reason: str) -> None:
        if not peer.bye_sent:
            peer.bye_sent = True
            self._send(peer, P.encode(P.Bye(reason)))

    def _drop(self, peer: _Peer) -> None:
        """Forget a peer that said goodbye or broke the protocol; reclaim its slots."""
        if self._peers.get(peer.identity) is not peer:
            return
        self._flush_outboxes()  # last words (ERROR, BYE) go out before we forget the peer
        del self._peers[peer.identity]
        if self._fd_peer.get(peer.fd) == peer.identity:
            del self._fd_peer[peer.fd]
        peer.conv.close()
        freed = self._ring.remove_consumer(peer.identity)
        for slot in freed:
            self._items[slot] = None
            if self._fwd[slot] is not None:
                self._forward_freed(slot)  # never waits on the departed peer's events
        if self._fwd_pending:
            self._poll_forwards()  # it may have been the one a forward still waited for
        peer.release_events = []
        if peer.watch is not None:
            peer.watch.close()
        self._bad_by_peer.pop(peer.identity, None)
        self._backend.collect()
        self._dispatch()

    def _lose(self, peer: _Peer, why: str) -> None:
        """A consumer died or went silent: reclaim what it held, serve the others."""
        if peer.identity not in self._peers:
            return
        held = len(self._ring.held_by(peer.identity))
        if not peer.bye_received and peer.conv.state != "closed":
            self._lost_total += 1
            self._ratelog.warning("lost", "ipcsync producer %r lost %s (%s); reclaimed %d slot(s)",
                          self.endpoint.name, peer.label, why, held)
        self._drop(peer)

    def _on_disconnect(self, peer: _Peer, why: str) -> None:
        """The consumer's connection closed without BYE. Liveness rule: memory a consumer
        can still read is never reused while its process lives, so a consumer whose
        process we watch is lost only once it has exited (at once if it already has;
        else its holds stay and nothing more is sent to it until the tick sees it gone).
        One we cannot watch is lost now: a closed connection is all we can know."""
        if peer.identity not in self._peers:
            return
        if peer.watch is None or peer.watch.gone() or peer.conv.state != "active":
            self._lose(peer, why if peer.watch is None else "process exited")
            return
        if not peer.disconnected:
            peer.disconnected = True
            self._ring.suspend(peer.identity)
            held = len(self._ring.held_by(peer.identity))
            log.warning("ipcsync producer %r: %s closed its connection without goodbye (%s) but its "
                        "process still runs; its %d slot(s) stay held until it exits",
                        self.endpoint.name, peer.label, why, held)

    def _tick_peers(self, now: float) -> None:
        """Liveness, once a tick: a consumer is lost only when its process is provably
        gone; one silent past 1.5 heartbeats is "stalled" (paused, a long GC, SIGSTOP):
        logged, counted, waited for through backpressure, never reclaimed. A peer that
        said HELLO but never ATTACHed (it holds nothing) is dropped after _HANDSHAKE_S."""
        for peer in list(self._peers.values()):
            if peer.watch is not None and peer.watch.gone():
                self._lose(peer, "process exited")
                continue
            if peer.conv.state == "await_attach" and now - peer.hello_at > _HANDSHAKE_S:
                self._lose(peer, f"no ATTACH within {_HANDSHAKE_S:.0f} s of its HELLO")
                continue
            hb = peer.hello.heartbeat_ms / 1000
            silent = now - peer.last_recv
            change = None if peer.disconnected else stall_change(peer.stalled, silent, hb)
            if change is not None:
                peer.stalled = change
                if change:
                    self._stalled_total += 1
                    self._ratelog.warning("stalled",
                        "ipcsync producer %r: %s has been silent for %.1f s (heartbeat %.2f s) but its "
                        "process is alive: stalled (paused, GC, SIGSTOP?); its %d slot(s) stay held",
                        self.endpoint.name, peer.label, silent, hb, len(self._ring.held_by(peer.identity)))
                else:
                    log.info("ipcsync producer %r: %s is answering again", self.endpoint.name, peer.label)
            if self._heartbeat and not peer.outbox and now - peer.last_send > self._heartbeat / 4:
                self._try_send(peer, P.encode(P.Heartbeat()))

    def _io_fds(self) -> list[int]:
        return self._fds

    def _io_pending(self) -> bool:
        return self._chan.pending()

    def _teardown(self, linger_ms: int = 0) -> None:
        """Free everything. Lock held (or the object is being collected). ``linger_ms``:
        how long frames already sent may still go out after the socket is closed."""
        try:
            self._abandon_forwards()
        except Exception as exc:
            log.debug("ipcsync producer teardown: %s", exc)
        for peer in self._peers.values():
            if peer.watch is not None:
                peer.watch.close()
        self._peers.clear()
        self._fd_peer.clear()
        if linger_ms:
            try:
                self._chan.sock.setsockopt(zmq.LINGER, linger_ms)
            except zmq.ZMQError:
                pass
        # Every view of the arena goes (the plans' cached destinations and slot() views
        # too), so closing it frees its memory now: on CUDA torch's IPC bookkeeping of the
        # export is settled here, not left for the interpreter's exit, where torch would
        # warn "Producer process has been terminated before all shared CUDA tensors released".
        self._plans.clear()
        self._slot_views = []
        for closer in (self._chan.close, self._arena.close, self._backend.collect, self._backend.close):
            try:
                closer()
            except Exception as exc:
                log.debug("ipcsync producer teardown: %s", exc)


def _forward_key(src: Any) -> tuple[Any, ...]:
    return (src.backend, src.pid, src.start_time, src.handle)


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())
