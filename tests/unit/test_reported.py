"""The launcher reads what a stage reports of its endpoints as typed ``Reported`` stats
(``launch/reported.py``): what ``stats().as_dict()`` wrote comes back with the same
figures, a field of the wrong type is named (or, read leniently, absent), and the summary
and the monitor read the typed fields."""

from __future__ import annotations

import json
from typing import Any

import pytest

from ipcsync.core.stats import Stats
from ipcsync.core.stats_types import ConsumerStats, FanInStats, Occupancy, ProducerStats, frozen_map
from ipcsync.launch.monitor import analyze, stats_records
from ipcsync.launch.reported import Reported, parse
from ipcsync.launch.reports import clean_report
from ipcsync.launch.summary import summarize


def producer_stats() -> ProducerStats:
    s = Stats(now=0.0)
    for _ in range(8):
        s.handoff(100, 0.002)
    s.waited("slot", 0.25)
    return ProducerStats(**s.totals(now=4.0), role="producer", occupancy=Occupancy(free=0, writing=0, queued=1,
                         in_flight=3), consumers=1, consumers_attached=1, consumers_lost=0, consumers_stalled=0,
                         consumers_stalled_total=0, bad_frames=0, forwarded=0, forwarded_held=0, layouts_inline=1,
                         lanes=1)


def consumer_stats() -> ConsumerStats:
    s = Stats(now=0.0)
    for _ in range(8):
        s.handoff(100, 0.001)
    s.waited("producer", 1.0)
    return ConsumerStats(**s.totals(now=4.0), role="consumer", held=0, buffered=0, kept=0, kept_moved=0,
                         kept_moved_bytes=0, forwarded_out=0, forwarded_lost=0, producer_stalled=False,
                         producer_stalled_total=0, lane=True)


def written(snap: Any, closed: bool = False) -> Any:
    """What ipcsync.stage writes of an endpoint, as the launcher reads it back."""
    return json.loads(json.dumps({**snap.as_dict(), "closed": closed}))


def test_what_a_stage_writes_comes_back_typed() -> None:
    fan = FanInStats(handoffs=8, bytes=800, elapsed_s=4.0, rate_per_s=2.0, bytes_per_s=200.0,
                     waiting_s=frozen_map({"producer": 0.5}), role="fanin", sources=frozen_map({"a/0": consumer_stats()}))
    raw = {"stage": "b", "replica": 0, "outputs": {"c": written(producer_stats(), closed=True)},
           "inputs": {"a": written(fan)}}
    report, problems = clean_report(raw, "b.0.json")
    assert report is not None and problems == []
    out, inp = report["outputs"]["c"], report["inputs"]["a"]
    assert isinstance(out, Reported) and isinstance(inp, Reported)
    assert (out.role, out.handoffs, out.bytes, out.elapsed_s, out.closed) == ("producer", 8, 800, 4.0, True)
    assert dict(out.waiting_s) == {"slot": 0.25} and out.occupancy == {"free": 0, "writing": 0, "queued": 1,
                                                                        "in_flight": 3}
    assert out.latency_s is not None and out.latency_s.p50 == 0.002 and out.latency_s.samples == 8
    assert inp.role == "fanin" and inp.sources is not None and inp.sources["a/0"].handoffs == 8
    assert inp.sources["a/0"].latency_s is not None and inp.sources["a/0"].latency_s.p99 == 0.001
    lines = summarize([raw, {"stage": "a", "replica": 0, "outputs": {"b": written(producer_stats())}}])
    assert lines[1].startswith("  a -> b: 8 items") and "latency p50 1.00 ms" in lines[1], lines
    assert lines[2].startswith("  b -> c: 8 items") and "producer:slot 0.25 s" in lines[2], lines


def test_a_field_left_out_reads_as_zero_and_a_wrong_one_is_named() -> None:
    r = parse({})
    assert (r.role, r.handoffs, r.bytes, r.elapsed_s, dict(r.waiting_s), r.latency_s, r.occupancy, r.sources,
            r.closed) == (None, 0, 0, 0.0, {}, None, None, None, False)
    with pytest.raises(ValueError, match="'bytes' is -1, not a count"):
        parse({"handoffs": 1, "bytes": -1})
    with pytest.raises(ValueError, match="source 'a/0': 'latency_s' p50 is 'x', not seconds"):
        parse({"sources": {"a/0": {"latency_s": {"p50": "x"}}}})
    lenient = parse({"handoffs": 2.9, "bytes": "many", "waiting_s": {"slot": "x", "consumer": 1}, "latency_s": 3,
                     "occupancy": [1], "sources": {"a": 5, "b": {"handoffs": 4}}}, lenient=True)
    assert (lenient.handoffs, lenient.bytes, dict(lenient.waiting_s), lenient.latency_s, lenient.occupancy) == (
        2, 0, {"slot": 0.0, "consumer": 1.0}, None, None)
    assert lenient.sources is not None and list(lenient.sources) == ["b"] and lenient.sources["b"].handoffs == 4


def test_the_monitor_reads_cleaned_and_raw_reports_alike() -> None:
    raw = {("a", 0): {"stage": "a", "replica": 0, "mono": 5.0, "pid": 7, "outputs": {"b": written(producer_stats())}},
           ("b", 0): {"stage": "b", "replica": 0, "mono": 5.0, "pid": 8, "inputs": {"a": written(consumer_stats())}}}
    cleaned = {k: clean_report(r, "x.json")[0] for k, r in raw.items()}
    for reports in (raw, cleaned):
        a = analyze({}, reports, order=["a", "b"])  # type: ignore[arg-type]
        (e,) = a.edges
        assert (e.items, e.received, e.slots, e.slots_used) == (8, 8, 4, 4)
        assert e.producer_wait == pytest.approx(0.25 / 4) and e.consumer_wait == pytest.approx(1.0 / 4)
        recs = stats_records(a, reports, run_id="r", now=0.0, run_s=1.0, final=True)  # type: ignore[arg-type]
        ends = [r for r in recs if r["type"] == "endpoint"]
        assert [(r["direction"], r["handoffs"], r["waiting_s"]) for r in ends] == [
            ("output", 8, {"slot": 0.25}), ("input", 8, {"producer": 1.0})]
        json.dumps(recs)
