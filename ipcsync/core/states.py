"""The ipcsync wire protocol's state machine, sans-IO, in h11's shape: one machine per
*sender* (``MACHINES``: which frames a party may send in each of its states, and where
each leads), the joint rules (``JOINT``: what a frame does to the party that reads it;
``LANE_TRANSITIONS``: the lane region, which both parties share) and ``Conversation``,
which holds both parties' states and checks every frame against them. Both processes of
a connection run the same ``Conversation`` from the same initial states; each fact of the
protocol is written once. The conversation itself: ``ipcsync.core.protocol``.

Why the joint rules are keyed by the frame read, not by the pair of states (h11's
STATE_TRIGGERED_TRANSITIONS): frames cross in flight. A frame changes its reader when the
reader reads it; the sender cannot know when that is, so in the sender's process the
effect waits in ``Conversation.unread`` and is applied to the reader's copy only when a
frame of the reader's needs it (the reader had read it before saying that frame). Data
frames (READY, RELEASE, ...) have no joint rule: they never wait there.
"""

from __future__ import annotations

from enum import Enum
from typing import Final

from ..errors import ProtocolError
from .messages import Message, MsgType

__all__ = [
    "Role", "State", "LanePhase", "Event", "MACHINES", "DATA_TYPES", "JOINT", "DEAF", "LANE_TRANSITIONS", "LANE_TYPES",
    "INITIAL", "ENDED", "DUE", "LANE_DUE", "PEER_OF", "Conversation",
]


class Role(str, Enum):
    """The two parties of a connection. A ``str`` enum: roles compare equal to their names."""

    PRODUCER = "producer"
    CONSUMER = "consumer"


class State(str, Enum):
    """Where one party stands (see ``MACHINES``; ``JOINT`` moves it on what it reads). A
    ``str`` enum: states compare equal to their names. The goodbye is part of the state:
    who said BYE first decides what may still come."""

    AWAIT_HELLO = "await_hello"  # producer: connected, nothing said yet
    SETUP_DUE = "setup_due"  # producer: HELLO read; SETUP (or ERROR) is its next frame
    AWAIT_ATTACH = "await_attach"  # producer: SETUP sent, waiting for the release events
    AWAIT_SETUP = "await_setup"  # consumer: its HELLO said (or about to be)
    ATTACH_DUE = "attach_due"  # consumer: SETUP read; ATTACH (or ERROR) is its next frame,
    #                            once its memory is open
    ACTIVE = "active"  # items flow
    ENDING = "ending"  # consumer: the producer said BYE; it releases what it holds, then says BYE
    BYE_SENT = "bye_sent"  # its BYE went first: the producer awaits the consumer's releases and
    #                        BYE; the consumer awaits the producer's acknowledging BYE
    AWAIT_ACK = "await_ack"  # consumer: its BYE answered the producer's; the ack is due
    ACK_DUE = "ack_due"  # producer: the consumer said BYE; its acknowledging BYE is the next frame
    CLOSED = "closed"  # both BYEs exchanged (or closed locally): nothing more is read
    ERROR = "error"  # ended by an ERROR (sent or read) or a frame that broke the protocol


class LanePhase(str, Enum):
    """The lane's region of the state machine (``LANE_TRANSITIONS``), shared by both
    parties: LANE and SWITCH must be allowed by their sender's machine and by this."""

    NONE = "none"  # on ZeroMQ, no lane offered
    OFFERED = "offered"  # the producer's LANE said
    SWITCHING = "switching"  # the producer's SWITCH said; the consumer's answering SWITCH is due
    SWITCHED = "switched"  # both SWITCHes: every later frame travels on the lane


# An event: a frame's type and who sends it.
Event = tuple[Role, MsgType]
_PRODUCER: Final = Role.PRODUCER
_CONSUMER: Final = Role.CONSUMER


def _stay(state: State, *types: MsgType) -> dict[MsgType, State]:
    return {t: state for t in types}


