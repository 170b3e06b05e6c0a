"""Counters behind ``Producer.stats()`` and ``Consumer.stats()`` (typed snapshots:
``core.stats_types``). Cheap to update: a few integer adds and one deque append per
handoff, or (``taken``, the consumer's steady path) one list append per handoff, folded in
once per wake-up (``settle``)."""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Mapping, TypedDict

from .stats_types import ConsumerStats, Latency, Occupancy, ProducerStats, frozen_map, plain

__all__ = ["Stats", "Totals", "ProducerStats", "ConsumerStats", "Occupancy"]  # (the snapshots, for the endpoints)


class Totals(TypedDict):
    """The counters every endpoint's snapshot starts with (``Stats.totals``)."""

    handoffs: int
    bytes: int
    elapsed_s: float
    rate_per_s: float
    bytes_per_s: float
    latency_s: Latency
    waiting_s: Mapping[str, float]


class Stats:
    """Handoffs, bytes, latency samples and time spent waiting, by cause."""

    def __init__(self, window: int = 4096, *, now: float | None = None) -> None:
        self.started = time.monotonic() if now is None else now
        self.handoffs = 0
        self.bytes = 0
        self.latencies: deque[float] = deque(maxlen=window)  # seconds, newest last
        self.waiting: dict[str, float] = {}
        # Handoffs not counted yet, as (bytes, latency in ns): ``taken.append`` is the
        # per-item step (a C call); ``settle`` (at a pump, and before a snapshot) counts them.
        self.taken: list[tuple[int, int]] = []

    def count(self, nbytes: int) -> None:
        self.handoffs += 1
        self.bytes += nbytes

    def handoff(self, nbytes: int, latency: float) -> None:
        """``count`` and ``latency`` in one call (the per-item path)."""
        self.handoffs += 1
        self.bytes += nbytes
        self.latencies.append(latency)

    def settle(self) -> None:
        """Count the handoffs ``taken`` holds."""
        taken = self.taken
        if not taken:
            return
        latencies = self.latencies
        n = 0
        for nbytes, ns in taken:
            n += nbytes
            latencies.append(ns / 1e9)
        self.handoffs += len(taken)
        self.bytes += n
        taken.clear()

    def latency(self, seconds: float) -> None:
        self.latencies.append(seconds)

    def waited(self, cause: str, seconds: float) -> None:
        self.waiting[cause] = self.waiting.get(cause, 0.0) + seconds

    def totals(self, *, now: float | None = None) -> Totals:
        """The counters, for a typed snapshot (``ProducerStats(**totals, ...)``). ``now``:
        the monotonic time to compute rates at (default: the clock's)."""
        self.settle()
        elapsed = max((time.monotonic() if now is None else now) - self.started, 1e-9)
        lat = sorted(self.latencies)

        def pct(p: float) -> float | None:
            return lat[min(len(lat) - 1, int(p * len(lat)))] if lat else None

        return Totals(handoffs=self.handoffs, bytes=self.bytes, elapsed_s=elapsed, rate_per_s=self.handoffs / elapsed,
                      bytes_per_s=self.bytes / elapsed,
                      latency_s=Latency(p50=pct(0.50), p90=pct(0.90), p99=pct(0.99), samples=len(lat)),
                      waiting_s=frozen_map(self.waiting))

    def snapshot(self, *, now: float | None = None, **extra: Any) -> dict[str, Any]:
        """``totals`` as plain nested dicts, ``extra`` added as is."""
        out: dict[str, Any] = plain(self.totals(now=now))
        out.update(extra)
        return out
