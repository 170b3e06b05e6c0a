"""``Producer.stats()``, ``Consumer.stats()`` and ``FanIn.stats()`` of live endpoints: frozen,
typed snapshots that keep every key they had as dicts (``core/stats_types.py``)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
import torch

import ipcsync

pytestmark = pytest.mark.timeout(60)

TOTALS = {"handoffs", "bytes", "elapsed_s", "rate_per_s", "bytes_per_s", "waiting_s", "role"}
PRODUCER_KEYS = TOTALS | {"latency_s", "occupancy", "consumers", "consumers_attached", "consumers_lost",
                          "consumers_stalled", "consumers_stalled_total", "bad_frames", "forwarded", "forwarded_held",
                          "layouts_inline", "lanes"}
CONSUMER_KEYS = TOTALS | {"latency_s", "held", "buffered", "kept", "kept_moved", "kept_moved_bytes", "forwarded_out",
                          "forwarded_lost", "producer_stalled", "producer_stalled_total", "lane"}
FANIN_KEYS = TOTALS | {"sources"}


def test_live_snapshots_are_typed_and_keep_their_keys(endpoints: Any) -> None:
    out = endpoints.producer("typed-a", device="cpu", slots=2, slot_bytes=1 << 12)
    b, c = (endpoints.producer(f"typed-{n}", device="cpu", slots=2, slot_bytes=1 << 12) for n in "bc")
    inp = endpoints.consumer("typed-a", device="cpu", timeout=30)
    fan = endpoints.fanin(["typed-b", "typed-c"], sources=["b/0", "c/0"], device="cpu", timeout=30)
    for p in (out, b, c):
        p.wait_for_consumers(1, timeout=30)
    for i in range(3):
        out.send({"x": torch.full((16,), i, dtype=torch.uint8)})
        assert inp.get(timeout=30) is not None
        b.send({"x": torch.full((16,), i, dtype=torch.uint8)})
        assert fan.get(timeout=30) is not None
    ps, cs, fs = out.stats(), inp.stats(), fan.stats()
    assert isinstance(ps, ipcsync.ProducerStats) and isinstance(cs, ipcsync.ConsumerStats)
    assert isinstance(fs, ipcsync.FanInStats)
    assert set(ps) == PRODUCER_KEYS and set(cs) == CONSUMER_KEYS and set(fs) == FANIN_KEYS
    assert ps.handoffs == 3 and ps["handoffs"] == 3 and ps.bytes == 48 and ps.consumers == 1
    assert isinstance(ps.occupancy, ipcsync.Occupancy) and sum(dict(ps.occupancy).values()) == 2
    assert cs.handoffs == 3 and isinstance(cs.latency_s, ipcsync.Latency) and cs.latency_s.samples == 3
    assert cs["latency_s"]["p50"] == cs.latency_s.p50 and cs.latency_s.p50 is not None and cs.latency_s.p50 >= 0
    assert type(cs.lane) is bool and type(cs.kept) is int
    assert fs.handoffs == 3 and set(fs.sources) == {"b/0", "c/0"}
    assert isinstance(fs.sources["b/0"], ipcsync.ConsumerStats) and fs["sources"]["b/0"]["handoffs"] == 3
    for snap in (ps, cs, fs):
        with pytest.raises(dataclasses.FrozenInstanceError):
            snap.handoffs = 0  # type: ignore[misc]
        assert json.loads(json.dumps(snap.as_dict())) == snap == dict(snap)
