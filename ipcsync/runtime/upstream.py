"""The consumer's I/O toward its producer (``ProducerLink``), around the session's rules
(``core.consumer_session``): what HELLO says about this process, who answered the
handshake (or why nobody did), the producer's memory and events opened at SETUP, the
foreign arenas FOREIGN names, the producer's liveness, and the stale socket files of a
dead producer.

- Who answered: on an ipc path the producer must be our user and the process SETUP names,
  and its arenas its own (``Backend.arena_owner_problem``), else a ConfigError.
- ``RingMemory``: the producer's arenas, slot views (a ``SlotStore`` per slot), ready and
  release events or flags, opened once at SETUP; memory shared by descriptor is opened
  from the packet that follows the producer's SWITCH on the lane
  (``open_shared_memory``, ``runtime.memory_wire``). ``seqs`` records the item last built
  in each slot, which a write fault there names (``ipcsync.writefaults``).
- The steady pump (``pump_lane``): while the lane carries every frame and nothing else
  needs a look (no kept slot to poll, no lent item coming back, no ERROR to send), a
  wake-up's lane frames go to ``session.receive_frames`` in one call; anything else, and
  every tick, goes through ``pump``.
- Kept items (``keeping.Kept``): released items a tensor of the program still views are
  given back at the start of every pump once nothing references them, all at once after
  the producer's BYE; ``check_stall`` moves them out or reports what holds the ring;
  ``give_up_kept`` at close.
- Loss (``on_lost``): items already handed out whose data the producer had not finished
  writing (shared by descriptor, ``wait="gpu"``) are named in a warning (``say_torn``); the
  producer's flags are poisoned (no stream of ours waits for ever on them), the
  connection dropped, the stale socket files removed and dead segments reclaimed.
- ``let_go_of_memory`` drops every view and import of the producer's memory before any BYE
  of ours (the producer may exit once it answered)."""

from __future__ import annotations

import logging
import os
import time
from array import array
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
import zmq

from .. import writefaults
from ..backends import Arena, Backend, Event
from ..backends.refs import SlotStore
from ..backends.cpu import reclaim_dead_segments
from ..core import protocol as P
from ..core.consumer_session import (ConsumerSession, ForeignReceived, HelloAgain, LaneOffered, SentReceived,
                                     SetupReceived, SwitchReceived)
from ..core.liveness import Verdict
from ..core.protocol import ErrorCode
from ..core.remote_session import LOSS_HEARTBEATS, RELEASE_PLACEHOLDER, is_remote_handle
from ..core.ratelog import RateLog, best_effort
from ..errors import (
    BackendError, ConfigError, IpcSyncError, IpcTimeoutError, PeerLostError, ProducerFailedError, ProtocolError,
)
from . import host
from .address import Endpoint, diagnose_unanswered, producer_identity_problem
from .bindlock import remove_stale
from .foreign import Downstream
from .keeping import Kept
from .memory_wire import PLACEHOLDER, recv_memory

if TYPE_CHECKING:  # (runtime.remote is loaded only where a remote edge is)
    from .remote import RemoteWatch

__all__ = ["make_hello", "unanswered_error", "identity_problem", "RingMemory", "remove_stale_endpoint",
           "ProducerLink"]

log = logging.getLogger(__name__)

_FRAMES_PER_PUMP = 256  # frames the steady pump reads at most (a flood cannot starve the caller)
MEMORY_WAIT_S = 5.0  # the memory packet is on the lane before the SWITCH that says to read it


def make_hello(backend: Any, credits: int, heartbeat: float) -> P.Hello:
    """HELLO: who this consumer is (process identity, host) and where it runs."""
    pid = os.getpid()
    return P.Hello(
        version=P.PROTOCOL_VERSION, pid=pid, start_time=host.start_time(pid), boot_id=host.host_identity(),
        pid_ns=host.pid_namespace(), backend=backend.name, device=backend.device_identity(),
        credits=credits, heartbeat_ms=int(heartbeat * 1000),
    )


