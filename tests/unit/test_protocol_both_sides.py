"""Both parties of one connection against each other, sans I/O.

``protocol.MACHINES`` holds one machine per sender and ``protocol.JOINT`` the joint
rules; each process runs the same ``Conversation`` over both. Here two of them, one per
process, are driven against each other:

- the conformance check: every frame one side may send, in any joint state it can reach,
  is accepted by the other side's copy in every joint state that side can be in when the
  frame arrives (frames travel in order, and cross: an exhaustive walk over both
  conversations with up to ``DEPTH`` frames in flight each way);
- every entry of every table (each machine, each joint rule, the lane region) is taken by
  that walk (no transition is dead);
- a ``ProducerSession`` wired to a ``ConsumerSession`` (the frames out of one go into the
  other, no sockets) is driven along a shortest walk to every transition, and both
  sessions follow the conversations step by step;
- in every state either session can reach, each frame its conversation refuses is refused
  by the session that receives it: a ProtocolError naming the frame, its sender and the
  state, an ERROR frame back, which ends the other session too.
"""

from __future__ import annotations

import copy
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import pytest
import torch

from ipcsync.core import protocol as P
from ipcsync.core.consumer_session import (ConsumerSession, ForeignReceived, ForwardedReceived, LaneOffered,
                                           SentReceived, SetupReceived, SwitchReceived)
from ipcsync.core.layout import plan_message
from ipcsync.core.producer_session import Kind, ProducerSession
from ipcsync.core.protocol import LanePhase, MsgType, Role, State
from ipcsync.errors import ProtocolError

PRODUCER, CONSUMER = Role.PRODUCER, Role.CONSUMER
DEPTH = 2  # frames in flight each way in the walk (the consumer's HELLO starts it)

# ------------------------------------------------------------------ the walk over both conversations
# A configuration: each process's conversation and the frame types in flight to each role.
Side = tuple[State, State, LanePhase, tuple[P.Event, ...]]  # a conversation as data


@dataclass(frozen=True)
class Config:
    producer: Side
    consumer: Side
    to_producer: tuple[MsgType, ...]
    to_consumer: tuple[MsgType, ...]

    def conv(self, role: Role) -> P.Conversation:
        c = P.Conversation(role)
        c.state, c.peer_state, c.lane, unread = self.producer if role is PRODUCER else self.consumer
        c.unread = list(unread)
        return c

    def to(self, role: Role) -> tuple[MsgType, ...]:
        return self.to_producer if role is PRODUCER else self.to_consumer


# An action: (role that acts, "send", "recv" or "drop", message type).
Action = tuple[Role, str, MsgType]
# A table entry a step takes: ("send", sender, its state, type), ("read", reader, its
# state, (sender, type)) for a joint rule, or ("lane", phase, (sender, type)).
Entry = tuple[Any, ...]


def _data(c: P.Conversation) -> Side:
    return c.state, c.peer_state, c.lane, tuple(c.unread)


def _put(cfg: Config, role: Role, c: P.Conversation, to_me: tuple[MsgType, ...],
         to_peer: tuple[MsgType, ...]) -> Config:
    if role is PRODUCER:
        return Config(_data(c), cfg.consumer, to_me, to_peer)
    return Config(cfg.producer, _data(c), to_peer, to_me)


START = Config((State.AWAIT_HELLO, State.AWAIT_SETUP, LanePhase.NONE, ()),
               (State.AWAIT_SETUP, State.AWAIT_HELLO, LanePhase.NONE, ((CONSUMER, MsgType.HELLO),)),
               (MsgType.HELLO,), ())