# --------------------------------------------------------------------------- the machines
# One machine per sender (h11's EVENT_TRIGGERED_TRANSITIONS): MACHINES[role][its state][a
# type it sends] -> its next state. A frame absent from its sender's table in the sender's
# state is a violation: the peer's (refused when read) or ours (refused when sent).
_S, _M = State, MsgType
_PRODUCER_SENDS: Final[dict[State, dict[MsgType, State]]] = {
    _S.AWAIT_HELLO: {},  # (a refused HELLO is answered by an ERROR outside any conversation)
    _S.SETUP_DUE: {_M.SETUP: _S.AWAIT_ATTACH, _M.ERROR: _S.ERROR},
    _S.AWAIT_ATTACH: {**_stay(_S.AWAIT_ATTACH, _M.LANE_OFFER, _M.SWITCH, _M.HEARTBEAT),
                      _M.BYE: _S.BYE_SENT, _M.ERROR: _S.ERROR},
    _S.ACTIVE: {**_stay(_S.ACTIVE, _M.READY, _M.FOREIGN, _M.FORWARD_READY, _M.SWITCH, _M.HEARTBEAT, _M.SENT),
                _M.BYE: _S.BYE_SENT, _M.ERROR: _S.ERROR},
    # (SENT after BYE: a remote edge confirms its last sends once they complete.)
    _S.BYE_SENT: {**_stay(_S.BYE_SENT, _M.SWITCH, _M.HEARTBEAT, _M.SENT), _M.ERROR: _S.ERROR},
    _S.ACK_DUE: {_M.BYE: _S.CLOSED},
    _S.CLOSED: {},
    _S.ERROR: {},
}
_CONSUMER_SENDS: Final[dict[State, dict[MsgType, State]]] = {
    # (HELLO again: the same one after a reconnect, or one of the older version. A consumer
    # may heartbeat while it waits: ours starts at its ATTACH.)
    _S.AWAIT_SETUP: {**_stay(_S.AWAIT_SETUP, _M.HELLO, _M.HEARTBEAT), _M.ERROR: _S.ERROR},
    _S.ATTACH_DUE: {_M.ATTACH: _S.ACTIVE, _M.ERROR: _S.ERROR},
    _S.ACTIVE: {**_stay(_S.ACTIVE, _M.RELEASE, _M.HEARTBEAT, _M.SWITCH), _M.BYE: _S.BYE_SENT, _M.ERROR: _S.ERROR},
    _S.ENDING: {**_stay(_S.ENDING, _M.RELEASE, _M.HEARTBEAT, _M.SWITCH), _M.BYE: _S.AWAIT_ACK, _M.ERROR: _S.ERROR},
    # After its BYE a consumer holds nothing; a SWITCH is still answered (the ack may come
    # on the lane).
    _S.BYE_SENT: {_M.SWITCH: _S.BYE_SENT, _M.ERROR: _S.ERROR},
    _S.AWAIT_ACK: {_M.SWITCH: _S.AWAIT_ACK, _M.ERROR: _S.ERROR},
    _S.CLOSED: {},
    _S.ERROR: {},
}
MACHINES: Final[dict[Role, dict[State, dict[MsgType, State]]]] = {
    _PRODUCER: _PRODUCER_SENDS, _CONSUMER: _CONSUMER_SENDS}
# Invariant: the data frames move no state (a self-loop of their sender's machine, no joint
# rule), so the sessions' steady paths check a wake-up's READYs or RELEASEs once, by state.
DATA_TYPES: Final = frozenset({MsgType.READY, MsgType.FOREIGN, MsgType.FORWARD_READY, MsgType.RELEASE,
                               MsgType.HEARTBEAT, MsgType.SENT})
INITIAL: Final[dict[Role, State]] = {_PRODUCER: State.AWAIT_HELLO, _CONSUMER: State.AWAIT_SETUP}
ENDED: Final = frozenset({State.CLOSED, State.ERROR})  # nothing more is read or said
# States, and lane phases, whose next event is a frame of the party's own, said before it
# reads anything more: the SETUP answering a HELLO, the ATTACH answering a SETUP, the ack
# of a BYE, and the consumer's SWITCH answering the producer's.
DUE: Final = frozenset({State.SETUP_DUE, State.ATTACH_DUE, State.ACK_DUE})
LANE_DUE: Final[dict[Role, frozenset[LanePhase]]] = {
    _PRODUCER: frozenset(), _CONSUMER: frozenset({LanePhase.SWITCHING})}
