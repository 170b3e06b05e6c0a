"""The ipcsync wire protocol's state machine, sans-IO: where one connection stands, seen
from one side (``Role``, ``State``), the lane's phases (``LanePhase``), and which message,
said by which side, may come in each (``TRANSITIONS``, ``LANE_TRANSITIONS``).
``Conversation`` checks every frame a side receives and every frame it sends against them.

``TRANSITIONS`` is one table for both parties: for each role and state, which messages
(sent by either side) are allowed and which state they lead to; the lane's phases are a
second region of it (``LANE_TRANSITIONS``). The conversation itself:
``ipcsync.core.protocol``.
"""

from __future__ import annotations

from enum import Enum
from typing import Final

from ..errors import ProtocolError
from .messages import Message, MsgType

__all__ = [
    "Role", "State", "LanePhase", "Event", "TRANSITIONS", "LANE_TRANSITIONS", "LANE_TYPES", "INITIAL", "ENDED",
    "DUE", "LANE_DUE", "PEER_OF", "Conversation",
]


class Role(str, Enum):
    """The two parties of a connection. A ``str`` enum: roles compare equal to their names."""

    PRODUCER = "producer"
    CONSUMER = "consumer"


class State(str, Enum):
    """Where one connection stands, seen from one side (see ``TRANSITIONS``). A ``str``
    enum: states compare equal to their names. The goodbye is part of the state: who said
    BYE first decides what may still come."""

    AWAIT_HELLO = "await_hello"  # producer: connected, nothing said yet
    SETUP_DUE = "setup_due"  # producer: HELLO received; SETUP (or ERROR) is our next frame
    AWAIT_ATTACH = "await_attach"  # producer: SETUP sent, waiting for the release events
    AWAIT_SETUP = "await_setup"  # consumer: HELLO sent
    ATTACH_DUE = "attach_due"  # consumer: SETUP received; ATTACH (or ERROR) is our next frame,
    #                            once its memory is open
    ACTIVE = "active"  # items flow
    ENDING = "ending"  # consumer: the producer said BYE; it releases what it holds, then says BYE
    BYE_SENT = "bye_sent"  # our BYE went first: the producer awaits the consumer's releases and
    #                        BYE; the consumer awaits the producer's acknowledging BYE
    AWAIT_ACK = "await_ack"  # consumer: its BYE answered the producer's; the ack is due
    ACK_DUE = "ack_due"  # producer: the consumer said BYE; our acknowledging BYE is the next frame
    CLOSED = "closed"  # both BYEs exchanged (or closed locally): nothing more is read
    ERROR = "error"  # ended by an ERROR (sent or received) or a frame that broke the protocol


class LanePhase(str, Enum):
    """The lane's region of the state machine (``LANE_TRANSITIONS``), the same for both
    roles: LANE and SWITCH must be allowed by the connection's ``State`` and by this."""

    NONE = "none"  # on ZeroMQ, no lane offered
    OFFERED = "offered"  # LANE said (the producer) or received (the consumer)
    SWITCHING = "switching"  # the producer's SWITCH said; the consumer's answering SWITCH is due
    SWITCHED = "switched"  # both SWITCHes: every later frame travels on the lane


# --------------------------------------------------------------------------- the tables

# One state machine for both parties, as data (h11's EVENT_TRIGGERED_TRANSITIONS):
# TRANSITIONS[role][state][(sender, message type)] -> that role's next state. An event is
# a message and who sends it: for a role, an event of its own is a send, one of the peer's
# a receipt; absent from the state's table, it is a protocol violation (a peer's) or a bug
# (ours). The tests drive both roles' tables against each other (every frame one side may
# send in a state is accepted by the other in every state it can be in when it arrives).
# LANE and SWITCH also move the lane's region (LANE_TRANSITIONS), which both roles share.
Event = tuple[Role, MsgType]
_PRODUCER: Final = Role.PRODUCER
_CONSUMER: Final = Role.CONSUMER


def _events(sender: Role, to: State, *types: MsgType) -> dict[Event, State]:
    return {(sender, t): to for t in types}


