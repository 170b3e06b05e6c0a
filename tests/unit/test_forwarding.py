"""The forwarding producer's bookkeeping (core.forwarding): foreign ids and the ledger."""

from __future__ import annotations

from typing import Any

from ipcsync.core.forwarding import ForeignRegistry, Forwarded, ForwardLedger


def test_foreign_ids_are_reused_only_when_idle_least_recently_used_first() -> None:
    reg = ForeignRegistry(2)
    a = reg.arena_for("a", lambda fid: b"A%d" % fid)
    b = reg.arena_for("b", lambda fid: b"B%d" % fid)
    assert (a.fid, a.version, b.fid) == (0, 0, 1)
    assert reg.arena_for("a", lambda fid: b"x") is a  # known: same entry, no new frame
    a.outstanding = b.outstanding = 1
    assert reg.arena_for("c", lambda fid: b"C") is None  # every id has items in flight
    b.outstanding = 0
    c = reg.arena_for("c", lambda fid: b"C%d" % fid)
    assert (c.fid, c.version, c.frame) == (1, 1, b"C1") and "b" not in reg.by_key


def _ledger_with(slot: int = 0) -> tuple[ForwardLedger[Any], Forwarded]:
    reg = ForeignRegistry(4)
    led: ForwardLedger[Any] = ForwardLedger(2)
    fwd = Forwarded("item", "origin", "stream", reg.arena_for("k", lambda fid: b"F"))
    led.hold(slot, fwd)
    led.published(slot)
    return led, fwd


def test_release_waits_for_incomplete_events_in_host_mode() -> None:
    led, fwd = _ledger_with()
    done = {"ev1": False}
    waits = [("peer1", "ev1")]
    assert led.freed(0, waits, lambda w: done[w[1]], host=True) is None
    assert led.pending == {0: waits} and fwd.foreign.outstanding == 1
    assert led.poll(lambda w: True, lambda w: done[w[1]]) == []
    done["ev1"] = True
    ready = led.poll(lambda w: True, lambda w: done[w[1]])
    assert ready == [(0, waits)]
    assert led.finish(0, waits) == (fwd, waits)
    assert not led.pending and fwd.foreign.outstanding == 0 and led.count() == 0


def test_gpu_mode_finishes_at_once() -> None:
    led, fwd = _ledger_with()
    assert led.freed(0, [("p", "e")], lambda w: False, host=False) == (fwd, [("p", "e")])


def test_a_lost_holder_is_never_waited_on() -> None:
    led, _ = _ledger_with()
    led.freed(0, [("lost", "e1"), ("live", "e2")], lambda w: False, host=True)
    ready = led.poll(lambda w: w[0] == "live", lambda w: w[1] == "e2")
    assert ready == [(0, [("live", "e2")])]


def test_freed_after_abandon_does_nothing() -> None:
    led, _ = _ledger_with()
    assert led.finish(0, []) is not None
    assert led.freed(0, [], lambda w: True, host=True) is None
    assert list(led.outstanding_slots()) == []