def moves(cfg: Config) -> Iterator[tuple[Action, Config, list[Entry]]]:
    """Every action possible in ``cfg``: (action, next config, the table entries it takes).
    A receipt the reader's conversation refuses raises AssertionError: that is a
    conformance failure."""
    for role in Role:
        me = cfg.conv(role)
        to_me, to_peer = cfg.to(role), cfg.to(P.PEER_OF[role])
        if me.state in P.ENDED:  # it reads nothing more: what reaches it is dropped
            if to_me:
                yield (role, "drop", to_me[0]), _put(cfg, role, me, to_me[1:], to_peer), []
            continue
        lane_due = me.lane in P.LANE_DUE[role]
        due = me.state in P.DUE or lane_due
        for t in P.MACHINES[role][me.state]:
            # (HELLO is said once, at the start; a HELLO said again after a reconnect is the
            # same HELLO, which the producer's session ignores: test_producer_session.)
            if t is MsgType.HELLO or (lane_due and t is not MsgType.SWITCH) or not me.may_send(t):
                continue
            if len(to_peer) >= DEPTH and not due:
                continue
            c = copy.deepcopy(me)
            c.send(t)
            taken: list[Entry] = [("send", role, me.state, t)]
            if t in P.LANE_TYPES:
                taken.append(("lane", me.lane, (role, t)))
            yield (role, "send", t), _put(cfg, role, c, to_me, to_peer + (t,)), taken
        if to_me and not due:  # a side whose frame is due says it before it reads on
            t = to_me[0]
            c = copy.deepcopy(me)
            try:
                c.receive(t)
            except ProtocolError as exc:
                raise AssertionError(f"the {role.value} refuses {t.name}, which the {P.PEER_OF[role].value} "
                                     f"may send: {exc}; {cfg}") from None
            event = (P.PEER_OF[role], t)
            taken = [("read", role, me.state, event)] if event in P.JOINT else []
            if t in P.LANE_TYPES:
                taken.append(("lane", me.lane, event))
            yield (role, "recv", t), _put(cfg, role, c, to_me[1:], to_peer), taken


@dataclass
class Walk:
    """Every configuration reachable from START, with a shortest path to each."""

    parent: dict[Config, tuple[Config, Action] | None] = field(default_factory=dict)
    # table entry -> (a configuration where it is taken, the action that takes it)
    taken: dict[Entry, tuple[Config, Action]] = field(default_factory=dict)

    def path(self, cfg: Config) -> list[Action]:
        out: list[Action] = []
        link = self.parent[cfg]
        while link is not None:
            cfg, action = link
            out.append(action)
            link = self.parent[cfg]
        return out[::-1]


def walk() -> Walk:
    w = Walk(parent={START: None})
    todo = deque([START])
    while todo:
        cfg = todo.popleft()
        for action, nxt, entries in moves(cfg):
            for entry in entries:
                w.taken.setdefault(entry, (cfg, action))
            if nxt not in w.parent:
                w.parent[nxt] = (cfg, action)
                todo.append(nxt)
    return w


_WALK: Walk | None = None


def the_walk() -> Walk:
    global _WALK
    if _WALK is None:
        _WALK = walk()
    return _WALK


def test_every_frame_one_side_may_send_is_accepted_by_the_other() -> None:
    w = the_walk()  # (moves asserts on every receipt)
    ends = {(c.producer[0], c.consumer[0]) for c in w.parent if not c.to_producer and not c.to_consumer}
    # Both ways of saying goodbye end cleanly, and so does an error from either side.
    assert (State.CLOSED, State.CLOSED) in ends
    assert (State.ERROR, State.ERROR) in ends
    # No configuration is stuck: something can always happen until both sides ended.
    for cfg in w.parent:
        if not (cfg.producer[0] in P.ENDED and cfg.consumer[0] in P.ENDED and not cfg.to_producer
                and not cfg.to_consumer):
            assert next(moves(cfg), None) is not None, cfg


def test_both_processes_start_from_the_same_states_and_agree_on_their_own() -> None:
    """The same machines in both processes: each side's own state, as its own process
    holds it, is where the other process's copy arrives once the frames in flight are read."""
    assert START.producer[:2] == START.consumer[1::-1] == (State.AWAIT_HELLO, State.AWAIT_SETUP)
    for cfg in the_walk().parent:
        if cfg.to_producer or cfg.to_consumer:
            continue
        p, c = cfg.conv(PRODUCER), cfg.conv(CONSUMER)
        if P.ENDED & {p.state, c.state}:
            continue
        # Nothing in flight, neither ended: the copy of the peer, in a side that still
        # reads, is the peer once the peer's frames show which of ours it read (all of
        # them, here). (A side whose own frame is due reads nothing: its copy may lag.)
        for me, peer in ((p, c), (c, p)):
            if me.state in P.DEAF:
                continue
            seen = me.peer_state
            for event in me.unread:
                seen = P.JOINT[event].get(seen, seen)
            assert seen is peer.state, cfg
        assert p.lane is c.lane, cfg