def _table() -> dict[Role, dict[State, dict[Event, State]]]:
    p, c, m = _PRODUCER, _CONSUMER, MsgType
    st = State
    return {
        p: {
            # (A refused HELLO is answered by an ERROR without a conversation.)
            st.AWAIT_HELLO: {(c, m.HELLO): st.SETUP_DUE},
            st.SETUP_DUE: {(p, m.SETUP): st.AWAIT_ATTACH, (p, m.ERROR): st.ERROR},
            # (Before its ATTACH the consumer may only heartbeat, or end with ERROR.)
            st.AWAIT_ATTACH: {
                (c, m.ATTACH): st.ACTIVE, (c, m.HEARTBEAT): st.AWAIT_ATTACH, (c, m.ERROR): st.ERROR,
                **_events(p, st.AWAIT_ATTACH, m.LANE_OFFER, m.SWITCH, m.HEARTBEAT),
                (p, m.BYE): st.BYE_SENT, (p, m.ERROR): st.ERROR,
            },
            st.ACTIVE: {
                **_events(c, st.ACTIVE, m.RELEASE, m.HEARTBEAT, m.SWITCH),
                (c, m.BYE): st.ACK_DUE, (c, m.ERROR): st.ERROR,
                **_events(p, st.ACTIVE, m.READY, m.FOREIGN, m.FORWARD_READY, m.SWITCH, m.HEARTBEAT, m.SENT),
                (p, m.BYE): st.BYE_SENT, (p, m.ERROR): st.ERROR,
            },
            # (A consumer still handshaking may ATTACH after our BYE; SENT confirms the last
            # sends of a remote edge after it.)
            st.BYE_SENT: {
                **_events(c, st.BYE_SENT, m.ATTACH, m.RELEASE, m.HEARTBEAT, m.SWITCH),
                (c, m.BYE): st.ACK_DUE, (c, m.ERROR): st.ERROR,
                **_events(p, st.BYE_SENT, m.SWITCH, m.HEARTBEAT, m.SENT), (p, m.ERROR): st.ERROR,
            },
            st.ACK_DUE: {(p, m.BYE): st.CLOSED},
            st.CLOSED: {},
            st.ERROR: {},
        },
        c: {
            # (The producer answers a HELLO with SETUP or ERROR before anything else. HELLO
            # again: the same one after a reconnect, or one of the older version.)
            # (A consumer may heartbeat while it waits: ours starts at its ATTACH.)
            st.AWAIT_SETUP: {
                (p, m.SETUP): st.ATTACH_DUE, (p, m.ERROR): st.ERROR,
                (c, m.HELLO): st.AWAIT_SETUP, (c, m.HEARTBEAT): st.AWAIT_SETUP, (c, m.ERROR): st.ERROR,
            },
            st.ATTACH_DUE: {(c, m.ATTACH): st.ACTIVE, (c, m.ERROR): st.ERROR},
            st.ACTIVE: {
                **_events(p, st.ACTIVE, m.READY, m.FOREIGN, m.FORWARD_READY, m.HEARTBEAT, m.SENT, m.LANE_OFFER,
                          m.SWITCH),
                (p, m.BYE): st.ENDING, (p, m.ERROR): st.ERROR,
                **_events(c, st.ACTIVE, m.RELEASE, m.HEARTBEAT, m.SWITCH),
                (c, m.BYE): st.BYE_SENT, (c, m.ERROR): st.ERROR,
            },
            # (SENT after BYE: the producer's last items are confirmed once their sends complete.)
            st.ENDING: {
                **_events(p, st.ENDING, m.HEARTBEAT, m.SENT, m.SWITCH), (p, m.ERROR): st.ERROR,
                **_events(c, st.ENDING, m.RELEASE, m.HEARTBEAT, m.SWITCH),
                (c, m.BYE): st.AWAIT_ACK, (c, m.ERROR): st.ERROR,
            },
            # Items arriving after our BYE are dropped (the producer frees their slots when it
            # reads the BYE); a SWITCH is still answered, since the ack may come on the lane.
            st.BYE_SENT: {
                **_events(p, st.BYE_SENT, m.READY, m.FOREIGN, m.FORWARD_READY, m.HEARTBEAT, m.SENT,
                          m.LANE_OFFER, m.SWITCH),
                (p, m.BYE): st.CLOSED, (p, m.ERROR): st.ERROR,
                (c, m.SWITCH): st.BYE_SENT, (c, m.ERROR): st.ERROR,
            },
            st.AWAIT_ACK: {
                **_events(p, st.AWAIT_ACK, m.HEARTBEAT, m.SENT, m.SWITCH),
                (p, m.BYE): st.CLOSED, (p, m.ERROR): st.ERROR,
                (c, m.SWITCH): st.AWAIT_ACK, (c, m.ERROR): st.ERROR,
            },
            st.CLOSED: {},
            st.ERROR: {},
        },
    }


TRANSITIONS: Final[dict[Role, dict[State, dict[Event, State]]]] = _table()

