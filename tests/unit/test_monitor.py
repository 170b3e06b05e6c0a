"""The monitor's pure parts: who waits on whom and the bottleneck (``launch/monitor.analyze``)
on synthetic stage snapshots, the status lines and stats records, and the trace
formatting (``core/trace.py``) on synthetic per-process event lines."""

from __future__ import annotations

import json
from typing import Any

import pytest

from ipcsync.core.trace import chrome_trace, parse_lines
from ipcsync.launch.monitor import BOUND, analyze, stats_records, status_lines


def producer(handoffs: int, slot_wait: float, free: int = 2, slots: int = 4, nbytes: int = 100) -> dict[str, Any]:
    return {"role": "producer", "handoffs": handoffs, "bytes": handoffs * nbytes, "elapsed_s": 10.0,
            "waiting_s": {"slot": slot_wait},
            "occupancy": {"free": free, "writing": 0, "queued": 0, "in_flight": slots - free}}


def consumer(handoffs: int, item_wait: float) -> dict[str, Any]:
    return {"role": "consumer", "handoffs": handoffs, "bytes": handoffs * 100, "elapsed_s": 10.0,
            "waiting_s": {"producer": item_wait}}


def report(stage: str, mono: float, inputs: dict[str, Any] | None = None,
           outputs: dict[str, Any] | None = None, replica: int = 0) -> dict[str, Any]:
    return {"stage": stage, "replica": replica, "pid": 100 + replica, "mono": mono,
            "inputs": inputs or {}, "outputs": outputs or {}}


def chain(a_wait_out: float, b_wait_in: float, b_wait_out: float, c_wait_in: float,
          items: int = 100) -> tuple[dict[Any, Any], dict[Any, Any]]:
    """Snapshots of a -> b -> c one second apart, with the given wait fractions."""
    prev = {("a", 0): report("a", 10.0, outputs={"b": producer(0, 0.0)}),
            ("b", 0): report("b", 10.0, inputs={"a": consumer(0, 0.0)}, outputs={"c": producer(0, 0.0)}),
            ("c", 0): report("c", 10.0, inputs={"b": consumer(0, 0.0)})}
    cur = {("a", 0): report("a", 11.0, outputs={"b": producer(items, a_wait_out)}),
           ("b", 0): report("b", 11.0, inputs={"a": consumer(items, b_wait_in)},
                            outputs={"c": producer(items, b_wait_out)}),
           ("c", 0): report("c", 11.0, inputs={"b": consumer(items, c_wait_in)})}
    return prev, cur


def test_slow_middle_stage_is_the_bottleneck() -> None:
    # a waits for slots towards b (b is slow to release); c waits for b's items.
    a = analyze(*chain(0.8, 0.0, 0.0, 0.9), order=["a", "b", "c"])
    ab, bc = a.edges
    assert (ab.src, ab.dst, ab.bound) == ("a", "b", "downstream")
    assert (bc.src, bc.dst, bc.bound) == ("b", "c", "upstream")
    assert a.bottleneck == "b"
    assert a.stages["b"]["busy"] == pytest.approx(1.0)
    assert a.stages["a"]["out_wait"] == pytest.approx(0.8)
    assert ab.items_per_s == pytest.approx(100.0) and ab.bytes_per_s == pytest.approx(10000.0)
    head = status_lines(a, 5.0)[0]
    assert "bottleneck: b" in head and "a waits for slots 80%" in head and "c waits for items 90%" in head


def test_slow_source_makes_everything_upstream_bound() -> None:
    a = analyze(*chain(0.0, 0.85, 0.0, 0.8), order=["a", "b", "c"])
    assert [e.bound for e in a.edges] == ["upstream", "upstream"]
    assert a.bottleneck == "a"


def test_slow_sink_makes_everything_downstream_bound() -> None:
    a = analyze(*chain(0.7, 0.0, 0.9, 0.0), order=["a", "b", "c"])
    assert [e.bound for e in a.edges] == ["downstream", "downstream"]
    assert a.bottleneck == "c"


