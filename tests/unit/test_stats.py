"""core/stats.py with a fake clock: what stats() reports is computed from these."""

from __future__ import annotations

from ipcsync.core.stats import Stats


def test_counts_bytes_rates_and_percentiles() -> None:
    s = Stats(window=100, now=10.0)
    for i in range(1, 101):
        s.handoff(1000, i / 1000)  # latencies 1..100 ms
    s.count(500)
    snap = s.snapshot(now=12.0, role="x")
    assert snap["handoffs"] == 101 and snap["bytes"] == 100_500 and snap["role"] == "x"
    assert snap["elapsed_s"] == 2.0 and snap["rate_per_s"] == 50.5 and snap["bytes_per_s"] == 50_250
    lat = snap["latency_s"]
    assert lat["samples"] == 100 and lat["p50"] == 0.051 and lat["p90"] == 0.091 and lat["p99"] == 0.1


def test_latency_window_keeps_the_newest_samples() -> None:
    s = Stats(window=3, now=0.0)
    for x in (5.0, 1.0, 2.0, 3.0):
        s.latency(x)
    assert s.snapshot(now=1.0)["latency_s"] == {"p50": 2.0, "p90": 3.0, "p99": 3.0, "samples": 3}


def test_waiting_adds_up_by_cause_and_empty_stats_have_no_percentiles() -> None:
    s = Stats(now=0.0)
    s.waited("slot", 0.5)
    s.waited("slot", 0.25)
    s.waited("consumer", 1.0)
    snap = s.snapshot(now=0.0)  # zero elapsed: rates stay finite
    assert snap["waiting_s"] == {"slot": 0.75, "consumer": 1.0}
    assert snap["latency_s"]["p50"] is None and snap["handoffs"] == 0 and snap["rate_per_s"] == 0.0