def unanswered_error(endpoint: Endpoint, t: float | None) -> IpcSyncError:
    """The handshake timed out: say why where the socket file can tell."""
    text = f"no producer answered on endpoint {endpoint.name!r} ({endpoint.url}) within {t} s"
    why = diagnose_unanswered(endpoint)
    if why is not None and why[0]:
        return ConfigError(f"{text}: {why[1]}")
    if why is not None:
        return IpcTimeoutError(f"{text}: {why[1]}; is it running, with the same name?")
    return IpcTimeoutError(f"{text}; is it running, with the same name?")


def identity_problem(endpoint: Endpoint, connection_fd: int, backend: Backend, s: P.Setup) -> str | None:
    """Who answered must be the producer the SETUP describes, of this user (see
    ``channel.producer_identity_problem``), and its arenas its own, as far as ``backend``
    can tell (``Backend.arena_owner_problem``)."""
    problem = producer_identity_problem(endpoint, connection_fd, s.pid, s.pid_ns)
    if problem is None:
        for handle in s.arenas:
            why = backend.arena_owner_problem(handle, s.pid)
            if why is not None:
                return f"the producer on {endpoint.name!r} (pid {s.pid}) {why}; refusing it"
    return problem


class RingMemory:
    """The producer's ring as this consumer sees it: its arenas, each slot's own storage
    (``stores``: items are built from it, and it says whether a tensor of the program
    still references the slot; ``stores[i].base`` is slot i's bytes), its ready events,
    and our release events (one per slot), with ``ready_done``, the ready events'
    queries (``Event.bound_query``), and ``record_release``, the release events' records
    (``Event.bound_record``). ``complete_on_record``: every one of those events is
    complete once recorded (the CPU backend's): the steady path skips them."""

    __slots__ = ("arenas", "stores", "views", "seqs", "watched", "ready_events", "ready_done", "release_events",
                 "record_release", "complete_on_record", "flags", "shared")

    def __init__(self) -> None:
        self.arenas: list[Arena] = []
        self.stores: list[SlotStore] = []
        self.views: list[torch.Tensor] = []
        # The seq of the item last built in each slot (what a write fault there names:
        # ipcsync.writefaults), and the read-only slots watched.
        self.seqs = array("q")
        self.watched: list[int | None] = []
        self.ready_events: list[Event] = []
        self.ready_done: list[Callable[[], bool]] = []
        self.release_events: list[Event] = []
        self.record_release: list[Callable[[Any], None]] = []
        self.complete_on_record = False
        # Shared by descriptor (runtime.sharing): the connection's flag segment, whose
        # flags are our events; each use sets the event's ``value`` (the item's generation).
        self.flags: Any = None
        self.shared = False

    def open(self, backend: Any, s: P.Setup, where: Any, name: str = "",
             fds: tuple[list[int], int] | None = None) -> None:
        """Open what SETUP ``s`` exports (``where``: the device its memory lies on) from the
        producer on ``name``; ``fds``: the arenas' and the flag segment's descriptors, for
        memory shared by descriptor (not taken: the caller closes them). BackendError if it
        cannot be."""
        try:
            if fds is not None:
                self.shared = True
                self.flags = backend.open_flags(fds[1], len(s.slots))
                self.arenas = [backend.open_shared_arena(h, n, fd, where)
                               for h, n, fd in zip(s.arenas, s.arena_bytes, fds[0])]
            else:
                self.arenas = [backend.open_arena(h, n, where) for h, n in zip(s.arenas, s.arena_bytes)]
            self.set_slots([self.arenas[a].tensor[off : off + n] for a, off, n in s.slots])
            cells = self.seqs.buffer_info()[0]
            self.watched = [writefaults.watch(v.data_ptr(), v.numel(), f"slot {i} of the producer on {name!r} "
                                              f"(pid {s.pid})", cells + i * self.seqs.itemsize)
                            for i, v in enumerate(self.views) if self.arenas[s.slots[i][0]].readonly]
            if self.flags is not None:
                self.set_events([self.flags.ready(i) for i in range(len(s.slots))],
                                [self.flags.release(i) for i in range(len(s.slots))])
            else:
                self.set_events([backend.open_event(h) for h in s.ready_events],
                                [backend.create_event() for _ in s.slots])
        except IpcSyncError as exc:
            raise exc if isinstance(exc, BackendError) else BackendError(str(exc)) from None

    def set_events(self, ready: list[Event], release: list[Event]) -> None:
        """The producer's ready events and our release events, one each per slot."""
        self.ready_events, self.release_events = ready, release
        self.ready_done = [e.bound_query() for e in ready]
        self.record_release = [e.bound_record() for e in release]
        self.complete_on_record = bool(ready) and all(type(e).complete_on_record for e in (*ready, *release))

    def release(self, slot: int, gen: int, stream: Any) -> None:
        """Our release of ``slot``'s item of generation ``gen``, recorded on ``stream``."""
        ev = self.release_events[slot]
        ev.value = gen
        ev.record(stream)

    def poison(self) -> None:
        """The producer is gone: every wait of ours on its ready flags passes (shared by
        descriptor; nothing to do with events, which a dead peer's death never completes:
        those are never waited on again)."""
        if self.flags is not None:
            self.flags.poison("ready")

    def set_slots(self, views: list[torch.Tensor]) -> None:
        """A storage of its own for each slot (``views``: uint8, one per slot)."""
        self.views = views
        self.stores = [SlotStore(v) for v in views]
        self.seqs = array("q", [-1]) * len(views)

    def renew(self, slot: int) -> SlotStore:
        """A fresh store for ``slot``, whose store's storage was moved (``SlotStore.moved``;
        after ``move_out`` its ``successor`` is one already)."""
        store = self.stores[slot] = SlotStore(self.views[slot], self.stores[slot].successor)
        return store

    def let_go(self) -> None:
        """Drop the slot views and close the arena imports (tensors the user still holds
        keep their memory mapped until they go)."""
        self.stores, self.views = [], []
        for token in self.watched:
            writefaults.unwatch(token)
        self.watched = []
        arenas, self.arenas = self.arenas, []
        best_effort("consumer: closing an arena", *(arena.close for arena in arenas))

    def drop_events(self, backend: Backend) -> None:
        """Teardown: forget the events; a flag segment is poisoned (nothing of ours may
        wait on it for ever) and retired (freed once our GPU work is done with it)."""
        self.set_events([], [])
        flags, self.flags = self.flags, None
        if flags is not None:
            flags.poison("ready")
            backend.retire_flags(flags)