def test_nobody_waiting_names_no_bottleneck() -> None:
    a = analyze(*chain(0.05, 0.05, 0.0, BOUND / 2), order=["a", "b", "c"])
    assert all(e.bound == "flowing" for e in a.edges)
    assert a.bottleneck is None
    assert "no bottleneck" in status_lines(a, 1.0)[0]


def test_a_producer_stuck_in_one_long_wait_counts_as_waiting() -> None:
    # Waits are added to stats when they end: a producer blocked all interval with every
    # slot taken and nothing sent shows no new wait seconds, yet it is waiting.
    prev, cur = chain(0.0, 0.0, 0.0, 0.0)
    prev[("a", 0)]["outputs"]["b"] = producer(50, 0.0, free=0)
    cur[("a", 0)]["outputs"]["b"] = producer(50, 0.0, free=0)
    a = analyze(prev, cur, order=["a", "b", "c"])
    assert a.edges[0].producer_wait == 1.0 and a.edges[0].bound == "downstream"
    assert a.bottleneck == "b"


def test_fanin_and_replicas_are_summed_per_edge() -> None:
    # Two loaders into one trainer through a FanIn (its own wait for items is top-level).
    fanin = {"role": "fanin", "handoffs": 200, "bytes": 20000, "elapsed_s": 4.0, "waiting_s": {"producer": 0.1},
             "sources": {"loader/0": consumer(100, 0.0), "loader/1": consumer(100, 0.0)}}
    cur = {("loader", 0): report("loader", 5.0, outputs={"train": producer(100, 3.0)}, replica=0),
           ("loader", 1): report("loader", 5.0, outputs={"train": producer(100, 2.6)}, replica=1),
           ("train", 0): report("train", 5.0, inputs={"loader": fanin})}
    a = analyze({}, cur, order=["loader", "train"])  # no predecessor: over each one's elapsed_s
    (e,) = a.edges
    assert (e.producers, e.consumers, e.items, e.received, e.slots) == (2, 1, 200, 200, 8)
    assert e.items_per_s == pytest.approx(20.0)
    assert e.producer_wait == pytest.approx((0.3 + 0.26) / 2)
    assert e.consumer_wait == pytest.approx(0.1 / 4.0)  # over the FanIn's own elapsed_s
    assert e.bound == "downstream" and a.bottleneck == "train"
    recs = stats_records(a, cur, run_id="r", now=1.0, run_s=2.0, final=True)
    assert {r["type"] for r in recs} == {"edge", "endpoint", "pipeline"}
    assert all(r["v"] == 1 and r["final"] is True for r in recs)
    (edge,) = [r for r in recs if r["type"] == "edge"]
    assert edge["edge"] == "loader->train" and edge["items"] == 200 and edge["slots_used"] == 4
    outs = [r for r in recs if r["type"] == "endpoint" and r["direction"] == "output"]
    assert sum(r["handoffs"] for r in outs) == 200
    json.dumps(recs)  # JSON-able as written


def test_an_edge_whose_ends_all_finished_shows_finished_not_flowing() -> None:
    # Before: an edge whose stages had closed it (or exited) kept reading "flowing"
    # until the launcher's final report.
    prev, cur = chain(0.0, 0.0, 0.0, 0.0, items=0)  # nothing moved in this interval
    cur[("a", 0)]["outputs"]["b"]["closed"] = True  # a closed its output...
    cur[("b", 0)]["inputs"]["a"]["closed"] = True  # ...and b its input from a
    cur[("c", 0)]["final"] = True  # c exited; b's output to it is still open
    a = analyze(prev, cur, order=["a", "b", "c"])
    ab, bc = a.edges
    assert ab.bound == "finished" and bc.bound == "flowing"
    lines = status_lines(a, 3.0)
    assert "a -> b:" in lines[1] and ": finished; 0 sent" in lines[1], lines
    cur[("b", 0)]["outputs"]["c"]["closed"] = True
    a = analyze(prev, cur, order=["a", "b", "c"])
    assert [e.bound for e in a.edges] == ["finished", "finished"] and a.bottleneck is None
    assert "every edge finished" in status_lines(a, 3.0)[0]
    assert {r["bound"] for r in stats_records(a, cur, run_id="r", now=0.0, run_s=3.0, final=False)
            if r["type"] == "edge"} == {"finished"}