# States in which a party reads only the frames whose joint rule names that state: its own
# frame is due, or (the producer's start) only a HELLO begins the conversation.
DEAF: Final = DUE | {State.AWAIT_HELLO}
PEER_OF: Final[dict[Role, Role]] = {_PRODUCER: _CONSUMER, _CONSUMER: _PRODUCER}


# --------------------------------------------------------------------------- the joint rules
# What a frame does to the party that reads it: JOINT[(sender, type)][reader's state] ->
# the reader's next state. A frame with a joint rule is read only in the states it names
# (elsewhere it is a violation); a frame without one leaves its reader's state alone.
def _ended_by_error(reader: Role) -> dict[State, State]:
    """An ERROR ends its reader in every state in which it reads at all."""
    return {s: State.ERROR for s in MACHINES[reader] if s not in ENDED | DEAF}


JOINT: Final[dict[Event, dict[State, State]]] = {
    # The handshake: each frame makes the reader's answer due.
    (_CONSUMER, _M.HELLO): {_S.AWAIT_HELLO: _S.SETUP_DUE},
    (_PRODUCER, _M.SETUP): {_S.AWAIT_SETUP: _S.ATTACH_DUE},
    # (An ATTACH may cross the producer's BYE: the consumer then releases and says BYE.)
    (_CONSUMER, _M.ATTACH): {_S.AWAIT_ATTACH: _S.ACTIVE, _S.BYE_SENT: _S.BYE_SENT},
    # The goodbye. The consumer's BYE is always acknowledged: the producer's next frame.
    (_CONSUMER, _M.BYE): {_S.ACTIVE: _S.ACK_DUE, _S.BYE_SENT: _S.ACK_DUE},
    # The producer's BYE ends the stream, or acknowledges the consumer's BYE (which ends it).
    (_PRODUCER, _M.BYE): {_S.ACTIVE: _S.ENDING, _S.BYE_SENT: _S.CLOSED, _S.AWAIT_ACK: _S.CLOSED},
    (_CONSUMER, _M.ERROR): _ended_by_error(_PRODUCER),
    (_PRODUCER, _M.ERROR): _ended_by_error(_CONSUMER),
}

# The lane's region, one table for both parties: LANE, then the producer's SWITCH, then
# the consumer's (its answer); LANE_TRANSITIONS[phase][(sender, type)] -> next phase.
LANE_TRANSITIONS: Final[dict[LanePhase, dict[Event, LanePhase]]] = {
    LanePhase.NONE: {(_PRODUCER, MsgType.LANE_OFFER): LanePhase.OFFERED},
    LanePhase.OFFERED: {(_PRODUCER, MsgType.SWITCH): LanePhase.SWITCHING},
    LanePhase.SWITCHING: {(_CONSUMER, MsgType.SWITCH): LanePhase.SWITCHED},
    LanePhase.SWITCHED: {},
}
LANE_TYPES: Final = frozenset({MsgType.LANE_OFFER, MsgType.SWITCH})