def test_every_entry_of_every_table_is_taken() -> None:
    taken = set(the_walk().taken)
    sends = {("send", role, state, t) for role, states in P.MACHINES.items()
             for state, table in states.items() for t in table}
    # (HELLO again, to a producer of the older version or after a reconnect, is outside
    # the walk: test_consumer_session and test_producer_session.)
    assert sends - taken == {("send", CONSUMER, State.AWAIT_SETUP, MsgType.HELLO)}
    reads = {("read", P.PEER_OF[sender], state, (sender, t)) for (sender, t), rule in P.JOINT.items()
             for state in rule}
    assert reads - taken == set()
    lanes = {("lane", phase, event) for phase, table in P.LANE_TRANSITIONS.items() for event in table}
    assert lanes - taken == set()


def test_the_steady_paths_check_per_wake_up_is_the_conversations_check() -> None:
    """The sessions' steady paths take a wake-up's data frames after one check of the
    reader's state (``ConsumerSession.receive_frames``: ACTIVE; ``ProducerSession.
    release_frames``: ACTIVE; ``ConsumerSession.release_frame``: the states whose machine
    sends RELEASE). A data frame moves no state and has no joint rule, so that check is
    the conversation's for every frame of the batch: here, in every configuration."""
    releasing = {s for s, sends in P.MACHINES[CONSUMER].items() if MsgType.RELEASE in sends}
    for cfg in the_walk().parent:
        for role, data in ((CONSUMER, MsgType.READY), (PRODUCER, MsgType.RELEASE)):
            conv = cfg.conv(role)
            if conv.state in P.ENDED or conv.state in P.DUE:
                continue
            if conv.state is State.ACTIVE:
                after = copy.deepcopy(conv)
                assert after.receive(data) is State.ACTIVE and after.lane is conv.lane, cfg
            elif not _refuses(conv, data):  # (taken by ``receive`` one by one: dropped after our BYE)
                assert (role, conv.state) in {(CONSUMER, State.BYE_SENT), (PRODUCER, State.BYE_SENT)}, cfg
        consumer = cfg.conv(CONSUMER)
        assert (consumer.state in releasing) is consumer.may_send(MsgType.RELEASE)


# ------------------------------------------------------------------ the two sessions, wired
SLOTS = 2
SLOT = 1024
LAYOUT = plan_message({"x": torch.zeros(4)}, SLOT).layout
HELLO = P.Hello(P.PROTOCOL_VERSION, 10, 1, "boot", "ns", "cpu", None, 8, 1000)
SETUP = P.Setup(P.PROTOCOL_VERSION, 99, 7, "ns", "cpu", None, ["arena"], [SLOT * SLOTS],
                [(0, i * SLOT, SLOT) for i in range(SLOTS)], [f"ev{i}" for i in range(SLOTS)], 1000)
FOREIGN = P.Foreign(3, "cpu", None, 42, 1, "h", 4096)
# A frame of each type (for the ones the table refuses).
SAMPLE: dict[MsgType, P.Message] = {
    MsgType.HELLO: P.Hello(P.PROTOCOL_VERSION, 11, 1, "boot", "ns", "cpu", None, 8, 1000),  # not the first
    MsgType.SETUP: SETUP,
    MsgType.ATTACH: P.Attach(["r"] * SLOTS),
    MsgType.READY: P.Ready(0, 0, 0, 0, 0, LAYOUT, None),
    MsgType.RELEASE: P.Release([(0, 0, 0)]),
    MsgType.HEARTBEAT: P.Heartbeat(),
    MsgType.BYE: P.Bye("test"),
    MsgType.ERROR: P.Error("protocol", "test"),
    MsgType.FOREIGN: FOREIGN,
    MsgType.FORWARD_READY: P.ForwardReady(0, 0, 0, 0, 0, LAYOUT, None, 3, 0, 256),
    MsgType.SENT: P.Sent(0),
    MsgType.LANE_OFFER: P.LaneOffer("/tmp/ipcsync-test.lane", b"t" * P.LANE_TOKEN_BYTES),
    MsgType.SWITCH: P.Switch(),
}


