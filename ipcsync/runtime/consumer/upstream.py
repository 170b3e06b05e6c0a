"""The consumer's connection to its producer (``ProducerLink``), around the session's rules
(``core.consumer_session``): the frames in (the pumps) and out (the sends, the batched
RELEASEs, BYE), the events the session hands back, and the items the program released
while still viewing them. Its other jobs are plain functions over the link
(``runtime.consumer.link_parts.LinkParts``): the handshake and the producer's memory opened at
SETUP (``runtime.consumer.upstream_setup``, into a ``runtime.consumer.ring_memory.RingMemory``); liveness,
loss and teardown (``runtime.consumer.upstream_loss``).

- The steady pump (``pump_lane``): while the lane carries every frame and nothing else
  needs a look (no kept slot to poll, no lent item coming back, no ERROR to send), a
  wake-up's lane frames go to ``session.receive_frames`` in one call; anything else, and
  every tick, goes through ``pump``, which hands the lane's steady READYs over in one call
  too, then every other frame one at a time. (``pump_lane`` keeps its own three lines of
  that read: shared through a function, they would cost a call per wake-up on the steady
  path; likewise ``pump``'s two per-frame loops, lane and ZeroMQ, on the ZeroMQ edges'
  steady path.)
- Kept items (``keeping.Kept``): released items a tensor of the program still views are
  given back at the start of every pump once nothing references them, all at once after
  the producer's BYE; ``check_stall`` moves them out or reports what holds the ring;
  ``give_up_kept`` at close.
- ``let_go_of_memory`` drops every view and import of the producer's memory before any BYE
  of ours (the producer may exit once it answered)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Sequence

import zmq

from ...core import protocol as P
from ...core.consumer_session import (ConsumerSession, ForeignReceived, HelloAgain, LaneOffered, SentReceived,
                                     SetupReceived, SwitchReceived)
from ...core.protocol import ErrorCode
from ...core.ratelog import RateLog
from ...errors import BackendError, IpcSyncError, ProtocolError
from ...system import host
from ..transport.address import Endpoint
from .foreign import Downstream
from .keeping import Kept
from .ring_memory import RingMemory
from .upstream_loss import on_lost
from .upstream_setup import on_setup, open_shared_memory

if TYPE_CHECKING:  # (runtime.remote.io is loaded only where a remote edge is)
    from ..remote.io import RemoteWatch

__all__ = ["ProducerLink"]

log = logging.getLogger(__name__)

_FRAMES_PER_PUMP = 256  # frames the steady pump reads at most (a flood cannot starve the caller)


class ProducerLink:
    """One consumer's connection to its producer: the channel, the session's frames in and
    out, the ring's memory and the foreign arenas opened as the session asks
    (``upstream_setup``), and the producer's liveness (``upstream_loss``). Every method
    runs under the consumer's lock.

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
        # A producer on another host: the runtime.remote.io.ConsumerEdge its SETUP named, whose
        # receive ring fills ``memory``; None on every local edge.
        self.remote: Any = None
        # A SETUP naming memory shared by descriptor, and where it lies: opened once its
        # descriptors came on the lane (``upstream_setup.open_shared_memory``).
        self.shared_setup: tuple[P.Setup, Any] | None = None
        self.lane_loss_seen = False  # a closed lane was handled as a closed connection
        # The producer's connection closed while its process may not be provably gone yet
        # (after its BYE: it may have died inside its close(), e.g. while we held items;
        # a loss: a killed process closes its sockets before it is a zombie), so its
        # /dev/shm arena may be left: until it is provably gone (then reclaim) ticks look.
        self.reclaim_when_gone = False
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
        next tick or wake-up (see ``runtime.transport.channel.ConsumerChannel.read_lane``).
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
                on_lost(self)
            elif s.bye_received:
                self.reclaim_when_gone = True
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
            on_setup(self, event.setup)
        elif self.remote is not None and kind is not SentReceived:
            # FOREIGN/FREADY name another host's memory: a producer forwards to a remote
            # consumer by copy (runtime.producer.forwarder), never zero-copy.
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
                open_shared_memory(self)
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

    # ------------------------------------------------------------------ liveness
    def producer_alive(self) -> bool:
        """False only when the producer's process is provably gone."""
        w = self.watch
        return w is None or not w.gone()  # None: cannot tell from here
