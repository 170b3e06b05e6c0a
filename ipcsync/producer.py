"""The public Producer: owns the slots, binds the endpoint, serves any number of consumers.

A facade. The parts, each with one job:

- ``runtime.slots``: the handoff steps (reserve -> order after the previous readers ->
  write and record ready -> publish; release), each with its ordering rule;
- ``runtime.peers`` (+ ``runtime.admission``): the consumers, their sockets, their
  liveness; ``core.producer_session``: one connection's protocol, sans I/O;
- ``runtime.forwarder`` (+ ``core.forwarding``): zero-copy forwarding and its invariants;
- ``runtime.port``: what arrives (the pump), and the entries other parts of ipcsync use
  (``ipcsync.forward``, ``Producer.slot()``, a Consumer that lent items to us).
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from types import TracebackType
from typing import Any, Callable, ContextManager, Mapping, Sequence, TypeVar

import torch

from . import limits
from .backends import backend_for, resolve_device
from .core import protocol as P
from .core.forwarding import ForwardLedger
from .core.layout import ALIGN, plan_message, signature
from .core.ring import POLICIES, Ring
from .core.stats import Stats
from .core.waits import wait_strategy
from .errors import ConfigError, IpcTimeoutError
from .item import AsyncSlotEntry, SlotWriter, SlotEntry
from .runtime import aio
from .runtime.channel import CurveKeys, ProducerChannel, check_transport, resolve_endpoint
from .runtime.endpoint import EndpointBase, check_positive_int
from .runtime.forwarder import Forwarder
from .runtime.peers import PeerTable
from .runtime.port import ProducerPort
from .runtime.slots import Handoffs, Waits

__all__ = ["Producer", "SlotWriter"]

log = logging.getLogger(__name__)

DEFAULT_SLOT_BYTES = limits.DEFAULT_SLOT_BYTES
_MAX_SLOTS = limits.MAX_SLOTS
_T = TypeVar("_T")


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

    ``port`` is internal composition (other parts of ipcsync use it), not user API.
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
        waiting = wait_strategy(wait)  # how a slot's overwrite is ordered after its readers
        self.wait_mode = waiting.name
        self.device = resolve_device(device)
        self.endpoint = resolve_endpoint(endpoint)
        check_transport(self.endpoint, curve, insecure, "producer")
        self._stream = stream
        self._backend = backend = backend_for(self.device)
        self._ring = ring = Ring(self.slots, policy)
        self._closing = False
        stride = (self.slot_bytes + ALIGN - 1) // ALIGN * ALIGN
        self._chan = chan = ProducerChannel(self.endpoint, limits.max_frame, curve)
        arena = None
        try:
            try:
                arena = backend.create_arena(stride * self.slots)
            except ConfigError as exc:  # e.g. /dev/shm too small: name the ring that asked
                raise ConfigError(f"Producer(slots={self.slots}, slot_bytes={self.slot_bytes}): {exc}") from None
            self._slot_views = [arena.tensor[i * stride: i * stride + self.slot_bytes] for i in range(self.slots)]
            self._ready_events = [backend.create_event() for _ in range(self.slots)]
        except BaseException:
            chan.close()
            if arena is not None:
                arena.close()
            raise
        self._stats = Stats()
        name = self.endpoint.name
        peers = PeerTable(chan, name, ring, self._ratelog, lambda peer: self.port.on_gone(peer))
        self._handoffs = h = Handoffs(
            ring=ring, slot_views=self._slot_views, ready_events=self._ready_events, slot_bytes=self.slot_bytes,
            peers=peers, ledger=ForwardLedger(self.slots), stats=self._stats, limits=limits,
            wait=waiting, timeout=self._timeout, name=name, ratelog=self._ratelog, backend=backend,
            waits=Waits(lambda: self.port.pump(), self._wait_until, self._timeout_error, self._resolve_timeout))
        self._plan_get: Callable[[Any], Any] = h.plans.get  # the cache dict's own get (hot path)
        fwd = Forwarder(handoffs=h, peers=peers, backend=backend, device=self.device, lock=self._lock,
                        enter=self._enter_send, touch=self._touch, default_stream=stream, name=name)
        self.port = ProducerPort(
            owner=self, lock=self._lock, chan=chan, peers=peers, handoffs=h, forwarder=fwd, backend=backend,
            arena=arena, stride=stride, heartbeat=self._heartbeat, tick=self._tick, gate=self._enter_send,
            check_open=self._check_open, default_stream=stream, name=name,
            ipc=self.endpoint.path is not None)
        self._pump = self.port.pump  # (an attribute: EndpointBase's waits pump through it)
        self._fds = chan.fds()
        self._start_service()

    # ------------------------------------------------------------------ public API
    def send(self, message: Any, meta: Any = None, *, timeout: float | None = None, stream: Any = None) -> int:
        """Copy ``message`` into a free slot and hand it to a consumer. Returns its seq.

        Blocks while every slot is in use (backpressure: nothing is dropped or
        overwritten), up to ``timeout`` (default: the producer's). On CUDA the copy and the
        ready event go on ``stream`` (default: current) and the call returns without a host
        sync. Raises ConfigError for a message that does not fit a slot or a bad meta,
        IpcTimeoutError when no slot frees in time, ClosedError after close().
        """
        # The handoff steps of runtime.slots: begin (1 reserve, 2 order after the previous
        # readers), 3 write, finish (3b record ready, 4 publish). On a steady edge each is
        # its fast branch (see runtime.slots).
        with self._lock:
            if self._closed or self._closing:
                self._refuse_send()
            key, tensors = signature(message)
            plan = self._plan_get(key)
            h = self._handoffs
            if plan is None:
                plan = h.new_plan(key, plan_message(message, self.slot_bytes, h.check_layout))
            s = stream if stream is not None else self._stream
            rec = h.begin(timeout, s)
            try:
                if s is None:  # 3. write, on the stream begin resolved (the current one)
                    plan.write(rec.slot, self._slot_views[rec.slot], tensors)
                else:
                    self._write_on(s, plan, rec.slot, tensors)
                return h.finish(rec, plan, meta, rec.stream)
            except BaseException:
                self._ring.abandon(rec.slot)
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
        spec = {**fields, **named_fields} if fields else named_fields
        return SlotEntry(self.port, spec, meta, timeout, stream)

    # ------------------------------------------------------------------ asyncio
    async def asend(self, message: Any, meta: Any = None, *, timeout: float | None = None,
                    stream: Any = None) -> int:
        """``send()`` for asyncio: the same copy, result, timeout and errors; while every
        slot is in use it awaits a release without blocking the event loop.

        Cancellation-safe: the only wait is before a slot is reserved, and the copy and
        publish then run without awaiting. So a cancelled ``asend`` sent nothing (the
        message was not copied, no slot is taken; send it again if you still want it), and
        an ``asend`` that returned a seq sent it. On CUDA with ``wait="host"`` (the
        default) a reused slot's previous readers' release events are polled inline
        (bounded by their GPU work on that slot); ``wait="gpu"`` enqueues that wait."""
        return await self._when_slot_free(lambda: self.send(message, meta, timeout=0, stream=stream), timeout)

    def aslot(
        self,
        fields: Mapping[str, tuple[Sequence[int], torch.dtype]] | None = None,
        *,
        meta: Any = None,
        timeout: float | None = None,
        stream: Any = None,
        **named_fields: tuple[Sequence[int], torch.dtype],
    ) -> AsyncSlotEntry:
        """``slot()`` for asyncio: ``async with out.aslot(x=(shape, dtype)) as s: ...``.
        Entering awaits a free slot without blocking the event loop; a cancelled entry
        reserved nothing. The block itself is ``slot()``'s: sent on a clean exit, the slot
        given back if it raises (a cancellation inside it included)."""
        spec = {**fields, **named_fields} if fields else named_fields
        entry = SlotEntry(self.port, spec, meta, 0.0, stream)
        return AsyncSlotEntry(entry, lambda: self._when_slot_free(entry.__enter__, timeout))

    async def aclose(self, timeout: float | None = None) -> None:
        """``close()`` for asyncio: refuses new sends at once, awaits (without blocking the
        event loop) until every item sent was delivered, says goodbye, awaits until every
        item was released, or its holders are gone, then runs ``close()`` with what is left of ``timeout`` (default: the
        producer's), whose remaining goodbye exchange is a round trip. Lets consumers on
        the same event loop finish their items. With nobody left, queued items are
        dropped as ``close()`` drops them."""
        t = self._resolve_timeout(timeout)
        deadline = None if t is None else time.monotonic() + t
        with self._lock:
            if self._closed:
                return
            self._closing = self.port.closing = True

        def drained() -> tuple[bool, None]:
            with self._lock:
                if self._closed:
                    return True, None
                self._pump()
                ring, port = self._ring, self.port
                if ring.queued > 0:
                    # (Nobody left to take queued items: close() drops them, with its warning.)
                    return self._handoffs.alone_too_long(port.attached_total), None
                # Every item sent was delivered: say goodbye now, as close() does before it
                # waits. A consumer gives back at our BYE the slots its program's tensors
                # still view (the reference rule keeps them until then), so waiting for
                # every release before the BYE would wait for ever on a kept view.
                for peer in port.peers:
                    port.say_bye(peer, "producer closed")
                return not ring.busy(), None

        def fill(poller: Any) -> None:
            with self._lock:
                if not self._closed:
                    poller.add(self._io_fds(), self._io_pending())

        await aio.wait_for_attempt(drained, fill, t, self._tick, lambda: None)
        self.close(None if deadline is None else max(0.0, deadline - time.monotonic()))

    async def _when_slot_free(self, reserve: Callable[[], _T], timeout: float | None) -> _T:
        """Await a free slot (up to ``timeout``, default the producer's), then ``reserve()``
        (a call that reserves with timeout 0, so it never blocks). Lost to another thread
        in between: wait again. Time over: ``reserve()`` once more; if still no slot is
        free, the sync call's IpcTimeoutError, naming ``timeout`` (not the 0 of that try)."""
        t = self._resolve_timeout(timeout)
        deadline = None if t is None else time.monotonic() + t
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            await aio.wait_for_attempt(self._slot_free, self._fill_poller, left, self._tick, lambda: None,
                                       self._waited_for_slot)
            try:
                return reserve()
            except IpcTimeoutError:
                with self._lock:
                    taken = self._ring.free_slots == 0  # by another thread since we looked
                    if taken and deadline is not None and time.monotonic() >= deadline:
                        raise self._handoffs.no_slot_error(t) from None
                if not taken:
                    raise

    def _slot_free(self) -> tuple[bool, None]:
        """A non-blocking look: is a slot free (after handling what arrived)? Refused on
        a closed or closing producer."""
        with self._lock:
            self._enter_send()
            if self._ring.free_slots == 0:
                self._pump()
            return self._ring.free_slots > 0, None

    def _fill_poller(self, poller: Any) -> None:
        with self._lock:
            self._enter_send()
            poller.add(self._io_fds(), self._io_pending())

    def _waited_for_slot(self, seconds: float) -> None:
        self._stats.waited("slot" if self._ring.consumers() else "consumer", seconds)

    def flush(self, timeout: float | None = None) -> None:
        """Block until every item sent so far has been released by its consumers (or they
        are gone). IpcTimeoutError after ``timeout``."""
        with self._call():
            t = self._resolve_timeout(timeout)
            if not self._wait_until(lambda: not self._ring.busy(), t):
                raise self._timeout_error("items still in flight", t, f"slot states: {self._ring.occupancy()}")

    def wait_for_consumers(self, n: int = 1, timeout: float | None = None) -> None:
        """Block until at least ``n`` consumers are attached. IpcTimeoutError after ``timeout``."""
        with self._call():
            t = self._resolve_timeout(timeout)
            if not self._wait_until(lambda: len(self._ring.consumers()) >= n, t):
                raise self._timeout_error(f"fewer than {n} consumers attached", t,
                                          f"is a consumer running on endpoint {self.endpoint.name!r}?")

    @property
    def consumers(self) -> int:
        """Number of consumers attached now."""
        return len(self._ring.consumers())

    def stats(self) -> dict[str, Any]:
        """Handoffs, bytes, rate, send-to-release latency percentiles, time spent waiting
        by cause, slot occupancy, consumers (attached now, ever, lost, stalled now: silent
        but alive), rejected frames, consumers on a lane now (``lanes``)."""
        with self._lock:
            port, peers = self.port, self.port.peers
            return self._stats.snapshot(
                role="producer", occupancy=self._ring.occupancy(), consumers=len(self._ring.consumers()),
                consumers_attached=port.attached_total, consumers_lost=peers.lost_total,
                consumers_stalled=peers.stalled_now(), consumers_stalled_total=peers.stalled_total,
                bad_frames=peers.bad_frames, forwarded=port.forwarder.forwarded_total,
                forwarded_held=port.forwarder.ledger.count(), layouts_inline=self._handoffs.layouts_inline,
                lanes=port.lanes_used,
            )

    def close(self, timeout: float | None = None) -> None:
        """Finish and shut down: a successful end of the stream. Items already sent (and
        queued ones, to a consumer that attaches meanwhile) are delivered; consumers end
        their iteration cleanly after the last one. Waits up to ``timeout`` (default: the
        producer's; None: as long as the consumers holding items live) for them to be
        released, saying on whom it waits every few seconds, then frees the slots and the
        endpoint. Idempotent; never raises for peers that are gone. A call blocked in
        another thread raises ClosedError.

        Nobody left: once every consumer that attached has left (said goodbye or died),
        items still queued wait 2 s (``runtime.slots.CLOSE_LINGER_S``) for a consumer to
        attach, then are dropped with a warning naming how many; close() does not wait
        out its timeout for them. If no consumer ever attached, queued items wait for
        one up to ``timeout`` (either side may start first), and are dropped with that
        warning when it runs out."""
        with self._lock:
            if self._closed:
                return
            self._closing = self.port.closing = True
            self._begin_close()
            t = self._resolve_timeout(timeout)
            deadline = None if t is None else time.monotonic() + t
            port = self.port
            try:
                h = self._handoffs
                h.deliver_queued(deadline, lambda: port.attached_total)
                for peer in port.peers:
                    port.say_bye(peer, "producer closed")
                h.wait_nagging(lambda: not self._ring.busy() and not port.peers
                               and not port.forwarder.ledger.pending, deadline, h.held_words)
            except Exception as exc:  # close never fails because of a peer
                log.debug("ipcsync producer close: %s", exc)
            port.forwarder.abandon()
            if self._ring.busy():
                log.warning("ipcsync producer %r closing with items not released by consumers "
                            "(slot states %s)", self.endpoint.name, self._ring.occupancy())
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
            self._closing = self.port.closing = True
            self._begin_close(timeout=1.0)
            frame = P.encode(P.Error(P.ErrorCode.FAILED.value, text[:1000]))
            for peer in self.port.peers:
                if not peer.session.bye_received and not peer.disconnected:
                    self.port.peers.send_raw(peer.identity, frame)
            self._closed = True
            self._teardown(linger_ms=200)  # the ERROR frames go out before the socket shuts
        self._stop_service()

    def __enter__(self) -> "Producer":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort(exc)

    # ------------------------------------------------------------------ internals
    def _refuse_send(self) -> None:
        self._check_open()
        if self._closing:
            raise ConfigError("send() during close()")

    def _enter_send(self) -> None:
        """A send-like call starts: refused on a closed or closing producer. Lock held."""
        if self._closed or self._closing:
            self._refuse_send()
        self._last_call = time.monotonic()

    def _touch(self) -> None:
        self._last_call = time.monotonic()

    def _on_stream(self, stream: Any) -> Any:
        if stream is None or self.device.type != "cuda":
            return nullcontext()
        return torch.cuda.stream(stream)

    def _write_on(self, stream: Any, plan: Any, slot: int, tensors: list[torch.Tensor]) -> None:
        """Step 3 on a stream the caller chose: the copy runs on ``stream``, so the caching
        allocator must not reuse a source's memory before it has run."""
        with self._on_stream(stream):
            plan.write(slot, self._slot_views[slot], tensors)
            for t in tensors:
                if t.is_cuda:
                    t.record_stream(stream)

    def _io_fds(self) -> list[int]:
        return self._fds

    def _io_pending(self) -> bool:
        return self._chan.pending()

    def _teardown(self, linger_ms: int = 0) -> None:
        """Free everything. Lock held (or the object is being collected). ``linger_ms``:
        how long frames already sent may still go out after the socket is closed."""
        port = self.__dict__.get("port")
        if port is not None:  # (None: __init__ failed before the parts existed)
            port.teardown(linger_ms)


