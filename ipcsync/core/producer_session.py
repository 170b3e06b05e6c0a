"""One consumer connection as the producer sees it, sans I/O (h11 style): frames in,
events out; the frames the session itself says (SETUP, BYE, BYE ack, ERROR, HEARTBEAT)
come out of it too. No sockets, no /proc, no clock: ``now`` is passed in.

Rules kept here:

- transitions, for what we receive and for what we send: each party's machine
  (``protocol.MACHINES``) and the joint rules (``protocol.JOINT``), through
  ``protocol.Conversation``; the steady RELEASEs are checked once per wake-up by their
  state (``release_frames``: a RELEASE moves no state, so one check covers the batch);
- the goodbye is the state: our BYE is said at most once (``BYE_SENT``); a BYE received is
  always acknowledged (``ACK_DUE``, then ``CLOSED``: the consumer closes its socket only
  after the ack, which proves its earlier frames arrived);
- the same HELLO again while we await ATTACH is ignored (ZeroMQ kept the consumer's
  first HELLO queued across a reconnect and it sent one more on connecting);
- a bad frame ends the session: an ERROR frame goes back and the caller drops the peer;
- layouts and foreign arenas sent to this consumer: a READY names a layout by id only
  when this consumer has that id's current version; a FREADY follows the FOREIGN of
  its arena's current version;
- liveness through ``core.liveness`` (heard / spoke / stalled / handshake overdue);
- lanes (see ``protocol``): LANE goes only to a consumer of ``LANE_VERSION`` or later;
  its phases (LANE after SETUP, once; our SWITCH once, after it; the consumer's SWITCH
  only as the answer to ours) are ``protocol.LANE_TRANSITIONS``, the lane's joint region.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Final, Sequence

from ..errors import ProtocolError
from . import protocol as P
from .liveness import HANDSHAKE_S, PeerClock, Verdict, handshake_overdue
from .protocol import ErrorCode, LanePhase, MsgType, State

__all__ = ["Kind", "SessionEvent", "ProducerSession", "error_frame"]

# States in which our BYE was said (or, ACK_DUE, is being said as the ack).
_BYE_SENT: Final = frozenset({State.BYE_SENT, State.ACK_DUE, State.CLOSED})
_BYE_RECEIVED: Final = frozenset({State.ACK_DUE, State.CLOSED})
# States in which the consumer may hold slots: items flow, or our BYE awaits their release.
_MAY_HOLD: Final = frozenset({State.ACTIVE, State.BYE_SENT})


class Kind(Enum):
    """What a received frame meant."""

    NOTHING = "nothing"  # heartbeat, or a duplicate HELLO: only liveness changed
    ATTACHED = "attached"  # data: the ATTACH (release event handles)
    RELEASED = "released"  # data: [(seq, slot, gen)]
    GOODBYE = "goodbye"  # the consumer said BYE; reply: the ack. Drop the peer.
    PEER_ERROR = "peer_error"  # data: the consumer's ERROR. Drop the peer.
    BAD_FRAME = "bad_frame"  # data: the ProtocolError; reply: our ERROR. Drop the peer.
    SWITCHED = "switched"  # the consumer's SWITCH: read its lane from now on


@dataclass(frozen=True)
class SessionEvent:
    kind: Kind
    data: Any = None
    reply: bytes | None = None  # a frame to send back before acting on the event


def error_frame(exc: ProtocolError) -> bytes:
    """The ERROR frame answering a frame that broke the protocol."""
    code = ErrorCode.VERSION if isinstance(exc, P.VersionMismatch) else ErrorCode.PROTOCOL
    return P.encode(P.Error(code.value, str(exc)[:1000]))


_NOTHING: Final = SessionEvent(Kind.NOTHING)


class ProducerSession:
    """The producer's side of one connection, from the consumer's HELLO on."""

    __slots__ = ("identity", "hello", "conv", "clock", "hello_at", "layouts", "foreign", "limits")

    def __init__(self, identity: bytes, hello: P.Hello, now: float, heartbeat: float,
                 limits: P.Limits = P.DEFAULT_LIMITS) -> None:
        """``heartbeat``: ours (seconds; 0: we send none)."""
        self.identity = identity
        self.hello = hello
        self.limits = limits
        self.conv = P.Conversation("producer")
        self.conv.receive(hello)
        self.clock = PeerClock(hello.heartbeat_ms / 1000, heartbeat, last_recv=now)
        self.hello_at = now
        self.layouts: dict[int, int] = {}  # layout id -> version this consumer has
        self.foreign: dict[int, int] = {}  # foreign id -> version described to it (FOREIGN)

    @property
    def state(self) -> State:
        return self.conv.state

    # The goodbye and the lane as flags, read from the state (for the runtime).
    @property
    def bye_sent(self) -> bool:
        """Our BYE was said (or the consumer's BYE was acknowledged)."""
        return self.conv.state in _BYE_SENT

    @property
    def bye_received(self) -> bool:
        return self.conv.state in _BYE_RECEIVED

    @property
    def may_hold(self) -> bool:
        """The consumer may hold slots: items flow, or our BYE awaits their release."""
        return self.conv.state in _MAY_HOLD

    @property
    def switch_sent(self) -> bool:
        """Our SWITCH was made (the runtime moves to the lane once it left)."""
        return self.conv.lane in (LanePhase.SWITCHING, LanePhase.SWITCHED)

    @property
    def switch_received(self) -> bool:
        """The consumer's SWITCH: its later frames come on the lane."""
        return self.conv.lane is LanePhase.SWITCHED

    @property
    def label(self) -> str:
        return f"consumer pid {self.hello.pid}"

    # ------------------------------------------------------------------ receiving
    def release_entries(self, frame: bytes, now: float) -> list[tuple[int, int, int]] | None:
        """The steady state's fast path: the entries of a RELEASE received while active
        (which leaves the state active), else None (use ``receive_frame``)."""
        entries: list[tuple[int, int, int]] = []
        return entries if self.release_frames((frame,), now, entries) else None

    def release_frames(self, frames: Sequence[bytes], now: float, out: list[tuple[int, int, int]]) -> int:
        """The steady path for a wake-up's frames, received at ``now``: while active,
        appends the entries of the leading RELEASEs to ``out`` (``decode_releases``: one
        call for the batch; a RELEASE leaves the state active) and returns how many frames
        it took; the caller hands each of the rest to ``receive_frame``, in order."""
        if self.conv.state is not State.ACTIVE:
            return 0
        n = P.decode_releases(frames, self.limits, out)
        if n:
            self.clock.last_recv = now
        return n

    def receive_frame(self, frame: bytes, now: float) -> SessionEvent:
        try:
            msg = P.decode(frame, self.limits)
        except ProtocolError as exc:
            return self.bad_frame(exc)
        return self.receive(msg, now)

    def receive(self, msg: P.Message, now: float) -> SessionEvent:
        self.clock.heard(now)
        kind = type(msg)
        if kind is P.Hello and msg == self.hello and self.conv.state is State.AWAIT_ATTACH:
            return _NOTHING  # the same HELLO again (see the module docstring): SETUP is on its way
        try:
            self.conv.receive(msg)
        except ProtocolError as exc:
            return self.bad_frame(exc)
        if type(msg) is P.Release:  # (not ``kind``: this narrows ``msg`` for the checker)
            return SessionEvent(Kind.RELEASED, msg.entries)
        if kind is P.Attach:
            return SessionEvent(Kind.ATTACHED, msg)
        if kind is P.Bye:  # (ACK_DUE: the ack is our next frame)
            return SessionEvent(Kind.GOODBYE, reply=self._frame(P.Bye("ack")))
        if kind is P.Error:
            return SessionEvent(Kind.PEER_ERROR, msg)
        if kind is P.Switch:  # (the table checked that it answers ours)
            return SessionEvent(Kind.SWITCHED)
        return _NOTHING

    def bad_frame(self, exc: ProtocolError) -> SessionEvent:
        """``exc``: why a frame from this consumer was refused. The session ends."""
        if self.conv.may_send(MsgType.ERROR):  # (the reply goes out even where it may not: we end)
            self.conv.send(MsgType.ERROR)
        self.conv.fail()
        return SessionEvent(Kind.BAD_FRAME, exc, error_frame(exc))

    def attach_problem(self, release_events: int, slots: int) -> SessionEvent | None:
        """A BAD_FRAME event if an ATTACH carrying ``release_events`` does not fit our ring."""
        if release_events != slots:
            return self.bad_frame(ProtocolError(
                f"ATTACH carries {release_events} release events for {slots} slots"))
        return None

    # ------------------------------------------------------------------ sending
    def _frame(self, msg: P.Message) -> bytes:
        """``msg`` encoded, once the table allowed us to send it now (else ProtocolError:
        a bug of ours, never a peer's)."""
        self.conv.send(MsgType(msg.TYPE))
        return P.encode(msg)

    def check_send(self, t: MsgType) -> None:
        """ProtocolError (a bug of ours, never a peer's) if we may not send ``t`` now."""
        if not self.conv.may_send(t):
            self.conv.send(t)  # raises, naming the state

    def setup(self, msg: P.Setup) -> bytes:
        """The SETUP answering the HELLO this session began with."""
        return self._frame(msg)

    @property
    def lane_capable(self) -> bool:
        """The consumer speaks a protocol version with lanes."""
        return self.hello.version >= P.LANE_VERSION

    def lane_offer(self, path: str, token: bytes) -> bytes:
        """LANE (after SETUP, once, to a lane-capable consumer)."""
        if not self.lane_capable:
            raise ProtocolError(f"a LANE may not go to {self.label} (version {self.hello.version})")
        return self._frame(P.LaneOffer(path, token))

    def switch(self) -> bytes:
        """Our SWITCH (once, after LANE): ``protocol.SWITCH_FRAME`` itself, which the
        runtime recognises by identity when it leaves on ZeroMQ."""
        self.conv.send(MsgType.SWITCH)
        return P.SWITCH_FRAME

    def bye(self, reason: str) -> bytes | None:
        """Our BYE, once (None if one was said already, or the session has ended)."""
        if not self.conv.may_send(MsgType.BYE):
            return None
        return self._frame(P.Bye(reason))

    def heartbeat(self, now: float) -> bytes | None:
        """A HEARTBEAT if one is due (we said nothing for a quarter of our heartbeat)."""
        if not self.conv.may_send(MsgType.HEARTBEAT) or not self.clock.heartbeat_due(now):
            return None
        return _HEARTBEAT

    def sent(self, seq: int) -> bytes:
        """SENT: a remote edge's sends up to ``seq`` completed (``core.remote_session`` 7)."""
        return self._frame(P.Sent(seq))

    def spoke(self, now: float) -> None:
        self.clock.spoke(now)

    def needs_layout(self, lid: int, version: int) -> bool:
        """True if a frame for layout ``lid`` at ``version`` must carry the layout to this
        consumer (it is then recorded as having it)."""
        if lid and self.layouts.get(lid) == version:
            return False
        if lid:
            self.layouts[lid] = version
        return True

    def needs_foreign(self, fid: int, version: int) -> bool:
        """True if this consumer must first get the FOREIGN of arena ``fid`` at ``version``
        (it is then recorded as having it)."""
        if self.foreign.get(fid) == version:
            return False
        self.foreign[fid] = version
        return True

    def close(self) -> None:
        self.conv.close()

    # ------------------------------------------------------------------ liveness
    def tick(self, now: float, process_gone: bool | None, watching_silence: bool = True,
             handshake_s: float = HANDSHAKE_S) -> tuple[Verdict, str]:
        """Judge the consumer at ``now`` (see ``core.liveness``): LOST when its process is
        provably gone or it never ATTACHed within ``handshake_s``; else STALLED/ANSWERING
        as its silence says (not while ``watching_silence`` is False)."""
        if process_gone:
            return Verdict.LOST, "process exited"
        if self.conv.state is State.AWAIT_ATTACH and handshake_overdue(now, self.hello_at, handshake_s):
            return Verdict.LOST, f"no ATTACH within {handshake_s:.0f} s of its HELLO"
        return self.clock.tick(now, None, watching_silence=watching_silence), ""


_HEARTBEAT: Final = P.encode(P.Heartbeat())
