"""The producer's session, frame in / frame out, with a fake clock (no sockets, no sleeps)."""

from __future__ import annotations

import pytest

from ipcsync.core import protocol as P
from ipcsync.core.liveness import HANDSHAKE_S, Verdict
from ipcsync.core.producer_session import Kind, ProducerSession
from ipcsync.core.protocol import State
from ipcsync.errors import ProtocolError


def hello(hb_ms: int = 1000) -> P.Hello:
    return P.Hello(version=P.PROTOCOL_VERSION, pid=1234, start_time=5, boot_id="b", pid_ns="ns",
                   backend="cpu", device=None, credits=2, heartbeat_ms=hb_ms)


SETUP = P.Setup(version=P.PROTOCOL_VERSION, pid=1, start_time=1, pid_ns="ns", backend="cpu", device=None,
                arenas=[b"a"], arena_bytes=[256], slots=[(0, 0, 256)], ready_events=[b"r"], heartbeat_ms=1000)


def set_up(identity: bytes = b"id", now: float = 0.0, hb_ms: int = 1000) -> ProducerSession:
    """A session that answered its consumer's HELLO with SETUP."""
    s = ProducerSession(identity, hello(hb_ms), now, heartbeat=1.0)
    s.setup(SETUP)
    return s


def attached(now: float = 0.0, hb_ms: int = 1000) -> ProducerSession:
    s = set_up(now=now, hb_ms=hb_ms)
    ev = s.receive_frame(P.encode(P.Attach([b"e0", b"e1"])), now)
    assert ev.kind is Kind.ATTACHED and s.state is State.ACTIVE
    return s


def test_hello_then_setup_then_attach() -> None:
    s = ProducerSession(b"id", hello(), 0.0, heartbeat=1.0)
    assert s.state is State.SETUP_DUE
    with pytest.raises(ProtocolError, match="may not send READY in state 'setup_due'"):
        s.check_send(P.MsgType.READY)
    assert isinstance(P.decode(s.setup(SETUP)), P.Setup)
    assert s.state is State.AWAIT_ATTACH
    ev = s.receive(P.Attach([b"e"]), 1.0)
    assert ev.kind is Kind.ATTACHED and s.state is State.ACTIVE


def test_duplicate_hello_while_awaiting_attach_is_ignored() -> None:
    s = set_up()
    assert s.receive(hello(), 1.0).kind is Kind.NOTHING
    assert s.state is State.AWAIT_ATTACH


def test_hello_when_active_is_a_bad_frame_answered_by_error() -> None:
    s = attached()
    ev = s.receive(hello(), 1.0)
    assert ev.kind is Kind.BAD_FRAME and isinstance(ev.data, ProtocolError)
    err = P.decode(ev.reply)
    assert isinstance(err, P.Error) and err.code == "protocol"
    assert s.state is State.ERROR  # ended by the broken frame


def test_garbage_frame_is_a_bad_frame() -> None:
    ev = attached().receive_frame(b"\x00garbage", 1.0)
    assert ev.kind is Kind.BAD_FRAME and ev.reply is not None


def test_release_fast_path_only_when_active() -> None:
    s = set_up()
    frame = P.encode(P.Release([(0, 0, 1)]))
    assert s.release_entries(frame, 1.0) is None  # not attached yet
    s = attached()
    assert s.release_entries(frame, 2.0) == [(0, 0, 1)]
    assert s.clock.last_recv == 2.0


def test_bye_received_is_acknowledged_and_our_bye_is_said_once() -> None:
    s = attached()
    assert isinstance(P.decode(s.bye("closing")), P.Bye)
    assert s.bye("again") is None
    s = attached()
    ev = s.receive(P.Bye("done"), 1.0)
    assert ev.kind is Kind.GOODBYE and isinstance(P.decode(ev.reply), P.Bye)
    assert s.bye_received and s.bye("late") is None and s.state is State.CLOSED


def test_sends_follow_the_table() -> None:
    s = attached()
    s.receive(P.Bye("done"), 1.0)
    with pytest.raises(ProtocolError):
        s.check_send(P.MsgType.READY)


