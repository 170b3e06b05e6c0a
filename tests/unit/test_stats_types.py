"""``stats()`` snapshots are frozen and typed (``core/stats_types.py``), and read as the
dicts they were: every key, ``dict()``, nested ``["latency_s"]["p50"]``, JSON through
``as_dict()``. Built here from the counters (``core/stats.py``) with a fake clock."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from ipcsync.core.stats import Stats
from ipcsync.core.stats_types import ConsumerStats, FanInStats, Latency, Occupancy, ProducerStats, frozen_map

PRODUCER_EXTRA: dict[str, Any] = dict(
    role="producer", occupancy=Occupancy(free=2, writing=0, queued=1, in_flight=1), consumers=1,
    consumers_attached=2, consumers_lost=1, consumers_stalled=0, consumers_stalled_total=3, bad_frames=0,
    forwarded=0, forwarded_held=0, layouts_inline=4, lanes=1)
CONSUMER_EXTRA: dict[str, Any] = dict(
    role="consumer", held=1, buffered=0, kept=0, kept_moved=0, kept_moved_bytes=0, forwarded_out=0,
    forwarded_lost=0, producer_stalled=False, producer_stalled_total=0, lane=True)


def counters() -> Stats:
    s = Stats(window=100, now=10.0)
    for i in range(1, 11):
        s.handoff(100, i / 1000)
    s.waited("slot", 0.5)
    return s


def test_a_producer_snapshot_is_typed_and_frozen() -> None:
    snap = ProducerStats(**counters().totals(now=12.0), **PRODUCER_EXTRA)
    assert (snap.handoffs, snap.bytes, snap.elapsed_s, snap.rate_per_s) == (10, 1000, 2.0, 5.0)
    assert isinstance(snap.latency_s, Latency) and snap.latency_s.samples == 10 and snap.latency_s.p50 == 0.006
    assert snap.occupancy.queued == 1 and snap.waiting_s["slot"] == 0.5 and snap.role == "producer"
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.handoffs = 0  # type: ignore[misc]
    with pytest.raises(TypeError):
        snap.waiting_s["slot"] = 0.0  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.latency_s.p50 = 0.0  # type: ignore[misc]


def test_it_reads_as_the_dict_it_was() -> None:
    snap = ProducerStats(**counters().totals(now=12.0), **PRODUCER_EXTRA)
    old = counters().snapshot(now=12.0, **{**PRODUCER_EXTRA, "occupancy": dict(PRODUCER_EXTRA["occupancy"])})
    assert list(snap) == list(old) and set(snap.keys()) == set(old) and len(snap) == len(old)
    for key, value in old.items():
        assert snap[key] == value and snap.get(key) == value and key in snap, key
    assert snap["latency_s"]["p50"] == 0.006 and snap["occupancy"]["free"] == 2 and snap["waiting_s"] == {"slot": 0.5}
    assert dict(snap)["handoffs"] == 10 and snap == old and snap.as_dict() == old
    assert json.loads(json.dumps(snap.as_dict())) == old
    assert "nothing" not in snap and snap.get("nothing") is None
    with pytest.raises(KeyError):
        snap["nothing"]
    assert {**snap, "closed": True}["closed"] is True  # what ipcsync.stage does with it


def test_field_types_are_as_declared() -> None:
    snaps = [ProducerStats(**counters().totals(now=12.0), **PRODUCER_EXTRA),
             ConsumerStats(**counters().totals(now=12.0), **CONSUMER_EXTRA)]
    snaps.append(FanInStats(handoffs=10, bytes=1000, elapsed_s=2.0, rate_per_s=5.0, bytes_per_s=500.0,
                            waiting_s=frozen_map({"producer": 0.25}), role="fanin",
                            sources=frozen_map({"a/0": snaps[1]})))
    for snap in snaps:
        for f in dataclasses.fields(snap):
            value = getattr(snap, f.name)
            kind = {"int": int, "float": float, "bool": bool, "Latency": Latency, "Occupancy": Occupancy}.get(str(f.type))
            if kind is int:
                assert type(value) is int, (f.name, value)
            elif kind is not None:
                assert isinstance(value, kind), (f.name, value)
            elif str(f.type).startswith("Mapping"):
                assert isinstance(value, type(frozen_map({}))), f.name  # read-only
    assert snaps[2].sources["a/0"].lane is True and snaps[2]["sources"]["a/0"]["lane"] is True
    assert snaps[2].as_dict()["sources"]["a/0"]["latency_s"]["samples"] == 10


def test_empty_counters_have_no_percentiles() -> None:
    lat = Stats(now=0.0).totals(now=0.0)["latency_s"]
    assert lat == Latency(p50=None, p90=None, p99=None, samples=0) == {"p50": None, "p90": None, "p99": None,
                                                                        "samples": 0}
