"""The public Consumer and Item.

Ordering rules of a handoff (receive):

1. READY for (seq, slot, gen) arrives after the producer recorded the slot's ready event;
2. before the item's tensors are used, the consumer's stream waits on that event
   (``wait="gpu"``: enqueued at once; ``"host"``: the host polls ``query()`` first, so a
   producer that dies mid-record can never wedge the consumer's stream);
3. ``release()`` records the slot's release event on the consumer's stream, then queues
   RELEASE(seq, slot, gen); queued releases go out in one message when the consumer has
   no more buffered items (or from the service thread while the user computes);
4. after the producer's BYE and the last buffered item, iteration ends; the consumer
   answers BYE once it holds nothing.

After the producer is declared lost, no wait is ever enqueued on its events.

Zero-copy forwarding (``ipcsync.forward``), the two roles a Consumer plays:

- as the middle stage's input: ``_forward_take`` hands an item over to the forwarding
  Producer (the item counts as released here: no auto-release, ``release()`` is a no-op,
  its upstream credit stays held); the Producer later calls ``_forward_done`` from
  whatever thread processed the last downstream release, after ordering the stream on
  every downstream release event; we record our release event on that stream and queue
  the RELEASE (drained under our lock by the next pump, which the call wakes through an
  eventfd when our lock is busy). While forwarded items are out, the consumer does not
  say BYE, and ``close()`` waits (bounded) for them;
- as the downstream consumer: FOREIGN opens another producer's arena (once per id,
  without taking the owner's per-export reference), FREADY buffers an item whose tensors
  are views of it. If that memory cannot be opened (its owner died, or closed past its
  timeout), the items referencing it are dropped with a warning and released, counted in
  ``stats()["forwarded_lost"]``; a GPU this consumer cannot read is a ConfigError.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import deque
from typing import Any, Iterator

import torch
import zmq

from .runtime import host as _host
from . import limits
from .core import protocol as P
from .core.liveness import stall_change
from .runtime.endpoint import EndpointBase, check_positive_int, check_timeout, check_wait
from .backends import Arena, Event, backend_for, resolve_device
from .backends.cpu import reclaim_dead_segments, segment_owner
from .runtime.channel import (ConsumerChannel, CurveKeys, check_transport, diagnose_unanswered, producer_identity_problem,
                      remove_stale, resolve_endpoint)
from .errors import (
    BackendError,
    ConfigError,
    IpcSyncError,
    IpcTimeoutError,
    PeerLostError,
    ProducerFailedError,
    ProtocolError,
)
from .core.layout import Recipe
from .runtime.handover import CannotForward, ForwardSource
from .core.stats import Stats
from .item import Item

__all__ = ["Consumer", "Item"]

log = logging.getLogger("ipcsync")

_MAX_RECIPES = P.MAX_LAYOUT_IDS  # layouts cached per producer (its ids are 1..this, reused)


class _Unset:
    """The type of a keyword argument's "not given" default (where None means forever)."""

    def __repr__(self) -> str:
        return "<default>"


_UNSET = _Unset()
_DEFAULT_CONNECT_TIMEOUT = limits.DEFAULT_CONNECT_TIMEOUT  # (``limits`` is also a parameter name)


