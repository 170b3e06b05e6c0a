"""The consumer's session, frame in / frame out, with a fake clock (no sockets, no
processes, no sleeps): handshake, READY buffering and layout caching, FOREIGN before
FREADY, release batching, BYE and its ack, ERROR -> exception, send rules, liveness."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import pytest
import torch

from ipcsync.core import protocol as P
from ipcsync.core.consumer_session import (ConsumerSession, ForeignReceived, ForwardedReceived, HelloAgain,
                                           SetupReceived)
from ipcsync.core.layout import RecipeCache, plan_message
from ipcsync.core.liveness import Verdict
from ipcsync.core.protocol import MsgType, State
from ipcsync.core.remote_session import EdgeAddress
from ipcsync.errors import ConfigError, PeerLostError, ProducerFailedError, ProtocolError

SLOT = 1024
LAYOUT = plan_message({"x": torch.zeros(4)}, SLOT).layout


def frame(msg: Any) -> list[bytes]:
    return [P.encode(msg)]


def kind(data: bytes) -> int:
    return msgpack.unpackb(data)[0]


def hello() -> P.Hello:
    return P.Hello(P.PROTOCOL_VERSION, 10, 1, "boot", "ns", "cpu", None, 8, 1000)


def setup(slots: int = 4, heartbeat_ms: int = 1000, backend: str = "cpu") -> P.Setup:
    return P.Setup(P.PROTOCOL_VERSION, 99, 7, "ns", backend, None, ["arena"], [SLOT * slots],
                   [(0, i * SLOT, SLOT) for i in range(slots)], [f"ev{i}" for i in range(slots)], heartbeat_ms)


def ready(seq: int, slot: int = 0, layout_id: int = 1, layout: Any = LAYOUT) -> list[bytes]:
    return frame(P.Ready(seq, slot, seq, 0, layout_id, layout, {"i": seq}))


def active(slots: int = 4, heartbeat: float = 1.0, **limits: Any) -> ConsumerSession:
    s = ConsumerSession("ep", "cpu", heartbeat, dataclasses.replace(P.DEFAULT_LIMITS, **limits), now=0.0)
    assert kind(s.hello(hello())) == MsgType.HELLO
    ev = s.receive(frame(setup(slots)))
    assert isinstance(ev, SetupReceived) and s.validate_setup(ev.setup)
    assert kind(s.attach(ev.setup, ["r"] * slots)) == MsgType.ATTACH
    return s


def test_handshake_then_ready_items_are_buffered_in_order_with_the_layout_cached() -> None:
    s = active()
    assert s.state is State.ACTIVE and s.release_batch == 2 and s.clock.heartbeat == 1.0
    assert s.receive(ready(0)) is None
    assert s.receive(ready(1, slot=1, layout=None)) is None  # the layout travelled once
    (a, b) = s.ready
    assert (a[0], a[1], b[0], b[1]) == (0, 0, 1, 1) and a[5] is b[5] and len(s.recipes) == 1
    assert s.error is None


def test_ready_naming_an_unknown_layout_or_slot_is_a_protocol_error_with_an_error_frame() -> None:
    s = active()
    s.receive(ready(0, layout_id=5, layout=None))
    assert isinstance(s.error, ProtocolError) and "never sent" in str(s.error)
    (out,) = s.outbox
    assert kind(out) == MsgType.ERROR and msgpack.unpackb(out)[1] == "protocol"
    s2 = active(slots=2)
    s2.receive(ready(0, slot=2))
    assert "READY names slot 2; the ring has 2" in str(s2.error)


def test_recipe_cache_bounds_its_ids() -> None:
    cache = RecipeCache("READY", 2)
    cache.resolve(1, LAYOUT, SLOT)
    cache.resolve(2, LAYOUT, SLOT)
    cache.resolve(2, LAYOUT, SLOT)  # replacing an id is fine
    with pytest.raises(ProtocolError, match="over 2 layouts"):
        cache.resolve(3, LAYOUT, SLOT)
    assert cache.resolve(0, LAYOUT, SLOT) is not cache.resolve(0, LAYOUT, SLOT)  # 0: not cached
    with pytest.raises(ProtocolError, match="bad layout"):
        cache.resolve(4, LAYOUT, 8)  # does not fit
    cache.clear()
    assert cache.get(1) is None


def test_forward_ready_before_its_foreign_is_refused() -> None:
    s = active()
    s.receive(frame(P.ForwardReady(0, 0, 0, 0, 1, LAYOUT, None, 3, 0, 64)))
    assert "foreign arena 3, which was never described" in str(s.error)


def test_foreign_then_forward_ready_gives_events_and_checks_the_region() -> None:
    s = active()
    fmsg = P.Foreign(3, "cpu", None, 42, 1, "h", 4096)
    assert s.receive(frame(fmsg)) == ForeignReceived(fmsg)
    ev = s.receive(frame(P.ForwardReady(0, 1, 0, 0, 1, LAYOUT, "m", 3, 256, 256)))
    assert isinstance(ev, ForwardedReceived) and ev.msg.slot == 1 and s.foreign[3] == fmsg
    assert not s.ready  # the runtime buffers it, with its view
    s.receive(frame(P.ForwardReady(1, 1, 0, 0, 1, None, "m", 3, 4000, 256)))
    assert "lies outside foreign arena 3" in str(s.error)


def test_foreign_of_another_backend_is_refused() -> None:
    s = active()
    s.receive(frame(P.Foreign(0, "cuda", "GPU-x", 42, 1, b"h", 4096)))
    assert "forwards cuda memory to a cpu consumer" in str(s.error)


def test_releases_go_out_in_batches_of_at_most_max_release_batch() -> None:
    s = active(max_release_batch=3)
    assert s.release_frame() is None
    s.pending.extend((i, 0, i) for i in range(5))
    data, entries = s.release_frame()  # type: ignore[misc]
    assert len(entries) == 3 and msgpack.unpackb(data) == [MsgType.RELEASE, [[0, 0, 0], [1, 0, 1], [2, 0, 2]]]
    s.unsend_releases(entries)  # it could not go out: first in line again, in order
    data, entries = s.release_frame()  # type: ignore[misc]
    assert entries == [(0, 0, 0), (1, 0, 1), (2, 0, 2)]
    data, entries = s.release_frame()  # type: ignore[misc]
    assert len(entries) == 2
    assert s.release_frame() is None and not s.pending


def test_bye_from_the_producer_then_ours_then_its_ack() -> None:
    s = active()
    s.receive(ready(0))
    s.receive(frame(P.Bye("done")))
    assert s.bye_received and s.state is State.ENDING and not s.finished(holding=False)  # one buffered
    s.ready.clear()
    assert s.finished(holding=True) is False and s.finished(holding=False)
    assert kind(s.bye()) == MsgType.BYE and s.bye() is None  # once
    s.receive(frame(P.Bye("ack")))
    assert s.bye_acked


def test_items_after_our_bye_are_dropped_and_a_close_after_it_acks() -> None:
    s = active()
    s.bye()
    s.receive(ready(0))
    assert not s.ready
    assert s.disconnected() and not s.closed_by_peer() and s.bye_acked and s.error is None


def test_connection_closing_before_any_bye_loses_the_producer() -> None:
    s = active()
    assert s.disconnected() and s.closed_by_peer()
    assert isinstance(s.error, PeerLostError) and "pid 99" in str(s.error) and "disconnected" in str(s.error)


def test_reconnect_during_the_handshake_says_hello_again() -> None:
    s = ConsumerSession("ep", "cpu", 1.0)
    s.hello(hello())
    assert s.connected() is None
    assert not s.disconnected()
    assert kind(s.connected()) == MsgType.HELLO and s.connected() is None  # type: ignore[arg-type]


@pytest.mark.parametrize("code,exc", [("backend", ConfigError), ("host", ConfigError), ("credits", ConfigError),
                                      ("device", ConfigError), ("closing", PeerLostError),
                                      ("dropped", PeerLostError),
                                      ("uid", ProtocolError), ("protocol", ProtocolError)])
def test_error_codes_map_to_exceptions(code: str, exc: type) -> None:
    s = ConsumerSession("ep", "cpu", 1.0)
    s.hello(hello())
    s.receive(frame(P.Error(code, "no")))
    assert type(s.error) is exc and f"({code}): no" in str(s.error) and not s.outbox


def test_failed_after_setup_is_producer_failed_and_drops_what_is_buffered() -> None:
    s = active()
    s.receive(ready(0))
    s.receive(frame(P.Error("failed", "boom")))
    assert isinstance(s.error, ProducerFailedError) and "boom" in str(s.error) and not s.ready


def test_version_mismatch_and_out_of_state_messages_answer_with_their_code() -> None:
    s = ConsumerSession("ep", "cpu", 1.0)
    s.hello(hello())
    s.receive([msgpack.packb([MsgType.SETUP, P.HIGHEST_VERSION + 1])])
    assert msgpack.unpackb(s.outbox[0])[1] == "version"
    s2 = ConsumerSession("ep", "cpu", 1.0)
    s2.hello(hello())
    s2.receive(ready(0))  # READY before SETUP
    assert "not allowed" in str(s2.error) and msgpack.unpackb(s2.outbox[0])[1] == "protocol"
    s3 = active()
    s3.receive([b"a", b"b"])
    assert "2 frames" in str(s3.error)


def test_a_producer_refusing_our_version_is_asked_again_one_version_lower_down_to_the_oldest() -> None:
    s = ConsumerSession("ep", "cpu", 1.0)
    s.hello(dataclasses.replace(hello(), version=P.HIGHEST_VERSION + 1))
    for version in range(P.HIGHEST_VERSION, P.OLDEST_VERSION - 1, -1):
        ev = s.receive(frame(P.Error("version", "another version")))
        assert isinstance(ev, HelloAgain) and P.decode(ev.frame).version == version, ev
        assert s.state is State.AWAIT_SETUP and s.error is None
    s.receive(frame(P.Error("version", "another version")))  # (none older than OLDEST_VERSION)
    assert isinstance(s.error, ProtocolError) and "(version)" in str(s.error)


def test_setup_validation() -> None:
    s = ConsumerSession("ep", "cpu", 1.0)
    s.hello(hello())
    bad = dataclasses.replace(setup(), slots=[(0, 0, SLOT * 9)] * 4)
    assert not s.validate_setup(bad) and "slot 0 lies outside its arena" in str(s.error)
    s2 = ConsumerSession("ep", "cpu", 1.0)
    s2.hello(hello())
    assert not s2.validate_setup(setup(backend="cuda")) and isinstance(s2.error, ConfigError)
    # The refusal is classified by its code, which the producer is told too.
    (out,) = s2.outbox
    assert msgpack.unpackb(out)[1] == P.ErrorCode.BACKEND.value
    assert msgpack.unpackb(s.outbox[0])[1] == P.ErrorCode.SETUP.value and isinstance(s.error, ProtocolError)
    # A remote edge joins any two kinds of device (its transfer copies): a CUDA producer's
    # remote SETUP is valid for a CPU consumer.
    s3 = ConsumerSession("ep", "cpu", 1.0)
    s3.hello(hello())
    remote = EdgeAddress("gloo", "10.0.0.1", 5555, "ab12", "10.0.0.1").encode()
    assert s3.validate_setup(dataclasses.replace(setup(backend="cuda"), arenas=[remote])), s3.error


def test_send_rules() -> None:
    s = ConsumerSession("ep", "cpu", 1.0)
    assert not s.conv.may_send(MsgType.RELEASE)
    with pytest.raises(ProtocolError, match="may not send ATTACH"):
        s.attach(setup(), [])
    s.receive(frame(P.Bye("x")))  # a BYE before SETUP breaks the protocol: ERROR, then nothing
    assert "BYE is not allowed while the consumer is in state 'await_setup'" in str(s.error)
    assert [kind(f) for f in s.outbox] == [MsgType.ERROR] and s.state is State.ERROR
    with pytest.raises(ProtocolError, match="may not send HELLO"):
        s.hello(hello())
    s.fail(ProtocolError("late"), "protocol")
    assert len(s.outbox) == 1  # nothing more may be sent once ended


def test_liveness_stall_answer_heartbeat_and_loss_with_a_fake_clock() -> None:
    s = active(heartbeat=0.4)  # the producer's heartbeat: 1 s
    assert s.tick(0.0, False) == (Verdict.ALIVE, P.encode(P.Heartbeat()))  # nothing sent yet
    s.clock.spoke(0.0)
    assert s.tick(0.05, False) == (Verdict.ALIVE, None)
    assert s.tick(0.2, False)[1] is not None  # a quarter of ours passed
    s.clock.spoke(1.4)
    assert s.tick(1.4, False) == (Verdict.ALIVE, None)  # silent 1.4 s < 1.5 heartbeats
    assert s.tick(1.6, False)[0] is Verdict.STALLED and s.clock.stalled and s.clock.stalls == 1
    assert s.tick(1.7, False)[0] is Verdict.ALIVE
    s.clock.heard(1.8)
    assert s.tick(1.8, False)[0] is Verdict.ANSWERING and not s.clock.stalled
    assert s.tick(100.0, None)[0] is Verdict.STALLED  # cannot tell: silence is a stall, never a loss
    assert s.tick(100.1, True)[0] is Verdict.LOST and "exited" in str(s.error)
    assert s.tick(100.2, True) == (Verdict.ALIVE, None)  # once lost, nothing more


def test_after_its_bye_the_producer_is_not_judged_and_heartbeats_stop_at_ours() -> None:
    s = active(heartbeat=0.4)
    s.receive(frame(P.Bye("done")))
    assert not s.watching
    assert s.tick(50.0, None)[0] is Verdict.ALIVE and s.error is None
    assert s.tick(50.0, None)[1] is not None  # still holding items: keep looking alive
    s.bye()
    assert s.tick(60.0, None) == (Verdict.ALIVE, None)


def test_no_heartbeats_without_ours_and_none_before_setup() -> None:
    s = ConsumerSession("ep", "cpu", 0.0)
    s.hello(hello())
    assert s.tick(10.0, None) == (Verdict.ALIVE, None)
    s.receive(frame(setup()))
    s.attach(setup(), ["r"] * 4)
    assert s.tick(20.0, False)[1] is None


def test_release_batch_is_at_least_two_and_at_most_half_the_ring() -> None:
    from ipcsync.core.consumer_session import release_batch_for

    assert [release_batch_for(n) for n in (1, 2, 3, 4, 8, 16, 64)] == [1, 1, 1, 2, 2, 4, 16]
    for n in range(1, 200):
        assert 1 <= release_batch_for(n) <= max(1, n // 2)


def test_dropped_by_a_remote_producer_is_peer_lost_with_items_still_buffered() -> None:
    # A remote producer drops a consumer that was silent (paused) past the loss rule and
    # says so: the READYs it had sent before arrive first, then the ERROR; the session is
    # broken and what it had buffered is dropped, never served.
    s = active()
    assert s.receive(ready(0)) is None and s.receive(ready(1, slot=1, layout=None)) is None
    s.receive(frame(P.Error("dropped", "this consumer was dropped (silent for 1.6 s)")))
    assert type(s.error) is PeerLostError and "(dropped)" in str(s.error)
    assert not s.ready


# --------------------------------------------------------------------------- the steady path
def test_receive_frames_buffers_the_steady_readies_and_leaves_the_rest_in_order() -> None:
    s = active()
    s.receive(ready(0))  # layout 1 travels once
    frames = [ready(1, 1, layout=None)[0], ready(2, 2, layout=None)[0],
              ready(3, 3, layout_id=2)[0],  # a new layout: not the steady path
              ready(4, 0, layout=None)[0]]
    assert s.receive_frames(frames, 5.0) == 2
    assert s.clock.last_recv == 5.0
    assert [e[0] for e in s.ready] == [0, 1, 2]
    for f in frames[2:]:  # the runtime hands the rest to receive, in order
        assert s.receive([f]) is None
    assert [s.take_ready()[0] for _ in range(5)] == [0, 1, 2, 3, 4]
    with pytest.raises(IndexError):
        s.take_ready()
    assert s.error is None


def test_receive_frames_leaves_an_unknown_layout_or_a_bad_slot_to_receive() -> None:
    s = active(slots=2)
    assert s.receive_frames([ready(0, layout=None)[0]], 1.0) == 0  # layout 1 was never sent
    s.receive([ready(0, layout=None)[0]])
    assert "never sent" in str(s.error)
    s = active(slots=2)
    s.receive(ready(0))
    assert s.receive_frames([ready(1, 5, layout=None)[0]], 1.0) == 0  # slot 5 of 2
    s.receive([ready(1, 5, layout=None)[0]])
    assert "names slot 5" in str(s.error)


def test_receive_frames_takes_nothing_after_our_bye_or_an_error() -> None:
    s = active()
    s.receive(ready(0))
    s.take_ready()
    s.bye()
    assert s.receive_frames([ready(1, layout=None)[0]], 1.0) == 0 and s.buffered() == 0
    s = active()
    s.fail(ProtocolError("x"), None)
    assert s.receive_frames([ready(1)[0]], 1.0) == 0


def test_taken_entries_can_be_requeued_and_buffered_items_given_back_at_close() -> None:
    s = active()
    for i in range(3):
        s.receive(ready(i, i))
    first = s.take_ready()
    s.requeue(first)  # its data was not ready in time: first in line again
    assert s.buffered() == 3 and s.take_ready() is first
    s.queue_release((0, 0, 0))
    s.give_back_buffered()  # close(): the rest are released unseen, in order
    assert s.buffered() == 0 and s.pending == [(0, 0, 0), (1, 1, 1), (2, 2, 2)]
    data, entries = s.release_frame(7.0)  # type: ignore[misc]
    assert entries == [(0, 0, 0), (1, 1, 1), (2, 2, 2)] and s.clock.last_send == 7.0