def test_the_final_report_keeps_the_lifetime_view() -> None:
    # At the end every end is closed: the final report still says who waited on whom.
    prev, cur = chain(0.8, 0.0, 0.0, 0.9)
    for r in cur.values():
        r["final"] = True
        for side in ("inputs", "outputs"):
            for s in r[side].values():
                s["closed"] = True
    assert all(e.bound == "finished" for e in analyze(prev, cur, order=["a", "b", "c"]).edges)
    a = analyze(prev, cur, order=["a", "b", "c"], final=True)
    assert [e.bound for e in a.edges] == ["downstream", "upstream"] and a.bottleneck == "b"


def test_malformed_snapshots_are_tolerated() -> None:
    cur = {("x", 0): {"stage": "x", "replica": 0, "mono": 1.0, "inputs": {"y": "nonsense"},
                      "outputs": {"z": {"handoffs": "many", "waiting_s": [1], "occupancy": {"free": None}}}}}
    a = analyze({("x", 0): {"stage": "x", "mono": "late"}}, cur)
    assert [e.name for e in a.edges] == ["x->z"]
    status_lines(a, 0.0)
    stats_records(a, cur, run_id="r", now=0.0, run_s=0.0, final=False)


# ---------------------------------------------------------------------------- trace formatting
def trace_lines(pid: int, stage: str, events: list[list[Any]], extra: list[str] = ()) -> list[str]:
    return [json.dumps({"v": 1, "pid": pid, "stage": stage, "replica": "0"}), json.dumps(["T", pid, "MainThread"]),
            *(json.dumps(e) for e in events), *extra]


def test_trace_merge_links_each_item_across_processes() -> None:
    prod = parse_lines(trace_lines(10, "src", [
        ["send", "src.0-sink", 0, 1_000, 10, [0, 64]], ["ready", "src.0-sink", 0, 2_000, 10, "consumer pid 20"],
        ["freed", "src.0-sink", 0, 9_000, 10, None]], extra=['{"dropped": 3}', '["send", "src.0-si']))
    cons = parse_lines(trace_lines(20, "sink", [
        ["receipt", "src.0-sink", 0, 3_000, 20, None], ["release", "src.0-sink", 0, 5_000, 20, None]]))
    assert prod is not None and cons is not None
    assert prod.dropped == 3 and prod.bad_lines == 1 and len(prod.events) == 3
    data = chrome_trace([prod, cons])
    json.dumps(data)
    ev = data["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {10: "src/0 (pid 10)", 20: "sink/0 (pid 20)"}
    points = {e["name"]: e for e in ev if e["ph"] == "X"}
    assert points["send"]["ts"] == 0.0 and points["release"]["ts"] == 4.0
    assert points["send"]["args"] == {"edge": "src.0-sink", "seq": 0, "slot": 0, "bytes": 64}
    flow = [e for e in ev if e["ph"] in ("s", "t", "f")]
    assert [(e["ph"], e["pid"]) for e in flow] == [("s", 10), ("t", 10), ("t", 20), ("f", 20)]
    assert len({e["id"] for e in flow}) == 1
    assert data["otherData"]["dropped_events"] == 3


def test_trace_without_a_header_or_over_the_limit() -> None:
    assert parse_lines(["not json", "[1, 2]"]) is None
    t = parse_lines(trace_lines(1, "a", [["send", "e", i, i, 1, None] for i in range(5)]), limit=2)
    assert t is not None and len(t.events) == 2 and t.dropped == 3