class Wire:
    """A ProducerSession and a ConsumerSession joined by two in-order queues of frames."""

    def __init__(self) -> None:
        self.now = 0.0
        self.seq = 0
        self.c = ConsumerSession("ep", "cpu", 1.0, now=0.0)
        self.p: ProducerSession | None = None
        self.to_c: deque[list[bytes]] = deque()
        self.to_p: deque[list[bytes]] = deque([[self.c.hello(HELLO)]])
        self.ack: bytes | None = None  # the producer's ack, made as it read the BYE
        self.answer: bytes | None = None  # the consumer's SWITCH, made as it read the producer's
        self.setup: P.Setup | None = None

    def side(self, role: Role) -> tuple[State, LanePhase]:
        """``role``'s state and lane phase as the table names them. A session makes a due
        frame as it reads what makes it due (the ack of a BYE, the answer to a SWITCH), so
        while that frame is in hand, not yet sent, the table's due state is the one before it."""
        if role is PRODUCER:
            if self.p is None:
                return State.AWAIT_HELLO, LanePhase.NONE
            state, lane = self.p.conv.state, self.p.conv.lane
            if self.ack is not None:
                assert state is State.CLOSED
                state = State.ACK_DUE
            return state, lane
        state, lane = self.c.conv.state, self.c.conv.lane
        if self.answer is not None:
            assert lane is LanePhase.SWITCHED
            lane = LanePhase.SWITCHING
        return state, lane

    # ---------------------------------------------------------------- sends, through each session's API
    def producer_says(self, t: MsgType) -> list[bytes]:
        p = self.p
        assert p is not None
        self.seq += 1
        if t is MsgType.SETUP:
            return [p.setup(SETUP)]
        if t is MsgType.LANE_OFFER:
            return [p.lane_offer("/tmp/ipcsync-test.lane", b"t" * P.LANE_TOKEN_BYTES)]
        if t is MsgType.SWITCH:
            return [p.switch()]
        if t is MsgType.HEARTBEAT:
            self.now += 100.0
            frame = p.heartbeat(self.now)
            assert frame is not None
            p.spoke(self.now)
            return [frame]
        if t is MsgType.READY:  # (the runtime encodes items itself, once the session allows it)
            p.check_send(t)
            return [P.encode(P.Ready(self.seq, 0, self.seq, 0, 0, LAYOUT, None))]
        if t is MsgType.FOREIGN:
            p.check_send(t)
            return [P.encode(FOREIGN)]
        if t is MsgType.FORWARD_READY:  # (its arena is described first: FOREIGN is allowed wherever FREADY is)
            p.check_send(MsgType.FOREIGN)
            p.check_send(t)
            return [P.encode(FOREIGN), P.encode(P.ForwardReady(self.seq, 0, self.seq, 0, 0, LAYOUT, None, 3, 0, 256))]
        if t is MsgType.SENT:
            return [p.sent(self.seq)]
        if t is MsgType.BYE:
            if self.ack is not None:
                frame, self.ack = self.ack, None
                return [frame]
            frame = p.bye("producer closed")
            assert frame is not None
            return [frame]
        assert t is MsgType.ERROR
        reply = p.bad_frame(ProtocolError("the test ends this connection")).reply
        assert reply is not None
        return [reply]

    def consumer_says(self, t: MsgType) -> list[bytes]:
        c = self.c
        self.seq += 1
        if t is MsgType.ATTACH:
            assert self.setup is not None
            return [c.attach(self.setup, ["r"] * SLOTS)]
        if t is MsgType.RELEASE:
            c.queue_release((self.seq, 0, self.seq))
            out = c.release_frame()
            assert out is not None
            return [out[0]]
        if t is MsgType.HEARTBEAT:
            self.now += 100.0
            _verdict, frame = c.tick(self.now, False)
            if c.state is State.AWAIT_SETUP:
                # (Ours heartbeats from its ATTACH on; a consumer may before, as the raw
                # peers of test_faults do: the table's send, said by hand.)
                assert frame is None
                c.conv.send(t)
                return [P.encode(P.Heartbeat())]
            assert frame is not None
            c.clock.spoke(self.now)
            return [frame]
        if t is MsgType.SWITCH:
            assert self.answer is not None
            frame, self.answer = self.answer, None
            return [frame]
        if t is MsgType.BYE:
            frame = c.bye()
            assert frame is not None
            return [frame]
        assert t is MsgType.ERROR
        c.fail(ProtocolError("the test ends this connection"), P.ErrorCode.PROTOCOL)
        return [c.outbox.pop()]

    def send(self, role: Role, t: MsgType) -> None:
        if role is PRODUCER:
            self.to_c.append(self.producer_says(t))
        else:
            self.to_p.append(self.consumer_says(t))

    # ---------------------------------------------------------------- receipts
    def to_producer(self, frame: bytes) -> Any:
        if self.p is None:
            hello = P.decode(frame)
            assert isinstance(hello, P.Hello)
            self.p = ProducerSession(b"consumer", hello, self.now, 1.0)
            return None
        ev = self.p.receive_frame(frame, self.now)
        if ev.kind is Kind.GOODBYE:
            self.ack = ev.reply
        return ev

    def to_consumer(self, frame: bytes) -> Any:
        ev = self.c.receive([frame])
        if isinstance(ev, SetupReceived):
            assert self.c.validate_setup(ev.setup), self.c.error
            self.setup = ev.setup
        elif isinstance(ev, SwitchReceived):
            self.answer = ev.frame
        return ev

    def deliver(self, role: Role) -> None:
        frames = (self.to_p if role is PRODUCER else self.to_c).popleft()
        if self.side(role)[0] in P.ENDED:
            return  # (the runtime reads nothing more from an ended connection)
        for frame in frames:
            ev = self.to_producer(frame) if role is PRODUCER else self.to_consumer(frame)
            if role is PRODUCER:
                assert ev is None or ev.kind is not Kind.BAD_FRAME, ev.data
            else:
                assert isinstance(ev, (type(None), SetupReceived, SwitchReceived, LaneOffered, SentReceived,
                                       ForeignReceived, ForwardedReceived)), ev
                if P.decode(frame).TYPE != MsgType.ERROR:
                    assert self.c.error is None, self.c.error

    def act(self, action: Action) -> None:
        role, what, t = action
        if what == "send":
            self.send(role, t)
        else:
            self.deliver(role)  # ("drop": delivered to an ended side, which reads nothing)