# The lane's region: LANE, then the producer's SWITCH, then the consumer's (its answer).
_LANE: Final[dict[LanePhase, dict[Event, LanePhase]]] = {
    LanePhase.NONE: {(_PRODUCER, MsgType.LANE_OFFER): LanePhase.OFFERED},
    LanePhase.OFFERED: {(_PRODUCER, MsgType.SWITCH): LanePhase.SWITCHING},
    LanePhase.SWITCHING: {(_CONSUMER, MsgType.SWITCH): LanePhase.SWITCHED},
    LanePhase.SWITCHED: {},
}
LANE_TRANSITIONS: Final[dict[Role, dict[LanePhase, dict[Event, LanePhase]]]] = {
    _PRODUCER: _LANE, _CONSUMER: _LANE}
LANE_TYPES: Final = frozenset({MsgType.LANE_OFFER, MsgType.SWITCH})
INITIAL: Final[dict[Role, State]] = {_PRODUCER: State.AWAIT_HELLO, _CONSUMER: State.AWAIT_SETUP}
ENDED: Final = frozenset({State.CLOSED, State.ERROR})  # nothing more is read or said
# States, and lane phases, whose next event is a frame of our own, said before anything more
# is read: the SETUP answering a HELLO, the ATTACH answering a SETUP, the ack of a BYE, and
# the consumer's SWITCH answering the producer's.
DUE: Final = frozenset({State.SETUP_DUE, State.ATTACH_DUE, State.ACK_DUE})
LANE_DUE: Final[dict[Role, frozenset[LanePhase]]] = {
    _PRODUCER: frozenset(), _CONSUMER: frozenset({LanePhase.SWITCHING})}
PEER_OF: Final[dict[Role, Role]] = {_PRODUCER: _CONSUMER, _CONSUMER: _PRODUCER}


class Conversation:
    """The protocol state of one connection, seen from one side (``role``): its ``state``
    and its ``lane`` phase, moved by what it receives (``receive``) and what it sends
    (``send``), both checked against the same tables."""

    __slots__ = ("role", "peer", "state", "lane")

    def __init__(self, role: Role | str) -> None:
        try:
            self.role = Role(role)
        except ValueError:
            raise ValueError(f"role must be 'producer' or 'consumer', not {role!r}") from None
        self.peer = PEER_OF[self.role]
        self.state = INITIAL[self.role]
        self.lane = LanePhase.NONE

    def _next(self, sender: Role, t: MsgType) -> tuple[State, LanePhase] | str:
        """The states ``(sender, t)`` leads to, or why it is not allowed now."""
        event = (sender, t)
        nxt = TRANSITIONS[self.role][self.state].get(event)
        if nxt is None:
            return f"in state {self.state.value!r}"
        if t not in LANE_TYPES:
            return nxt, self.lane
        lane = LANE_TRANSITIONS[self.role][self.lane].get(event)
        if lane is None:
            return f"in state {self.state.value!r} with the lane {self.lane.value!r}"
        return nxt, lane

    def receive(self, msg: Message | MsgType) -> State:
        """Advance on a received message (or its type); return the new state. Raises
        ProtocolError naming the frame and the state for a message that is not allowed
        now (the state does not change)."""
        t = MsgType(msg if isinstance(msg, int) else msg.TYPE)
        if self.state in ENDED:
            how = "closed" if self.state is State.CLOSED else "ended with an error"
            raise ProtocolError(f"{t.name} received after the connection {how}")
        nxt = self._next(self.peer, t)
        if isinstance(nxt, str):
            raise ProtocolError(f"{t.name} is not allowed while the {self.role.value} is {nxt}")
        self.state, self.lane = nxt
        return self.state

    def may_send(self, t: MsgType) -> bool:
        return not isinstance(self._next(self.role, t), str)

    def send(self, t: MsgType) -> State:
        """Advance on a message this side sends; ProtocolError (a bug of ours, never the
        peer's) if the tables do not allow it now."""
        nxt = self._next(self.role, t)
        if isinstance(nxt, str):
            raise ProtocolError(f"the {self.role.value} may not send {t.name} {nxt}")
        self.state, self.lane = nxt
        return self.state

    def close(self) -> None:
        """Ended locally (connection dropped or closed): nothing more is read. An ERROR
        state stays."""
        if self.state is not State.ERROR:
            self.state = State.CLOSED

    def fail(self) -> None:
        """Ended by an error, whether or not an ERROR frame could be said."""
        self.state = State.ERROR
