"""IPCSYNC_SPIN_US: the bounded spin before a blocking wait sleeps (runtime.waiting)."""

from __future__ import annotations

import pytest

from ipcsync import limits
from ipcsync.runtime.waiting import spin_seconds


def test_default_spin_when_unset_or_blank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("IPCSYNC_SPIN_US", raising=False)
    assert spin_seconds() == limits.DEFAULT_SPIN_US / 1e6
    monkeypatch.setenv("IPCSYNC_SPIN_US", " ")
    assert spin_seconds() == limits.DEFAULT_SPIN_US / 1e6


@pytest.mark.parametrize("raw, seconds", [("0", 0.0), ("50", 50e-6), (str(limits.MAX_SPIN_US), limits.MAX_SPIN_US / 1e6)])
def test_spin_from_the_environment(monkeypatch: pytest.MonkeyPatch, raw: str, seconds: float) -> None:
    monkeypatch.setenv("IPCSYNC_SPIN_US", raw)
    assert spin_seconds() == pytest.approx(seconds)


@pytest.mark.parametrize("raw", ["-1", "abc", "1.5", str(limits.MAX_SPIN_US + 1)])
def test_a_bad_spin_is_refused_with_the_variable_named(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("IPCSYNC_SPIN_US", raw)
    with pytest.raises(ValueError, match="IPCSYNC_SPIN_US"):
        spin_seconds()


# ------------------------------------------------------------------ core.spin.AdaptiveSpin
from ipcsync.core.spin import ACTIVE_WINDOW_S, MAX_SKIP, MISSES_BEFORE_BACKOFF, AdaptiveSpin


def _active(budget: float = 200e-6) -> AdaptiveSpin:
    s = AdaptiveSpin(budget)
    s.parked(ACTIVE_WINDOW_S / 2, answered=True)  # a quick answer: the peer is active
    return s


def test_no_spin_when_off_or_before_the_peer_was_ever_active() -> None:
    assert AdaptiveSpin(0.0).plan(None) == 0.0
    off = AdaptiveSpin(0.0)
    off.parked(0.0, answered=True)
    assert off.plan(None) == 0.0
    assert AdaptiveSpin(200e-6).plan(None) == 0.0  # nothing heard yet: park at once


def test_an_active_peer_gets_the_budget_bounded_by_the_wait() -> None:
    s = _active()
    assert s.plan(None) == pytest.approx(200e-6)
    assert s.plan(50e-6) == pytest.approx(50e-6)
    assert s.plan(0.0) == 0.0


def test_an_idle_peer_stops_the_spin_until_it_is_active_again() -> None:
    s = _active()
    s.missed()
    s.parked(ACTIVE_WINDOW_S * 10, answered=True)  # answered only after a long park: idle
    assert s.plan(None) == 0.0
    s.parked(ACTIVE_WINDOW_S * 10, answered=False)  # a wait that timed out: still idle
    assert s.plan(None) == 0.0
    s.parked(0.0, answered=True)
    assert s.plan(None) > 0


def test_a_timed_out_wait_makes_the_endpoint_idle() -> None:
    s = _active()
    s.missed()
    s.parked(0.0, answered=False)
    assert s.plan(None) == 0.0


def test_fruitless_spins_back_off_and_a_hit_restores_them() -> None:
    s = _active()
    spun = []
    for _ in range(400):  # the peer always answers just after the spin ends
        budget = s.plan(None)
        spun.append(budget > 0)
        if budget:
            s.missed()
        s.parked(ACTIVE_WINDOW_S / 4, answered=True)
    assert all(spun[:MISSES_BEFORE_BACKOFF])
    # Once backed off, at most one wait in MAX_SKIP + 1 spins.
    tail = spun[-4 * (MAX_SKIP + 1):]
    assert sum(tail) <= 4
    s.skip = 0  # the next wait spins, and finds its answer
    assert s.plan(None) > 0
    s.hit()
    assert [s.plan(None) > 0 for _ in range(MISSES_BEFORE_BACKOFF)] == [True] * MISSES_BEFORE_BACKOFF


def test_a_negative_budget_is_refused() -> None:
    with pytest.raises(ValueError):
        AdaptiveSpin(-1.0)