def replay(path: list[Action]) -> Wire:
    """Drive two wired sessions along ``path``; after each step, each session's state and
    lane phase are its conversation's in the walk, and (no due frame in hand) each
    session's conversation is the walk's."""
    wire = Wire()
    cfg = START
    for action in path:
        cfg = next(nxt for a, nxt, _entries in moves(cfg) if a == action)
        wire.act(action)
        assert (wire.side(PRODUCER), wire.side(CONSUMER)) == (
            (cfg.producer[0], cfg.producer[2]), (cfg.consumer[0], cfg.consumer[2])), (action, path)
        if wire.p is not None and wire.ack is None and wire.answer is None:
            assert (_data(wire.p.conv), _data(wire.c.conv)) == (cfg.producer, cfg.consumer), (action, path)
    return wire


def _name(x: Any) -> str:
    if isinstance(x, tuple):
        return "-".join(_name(y) for y in x)
    return x.name if isinstance(x, MsgType) else str(getattr(x, "value", x))


def _entries() -> list[Any]:
    return [pytest.param(entry, id=_name(entry)) for entry in sorted(the_walk().taken, key=repr)]


@pytest.mark.parametrize("entry", _entries())
def test_wired_sessions_follow_the_conversations_to_every_transition(entry: Any) -> None:
    cfg, action = the_walk().taken[entry]
    replay(the_walk().path(cfg) + [action])


def _refuses(c: P.Conversation, t: MsgType) -> bool:
    try:
        copy.deepcopy(c).receive(t)
    except ProtocolError:
        return True
    return False


def _reachable_sides() -> list[Any]:
    """Every conversation of a side that reads in some configuration (its state, its copy
    of the peer's, the lane), with a shortest path there."""
    w = the_walk()
    seen: dict[tuple[Role, State, State, LanePhase], Config] = {}
    for cfg in w.parent:  # (BFS order: the first is the nearest)
        for role in Role:
            state, peer_state, lane, _unread = cfg.producer if role is PRODUCER else cfg.consumer
            if state in P.ENDED or state in P.DUE or lane in P.LANE_DUE[role]:
                continue
            if role is PRODUCER and state is State.AWAIT_HELLO:
                continue  # (a producer session begins with the HELLO: test_producer_session)
            seen.setdefault((role, state, peer_state, lane), cfg)
    return [pytest.param(role, cfg, id=f"{role.value}-{state.value}-{peer_state.value}-{lane.value}")
            for (role, state, peer_state, lane), cfg in seen.items()]


