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
