"""Unit tests of the liveness rule as data (ipcsync.core.liveness), with a fake clock:
``now`` is a number the test moves; nothing sleeps.

The rule (shared/DESIGN.md): a peer silent for more than STALL_FACTOR of its heartbeat is
stalled, and answering again once heard; it is LOST only when its process is provably gone
(never for silence, never when we cannot say); a peer without a heartbeat is never stalled;
we owe a heartbeat after a quarter of ours without speaking; silence is not watched once
the connection closed (or the peer said goodbye).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ipcsync.core.liveness import (
    HANDSHAKE_S,
    SEND_FRACTION,
    STALL_FACTOR,
    PeerClock,
    Verdict,
    handshake_overdue,
    stall_change,
)

HB = 2.0  # the peer's heartbeat in these tests
T0 = 1000.0  # the fake clock's start


def clock(heartbeat: float = HB, ours: float = 1.0) -> PeerClock:
    return PeerClock(heartbeat=heartbeat, ours=ours, last_recv=T0)


# --------------------------------------------------------------------------- stall_change
def test_stall_factor_is_one_and_a_half_heartbeats() -> None:
    assert STALL_FACTOR == 1.5
    assert stall_change(False, 1.5 * HB, HB) is None  # exactly 1.5 heartbeats: not yet
    assert stall_change(False, 1.5 * HB + 1e-6, HB) is True
    assert stall_change(True, 1.5 * HB + 1, HB) is None  # already stalled: no change
    assert stall_change(True, 0.0, HB) is False  # heard again
    assert stall_change(False, 0.0, HB) is None


@pytest.mark.parametrize("silent", [0.0, 10.0, 1e9])
def test_no_heartbeat_never_stalls(silent: float) -> None:
    assert stall_change(False, silent, 0.0) is None
    assert stall_change(True, silent, 0.0) is False  # a peer that stops heartbeating is not held stalled


@settings(max_examples=300, deadline=None, database=None)
@given(stalled=st.booleans(), silent=st.floats(0, 1e6), heartbeat=st.floats(0.01, 1e3))
def test_stall_change_is_exactly_the_threshold(stalled: bool, silent: float, heartbeat: float) -> None:
    should = silent > STALL_FACTOR * heartbeat
    got = stall_change(stalled, silent, heartbeat)
    assert got == (should if should != stalled else None)


# --------------------------------------------------------------------------- PeerClock.tick
def test_silent_for_more_than_one_and_a_half_heartbeats_is_stalled_then_answering() -> None:
    c = clock()
    assert c.tick(T0 + 1.5 * HB, process_gone=False) is Verdict.ALIVE
    assert not c.stalled
    assert c.tick(T0 + 1.5 * HB + 0.01, process_gone=False) is Verdict.STALLED
    assert c.stalled and c.stalls == 1
    # Still silent: reported once, not again at every tick.
    assert c.tick(T0 + 100 * HB, process_gone=False) is Verdict.ALIVE
    assert c.stalled and c.stalls == 1
    c.heard(T0 + 100 * HB)
    assert c.tick(T0 + 100 * HB + 0.1, process_gone=False) is Verdict.ANSWERING
    assert not c.stalled and c.stalls == 1
    assert c.tick(T0 + 100 * HB + 0.2, process_gone=False) is Verdict.ALIVE


def test_stalls_counts_every_fall_into_silence() -> None:
    c = clock()
    now = T0
    for k in range(1, 4):
        now += 2 * HB
        assert c.tick(now, process_gone=False) is Verdict.STALLED
        c.heard(now)
        assert c.tick(now, process_gone=False) is Verdict.ANSWERING
        assert c.stalls == k


def test_a_peer_heard_in_time_stays_alive() -> None:
    c = clock()
    for k in range(1, 50):
        now = T0 + k * HB  # heard once per heartbeat: never 1.5 heartbeats of silence
        assert c.tick(now, process_gone=False) is Verdict.ALIVE
        c.heard(now)
    assert c.stalls == 0


@pytest.mark.parametrize("stalled_first", [False, True])
def test_process_gone_is_lost_whatever_the_silence(stalled_first: bool) -> None:
    c = clock()
    if stalled_first:
        assert c.tick(T0 + 10 * HB, process_gone=False) is Verdict.STALLED
    assert c.tick(T0 + 10 * HB + 1, process_gone=True) is Verdict.LOST
    assert clock().tick(T0, process_gone=True) is Verdict.LOST  # even just heard
    assert clock().tick(T0 + 1e9, process_gone=True, watching_silence=False) is Verdict.LOST


@pytest.mark.parametrize("silent", [0.0, 1.0, 1.5 * HB + 1, 1e6])
def test_unknown_process_state_is_never_lost(silent: float) -> None:
    """None (no watch, /proc unreadable) means "cannot say": never death, only stalls."""
    c = clock()
    verdict = c.tick(T0 + silent, process_gone=None)
    assert verdict is not Verdict.LOST
    assert verdict is (Verdict.STALLED if silent > STALL_FACTOR * HB else Verdict.ALIVE)
    assert c.tick(T0 + silent + 1e6, process_gone=None) is not Verdict.LOST


@pytest.mark.parametrize("gone", [False, None])
def test_peer_without_heartbeat_is_never_stalled(gone: bool | None) -> None:
    c = clock(heartbeat=0.0)
    for silent in (0.0, 1.0, 1e3, 1e9):
        assert c.tick(T0 + silent, process_gone=gone) is Verdict.ALIVE
    assert not c.stalled and c.stalls == 0


@pytest.mark.parametrize("gone", [False, None])
def test_silence_is_not_watched_when_the_connection_closed(gone: bool | None) -> None:
    c = clock()
    assert c.tick(T0 + 1e6, process_gone=gone, watching_silence=False) is Verdict.ALIVE
    assert not c.stalled and c.stalls == 0
    # Were it watched, the same silence would count.
    assert c.tick(T0 + 1e6, process_gone=gone) is Verdict.STALLED


def test_silence_stops_counting_for_a_stalled_peer_whose_connection_closed() -> None:
    c = clock()
    assert c.tick(T0 + 10 * HB, process_gone=False) is Verdict.STALLED
    assert c.tick(T0 + 20 * HB, process_gone=False, watching_silence=False) is Verdict.ALIVE
    assert c.stalled  # unchanged: only hearing it or losing it changes that


def test_silent_for_measures_from_the_last_time_heard() -> None:
    c = clock()
    assert c.silent_for(T0 + 3.0) == 3.0
    c.heard(T0 + 2.0)
    assert c.silent_for(T0 + 3.0) == 1.0


# --------------------------------------------------------------------------- heartbeat_due
def test_heartbeat_due_after_a_quarter_of_ours() -> None:
    assert SEND_FRACTION == 0.25
    ours = 4.0
    c = clock(ours=ours)
    assert c.heartbeat_due(T0), "never spoke: due at once"
    c.spoke(T0)
    assert not c.heartbeat_due(T0 + ours * 0.25)  # exactly a quarter: not yet
    assert c.heartbeat_due(T0 + ours * 0.25 + 1e-6)
    c.spoke(T0 + 1.0)  # any frame we send counts, not only heartbeats
    assert not c.heartbeat_due(T0 + 1.0 + ours * 0.25)
    assert c.heartbeat_due(T0 + 1.0 + ours * 0.25 + 1e-6)


def test_heartbeat_due_ignores_what_we_hear() -> None:
    c = clock(ours=4.0)
    c.spoke(T0)
    c.heard(T0 + 1.5)
    assert c.heartbeat_due(T0 + 1.01)
    assert c.heartbeat_due(T0 + 2.0)


@pytest.mark.parametrize("silent", [0.0, 1.0, 1e9])
def test_no_heartbeat_of_ours_is_never_due(silent: float) -> None:
    c = clock(ours=0.0)
    assert not c.heartbeat_due(T0 + silent)
    c.spoke(T0)
    assert not c.heartbeat_due(T0 + silent)


def test_a_quarter_heartbeat_keeps_the_peer_well_inside_its_stall_limit() -> None:
    """Both sides with the same heartbeat: the sender's longest silence (a quarter) is far
    below the receiver's stall limit (one and a half)."""
    assert SEND_FRACTION < STALL_FACTOR


# --------------------------------------------------------------------------- handshake
def test_handshake_overdue_after_the_limit() -> None:
    assert not handshake_overdue(T0 + HANDSHAKE_S, T0)
    assert handshake_overdue(T0 + HANDSHAKE_S + 1e-6, T0)
    assert not handshake_overdue(T0 + 5.0, T0, limit=5.0)
    assert handshake_overdue(T0 + 5.1, T0, limit=5.0)
    assert not handshake_overdue(T0, T0)
