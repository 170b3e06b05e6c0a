"""Sessions are a boundary: the runtime and the facades change a session's state (its
fields, queues and liveness clock) only through the session's methods. Checked on the
source tree, and on the producer's peer table with a fake clock: what it sends tells the
session through ``spoke(now)`` at the tick's time, which decides when a heartbeat is due."""

from __future__ import annotations

import ast
import logging
from pathlib import Path
from typing import Any

from ipcsync.core import protocol as P
from ipcsync.core.producer_session import Kind, ProducerSession
from ipcsync.core.protocol import State
from ipcsync.core.ratelog import RateLog
from ipcsync.core.ring import Ring
from ipcsync.runtime.producer.peers import Peer, PeerTable

PKG = Path(__file__).resolve().parents[2] / "ipcsync"
MUTATORS = {"append", "appendleft", "extend", "extendleft", "pop", "popleft", "clear", "remove", "add",
            "discard", "update", "insert", "setdefault", "rotate", "sort"}
# Writes that are still to become session methods (each named exactly, so that a new one
# anywhere fails this test): none left.
PENDING: set[tuple[str, str]] = set()


def _through_session(node: ast.expr) -> bool:
    """``node`` (an attribute or item) lies inside a session or a liveness clock."""
    n = node.value if isinstance(node, (ast.Attribute, ast.Subscript)) else node
    while isinstance(n, (ast.Attribute, ast.Subscript)):
        if isinstance(n, ast.Attribute) and n.attr in ("session", "clock"):
            return True
        n = n.value
    return False


def _writes(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[ast.expr] = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for t in targets:
            for e in t.elts if isinstance(t, ast.Tuple) else [t]:
                if isinstance(e, (ast.Attribute, ast.Subscript)) and _through_session(e):
                    out.append(ast.unparse(node))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in MUTATORS and _through_session(node.func)):
            out.append(ast.unparse(node))
    return out


def test_runtime_and_facades_write_no_session_or_clock_state() -> None:
    found = []
    for path in sorted([*PKG.joinpath("runtime").rglob("*.py"), *PKG.glob("*.py")]):
        rel = str(path.relative_to(PKG))
        found += [f"{rel}: {w}" for w in _writes(path) if (rel, w) not in PENDING]
    assert not found, "session state written from outside the session:\n" + "\n".join(found)


class FakeChannel:
    """The producer's ZeroMQ channel as the peer table uses it: every send goes out."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def send(self, identity: bytes, frame: bytes) -> bool:
        self.sent.append(frame)
        return True


def _heartbeats(chan: FakeChannel) -> int:
    return sum(isinstance(P.decode(f), P.Heartbeat) for f in chan.sent if f != b"item")


def _table_with_one_consumer() -> tuple[PeerTable, Peer, FakeChannel]:
    hello = P.Hello(version=P.PROTOCOL_VERSION, pid=1234, start_time=5, boot_id="b", pid_ns="ns",
                    backend="cpu", device=None, credits=2, heartbeat_ms=1000)
    setup = P.Setup(version=P.PROTOCOL_VERSION, pid=1, start_time=1, pid_ns="ns", backend="cpu", device=None,
                    arenas=[b"a"], arena_bytes=[256], slots=[(0, 0, 256)], ready_events=[b"r"], heartbeat_ms=1000)
    session = ProducerSession(b"id", hello, 0.0, heartbeat=1.0)  # ours: 1 s, so due after 0.25 s of silence
    session.setup(setup)
    assert session.receive_frame(P.encode(P.Attach([b"e0"])), 0.0).kind is Kind.ATTACHED
    assert session.state is State.ACTIVE
    chan = FakeChannel()
    table = PeerTable(chan, "t", Ring(1, "shard"), RateLog(logging.getLogger("t")), lambda peer: None)
    peer = Peer(session, -1, None)
    table.add(peer)
    return table, peer, chan


def test_what_the_table_sends_defers_the_heartbeat_by_the_clock_the_tick_is_given() -> None:
    table, peer, chan = _table_with_one_consumer()
    table.send(peer, b"item")
    table.tick(0.3)  # spoke since the last tick: at 0.3 as far as the session knows
    assert _heartbeats(chan) == 0
    table.tick(0.5)
    assert _heartbeats(chan) == 0
    table.tick(0.6)  # silent for 0.3 s > a quarter of our heartbeat
    assert _heartbeats(chan) == 1
    table.tick(0.7)  # the heartbeat itself counts as speaking
    table.tick(0.9)
    assert _heartbeats(chan) == 1
    table.tick(1.0)
    assert _heartbeats(chan) == 2
    table.close()


def test_a_consumer_that_items_flow_to_gets_no_heartbeat() -> None:
    table, peer, chan = _table_with_one_consumer()
    for i in range(1, 8):  # (until 1.4 s: the consumer, silent since 0, is not stalled yet)
        table.send(peer, b"item")
        table.tick(i * 0.2)
    assert _heartbeats(chan) == 0
    table.close()
