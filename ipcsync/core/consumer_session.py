"""The consumer's side of one connection, sans I/O (h11's rule: frames in, events out;
the frames to send are made here too, under the same state machine).

Pure: no sockets, no /proc, no clock of its own (``now`` is passed in). The runtime
(``ipcsync.consumer``) reads frames off its socket, hands each to ``receive`` and acts on
what comes back; it sends the frames the session makes (``hello``, ``attach``,
``release_frame``, ``bye``, ``tick``'s heartbeats, and the ERROR frames ``fail`` leaves
in ``outbox``).

Rules kept here, once:

- what each party may send in each state is its machine (``protocol.MACHINES``), and what
  a frame does to its reader the joint rules (``protocol.JOINT``), checked for every
  frame sent and read through ``protocol.Conversation`` (a send outside them is a bug of
  ours: ProtocolError); the steady READYs are checked once per wake-up by their state
  (``receive_frames``: a READY moves no state, so one check covers the batch);
- READY items are buffered in ``ready`` in order; a layout travels once per id and is
  validated once (``RecipeCache``); an item arriving after our BYE is dropped (the
  producer frees its slot when it reads the BYE); the runtime changes ``ready`` and
  ``pending`` only through the session's methods (``take_ready``, ``requeue``,
  ``add_forwarded``, ``queue_release``, ``release_frame``/``unsend_releases``, ...), and
  a wake-up's frames go through ``receive_frames`` (the steady READYs, one call) before
  ``receive`` (the rest, one by one);
- FOREIGN describes another producer's arena before any FREADY names it (FREADY naming
  an undescribed arena, a slot outside the ring or a region outside the arena is a
  protocol error);
- releases are queued in ``pending`` and go out in batches of at most
  ``limits.max_release_batch`` (``release_frame``); ``release_batch`` is how many the
  runtime lets gather while the user iterates (``release_batch_for``: at most half the
  ring, so the producer always has slots it can fill; every wait flushes first);
- the goodbye is the state: ``ENDING`` (the producer ended the stream), ``BYE_SENT`` (ours
  first, once, when nothing is held), ``AWAIT_ACK`` (ours after its), ``CLOSED`` (its BYE
  after ours, or its connection closing then); ``bye_received``, ``bye_sent`` and
  ``bye_acked`` read them;
- an ERROR from the producer becomes the exception of ``REFUSALS``; the first error is
  sticky (``error``) and stops the session;
- liveness (``tick``): the rule of ``core.liveness`` applied to the producer, from SETUP
  until its BYE; heartbeats from SETUP until our BYE;
- lanes (see ``protocol``): LANE only after SETUP, once (``LaneOffered``); the
  producer's SWITCH only after a LANE, once (``SwitchReceived``: read the lane from now
  on and answer with ``switch()``, our last ZeroMQ frame): ``protocol.LANE_TRANSITIONS``,
  the lane's joint region;
- a producer of an older version refusing our HELLO's version: HELLO again one version
  lower (``HelloAgain``), down to ``OLDEST_VERSION`` (4 -> 3: no lane).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Any, NamedTuple, Union

from ..errors import ConfigError, IpcSyncError, PeerLostError, ProducerFailedError, ProtocolError
from . import protocol as P
from .layout import Recipe, RecipeCache
from .liveness import PeerClock, Verdict
from .protocol import ErrorCode, LanePhase, MsgType, State
from .remote_session import is_remote_handle

__all__ = ["ConsumerSession", "REFUSALS", "SETUP_REFUSALS", "SetupReceived", "ForeignReceived", "ForwardedReceived",
           "SentReceived", "LaneOffered", "SwitchReceived", "HelloAgain", "ReadyEntry",
           "release_batch_for"]

# ERROR from the producer -> the exception this consumer raises (any other code:
# ProtocolError; "failed" once SETUP arrived: ProducerFailedError, see _on_error).
REFUSALS: dict[str, type[IpcSyncError]] = {
    ErrorCode.BACKEND.value: ConfigError,
    ErrorCode.HOST.value: ConfigError,
    ErrorCode.CREDITS.value: ConfigError,
    ErrorCode.DEVICE.value: ConfigError,
    ErrorCode.CLOSING.value: PeerLostError,
    # A remote edge's producer dropped us for silence (we were paused): what it had sent us
    # and we had not received is gone, and any recv still running may read a slot it has
    # written again since. The buffered items are never served.
    ErrorCode.DROPPED.value: PeerLostError,
}

# Why this consumer refuses a SETUP (the code its ERROR frame carries) -> the exception it
# raises: another backend is the user's configuration; an inconsistent SETUP, the producer's bug.
SETUP_REFUSALS: dict[ErrorCode, type[IpcSyncError]] = {
    ErrorCode.BACKEND: ConfigError,
    ErrorCode.SETUP: ProtocolError,
}

# A buffered item: (seq, slot, gen, sent_ns, meta, recipe). The runtime may put another
# object with ``build(slot_index, slot)`` and ``nbytes`` in place of the recipe.
ReadyEntry = tuple[int, int, int, int, Any, Any]


class SetupReceived(NamedTuple):
    """SETUP arrived: check who sent it and open its memory, then ``validate_setup`` and
    ``attach`` (or ``fail``)."""

    setup: P.Setup


class ForeignReceived(NamedTuple):
    """FOREIGN arrived (recorded in ``foreign``): open that arena for the FREADYs to come."""

    msg: P.Foreign


class ForwardedReceived(NamedTuple):
    """A valid FREADY: buffer it (``ready``) with a view of its region, or, when that
    memory cannot be opened, drop it and ``release`` it at once."""

    msg: P.ForwardReady
    recipe: Recipe


class SentReceived(NamedTuple):
    """SENT arrived (a remote edge's producer confirms its sends up to ``seq``): the
    runtime's remote edge checks and records it (``core.remote_session`` 7); on an edge
    that is not remote it is a protocol error."""

    seq: int


class LaneOffered(NamedTuple):
    """LANE arrived: connect to its path and send its token (or stay on ZeroMQ)."""

    msg: P.LaneOffer


class SwitchReceived(NamedTuple):
    """The producer's SWITCH: read the lane from now on, and send ``frame`` (our SWITCH)
    as our last ZeroMQ frame."""

    frame: bytes


class HelloAgain(NamedTuple):
    """A producer of an older protocol version refused our HELLO's version: send
    ``frame``, a HELLO one version lower (see the module docstring)."""

    frame: bytes


Event = Union[SetupReceived, ForeignReceived, ForwardedReceived, SentReceived, LaneOffered, SwitchReceived,
              HelloAgain]

_ACTIVE = State.ACTIVE
# Handshake done, not ended: releases, BYE and its ack may still travel.
_EXCHANGING = frozenset({State.ACTIVE, State.ENDING, State.BYE_SENT, State.AWAIT_ACK})
_BYE_RECEIVED = frozenset({State.ENDING, State.AWAIT_ACK, State.CLOSED})
# The states in which our machine lets us send RELEASE (read once: release_frame is per
# batch; a RELEASE moves no state, so one check covers the batch).
_RELEASING = frozenset(state for state, sends in P.MACHINES[P.Role.CONSUMER].items() if MsgType.RELEASE in sends)
_BYE_SENT = frozenset({State.BYE_SENT, State.AWAIT_ACK, State.CLOSED})


# What the producer sends that is dropped once we said BYE (the producer frees those slots
# when it reads our BYE, and the arenas they name).
_DROPPED_AFTER_BYE = (P.Ready, P.ForwardReady, P.Foreign)


def release_batch_for(slots: int) -> int:
    """How many releases gather before a RELEASE goes out while the user iterates: a
    quarter of the ring, at least 2 (so request/reply sends its request before the RELEASE
    of the previous answer: the RELEASE goes out when the consumer next waits), at most
    half of it (the producer always has the other half to fill)."""
    return max(1, min(slots // 2, max(2, slots // 4)))


class ConsumerSession:
    """The protocol state of one consumer's connection to its producer.

    ``name``: the producer's endpoint name (for messages); ``backend``: this consumer's
    backend name; ``heartbeat``: ours in seconds (0: none); ``now``: the clock at start.
    """

    __slots__ = ("name", "backend", "limits", "conv", "enc", "setup", "error", "outbox", "ready", "pending",
                 "release_batch", "recipes", "frecipes", "foreign", "slot_bytes", "clock", "lane_offer",
                 "take_ready", "queue_release", "_hello",
                 "_rehello")

    def __init__(self, name: str, backend: str, heartbeat: float, limits: P.Limits = P.DEFAULT_LIMITS,
                 now: float = 0.0) -> None:
        self.name = name
        self.backend = backend
        self.limits = limits
        self.conv = P.Conversation("consumer")
        self.enc = P.Encoder()
        self.setup: P.Setup | None = None  # once accepted (memory opened, ATTACH made)
        self.error: IpcSyncError | None = None
        self.outbox: list[bytes] = []  # ERROR frames to send (see fail)
        self.ready: deque[ReadyEntry] = deque()
        self.pending: list[tuple[int, int, int]] = []  # releases not yet sent: (seq, slot, gen)
        self.release_batch = 1
        self.recipes = RecipeCache("READY", P.MAX_LAYOUT_IDS)
        self.frecipes = RecipeCache("FREADY", P.MAX_LAYOUT_IDS)
        self.foreign: dict[int, P.Foreign] = {}  # FOREIGN id -> its description
        self.slot_bytes: list[int] = []
        self.clock = PeerClock(heartbeat=0.0, ours=heartbeat, last_recv=now)
        self.lane_offer: P.LaneOffer | None = None  # the producer's LANE, once received
        self._hello: P.Hello | None = None
        self._rehello = False
        # The steady path's two per-item steps, as the containers' own methods (one C call
        # each, no Python frame). take_ready(): the next buffered entry, in order; raises
        # IndexError when none is buffered (then pump, or ``requeue`` what was taken).
        self.take_ready = self.ready.popleft
        # queue_release((seq, slot, gen)): a RELEASE to send with the next batch
        # (``release_frame``), once the item's release event is recorded.
        self.queue_release = self.pending.append

    # ------------------------------------------------------------------ state
    @property
    def state(self) -> State:
        return self.conv.state

    @property
    def exchanging(self) -> bool:
        """Handshake done and not ended: releases, BYE and its ack may still travel."""
        return self.conv.state in _EXCHANGING

    # The goodbye and the lane as flags, read from the state (for the runtime).
    @property
    def bye_received(self) -> bool:
        """The producer ended the stream (or the connection closed cleanly)."""
        return self.conv.state in _BYE_RECEIVED

    @property
    def bye_sent(self) -> bool:
        return self.conv.state in _BYE_SENT

    @property
    def bye_acked(self) -> bool:
        """The producer answered our BYE (or closed its connection after it)."""
        return self.conv.state is State.CLOSED

    @property
    def switched(self) -> bool:
        """The producer's SWITCH was handled: its later frames come on the lane."""
        return self.conv.lane in (LanePhase.SWITCHING, LanePhase.SWITCHED)

    @property
    def watching(self) -> bool:
        """The producer's liveness is being judged (``tick`` needs ``process_gone``)."""
        return self.setup is not None and self.error is None and not self.bye_received

    def finished(self, holding: bool) -> bool:
        """The producer said BYE and nothing is held, buffered or unsent: say BYE now."""
        return (self.error is None and self.bye_received and not holding and not self.ready
                and not self.pending)

    # ------------------------------------------------------------------ buffered items
    def buffered(self) -> int:
        """How many READY entries are buffered (not yet taken)."""
        return len(self.ready)

    def requeue(self, entry: ReadyEntry) -> None:
        """An entry taken but not handed over (its data was not ready in time): first in
        line again."""
        self.ready.appendleft(entry)

    def add_forwarded(self, entry: ReadyEntry) -> None:
        """Buffer a FREADY's entry (``ForwardedReceived``: the runtime opened its region),
        in arrival order with the READYs."""
        self.ready.append(entry)

    def give_back_buffered(self) -> None:
        """close(): every buffered item is released unseen (queued for the last RELEASE)."""
        ready, pending = self.ready, self.pending
        while ready:
            seq, slot, gen, *_ = ready.popleft()
            pending.append((seq, slot, gen))

    def drop_buffered(self) -> None:
        """Teardown: forget the buffered items (nothing more is sent)."""
        self.ready.clear()

    def forget_layouts(self) -> None:
        """Drop the layouts' recipes (and the slot views they cache) before our BYE: after
        it the producer may free the memory they view."""
        self.recipes.clear()
        self.frecipes.clear()

    def heard(self, now: float) -> None:
        """Frames from the producer arrived at ``now`` (liveness)."""
        self.clock.last_recv = now

    def spoke(self, now: float) -> None:
        """A frame of ours went out at ``now`` (heartbeats are due only after silence)."""
        self.clock.last_send = now

    # ------------------------------------------------------------------ sends
    def hello(self, msg: P.Hello) -> bytes:
        """The first frame (again after a reconnect during the handshake: ``connected``)."""
        self.conv.send(MsgType.HELLO)
        self._hello = msg
        return P.encode(msg)

    def validate_setup(self, s: P.Setup) -> bool:
        """SETUP describes a ring this consumer can use; else ``fail`` and False."""
        code, problem = ErrorCode.SETUP, None
        if s.backend != self.backend and not (s.arenas and is_remote_handle(s.arenas[0])):
            # (a remote edge joins any two kinds of device: its transfer copies)
            code, problem = ErrorCode.BACKEND, f"producer uses the {s.backend} backend, this consumer {self.backend}"
        elif not s.slots or len(s.slots) != len(s.ready_events):
            problem = f"SETUP has {len(s.slots)} slots and {len(s.ready_events)} ready events"
        elif not s.arenas or len(s.arenas) != len(s.arena_bytes):
            problem = "SETUP arenas and their sizes do not match"
        else:
            for i, (a, off, n) in enumerate(s.slots):
                if a >= len(s.arenas) or off + n > s.arena_bytes[a]:
                    problem = f"SETUP slot {i} lies outside its arena"
                    break
        if problem is None:
            return True
        self.fail(SETUP_REFUSALS[code](problem), code)
        return False

    def attach(self, s: P.Setup, release_handles: list[Any]) -> bytes:
        """SETUP accepted (its memory is open): the ATTACH frame with our release events."""
        self.conv.send(MsgType.ATTACH)
        self.setup = s
        self.slot_bytes = [n for _a, _off, n in s.slots]
        self.clock.heartbeat = s.heartbeat_ms / 1000
        self.release_batch = release_batch_for(len(s.slots))
        return P.encode(P.Attach(release_handles))

    def release_frame(self, now: float | None = None) -> tuple[bytes, list[tuple[int, int, int]]] | None:
        """The next RELEASE to send and the entries it carries, taken off the queue (a
        send that did not go out gives them back: ``unsend_releases``), or None: nothing
        queued, or no longer exchanging. ``now``: when it goes out (the clock's last
        send: heartbeats are due only after silence)."""
        pending = self.pending
        if not pending or self.error is not None or self.conv.state not in _RELEASING:
            return None
        n = min(len(pending), self.limits.max_release_batch)
        entries = pending[:n]
        del pending[:n]
        if now is not None:
            self.clock.last_send = now
        return self.enc.release(entries), entries

    def unsend_releases(self, entries: list[tuple[int, int, int]]) -> None:
        """The RELEASE of ``release_frame`` could not go out (the connection is full):
        its entries are first in the queue again."""
        self.pending[:0] = entries

    def bye(self) -> bytes | None:
        """Our BYE, once (nothing is held: every caller releases first). Items arriving
        after it are dropped."""
        if self.bye_sent:
            return None
        self.conv.send(MsgType.BYE)
        return P.encode(P.Bye("consumer closed"))

    def fail(self, error: IpcSyncError, code: str | None) -> None:
        """Record the first fatal error; with ``code``, an ERROR frame for the producer
        goes to ``outbox``. Buffered items are dropped; the session is in state ERROR."""
        if self.error is not None:
            return
        self.error = error
        if code is not None and self.conv.may_send(MsgType.ERROR):
            self.conv.send(MsgType.ERROR)
            self.outbox.append(P.encode(P.Error(str(getattr(code, "value", code)), str(error)[:1000])))
        self.conv.fail()
        self.ready.clear()

    def lost(self, why: str) -> None:
        """The producer is provably gone (its process exited, or its connection closed)."""
        pid = self.setup.pid if self.setup else None
        self.fail(PeerLostError(
            f"producer (pid {pid}) on endpoint {self.name!r} {why}; items it had "
            "not delivered are lost. Restart the producer and connect again."
        ), None)

    # ------------------------------------------------------------------ connection
    def disconnected(self) -> bool:
        """The connection dropped. During the handshake: say HELLO again on reconnect
        (False). After it: True, and call ``closed_by_peer`` once the frames that
        arrived before the drop are handled."""
        if self.conv.state is State.AWAIT_SETUP:
            self._rehello = True
            return False
        return True

    def connected(self) -> bytes | None:
        """(Re)connected: HELLO again if the handshake lost its first one."""
        if self._rehello and self.conv.state is State.AWAIT_SETUP and self._hello is not None:
            self._rehello = False
            return self.hello(self._hello)
        return None

    def closed_by_peer(self) -> bool:
        """The producer's connection closed: after our BYE that acks it (a BYE then a
        close is clean); before its own BYE the producer is lost (True)."""
        if self.bye_sent:
            self.conv.close()  # (acknowledges our BYE)
        elif not self.bye_received:
            self.lost("disconnected")
            return True
        return False

    def tick(self, now: float, process_gone: bool | None, gone_why: str = "exited") -> tuple[Verdict, bytes | None]:
        """Judge the producer at ``now`` (``process_gone``: see PeerClock.tick; asked only
        while ``watching``; ``gone_why`` ends the sentence that says why it is gone): LOST
        is recorded (``error``); STALLED/ANSWERING are for the
        runtime to report. Also the HEARTBEAT to send, if one is due: they go on until our
        BYE, so a consumer still holding items after the producer's BYE does not look dead."""
        if self.setup is None or self.error is not None:
            return Verdict.ALIVE, None
        verdict = Verdict.ALIVE
        if not self.bye_received:  # after its BYE the producer only waits for our releases
            verdict = self.clock.tick(now, process_gone)
            if verdict is Verdict.LOST:
                self.lost(gone_why)
                return verdict, None
        if self.conv.may_send(MsgType.HEARTBEAT) and self.clock.heartbeat_due(now):
            return verdict, P.encode(P.Heartbeat())
        return verdict, None

    # ------------------------------------------------------------------ receives
    def receive(self, frames: list[bytes]) -> Event | None:
        """Handle one message from the producer; an event where the runtime must act."""
        if len(frames) == 1 and self.conv.state is _ACTIVE:
            # Steady state: a READY whose layout this consumer has (it stays active).
            r = P.decode_ready(frames[0], self.limits)
            if r is not None:
                self._on_ready(r[0], r[1], r[2], r[3], r[4], None, r[5])
                return None
        if len(frames) != 1:
            self.fail(ProtocolError(f"producer sent a message of {len(frames)} frames"), ErrorCode.PROTOCOL)
            return None
        try:
            msg = P.decode(frames[0], self.limits)
            if (type(msg) is P.Error and msg.code == ErrorCode.VERSION.value and self.conv.state is State.AWAIT_SETUP
                    and self._hello is not None and self._hello.version > P.OLDEST_VERSION):
                # A producer of an older version: one version lower (4 -> 3: no lane).
                return HelloAgain(self.hello(dataclasses.replace(self._hello, version=self._hello.version - 1)))
            self.conv.receive(msg)
        except ProtocolError as exc:
            code = ErrorCode.VERSION if isinstance(exc, P.VersionMismatch) else ErrorCode.PROTOCOL
            self.fail(ProtocolError(f"producer on {self.name!r} broke the protocol: {exc}"), code)
            return None
        kind = type(msg)
        if self.conv.state is State.BYE_SENT and kind in _DROPPED_AFTER_BYE:
            return None  # we are leaving (see bye)
        # (A class pattern is a C-level type check: no Python call, and mypy narrows ``msg``.)
        match msg:
            case P.Ready():
                self._on_ready(msg.seq, msg.slot, msg.gen, msg.sent_ns, msg.layout_id, msg.layout, msg.meta)
            case P.ForwardReady():
                return self._on_forward_ready(msg)
            case P.Foreign():
                return self._on_foreign(msg)
            case P.Setup():
                return SetupReceived(msg)
            case P.Sent():
                # (After our BYE the items it confirms were dropped: nothing to record.)
                return None if self.bye_sent else SentReceived(msg.seq)
            case P.Error():
                self._on_error(msg)
            case P.LaneOffer():
                return self._on_lane(msg)
            case P.Switch():
                return self._on_switch()
        return None

    def receive_frames(self, frames: list[bytes], now: float) -> int:
        """The steady path of ``receive`` for a wake-up's frames, received at ``now``:
        buffers their leading READYs whose layout this consumer has (``decode_readies``:
        one call for the batch) and returns how many it took; the caller hands each of the
        rest to ``receive``, in order (a new layout, a control frame, anything bad)."""
        if frames:
            self.clock.last_recv = now
        if self.conv.state is not _ACTIVE or self.error is not None:  # (our BYE leaves ACTIVE)
            return 0
        got = P.decode_readies(frames, self.limits)
        nslots, recipe_of, append = len(self.slot_bytes), self.recipes.get, self.ready.append
        n = 0
        for seq, slot, gen, sent_ns, layout_id, meta in got:
            recipe = recipe_of(layout_id) if slot < nslots else None
            if recipe is None:
                return n  # (receive says what is wrong, or resolves it)
            append((seq, slot, gen, sent_ns, meta, recipe))
            n += 1
        return n

    def _on_lane(self, m: P.LaneOffer) -> LaneOffered | None:
        if self.setup is None or (self._hello is not None and self._hello.version < P.LANE_VERSION):
            self.fail(ProtocolError(f"producer on {self.name!r} offered a lane it may not offer now"),
                      ErrorCode.PROTOCOL)
            return None
        self.lane_offer = m
        return LaneOffered(m)

    def _on_switch(self) -> SwitchReceived:
        # (The table checked that a LANE came first and that this is the first SWITCH.)
        return SwitchReceived(self.switch())

    def switch(self) -> bytes:
        """Our SWITCH, answering the producer's: ``protocol.SWITCH_FRAME`` itself."""
        self.conv.send(MsgType.SWITCH)
        return P.SWITCH_FRAME

    def _on_ready(self, seq: int, slot: int, gen: int, sent_ns: int, layout_id: int,
                  layout: Any, meta: Any) -> None:
        """Buffer a READY: ``layout`` is None when it travelled earlier under ``layout_id``
        (never called after our BYE: ``receive`` drops such items)."""
        slot_bytes = self.slot_bytes
        if slot >= len(slot_bytes):
            self.fail(ProtocolError(f"READY names slot {slot}; the ring has {len(slot_bytes)}"), ErrorCode.PROTOCOL)
            return
        # (The cache's get is the dict's own: no Python call on the steady-state path.)
        recipe = self.recipes.get(layout_id) if layout is None else None
        if recipe is None:
            try:
                recipe = self.recipes.resolve(layout_id, layout, slot_bytes[slot])
            except ProtocolError as exc:
                self.fail(exc, ErrorCode.PROTOCOL)
                return
        self.ready.append((seq, slot, gen, sent_ns, meta, recipe))

    def _on_foreign(self, m: P.Foreign) -> ForeignReceived | None:
        if m.backend != self.backend:
            self.fail(ProtocolError(
                f"producer on {self.name!r} forwards {m.backend} memory to a {self.backend} consumer"),
                ErrorCode.PROTOCOL)
            return None
        self.foreign[m.fid] = m
        return ForeignReceived(m)

    def _on_forward_ready(self, m: P.ForwardReady) -> ForwardedReceived | None:
        d = self.foreign.get(m.fid)
        problem = None
        if d is None:
            problem = f"FREADY names foreign arena {m.fid}, which was never described"
        elif m.slot >= len(self.slot_bytes):
            problem = f"FREADY names slot {m.slot}; the ring has {len(self.slot_bytes)}"
        elif m.offset + m.nbytes > d.nbytes:
            problem = f"FREADY region {m.offset}+{m.nbytes} lies outside foreign arena {m.fid} of {d.nbytes} bytes"
        if problem is not None:
            self.fail(ProtocolError(problem), ErrorCode.PROTOCOL)
            return None
        try:
            recipe = self.frecipes.resolve(m.layout_id, m.layout, m.nbytes)
        except ProtocolError as exc:
            self.fail(exc, ErrorCode.PROTOCOL)
            return None
        if recipe.extent > m.nbytes:
            self.fail(ProtocolError(f"FREADY layout reaches byte {recipe.extent} of a {m.nbytes}-byte region"),
                      ErrorCode.PROTOCOL)
            return None
        return ForwardedReceived(m, recipe)

    def _on_error(self, msg: P.Error) -> None:
        if msg.code == ErrorCode.FAILED.value and self.setup is not None:
            # The producer's with-block raised (or it called abort()): never a clean end.
            self.fail(ProducerFailedError(
                f"producer (pid {self.setup.pid}) on endpoint {self.name!r} failed: "
                f"{msg.message}; its stream ended early and items it had sent but this consumer "
                "had not yet received are dropped"), None)
            return
        text = f"producer on {self.name!r} refused this consumer ({msg.code}): {msg.message}"
        self.fail(REFUSALS.get(msg.code, ProtocolError)(text), None)