def test_attach_with_wrong_number_of_events_is_refused() -> None:
    s = set_up()
    s.receive(P.Attach([b"e"]), 0.0)
    bad = s.attach_problem(1, 4)
    assert bad is not None and bad.kind is Kind.BAD_FRAME and "4 slots" in str(bad.data)
    assert s.state is State.ERROR  # ended by the broken frame
    assert set_up(b"id2").attach_problem(4, 4) is None


def test_layouts_and_foreign_arenas_sent_once_per_version() -> None:
    s = attached()
    assert s.needs_layout(3, 7) and not s.needs_layout(3, 7)
    assert s.needs_layout(3, 8)  # the id was reassigned
    assert s.needs_layout(0, 0) and s.needs_layout(0, 0)  # no id: always inline
    assert s.needs_foreign(1, 0) and not s.needs_foreign(1, 0) and s.needs_foreign(1, 1)


def test_stall_and_answer_again_with_a_fake_clock() -> None:
    s = attached(now=0.0, hb_ms=1000)
    assert s.tick(1.4, False) == (Verdict.ALIVE, "")
    assert s.tick(1.6, False)[0] is Verdict.STALLED
    assert s.tick(5.0, False)[0] is Verdict.ALIVE  # still stalled: reported once
    s.receive(P.Heartbeat(), 5.1)
    assert s.tick(5.2, False)[0] is Verdict.ANSWERING
    assert s.clock.stalls == 1


def test_silence_never_loses_a_live_peer_but_exit_does() -> None:
    s = attached(now=0.0)
    assert s.tick(1e6, False)[0] is Verdict.STALLED
    assert s.tick(1e6 + 1, None)[0] is Verdict.ALIVE  # cannot say: never a death
    assert s.tick(1e6 + 2, True) == (Verdict.LOST, "process exited")


def test_disconnected_peer_silence_does_not_count() -> None:
    s = attached(now=0.0)
    assert s.tick(100.0, False, watching_silence=False)[0] is Verdict.ALIVE


def test_handshake_overdue_only_before_attach() -> None:
    s = set_up(now=10.0, hb_ms=0)
    assert s.tick(10.0 + HANDSHAKE_S - 1, False)[0] is Verdict.ALIVE
    verdict, why = s.tick(10.0 + HANDSHAKE_S + 1, False)
    assert verdict is Verdict.LOST and "no ATTACH" in why
    s = attached(now=10.0, hb_ms=0)
    assert s.tick(10.0 + HANDSHAKE_S + 1, False)[0] is Verdict.ALIVE
    assert s.tick(100.0, False, handshake_s=0.5)[0] is Verdict.ALIVE


def test_heartbeat_due_a_quarter_of_ours_after_we_spoke() -> None:
    s = attached()
    assert s.heartbeat(0.0) is not None  # never spoke
    s.spoke(10.0)
    assert s.heartbeat(10.2) is None
    assert isinstance(P.decode(s.heartbeat(10.3)), P.Heartbeat)
    quiet = ProducerSession(b"id", hello(), 0.0, heartbeat=0.0)
    assert quiet.heartbeat(100.0) is None


def test_the_consumer_may_hold_slots_while_items_flow_and_after_our_bye() -> None:
    # (The runtime keeps a disconnected consumer's slots held while its process lives
    # exactly when it may hold some: PeerTable.on_disconnect.)
    s = set_up()
    assert not s.may_hold and not s.bye_sent
    s.receive(P.Attach([b"e"]), 1.0)
    assert s.may_hold
    assert s.bye("closing") is not None and s.state is State.BYE_SENT
    assert s.may_hold and s.bye_sent and not s.bye_received
    s.receive(P.Release([(0, 0, 0)]), 2.0)  # its releases still come
    ev = s.receive(P.Bye("done"), 3.0)
    assert ev.kind is Kind.GOODBYE and s.state is State.CLOSED
    assert not s.may_hold and s.bye_received


def test_a_consumer_heartbeating_before_its_attach_is_kept() -> None:
    # (A peer may open the producer's memory slowly and heartbeat meanwhile: alive, not
    # attached, never a bad frame: test_faults' during-setup rows.)
    s = set_up()
    assert s.receive_frame(P.encode(P.Heartbeat()), 1.0).kind is Kind.NOTHING
    assert s.state is State.AWAIT_ATTACH and s.clock.last_recv == 1.0