class Conversation:
    """One connection's protocol state, held by one party (``role``) and the same in both
    processes: ``state`` (ours), ``peer_state`` (the peer's machine, as far as its frames
    have shown), the shared ``lane`` phase, and ``unread``: the frames we said that carry a
    joint rule and that the peer's frames have not yet shown it read (oldest first).

    ``send`` applies a frame of ours to our machine; ``receive`` applies a peer's frame to
    the peer's machine (first applying to it those of ``unread`` it needs: the peer read
    them before it said this), then its joint rule to us."""

    __slots__ = ("role", "peer", "state", "peer_state", "lane", "unread")

    def __init__(self, role: Role | str) -> None:
        try:
            self.role = Role(role)
        except ValueError:
            raise ValueError(f"role must be 'producer' or 'consumer', not {role!r}") from None
        self.peer = PEER_OF[self.role]
        self.state = INITIAL[self.role]
        self.peer_state = INITIAL[self.peer]
        self.lane = LanePhase.NONE
        self.unread: list[Event] = []  # (bounded: only handshake, goodbye and error frames)

    @property
    def states(self) -> dict[Role, State]:
        """Both parties' states, by role (h11's ``ConnectionState.states``)."""
        return {self.role: self.state, self.peer: self.peer_state}

    def _where(self, t: MsgType) -> str:
        return f"{t.name} is not allowed while the {self.role.value} is in state {self.state.value!r}"

    def _heard(self, t: MsgType) -> tuple[State, State, LanePhase, int] | str:
        """What reading the peer's ``t`` leads to: (our state, the peer's, the lane, how
        many of ``unread`` the peer had read), or why it is not allowed now."""
        peer, state, lane = self.peer, self.state, self.lane
        sends, unread = MACHINES[peer], self.unread
        peer_state, read = self.peer_state, 0
        peer_next = sends[peer_state].get(t)
        while peer_next is None and read < len(unread):
            # (A frame of ours its joint rule does not name was refused or ignored there.)
            peer_state = JOINT[unread[read]].get(peer_state, peer_state)
            read += 1
            peer_next = sends[peer_state].get(t)
        if peer_next is None:
            return f"{self._where(t)}: the {peer.value} may not send it in state {peer_state.value!r}"
        event = (peer, t)
        rule = JOINT.get(event)
        if rule is not None:
            nxt = rule.get(state)
            if nxt is None:
                names = ", ".join(repr(s.value) for s in rule)
                return f"{self._where(t)}: the {peer.value}'s {t.name} is read only in state {names}"
        elif state in DEAF:
            reads = [e[1].name for e, r in JOINT.items() if e[0] is peer and state in r]
            return f"{self._where(t)}: in that state it reads {', '.join(reads) or 'nothing'} from the {peer.value}"
        else:
            nxt = state
        if t in LANE_TYPES:
            nxt_lane = LANE_TRANSITIONS[lane].get(event)
            if nxt_lane is None:
                return (f"{self._where(t)} with the lane {lane.value!r}: the {peer.value}'s {t.name} does not move the "
                        "lane from there (the producer's LANE, then its SWITCH, then the consumer's)")
            lane = nxt_lane
        return nxt, peer_next, lane, read

    def receive(self, msg: Message | MsgType) -> State:
        """Advance on a message read from the peer (or its type); return our new state.
        Raises ProtocolError naming the frame, its sender and the states for a message
        that is not allowed now (nothing changes)."""
        t = MsgType(msg if isinstance(msg, int) else msg.TYPE)
        if self.state in ENDED:
            how = "closed" if self.state is State.CLOSED else "ended with an error"
            raise ProtocolError(f"{t.name} from the {self.peer.value} received after the connection {how}")
        nxt = self._heard(t)
        if isinstance(nxt, str):
            raise ProtocolError(nxt)
        self.state, self.peer_state, self.lane, read = nxt
        if read:
            del self.unread[:read]
        return self.state

    def _said(self, t: MsgType) -> tuple[State, LanePhase] | str:
        """Where our ``t`` leads (our state, the lane), or why we may not send it now."""
        nxt = MACHINES[self.role][self.state].get(t)
        if nxt is None:
            return f"in state {self.state.value!r}"
        if t not in LANE_TYPES:
            return nxt, self.lane
        lane = LANE_TRANSITIONS[self.lane].get((self.role, t))
        if lane is None:
            return f"in state {self.state.value!r} with the lane {self.lane.value!r}"
        return nxt, lane

    def may_send(self, t: MsgType) -> bool:
        return not isinstance(self._said(t), str)

    def send(self, t: MsgType) -> State:
        """Advance on a message this side sends; ProtocolError (a bug of ours, never the
        peer's) if our machine does not allow it now."""
        nxt = self._said(t)
        if isinstance(nxt, str):
            raise ProtocolError(f"the {self.role.value} may not send {t.name} {nxt}")
        self.state, self.lane = nxt
        event = (self.role, t)
        if event in JOINT:
            self.unread.append(event)
        return self.state

    def close(self) -> None:
        """Ended locally (connection dropped or closed): nothing more is read. An ERROR
        state stays."""
        if self.state is not State.ERROR:
            self.state = State.CLOSED

    def fail(self) -> None:
        """Ended by an error, whether or not an ERROR frame could be said."""
        self.state = State.ERROR