@pytest.mark.parametrize("role,cfg", _reachable_sides())
def test_a_frame_the_conversation_refuses_is_a_protocol_error_naming_frame_sender_and_state(
        role: Role, cfg: Config) -> None:
    path = the_walk().path(cfg)
    conv = cfg.conv(role)
    state, lane, peer = conv.state, conv.lane, P.PEER_OF[role]
    refused = [t for t in MsgType if _refuses(conv, t)]
    assert refused
    for t in refused:
        wire = replay(path)
        frame = P.encode(SAMPLE[t])
        if role is PRODUCER:
            assert wire.p is not None
            bad = wire.p.receive_frame(frame, wire.now)
            assert bad.kind is Kind.BAD_FRAME and bad.reply is not None, (t, bad)
            message, reply = str(bad.data), bad.reply
        else:
            ev = wire.c.receive([frame])
            assert ev is None and isinstance(wire.c.error, ProtocolError), (t, ev, wire.c.error)
            message = str(wire.c.error).split(" broke the protocol: ", 1)[1]  # (after the producer's name)
            (reply,) = wire.c.outbox
        assert t.name in message and repr(state.value) in message and peer.value in message, message
        phases = [phase for phase, table in P.LANE_TRANSITIONS.items() if (peer, t) in table]
        if phases:
            unlaned = copy.deepcopy(conv)
            unlaned.lane = phases[0]
            if not _refuses(unlaned, t):
                assert repr(lane.value) in message, message  # the lane refused it
        assert wire.side(role)[0] is State.ERROR
        # The ERROR frame ends the other side too, when it reads it (it reads nothing more
        # once ended; a producer still unaware of the consumer has no conversation yet).
        err = P.decode(reply)
        assert isinstance(err, P.Error) and err.code == P.ErrorCode.PROTOCOL.value
        if wire.side(peer)[0] not in P.ENDED | P.DUE | {State.AWAIT_HELLO}:
            if peer is PRODUCER:
                assert wire.p is not None and wire.p.receive_frame(reply, wire.now).kind is Kind.PEER_ERROR
            else:
                wire.c.receive([reply])
                assert wire.c.error is not None
            assert wire.side(peer)[0] is State.ERROR


def test_a_whole_session_item_by_item_with_a_lane_and_both_goodbyes() -> None:
    """The common path, spelled out: handshake, lane, items, releases, the producer's BYE
    first, the consumer's releases and BYE, the ack."""
    wire = Wire()
    wire.deliver(PRODUCER)  # HELLO
    for t in (MsgType.SETUP, MsgType.LANE_OFFER):
        wire.send(PRODUCER, t)
    wire.deliver(CONSUMER)
    wire.send(CONSUMER, MsgType.ATTACH)
    wire.deliver(CONSUMER)  # LANE
    wire.deliver(PRODUCER)  # ATTACH
    assert wire.side(PRODUCER) == (State.ACTIVE, LanePhase.OFFERED)
    for t in (MsgType.SWITCH, MsgType.READY, MsgType.READY, MsgType.BYE):
        wire.send(PRODUCER, t)
    for _ in range(4):
        wire.deliver(CONSUMER)
    assert wire.side(CONSUMER) == (State.ENDING, LanePhase.SWITCHING) and len(wire.c.ready) == 2
    wire.send(CONSUMER, MsgType.SWITCH)
    assert wire.c.switched and wire.side(CONSUMER)[1] is LanePhase.SWITCHED
    wire.c.ready.clear()
    wire.send(CONSUMER, MsgType.RELEASE)
    assert wire.c.finished(holding=False)
    wire.send(CONSUMER, MsgType.BYE)
    assert wire.c.bye_sent and wire.c.bye_received and not wire.c.bye_acked
    for _ in range(3):
        wire.deliver(PRODUCER)
    assert wire.p is not None and wire.p.switch_received and wire.p.bye_received
    wire.send(PRODUCER, MsgType.BYE)  # the ack
    wire.deliver(CONSUMER)
    assert wire.side(CONSUMER)[0] is State.CLOSED and wire.side(PRODUCER)[0] is State.CLOSED  # (bye_acked)