class _Wake:
    """An eventfd that another thread writes to wake our poll. Closed when collected, not
    at teardown: a thread that still holds a reference may be writing to it, and a closed
    fd number can be reused by anything."""

    __slots__ = ("fd",)

    def __init__(self) -> None:
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)

    def set(self) -> None:
        try:
            os.eventfd_write(self.fd, 1)
        except OSError:
            pass

    def clear(self) -> None:
        try:
            os.eventfd_read(self.fd)
        except OSError:  # not set (EAGAIN)
            pass

    def __del__(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


class _ForeignArena:
    """Another producer's arena, described by FOREIGN: open, or why it could not be."""

    __slots__ = ("msg", "arena", "error")

    def __init__(self, msg: P.Foreign, arena: Arena | None, error: str | None) -> None:
        self.msg, self.arena, self.error = msg, arena, error


class _ForeignUse:
    """What a buffered FREADY keeps in place of a Recipe (``_make_item`` calls ``build``
    and reads ``nbytes`` alike): the item's views are built in the foreign region."""

    __slots__ = ("recipe", "entry", "view", "offset", "region_bytes", "nbytes")

    def __init__(self, recipe: Recipe, entry: _ForeignArena, view: torch.Tensor, offset: int,
                 region_bytes: int) -> None:
        self.recipe, self.entry, self.view = recipe, entry, view
        self.offset, self.region_bytes = offset, region_bytes
        self.nbytes = recipe.nbytes

    def build(self, slot_index: int, slot: torch.Tensor) -> Any:
        return self.recipe.build_at(self.view)


class Consumer(EndpointBase):
    """Connects to a producer's ``endpoint`` and receives its items, in order.

    Args:
        endpoint: the producer's endpoint (bare name, ``ipc://...`` or ``tcp://...``).
        device: must be the same kind of device as the producer's (``cpu`` / ``cuda[:N]``).
        wait: ``"gpu"`` (the stream waits on the producer's event at once) or ``"host"``
            (poll until complete: never wedges if the producer dies).
        timeout: default for blocking calls (``get``, ``close``'s wait for forwarded
            items); None (the default) or inf: as long as the producer lives.
        connect_timeout: how long the handshake waits for a producer to appear and answer
            (seconds; None or inf: forever). Default: ``timeout`` when that is given,
            else 30 s.
        idle_timeout: how long iteration waits for the next item; None: as long as the
            producer is alive.
        heartbeat: seconds between liveness messages when idle. A producer silent for
            1.5x its heartbeat is reported as stalled (logged, ``stats()["producer_stalled"]``)
            and waited for; it is lost only when its process is provably gone or its
            connection closed without goodbye.
        credits: most items held at once (buffered + unreleased); default: all slots.
        auto_release: release the previous item at the next iteration.
        stream: CUDA stream for waits and release events (default: current at each call).
        curve: for a ``tcp://`` endpoint, ``CurveKeys`` with ``server`` = the producer's
            public key; refused without them unless ``insecure=True``.
        insecure: accept a plain tcp:// control channel.
    """

    _role = "consumer"

    def __init__(
        self,
        endpoint: str,
        *,
        device: str | torch.device | None = None,
        wait: str = "gpu",
        timeout: float | None = limits.DEFAULT_TIMEOUT,
        connect_timeout: float | None | _Unset = _UNSET,
        idle_timeout: float | None = None,
        heartbeat: float | None = limits.DEFAULT_HEARTBEAT,
        credits: int | None = None,
        auto_release: bool = True,
        stream: Any = None,
        curve: CurveKeys | None = None,
        insecure: bool = False,
        limits: P.Limits = P.DEFAULT_LIMITS,
    ) -> None:
        super().__init__(endpoint, timeout, heartbeat)
        self.wait_mode = check_wait(wait)
        self._idle_timeout = check_timeout("idle_timeout", idle_timeout)
        if isinstance(connect_timeout, _Unset):
            connect_timeout = _DEFAULT_CONNECT_TIMEOUT if timeout is None else timeout
        connect = check_timeout("connect_timeout", connect_timeout)
        self._credits = check_positive_int("credits", credits, 1 << 20) if credits is not None else 1 << 20
        self.auto_release = bool(auto_release)
        self.device = resolve_device(device)
        self.endpoint = resolve_endpoint(endpoint)
        check_transport(self.endpoint, curve, insecure, "consumer")
        self.source = endpoint  # what Item.source says; FanIn relabels it
        self._limits = limits
        self._stream = stream
        self._backend = backend_for(self.device)
        self._stats = Stats()
        self._conv = P.Conversation("consumer")
        self._enc = P.Encoder()  # used under the lock
        # Buffered READYs: (seq, slot, gen, sent_ns, meta, recipe).
        self._ready: deque[tuple[int, int, int, int, Any, Recipe]] = deque()
        self._recipes: dict[int, Recipe] = {}  # layout id -> validated layout
        self._held: dict[int, Item] = {}
        self._pending: list[tuple[int, int, int]] = []
        # Per iterating thread, its current item (auto-released at that thread's next
        # next()): one thread never releases another's item.
        self._current: dict[int, Item] = {}
        self._error: IpcSyncError | None = None
        self._bye_received = False
        self._bye_sent = False
        self._bye_acked = False
        self._rehello = False
        self._arenas: list[Arena] = []
        self._slot_views: list[torch.Tensor] = []
        self._ready_events: list[Event] = []
        self._release_events: list[Event] = []
        self._setup: P.Setup | None = None
        self._release_batch = 1
        # Zero-copy forwarding (see the module docstring).
        self._foreign: dict[int, _ForeignArena] = {}  # FOREIGN id -> arena
        self._frecipes: dict[int, Recipe] = {}  # layout id -> layout validated for FREADY
        self._foreign_seqs: dict[int, _ForeignUse] = {}  # seq -> region, for items from FREADY
        self._foreign_lost = 0  # FREADY items dropped: their memory could not be opened
        self._forwarded: dict[int, Item] = {}  # seq -> item handed to a forwarding Producer
        self._fwd_done: deque[Item] = deque()  # forwarded items back (appended by any thread)
        self._wake: _Wake | None = None  # among our wait fds (_io_fds), made at the first forward
        self._fwd_outs: list[Any] = []  # the Producers that forwarded items of ours
        self._last_recv = time.monotonic()
        self._last_send = 0.0
        self._producer_watch: _host.ProcessWatch | None = None  # set at SETUP
        self._stalled = False  # the producer is silent past 1.5 heartbeats but alive
        self._stalled_total = 0
        self._chan = ConsumerChannel(self.endpoint, b"c" + os.urandom(15), limits.max_frame, curve)
        try:
            self._fds = self._chan.fds()
            with self._lock:
                self._send_frame(P.encode(self._hello()))
                t = None if connect is None or math.isinf(connect) else connect
                if not self._wait_until(lambda: self._conv.state != "await_setup", t):
                    self._raise_unanswered(t)
                self._raise_if_broken()
        except BaseException:
            self._closed = True
            self._teardown()
            raise
        self._start_service()

    # ------------------------------------------------------------------ public API
    def get(self, timeout: float | None = None) -> Item | None:
        """The next item, or None once the producer has closed and everything it sent was
        received. Blocks up to ``timeout`` (default: the consumer's); raises
        IpcTimeoutError then, PeerLostError if the producer died, ClosedError after close().
        """
        with self._call():
            return self._next_item(self._resolve_timeout(timeout))

    def __iter__(self) -> Iterator[Item]:
        return self

    def __next__(self) -> Item:
        with self._lock:  # the hot path: an explicit lock rather than _call()
            if self._closed:
                self._check_open()
            try:
                self._release_current()
                ready = self._ready
                pumped = not ready and not self._bye_received and self._error is None
                if pumped:
                    self._pump()  # (no socket work when an item is already buffered)
                if ready and self._error is None:
                    item = self._current[threading.get_ident()] = self._make_item(ready.popleft())
                    return item
                t = self._idle_timeout
                item = self._next_item(None if t is None or math.isinf(t) else t, pumped)
            finally:
                self._last_call = time.monotonic()
        if item is None:
            raise StopIteration
        return item

    def stats(self) -> dict[str, Any]:
        """Handoffs, bytes, rate, producer-send-to-receive latency percentiles, time spent
        waiting by cause, items held and buffered."""
        with self._lock:
            return self._stats.snapshot(
                role="consumer", held=len(self._held), buffered=len(self._ready),
                forwarded_out=len(self._forwarded), forwarded_lost=self._foreign_lost,
                producer_stalled=self._stalled, producer_stalled_total=self._stalled_total,
            )

    @property
    def slots(self) -> int:
        """Number of slots in the producer's ring."""
        return len(self._setup.slots) if self._setup else 0

    @property
    def producer_pid(self) -> int | None:
        return self._setup.pid if self._setup else None

    def close(self, timeout: float | None = None) -> None:
        """Release everything held, say goodbye and disconnect. Idempotent. The goodbye
        waits at most ``min(timeout, 1 s)``; items this consumer forwarded zero-copy are
        waited for up to ``timeout`` (default: the consumer's; None: while their holders
        live). A call blocked in another thread raises ClosedError."""
        self._close(timeout, forwarded_wait=True)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        # An exception (Ctrl-C included) leaves at once: no wait for forwarded items.
        self._close(None if exc_type is None else 0.0, forwarded_wait=exc_type is None)

    def _close(self, timeout: float | None, forwarded_wait: bool) -> None:
        with self._lock:
            if self._closed:
                return
            self._begin_close(timeout=1.0)
            try:
                for item in list(self._held.values()):
                    self._release_locked(item, None)
                while self._ready:
                    seq, slot, gen, *_ = self._ready.popleft()
                    self._pending.append((seq, slot, gen))
                self._flush_releases()
                if self._forwarded:
                    self._close_forwarded(timeout if forwarded_wait else 0.0)
                if self._conv.state in ("active", "ending") and self._error is None and not self._bye_acked:
                    self._say_bye()
                    t = self._resolve_timeout(timeout)
                    t = 1.0 if t is None else min(t, 1.0)
                    t = max(t, 0.2)  # the ack is a round trip away: never drop our last frames
                    # Our RELEASE and BYE frames are delivered once the producer acks the
                    # BYE; only then may the socket close (linger 0 drops unsent frames).
                    self._wait_until(
                        lambda: self._bye_acked or self._error is not None or not self._producer_alive(), t
                    )
                    if not self._bye_acked and not self._producer_alive():
                        self._remove_stale_endpoint(wait=0.0)  # it died after its BYE
            except IpcSyncError as exc:
                log.debug("ipcsync consumer close: %s", exc)
            self._closed = True
            self._teardown()
        self._stop_service()

    def __enter__(self) -> "Consumer":
        return self

    # ------------------------------------------------------------------ internals
    def _hello(self) -> P.Hello:
        pid = os.getpid()
        return P.Hello(
            version=P.PROTOCOL_VERSION,
            pid=pid,
            start_time=_host.start_time(pid),
            boot_id=_host.boot_id(),
            pid_ns=_host.pid_namespace(),
            backend=self._backend.name,
            device=self._backend.device_identity(),
            credits=self._credits,
            heartbeat_ms=int(self._heartbeat * 1000),
        )

    def _next_item(self, timeout: float | None, pumped: bool = False) -> Item | None:
        """``pumped``: the caller has just pumped (nothing is buffered)."""
        self._release_current()
        if not self._ready and not self._bye_received and self._error is None:
            self._wait_until(
                lambda: bool(self._ready) or self._bye_received or self._error is not None,
                timeout, "producer", self._stats.waited, pumped=pumped,
            )
        self._raise_if_broken()
        if self._ready:
            item = self._make_item(self._ready.popleft())
            self._current[threading.get_ident()] = item
            return item
        if self._bye_received:
            self._pump()  # answers BYE once nothing is held
            return None
        raise IpcTimeoutError(
            f"no item from the producer on {self.endpoint.name!r} within {timeout} s; "
            "it is alive but sent nothing (pass a larger timeout, or None to wait)"
        )

    def _release_current(self) -> None:
        """This thread's iteration moves on: release its previous item (``auto_release``).
        Lock held."""
        cur = self._current.pop(threading.get_ident(), None) if self._current else None
        if cur is not None and self.auto_release and not cur.released:
            self._release_locked(cur, None)

    def _poll(self) -> tuple[bool, Item | None]:
        """Without waiting for the producer: (True, item), (True, None) at the end of the
        stream, or (False, None) when nothing has arrived. For FanIn. Lock held."""
        self._pump()
        self._raise_if_broken()
        if self._ready:
            return True, self._make_item(self._ready.popleft())
        if self._bye_received:
            self._pump()  # answers BYE once nothing is held
            return True, None
        return False, None

    def _make_item(self, entry: tuple[int, int, int, int, Any, Recipe]) -> Item:
        seq, slot, gen, sent_ns, meta, recipe = entry
        nbytes = recipe.nbytes
        item = Item(self, seq, slot, gen, meta, recipe.build(slot, self._slot_views[slot]), nbytes)
        # Held before any wait below: a host-mode wait pumps, and a pump that saw the
        # producer's BYE with nothing held would say BYE under this item (the producer
        # would then close and free the arena while we read it).
        self._held[seq] = item
        ev = self._ready_events[slot]
        # Complete already: the data is written, no wait to enqueue (see Producer._prepare_slot;
        # the producer re-records this event only after we release the slot).
        if not ev.query():
            if self.wait_mode == "host":
                if not self._wait_until(lambda: self._error is not None or ev.query(), None, "event",
                                        self._stats.waited, poll_event=True):
                    raise AssertionError("unreachable")
                self._raise_if_broken()  # complete now: nothing to enqueue
            else:
                ev.wait(self._stream)  # on the consumer's stream; no host block
        stats = self._stats
        stats.handoffs += 1
        stats.bytes += nbytes
        stats.latencies.append((time.monotonic_ns() - sent_ns) / 1e9)
        return item

    def _release(self, item: Item, stream: Any) -> None:
        with self._lock:
            self._last_call = time.monotonic()
            if not item.released and not self._closed:
                self._release_locked(item, stream)

    def _release_locked(self, item: Item, stream: Any) -> None:
        if item.released:
            return
        item.released = True
        # The item stops viewing the slot: a leftover reference to it (the loop variable
        # after a loop) must not keep the producer's memory mapped (see _let_go_of_memory).
        item.tensors = None
        self._held.pop(item.seq, None)
        if self._foreign_seqs:
            self._foreign_seqs.pop(item.seq, None)
        if self._error is None:
            self._release_events[item.slot].record(stream if stream is not None else self._stream)
        pending = self._pending
        pending.append((item.seq, item.slot, item.gen))
        # Batched: queued releases go out together when this many are waiting, when the
        # consumer is about to wait for more items (see _pump), or from the service thread.
        if len(pending) >= self._release_batch:
            self._flush_releases()

    def _flush_releases(self) -> None:
        if not self._pending or self._error is not None or self._conv.state not in ("active", "ending"):
            return
        n = min(len(self._pending), self._limits.max_release_batch)
        if self._send_frame(self._enc.release(self._pending[:n])):
            del self._pending[:n]

    def _say_bye(self) -> None:
        """Nothing is held (every caller releases first). Items that arrive after our BYE
        are dropped: the producer frees their slots when it reads the BYE."""
        if not self._bye_sent:
            self._bye_sent = True
            self._let_go_of_memory()
            self._send_frame(P.encode(P.Bye("consumer closed")))

    def _let_go_of_memory(self) -> None:
        """Drop our references to the producer's memory (slot views, the recipes' cached
        views, the arena imports, foreign arenas) before our BYE, after which the producer
        may free its arena and exit: with CUDA, torch then drops its IPC reference to the
        arena now, instead of the producer exiting first and torch warning there ("Producer
        process has been terminated before all shared CUDA tensors released"). Tensors the
        user still holds keep their memory mapped until they go. Lock held."""
        self._recipes.clear()
        self._slot_views = []
        arenas, self._arenas = self._arenas, []
        for arena in arenas:
            try:
                arena.close()
            except Exception as exc:  # best effort
                log.debug("ipcsync consumer: closing an arena: %s", exc)
        self._close_foreign()

    def _send_frame(self, frame: bytes) -> bool:
        ok = self._chan.send(frame)
        if ok:
            self._last_send = time.monotonic()
        return ok

    def _wait_io_forwarding(self, timeout: float) -> None:
        """A wait while items we forwarded are out. Our releases upstream wait for
        the forwarding Producers to process their consumers' RELEASEs, and while the user's
        thread waits here (for the next item, which may wait for those very releases) only
        their service threads would, once per tick: so poll their sockets too and pump
        them. Their locks are only tried (whoever holds one is pumping that producer), and
        held for the poll, so no other thread uses their sockets meanwhile. Lock held."""
        poller = zmq.Poller()
        chan = self._chan
        poller.register(chan.sock, zmq.POLLIN)
        if chan.mon is not None:
            poller.register(chan.mon, zmq.POLLIN)
        if self._wake is not None:
            poller.register(self._wake.fd, zmq.POLLIN)
        taken = []
        try:
            for out in list(self._fwd_outs):
                if out._closed:
                    self._fwd_outs.remove(out)
                    continue
                if out._lock.acquire(blocking=False):
                    if out._closed:
                        out._lock.release()
                        continue
                    taken.append(out)
                    poller.register(out._chan.sock, zmq.POLLIN)
                    if out._chan.mon is not None:
                        poller.register(out._chan.mon, zmq.POLLIN)
            poller.poll(max(0, int(timeout * 1000)))
            for out in taken:
                try:
                    out._pump()
                except Exception as exc:  # its own calls report its errors
                    log.debug("ipcsync consumer: pumping a forwarding producer: %s", exc)
        finally:
            for out in taken:
                out._lock.release()

    def _raise_if_broken(self) -> None:
        if self._error is not None:
            raise self._error

    def _fail(self, error: IpcSyncError, code: str | None) -> None:
        """Record a fatal error; tell the producer if it is our fault to report."""
        if self._error is not None:
            return
        self._error = error
        if code is not None:
            try:
                self._chan.send(P.encode(P.Error(code, str(error)[:1000])))
            except zmq.ZMQError:
                pass
        self._ready.clear()

    def _lost(self, why: str) -> None:
        pid = self._setup.pid if self._setup else None
        self._fail(PeerLostError(
            f"producer (pid {pid}) on endpoint {self.endpoint.name!r} {why}; items it had "
            "not delivered are lost. Restart the producer and connect again."
        ), None)
        self._close_foreign()  # items still held keep their own mappings
        # Stop ZeroMQ from silently reconnecting to a successor on the same path.
        try:
            self._chan.sock.disconnect(self.endpoint.url)
        except zmq.ZMQError:
            pass
        self._remove_stale_endpoint(wait=0.0)
        reclaim_dead_segments()  # a dead producer's /dev/shm arena, whoever tracks it

    def _remove_stale_endpoint(self, wait: float) -> None:
        """Whoever notices a dead producer removes its stale socket files. A killed process
        keeps its files (and its bind lock) until its last thread has exited, which can be
        after its main thread shows as a zombie: retry for up to ``wait`` seconds."""
        if self._setup is None or self._setup.pid_ns != _host.pid_namespace():
            return
        deadline = time.monotonic() + wait
        ep = self.endpoint
        while True:
            if not any(os.path.exists(f) for f in (ep.path, ep.lock_path) if f):
                return  # removed already (by us, another consumer or a successor's bind)
            if not self._producer_alive() and remove_stale(self.endpoint):
                log.debug("ipcsync consumer: removed stale endpoint %s", self.endpoint.path)
                return
            if time.monotonic() >= deadline:
                return
            time.sleep(0.01)

    def _producer_alive(self) -> bool:
        """False only when the producer's process is provably gone."""
        w = self._producer_watch
        return w is None or not w.gone()  # None: cannot tell from here

    def _pump(self) -> None:
        if self._wake is not None:
            self._drain_forwarded()
        disconnected = False
        for ev, _fd in self._chan.events():
            if ev == zmq.EVENT_DISCONNECTED:
                if self._conv.state == "await_setup":
                    self._rehello = True
                else:
                    disconnected = True
            elif ev == zmq.EVENT_CONNECTED and self._rehello and self._conv.state == "await_setup":
                self._rehello = False
                self._send_frame(P.encode(self._hello()))
        recv, on_frames = self._chan.recv, self._on_frames
        for _ in range(10_000):
            if self._error is not None:
                break
            frames = recv()
            if frames is None:
                break
            self._last_recv = time.monotonic()
            on_frames(frames)
        # Frames that arrived before the disconnect count (a BYE then a close is clean).
        if disconnected:
            if self._bye_sent:
                self._bye_acked = True  # the producer closed after our goodbye
            elif not self._bye_received:
                self._lost("disconnected")
        if self._error is None:
            if not self._ready:
                self._flush_releases()
            if (self._bye_received and not self._held and not self._ready and not self._pending
                    and not self._forwarded):
                self._say_bye()
        now = time.monotonic()
        if now >= self._next_tick:
            self._next_tick = now + self._tick
            self._tick_producer(now)

    def _service_pump(self) -> None:
        # The user's thread is away (computing): nothing to batch with, flush now.
        self._flush_releases()
        self._pump()

    def _on_frames(self, frames: list[bytes]) -> None:
        if len(frames) == 1 and self._conv.state == "active":
            # Steady state: a READY whose layout this consumer has (it stays active).
            r = P.decode_ready(frames[0], self._limits)
            if r is not None:
                seq, slot, gen, sent_ns, layout_id, meta = r
                self._on_ready(seq, slot, gen, sent_ns, layout_id, None, meta)
                return
        if len(frames) != 1:
            self._fail(ProtocolError(f"producer sent a message of {len(frames)} frames"), "protocol")
            return
        try:
            msg = P.decode(frames[0], self._limits)
            self._conv.receive(msg)
        except ProtocolError as exc:
            code = "version" if isinstance(exc, P.VersionMismatch) else "protocol"
            self._fail(ProtocolError(f"producer on {self.endpoint.name!r} broke the protocol: {exc}"), code)
            return
        kind = type(msg)
        if kind is P.Ready:
            m: P.Ready = msg  # type: ignore[assignment]
            self._on_ready(m.seq, m.slot, m.gen, m.sent_ns, m.layout_id, m.layout, m.meta)
        elif kind is P.ForwardReady:
            self._on_forward_ready(msg)  # type: ignore[arg-type]
        elif kind is P.Foreign:
            self._on_foreign(msg)  # type: ignore[arg-type]
        elif kind is P.Setup:
            self._on_setup(msg)  # type: ignore[arg-type]
        elif kind is P.Bye:
            self._bye_received = True
            if self._bye_sent:
                self._bye_acked = True
        elif kind is P.Error:
            self._on_error(msg)  # type: ignore[arg-type]

    def _on_ready(self, seq: int, slot: int, gen: int, sent_ns: int, layout_id: int,
                  layout: Any, meta: Any) -> None:
        """Buffer a READY: ``layout`` is None when it travelled earlier under ``layout_id``."""
        if self._bye_sent:
            return  # we are leaving (see _say_bye)
        if slot >= len(self._slot_views):
            self._fail(ProtocolError(f"READY names slot {slot}; the ring has {len(self._slot_views)}"), "protocol")
            return
        if layout is None:
            recipe = self._recipes.get(layout_id)
            if recipe is None:
                self._fail(ProtocolError(f"READY names layout {layout_id}, which was never sent"), "protocol")
                return
        else:
            # A layout is validated once (dtypes, bounds) and kept under its id.
            try:
                recipe = Recipe(layout, self._slot_views[slot].numel())
            except ProtocolError as exc:
                self._fail(ProtocolError(f"producer sent a bad layout: {exc}"), "protocol")
                return
            if layout_id:
                if len(self._recipes) >= _MAX_RECIPES and layout_id not in self._recipes:
                    self._fail(ProtocolError(f"producer sent over {_MAX_RECIPES} layouts"), "protocol")
                    return
                self._recipes[layout_id] = recipe
        self._ready.append((seq, slot, gen, sent_ns, meta, recipe))

    def _on_error(self, msg: P.Error) -> None:
        err: IpcSyncError
        if msg.code == "failed" and self._setup is not None:
            # The producer's with-block raised (or it called abort()): never a clean end.
            self._fail(ProducerFailedError(
                f"producer (pid {self._setup.pid}) on endpoint {self.endpoint.name!r} failed: "
                f"{msg.message}; its stream ended early and items it had sent but this consumer "
                "had not yet received are dropped"), None)
            return
        text = f"producer on {self.endpoint.name!r} refused this consumer ({msg.code}): {msg.message}"
        if msg.code in ("backend", "host", "credits", "device"):
            err = ConfigError(text)
        elif msg.code == "closing":
            err = PeerLostError(text)
        else:
            err = ProtocolError(text)
        self._fail(err, None)

    def _on_setup(self, s: P.Setup) -> None:
        problem = self._producer_identity_problem(s)
        if problem is not None:
            self._fail(ConfigError(problem), "identity")
            return
        if s.backend != self._backend.name:
            problem = f"producer uses the {s.backend} backend, this consumer {self._backend.name}"
        elif not s.slots or len(s.slots) != len(s.ready_events):
            problem = f"SETUP has {len(s.slots)} slots and {len(s.ready_events)} ready events"
        elif not s.arenas or len(s.arenas) != len(s.arena_bytes):
            problem = "SETUP arenas and their sizes do not match"
        else:
            for i, (a, off, n) in enumerate(s.slots):
                if a >= len(s.arenas) or off + n > s.arena_bytes[a]:
                    problem = f"SETUP slot {i} lies outside its arena"
                    break
        if problem is not None:
            self._fail(ConfigError(problem) if "backend" in problem else ProtocolError(problem), "setup")
            return
        try:
            # The producer's GPU may be another one of this host (peer access required);
            # items are then views of its memory, on its device.
            where = self._backend.locate(s.device, need_access=True)
        except ConfigError as exc:
            self._fail(exc, "device")
            return
        try:
            self._arenas = [self._backend.open_arena(h, n, where) for h, n in zip(s.arenas, s.arena_bytes)]
            self._slot_views = [self._arenas[a].tensor[off : off + n] for a, off, n in s.slots]
            self._ready_events = [self._backend.open_event(h) for h in s.ready_events]
            self._release_events = [self._backend.create_event() for _ in s.slots]
        except IpcSyncError as exc:
            self._fail(exc if isinstance(exc, BackendError) else BackendError(str(exc)), "backend")
            return
        self._setup = s
        if s.pid_ns == _host.pid_namespace():
            self._producer_watch = _host.ProcessWatch(s.pid, s.start_time)
        self._release_batch = max(1, len(s.slots) // 4)
        self._send_frame(P.encode(P.Attach([e.handle() for e in self._release_events])))

    def _raise_unanswered(self, t: float | None) -> None:
        """The handshake timed out: say why where the socket file can tell."""
        text = f"no producer answered on endpoint {self.endpoint.name!r} ({self.endpoint.url}) within {t} s"
        why = diagnose_unanswered(self.endpoint)
        if why is not None and why[0]:
            raise ConfigError(f"{text}: {why[1]}")
        if why is not None:
            raise IpcTimeoutError(f"{text}: {why[1]}; is it running, with the same name?")
        raise IpcTimeoutError(f"{text}; is it running, with the same name?")

    def _producer_identity_problem(self, s: P.Setup) -> str | None:
        """Who answered must be the producer the SETUP describes, of this user (see
        ``channel.producer_identity_problem``); on the CPU backend its arenas must be named
        after its pid (the segment's owner uid is checked when it is opened)."""
        problem = producer_identity_problem(self.endpoint, self._chan.current_connection_fd(), s.pid, s.pid_ns)
        if problem is None and self._backend.name == "cpu":
            for handle in s.arenas:
                owner = segment_owner(handle) if type(handle) is str else None
                if owner is not None and owner.pid != s.pid:
                    return (f"the producer on {self.endpoint.name!r} (pid {s.pid}) names shared memory "
                            f"{handle} of pid {owner.pid}; refusing it")
        return problem

    def _tick_producer(self, now: float) -> None:
        s = self._setup
        if s is None or self._error is not None:
            return
        if not self._bye_received:  # after its BYE the producer only waits for our releases
            if not self._producer_alive():
                self._lost("exited")
                return
            # Liveness rule: a silent producer whose process lives is stalled (paused, a
            # long GC, SIGSTOP), not lost: waited for, reported.
            hb = s.heartbeat_ms / 1000
            silent = now - self._last_recv
            change = stall_change(self._stalled, silent, hb)
            if change is not None:
                self._stalled = change
                if change:
                    self._stalled_total += 1
                    self._ratelog.warning("stalled",
                                          "ipcsync consumer %r: producer pid %d has been silent for %.1f s "
                                          "(heartbeat %.2f s) but its process is alive: stalled, waiting",
                                          self.endpoint.name, s.pid, silent, hb)
                else:
                    log.info("ipcsync consumer %r: producer pid %d is answering again", self.endpoint.name, s.pid)
        # Heartbeats go on until our BYE: a consumer still holding items after the
        # producer's BYE must not look dead to the closing producer.
        if self._heartbeat and not self._bye_sent and now - self._last_send > self._heartbeat / 4:
            self._send_frame(P.encode(P.Heartbeat()))

    def _io_fds(self) -> list[int]:
        if self._wake is not None:
            return [*self._fds, self._wake.fd]
        return self._fds

    def _io_pending(self) -> bool:
        return self._chan.pending()

    def _wait_holding_lock(self, timeout: float) -> bool:
        # Waiting with forwarded items out polls the forwarding Producers' sockets under
        # their locks (see _wait_io_forwarding): keep ours too, a tick at a time.
        if not (self._forwarded and self._fwd_outs):
            return False
        self._wait_io_forwarding(timeout)
        return True

    def _teardown(self) -> None:
        if isinstance(self._error, PeerLostError) and not isinstance(self._error, ProducerFailedError):
            self._remove_stale_endpoint(wait=0.5)
        self._ready.clear()
        self._let_go_of_memory()
        self._wake = None  # (closed when collected; see _Wake)
        if self._producer_watch is not None:
            self._producer_watch.close()
        self._ready_events = []
        self._release_events = []
        for closer in (self._chan.close, self._backend.collect):
            try:
                closer()
            except Exception as exc:
                log.debug("ipcsync consumer teardown: %s", exc)


    # ------------------------------------------------------------------ forwarding: downstream
    def _close_foreign(self) -> None:
        """Drop our foreign arenas (on close and when the producer is lost)."""
        self._foreign_seqs.clear()
        for entry in self._foreign.values():
            if entry.arena is not None:
                try:
                    entry.arena.close()
                except Exception as exc:
                    log.debug("ipcsync consumer: closing a foreign arena: %s", exc)
        self._foreign.clear()

    def _on_foreign(self, m: P.Foreign) -> None:
        """Open another producer's arena that FREADY items will name (once per id)."""
        if m.backend != self._backend.name:
            self._fail(ProtocolError(
                f"producer on {self.endpoint.name!r} forwards {m.backend} memory to a "
                f"{self._backend.name} consumer"), "protocol")
            return
        old = self._foreign.pop(m.fid, None)
        if old is not None and old.arena is not None:
            old.arena.close()  # items still viewing it keep their mapping
        try:
            where = self._backend.locate(m.device, need_access=True)
        except ConfigError as exc:
            self._fail(ConfigError(
                f"producer on {self.endpoint.name!r} forwards items that live in the memory of "
                f"producer pid {m.pid} (GPU {m.device}), which this consumer cannot read: {exc}. "
                "Have the forwarding stage copy them: ipcsync.forward(..., copy=True)"), "device")
            return
        arena: Arena | None = None
        error: str | None = None
        try:
            arena = self._backend.open_borrowed_arena(m.handle, m.nbytes, where)
        except Exception as exc:  # the owner is gone (or closed past its timeout)
            error = str(exc)
            self._ratelog.warning(
                "foreign",
                "ipcsync consumer %r: cannot open the memory of producer pid %d that items are "
                "forwarded from (%s); items forwarded from it will be dropped",
                self.endpoint.name, m.pid, error)
        self._foreign[m.fid] = _ForeignArena(m, arena, error)

    def _on_forward_ready(self, m: P.ForwardReady) -> None:
        """Buffer an item whose tensors lie in a foreign arena's region."""
        if self._bye_sent:
            return  # we are leaving (see _say_bye)
        entry = self._foreign.get(m.fid)
        problem = None
        if entry is None:
            problem = f"FREADY names foreign arena {m.fid}, which was never described"
        elif m.slot >= len(self._slot_views):
            problem = f"FREADY names slot {m.slot}; the ring has {len(self._slot_views)}"
        elif m.offset + m.nbytes > entry.msg.nbytes:
            problem = (f"FREADY region {m.offset}+{m.nbytes} lies outside foreign arena {m.fid} "
                       f"of {entry.msg.nbytes} bytes")
        if problem is not None:
            self._fail(ProtocolError(problem), "protocol")
            return
        assert entry is not None
        if m.layout is None:
            recipe = self._frecipes.get(m.layout_id)
            if recipe is None:
                self._fail(ProtocolError(f"FREADY names layout {m.layout_id}, which was never sent"), "protocol")
                return
        else:
            try:
                recipe = Recipe(m.layout, m.nbytes)
            except ProtocolError as exc:
                self._fail(ProtocolError(f"producer sent a bad layout: {exc}"), "protocol")
                return
            if m.layout_id:
                if len(self._frecipes) >= _MAX_RECIPES and m.layout_id not in self._frecipes:
                    self._fail(ProtocolError(f"producer sent over {_MAX_RECIPES} layouts"), "protocol")
                    return
                self._frecipes[m.layout_id] = recipe
        if recipe.extent > m.nbytes:
            self._fail(ProtocolError(
                f"FREADY layout reaches byte {recipe.extent} of a {m.nbytes}-byte region"), "protocol")
            return
        if entry.arena is None:
            # The memory is gone: drop the item and give the slot back at once.
            self._foreign_lost += 1
            self._ratelog.warning(
                "foreign_lost", "ipcsync consumer %r dropped forwarded item %d (%d so far): the memory "
                "of producer pid %d it lies in cannot be opened (%s)",
                self.endpoint.name, m.seq, self._foreign_lost, entry.msg.pid, entry.error)
            self._release_events[m.slot].record(self._stream)
            self._pending.append((m.seq, m.slot, m.gen))
            return
        view = entry.arena.tensor[m.offset : m.offset + m.nbytes]
        use = _ForeignUse(recipe, entry, view, m.offset, m.nbytes)
        self._foreign_seqs[m.seq] = use
        self._ready.append((m.seq, m.slot, m.gen, m.sent_ns, m.meta, use))  # type: ignore[arg-type]

    # ------------------------------------------------------------------ forwarding: middle
    def _forward_take(self, item: Item, out: Any) -> ForwardSource:
        """Hand ``item`` over to Producer ``out``, which forwards it zero-copy. Returns
        where it lies; raises CannotForward (nothing changed) if it cannot be. Takes our
        lock (the caller holds no other endpoint's lock)."""
        with self._lock:
            if self._closed:
                raise CannotForward("the consumer it came from is closed")
            if self._error is not None:
                raise CannotForward(f"its producer is gone or broke the protocol ({self._error})")
            if item.released or self._held.get(item.seq) is not item:
                raise CannotForward(f"item {item.seq} is not held by its consumer")
            s = self._setup
            assert s is not None
            use = self._foreign_seqs.get(item.seq) if self._foreign_seqs else None
            if use is not None:  # itself forwarded to us: pass on the original owner's arena
                m = use.entry.msg
                src = ForwardSource(m.backend, m.device, m.pid, m.start_time, m.handle, m.nbytes,
                                    use.offset, use.region_bytes, use.view, self._ready_events[item.slot])
            else:
                a, off, n = s.slots[item.slot]
                src = ForwardSource(s.backend, s.device, s.pid, s.start_time, s.arenas[a], s.arena_bytes[a],
                                    off, n, self._slot_views[item.slot], self._ready_events[item.slot])
            if self._wake is None:
                self._wake = _Wake()  # waited on with our sockets (see _io_fds)
            if out not in self._fwd_outs:
                self._fwd_outs.append(out)
            # Ownership moves: no auto-release, release() is a no-op; the credit stays held.
            item.released = True
            del self._held[item.seq]
            self._forwarded[item.seq] = item
            for tid, cur in list(self._current.items()):
                if cur is item:
                    del self._current[tid]
            return src

    def _forward_undo(self, item: Item) -> None:
        """The forwarding Producer could not send ``item`` after all: take it back."""
        with self._lock:
            if self._forwarded.pop(item.seq, None) is item and not self._closed:
                item.released = False
                self._held[item.seq] = item

    def _forward_done(self, item: Item, stream: Any) -> None:
        """Every downstream holder of forwarded ``item`` released it, and ``stream`` is
        ordered after their release events: record our release event there and queue the
        RELEASE. Called by the forwarding Producer from any thread, holding its own lock,
        so it never waits for ours: the queue is drained under our lock, now if it is
        free, else by the pump that the eventfd wakes."""
        if self._error is None and not self._closed:
            try:
                self._release_events[item.slot].record(stream)
            except IndexError:  # torn down meanwhile
                pass
        self._fwd_done.append(item)
        if self._lock.acquire(blocking=False):
            try:
                if not self._closed:
                    self._drain_forwarded()
            finally:
                self._lock.release()
            return
        wake = self._wake
        if wake is not None:
            wake.set()

    def _drain_forwarded(self) -> None:
        """Queue the RELEASEs of forwarded items that came back and send them. Lock held."""
        if self._wake is not None:
            self._wake.clear()
        done = self._fwd_done
        if not done:
            return
        while done:
            item = done.popleft()
            if self._forwarded.pop(item.seq, None) is None:
                continue
            if self._foreign_seqs:
                self._foreign_seqs.pop(item.seq, None)
            self._pending.append((item.seq, item.slot, item.gen))
        self._flush_releases()

    def _close_forwarded(self, timeout: float | None) -> None:
        """close() with forwarded items still held downstream: wait (up to ``timeout``,
        default the consumer's) for the forwarding Producer to give them back, then
        release what is left, with a warning. Lock held."""
        if self._error is None and self._conv.state in ("active", "ending"):
            t = self._resolve_timeout(timeout)
            self._wait_until(lambda: not self._forwarded or self._error is not None, t)
        self._drain_forwarded()
        if self._forwarded:
            log.warning(
                "ipcsync consumer %r closing while %d item(s) it forwarded zero-copy are still held "
                "downstream; releasing them to the producer, which may now overwrite memory those "
                "consumers read (close the forwarding Producer before this Consumer)",
                self.endpoint.name, len(self._forwarded))
            for item in self._forwarded.values():
                if self._error is None:
                    self._release_events[item.slot].record(self._stream)
                self._pending.append((item.seq, item.slot, item.gen))
            self._forwarded.clear()
            self._flush_releases()