def remove_stale_endpoint(endpoint: Endpoint, setup: P.Setup | None, alive: Callable[[], bool],
                          wait: float) -> None:
    """Whoever notices a dead producer removes its stale socket files. A killed process
    keeps its files (and its bind lock) until its last thread has exited, which can be
    after its main thread shows as a zombie: retry for up to ``wait`` seconds."""
    if setup is None or setup.pid_ns != host.pid_namespace():
        return
    deadline = time.monotonic() + wait
    while True:
        if not any(os.path.exists(f) for f in (endpoint.path, endpoint.lock_path) if f):
            return  # removed already (by us, another consumer or a successor's bind)
        if not alive() and remove_stale(endpoint):
            log.debug("ipcsync consumer: removed stale endpoint %s", endpoint.path)
            return
        if time.monotonic() >= deadline:
            return
        time.sleep(0.01)


class ProducerLink:
    """One consumer's connection to its producer: the channel, the session's frames in and
    out, the ring's memory and the foreign arenas opened as the session asks, and the
    producer's liveness. Every method runs under the consumer's lock.

    ``lender``: the consumer's ``Lender``, asked whether an item is out (``holding``,
    ``held_count``: when to say BYE, whether the ring is stalled); its ``wake`` and
    ``drain`` bring lent items back."""

    def __init__(self, endpoint: Endpoint, chan: Any, session: ConsumerSession, backend: Any, stream: Any,
                 ratelog: RateLog) -> None:
        self.endpoint, self.chan, self.session = endpoint, chan, session
        self.backend, self.stream, self.ratelog = backend, stream, ratelog
        self.memory = RingMemory()
        self.downstream = Downstream(backend, endpoint.name, ratelog)
        # Set at SETUP: a ProcessWatch (same PID namespace), a RemoteWatch (another host).
        self.watch: host.ProcessWatch | RemoteWatch | None = None
        self.lender: Any = None  # set by the consumer
        # A producer on another host: the runtime.remote.ConsumerEdge its SETUP named, whose
        # receive ring fills ``memory``; None on every local edge.
        self.remote: Any = None
        # A SETUP naming memory shared by descriptor, and where it lies: opened once its
        # descriptors came on the lane (``open_shared_memory``).
        self.shared_setup: tuple[P.Setup, Any] | None = None
        self.lane_loss_seen = False  # a closed lane was handled as a closed connection
        # The producer closed its connection after its BYE: a clean end, unless it died
        # inside its close() (e.g. while we held items), leaving its /dev/shm arena behind.
        # Until its process is provably gone (then reclaim) the ticks look.
        self.closed_after_bye = False
        # Items the program released while its tensors still view their slot (the
        # reference rule): given back at a pump once nothing references them.
        self.kept = Kept()
        self.credits = 1 << 20  # the most items we may hold (the consumer's credits=)
        self.check_refs = True  # the consumer's keep_refs_check (and torch can count)

    # ------------------------------------------------------------------ sends
    def send(self, frame: bytes) -> bool:
        ok: bool = self.chan.send(frame)
        if ok:
            self.session.spoke(time.monotonic())
        return ok

    def send_errors(self) -> None:
        outbox = self.session.outbox
        for frame in outbox:
            try:
                self.chan.send(frame)
            except zmq.ZMQError:
                pass
        outbox.clear()

    def fail(self, error: IpcSyncError, code: str | None) -> None:
        """Record a fatal error; tell the producer if it is ours to report."""
        self.session.fail(error, code)
        self.send_errors()

    def flush_releases(self) -> None:
        """Send the queued releases (one RELEASE; once per batch, not per item)."""
        s = self.session
        out = s.release_frame(time.monotonic())
        if out is not None and not self.chan.send(out[0]):
            s.unsend_releases(out[1])

    def release_kept(self, collect: bool = False) -> None:
        """Give back the kept items nothing references any more (``collect``: after a
        garbage collection); all of them once the producer said BYE (it writes nothing
        more) or is gone. Each release event is recorded now, on the consumer's stream:
        work the program queued through its views came before it dropped them."""
        s = self.session
        kept = self.kept
        items = kept.take_all() if s.bye_received or s.error is not None else kept.freed(collect)
        if items:
            self.queue_releases(items)
            if s.error is None and len(s.pending) >= s.release_batch:
                self.flush_releases()

    def queue_releases(self, items: list[Any]) -> None:
        """Record each kept item's release event on the consumer's stream and queue its
        RELEASE."""
        s = self.session
        uses = self.downstream.uses
        for item in items:
            item.store = None  # given back: a leftover item keeps no storage of the slot
            if uses:
                uses.pop(item.seq, None)
            if s.error is None:
                self.memory.release(item.slot, item.gen, self.stream)
            s.queue_release((item.seq, item.slot, item.gen))

    def check_stall(self, waiting: bool = False) -> None:
        """A pump found nothing buffered while this consumer keeps items (``waiting``: a
        call of the program waits for an item, which may be kept or held ones): kept
        items whose ring would stall move out of it, and what still stalls it is reported
        (``Kept.check``); their slots go back."""
        setup = self.session.setup
        if setup is not None:
            back = self.kept.check(self.endpoint.name, self.lender.held_count(),
                                   min(len(setup.slots), self.credits), time.monotonic(),
                                   self.memory.ready_events, self.stream, waiting)
            if back:
                self.queue_releases(back)

    def stuck(self, limit: float | None) -> bool:
        """Asked by a call waiting for an item: the ring has been full of this program's
        own items (kept, or held and not released) for ``limit`` seconds, so no item can
        come (``Kept.stuck``)."""
        if self.kept or self.lender.held:
            self.check_stall(waiting=True)
        return self.kept.stuck(limit)

    def stall_text(self) -> str:
        """For a timeout's message: what the program keeps or holds, if anything."""
        return self.kept.stall_text(self.lender.held_count() if self.lender is not None else 0)

    def give_up_kept(self) -> None:
        """close(): give every kept slot back, the kept items' bytes moved out of the ring
        first while the producer may still write (``Kept.move_out``); warn of any that
        could not be."""
        s = self.session
        if self.kept and not s.bye_received and s.error is None:
            self.queue_releases(self.kept.move_out(self.memory.ready_events, self.stream, self.endpoint.name))
        if self.kept and not s.bye_received and s.error is None:
            log.warning("ipcsync consumer %r closing: %s; they are given back now and may change",
                        self.endpoint.name, self.kept.describe())
        self.queue_releases(self.kept.take_all())

    def say_bye(self) -> None:
        """Nothing is held (every caller releases first). Kept slots go back before the
        BYE, whatever still views them: the producer said BYE (it writes nothing more) or
        close() gave them up; a BYE that overtook them left the last items unreleased."""
        if self.kept:
            self.queue_releases(self.kept.take_all())
        if self.session.pending:
            self.flush_releases()
        frame = self.session.bye()
        if frame is not None:
            self.let_go_of_memory()
            self.send(frame)

    def let_go_of_memory(self) -> None:
        """Drop our references to the producer's memory (slot views, the recipes' cached
        views, the arena imports, foreign arenas) before our BYE, after which the producer
        may free its arena and exit: with CUDA, torch then drops its IPC reference to the
        arena now, instead of the producer exiting first and torch warning there ("Producer
        process has been terminated before all shared CUDA tensors released"). Tensors the
        user still holds keep their memory mapped until they go."""
        self.session.forget_layouts()
        self.memory.let_go()
        self.downstream.close()

    # ------------------------------------------------------------------ receives
    def pump_lane(self) -> None:
        """The steady pump: while the lane carries every frame (``chan.steady_lane``) and
        nothing else needs a look (no kept slots to poll, no lent items coming back, no
        ERROR to send), read the lane's frames and hand them to the session in one call
        (``receive_frames``: the steady READYs); anything else takes ``pump``, which
        handles the rest of the frames in order. ZeroMQ is not polled here: after the
        producer's SWITCH only its monitor's events come there, read by ``pump`` at the
        next tick or wake-up (see ``runtime.channel.ConsumerChannel.read_lane``).
        Queued releases go out when nothing was buffered (the consumer is about to wait)."""
        chan, s = self.chan, self.session
        if chan.steady_lane is None or self.kept.items or self.lender.wake is not None or s.outbox:
            self.pump()
            return
        frames: list[bytes] = []
        chan.read_lane(frames, _FRAMES_PER_PUMP)
        n = s.receive_frames(frames, time.monotonic())
        if n < len(frames) or chan.steady_lane is None:
            self.pump(frames[n:])  # the rest in order, then everything else
        elif s.pending and not s.ready:
            self.flush_releases()

    def pump(self, taken: Sequence[bytes] = ()) -> None:
        """Handle everything that has arrived, without blocking (``taken``: frames read
        off the lane already, handled first)."""
        lender, s, chan = self.lender, self.session, self.chan
        if self.kept.items:
            self.release_kept()
        if lender.wake is not None:
            lender.drain()
        if self.remote is not None and self.remote.wake is not None:
            self.remote.wake.clear()  # (before reading what the completion thread settled)
        if chan.lane is not None and (chan.steady_lane is None or chan.steady_lane.tail):
            if not chan.lane_in:
                chan.check_lane()  # refused before the SWITCH: stay on ZeroMQ
            else:
                chan.flush_lane()
        dropped = False
        for ev, _fd in chan.events():
            if ev == zmq.EVENT_DISCONNECTED:
                dropped = s.disconnected() or dropped
            elif ev == zmq.EVENT_CONNECTED:
                frame = s.connected()
                if frame is not None:
                    self.send(frame)
        recv, receive = self.chan.recv, s.receive
        if not taken and chan.steady_lane is not None:  # the lane's steady READYs: in one call
            got: list[bytes] = []
            chan.read_lane(got, _FRAMES_PER_PUMP)
            taken = got[s.receive_frames(got, time.monotonic()):]
        heard = bool(taken)
        for frame in taken:
            if s.error is not None:
                break
            event = receive([frame])
            if event is not None:
                self.on_event(event)
        for _ in range(10_000):
            if s.error is not None:
                break
            frames = recv()
            if frames is None:
                break
            heard = True
            event = receive(frames)
            if event is not None:
                self.on_event(event)
        if chan.lane_lost and not self.lane_loss_seen:
            # A switched lane closed: the same evidence as a closed ZeroMQ connection.
            self.lane_loss_seen = True
            dropped = s.disconnected() or dropped
        if heard:
            s.heard(time.monotonic())
            if self.remote is not None:  # the bytes of READYs just buffered: post their recvs
                self.remote.post(s.ready)
        if s.outbox:
            self.send_errors()
        # Frames that arrived before the disconnect count (a BYE then a close is clean).
        if dropped:
            if s.closed_by_peer():
                self.on_lost()
            elif s.bye_received:
                self.closed_after_bye = True
        if s.error is None:
            if not s.ready:
                if self.kept:
                    self.check_stall()
                self.flush_releases()
            elif len(s.pending) >= s.release_batch:
                self.flush_releases()
            if s.bye_received and s.finished(lender.holding()):
                self.say_bye()

    def on_event(self, event: Any) -> None:
        kind = type(event)
        if kind is SetupReceived:
            self.on_setup(event.setup)
        elif self.remote is not None and kind is not SentReceived:
            # FOREIGN/FREADY name another host's memory: a producer forwards to a remote
            # consumer by copy (runtime.forwarder), never zero-copy.
            self.fail(ProtocolError(f"producer on {self.endpoint.name!r} broke the protocol: a zero-copy "
                                    "forward on a remote edge"), ErrorCode.PROTOCOL)
        elif kind is ForeignReceived:
            error = self.downstream.open(event.msg)
            if error is not None:
                self.fail(error, ErrorCode.DEVICE)
        elif kind is SentReceived:
            if self.remote is None:
                self.fail(ProtocolError(f"producer on {self.endpoint.name!r} broke the protocol: SENT on an "
                                        "edge that is not remote"), ErrorCode.PROTOCOL)
                return
            try:
                self.remote.confirm(event.seq, self.session.ready)
            except ProtocolError as exc:
                self.fail(ProtocolError(f"producer on {self.endpoint.name!r} broke the protocol: {exc}"),
                          ErrorCode.PROTOCOL)
        elif kind is LaneOffered:
            setup = self.session.setup
            pid = setup.pid if setup is not None and setup.pid_ns == host.pid_namespace() else None
            why = self.chan.connect_lane(event.msg, pid)
            if why is not None and self.shared_setup is not None:
                self.fail(BackendError(f"the producer on {self.endpoint.name!r} shares its GPU memory by "
                                       f"descriptor over a lane, and no lane could be made: {why}"),
                          ErrorCode.BACKEND)
            elif why is not None:
                log.info("ipcsync consumer %r: no lane (%s); staying on ZeroMQ", self.endpoint.name, why)
        elif kind is SwitchReceived:
            if self.shared_setup is not None:  # (its memory packet is on the lane already, first)
                self.open_shared_memory()
            self.chan.switch_in(event.frame)  # from the next frame on, read the lane
        elif kind is HelloAgain:
            log.info("ipcsync consumer %r: the producer speaks protocol version %d; no lane",
                     self.endpoint.name, P.OLDEST_VERSION)
            self.send(event.frame)
        else:  # ForwardedReceived
            m = event.msg
            use = self.downstream.use(m, event.recipe)
            if use is None:  # its memory is gone: drop it, give the slot back at once
                self.memory.release(m.slot, m.gen, self.stream)
                self.session.queue_release((m.seq, m.slot, m.gen))
            else:
                self.session.add_forwarded((m.seq, m.slot, m.gen, m.sent_ns, m.meta, use))

    def on_setup(self, s: P.Setup) -> None:
        problem = identity_problem(self.endpoint, self.chan.current_connection_fd(), self.backend, s)
        if problem is not None:
            self.fail(ConfigError(problem), ErrorCode.IDENTITY)
            return
        if not self.session.validate_setup(s):
            self.send_errors()
            return
        if is_remote_handle(s.arenas[0]):
            if s.version < P.SENT_VERSION:  # (no SENT would ever come: nothing could be served)
                self.fail(ConfigError(
                    f"producer on {self.endpoint.name!r} speaks protocol version {s.version}, and a remote "
                    f"edge needs {P.SENT_VERSION} or later at both ends: run the same ipcsync version on "
                    "every host"), ErrorCode.VERSION)
                return
            self.on_remote_setup(s)
            return
        try:
            # The producer's GPU may be another one of this host (peer access required);
            # items are then views of its memory, on its device.
            where = self.backend.locate(s.device, need_access=True)
        except ConfigError as exc:
            self.fail(exc, ErrorCode.DEVICE)
            return
        if s.pid_ns == host.pid_namespace():
            self.watch = host.ProcessWatch(s.pid, s.start_time)
        if self.backend.is_shared_handle(s.arenas[0]):
            # Its descriptors come first on the lane its next frame offers, right after its
            # SWITCH (runtime.memory_wire); it hands us no item before that.
            self.shared_setup = (s, where)
            self.send(self.session.attach(s, [PLACEHOLDER] * len(s.slots)))
            return
        try:
            self.memory.open(self.backend, s, where, self.endpoint.name)
        except BackendError as exc:
            self.fail(exc, ErrorCode.BACKEND)
            return
        self.send(self.session.attach(s, [e.handle() for e in self.memory.release_events]))

    def open_shared_memory(self) -> None:
        """The producer's SWITCH was handled: read its memory packet off the lane (the
        first packet there) and open the arenas and the flags it carries."""
        assert self.shared_setup is not None
        s, where = self.shared_setup
        lane = self.chan.lane
        try:
            if lane is None:
                raise BackendError("its lane is gone")
            arena_fds, flags_fd = recv_memory(lane.sock, len(s.arenas), MEMORY_WAIT_S)
        except BackendError as exc:
            self.fail(exc, ErrorCode.BACKEND)
            return
        try:
            self.memory.open(self.backend, s, where, self.endpoint.name, (arena_fds, flags_fd))
            self.shared_setup = None
        except BackendError as exc:
            self.fail(exc, ErrorCode.BACKEND)
        finally:
            for fd in (*arena_fds, flags_fd):
                os.close(fd)

    def on_remote_setup(self, s: P.Setup) -> None:
        """A producer on another host (core.remote_session): join the edge its SETUP names
        (blocks for the rendezvous), receive into our own ring, ATTACH once joined."""
        from .remote import RemoteWatch, open_consumer_edge  # noqa: PLC0415 (only when used)

        try:
            edge = open_consumer_edge(s.arenas[0], self.backend.device, s.arena_bytes[0], s.slots,
                                      f"producer pid {s.pid} on {self.endpoint.name!r}")
        except IpcSyncError as exc:
            self.fail(exc, ErrorCode.BACKEND)
            return
        self.remote = edge
        # The producer took part in the join just now (its store, its group): heard. Its
        # frames of meanwhile wait unread; this pump could not read them while it joined.
        self.session.heard(time.monotonic())
        m = self.memory
        m.arenas = [edge.arena]
        m.set_slots(list(edge.slot_views))
        m.set_events(list(edge.ready_events), list(edge.release_events))
        self.watch = RemoteWatch(self.session.clock, edge)
        self.send(self.session.attach(s, [RELEASE_PLACEHOLDER] * len(s.slots)))

    # ------------------------------------------------------------------ liveness
    def producer_alive(self) -> bool:
        """False only when the producer's process is provably gone."""
        w = self.watch
        return w is None or not w.gone()  # None: cannot tell from here

    def tick(self, now: float) -> None:
        s = self.session
        setup = s.setup
        if setup is None:  # (before SETUP every verdict is ALIVE, with no frame)
            return
        if self.closed_after_bye and self.watch is not None and self.watch.gone():
            self.closed_after_bye = False
            reclaim_dead_segments()  # its arena, if it died inside its close()
        gone = (not self.producer_alive()) if s.watching else None
        w = self.watch
        remote = self.remote is not None  # (exactly when w is a RemoteWatch)
        verdict, frame = s.tick(now, gone, w.why() if gone and w is not None and not isinstance(w, host.ProcessWatch)
                                else "exited")
        if verdict is Verdict.LOST:
            self.on_lost()
            return
        if verdict is Verdict.STALLED and remote:
            self.ratelog.warning("stalled",
                                 "ipcsync consumer %r: remote producer pid %d has been silent for %.1f s "
                                 "(heartbeat %.2f s); it is lost if still silent past %d heartbeats",
                                 self.endpoint.name, setup.pid, s.clock.silent_for(now), s.clock.heartbeat,
                                 LOSS_HEARTBEATS)
        elif verdict is Verdict.STALLED:
            # A silent producer whose process lives is stalled (paused, a long GC,
            # SIGSTOP), not lost: waited for, reported.
            self.ratelog.warning("stalled",
                                 "ipcsync consumer %r: producer pid %d has been silent for %.1f s "
                                 "(heartbeat %.2f s) but its process is alive: stalled, waiting",
                                 self.endpoint.name, setup.pid, s.clock.silent_for(now), s.clock.heartbeat)
        elif verdict is Verdict.ANSWERING:
            log.info("ipcsync consumer %r: producer pid %d is answering again", self.endpoint.name, setup.pid)
        if frame is not None:
            self.send(frame)

    def on_lost(self) -> None:
        """The session declared the producer lost: the I/O side of it."""
        self.say_torn()
        self.memory.poison()  # no stream of ours waits for ever on a flag it will never write
        self.downstream.close()  # items still held keep their own mappings
        if self.remote is not None:
            self.remote.fail("producer lost")  # abandons (aborts) its pending recvs
        # Stop ZeroMQ from silently reconnecting to a successor on the same path.
        try:
            self.chan.disconnect(self.endpoint.url)
        except zmq.ZMQError:
            pass
        self.remove_stale(0.0)
        reclaim_dead_segments()  # a dead producer's /dev/shm arena, whoever tracks it

    def say_torn(self) -> None:
        """Shared by descriptor: items the program holds whose data the producer had not
        finished writing when it died (handed out with a GPU-side wait) are named once."""
        mem, lender = self.memory, self.lender
        if mem.flags is None or lender is None:
            return
        torn = []
        for item in lender.held_items():
            ev = mem.ready_events[item.slot]
            ev.value = item.gen
            if not ev.query():
                torn.append(item.seq)
        if torn:
            log.warning("ipcsync consumer %r: the producer died before it finished writing item(s) %s, which this "
                        "consumer had already handed out (wait='gpu'); their tensors hold incomplete data",
                        self.endpoint.name, torn[:16])

    def remove_stale(self, wait: float) -> None:
        remove_stale_endpoint(self.endpoint, self.session.setup, self.producer_alive, wait)

    def teardown(self) -> None:
        error = self.session.error
        if isinstance(error, PeerLostError) and not isinstance(error, ProducerFailedError):
            self.remove_stale(0.5)
        self.session.drop_buffered()
        self.let_go_of_memory()
        if self.watch is not None:
            self.watch.close()
        if self.remote is not None:
            best_effort("consumer teardown", self.remote.close)
        self.memory.drop_events(self.backend)
        best_effort("consumer teardown", self.chan.close, self.backend.collect)
