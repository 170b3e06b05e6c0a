"""Stage reports are untrusted input: the launcher's summary and the monitor's analysis
never fail on a report of the wrong shape (``ipcsync.launch.reports``); they leave out
what is bad, keep the rest and say what they left out."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from ipcsync.launch.monitor import analyze, stats_records, status_lines
from ipcsync.launch.reports import clean_report
from ipcsync.launch.supervisor import summarize


def good(stage: str, outputs: dict[str, Any] | None = None, inputs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"stage": stage, "replica": 0, "outputs": outputs or {}, "inputs": inputs or {}}


OUT = {"handoffs": 40, "bytes": 4000, "elapsed_s": 2.0, "waiting_s": {"slot": 0.5}}
IN = {"handoffs": 40, "latency_s": {"p50": 0.001, "p90": 0.002, "p99": 0.003, "samples": 40},
      "waiting_s": {"producer": 0.1}}

BAD_STATS = [
    {"handoffs": "many"}, {"handoffs": -1}, {"handoffs": True}, {"handoffs": 1.5}, {"handoffs": 1 << 64},
    {"bytes": [1]}, {"elapsed_s": float("inf")}, {"elapsed_s": float("nan")}, {"elapsed_s": -3.0},
    {"waiting_s": "long"}, {"waiting_s": {"slot": "x"}}, {"waiting_s": {"slot": 1e400}},
    {"latency_s": 5}, {"latency_s": {"p50": "fast"}}, {"latency_s": {"p99": -1}},
    {"sources": [1, 2]}, {"sources": {"a": {"handoffs": "x"}}}, {"sources": {"a": 3}},
    {"occupancy": [1]}, {"occupancy": {"free": "all"}}, "stats", 7, None, [],
]


def test_summary_of_well_formed_reports() -> None:
    lines = summarize([good("src", outputs={"sink": OUT}), good("sink", inputs={"src": IN})])
    assert lines[0] == "edge summary:" and lines[1].startswith("  src -> sink: 40 items")
    assert len(lines) == 2


def test_each_malformed_shape_is_left_out_and_said_once() -> None:
    for bad in BAD_STATS:
        reports = [good("src", outputs={"sink": OUT, "other": bad}), good("sink", inputs={"src": IN})]
        lines = summarize(reports)
        assert lines[0] == "edge summary:" and lines[1].startswith("  src -> sink: 40 items"), (bad, lines)
        assert not any("other" in line for line in lines[1:-1]), (bad, lines)
        assert lines[-1].startswith("left out of the summary, not of the expected shape: src/0 output to 'other'"), (
            bad, lines)


def test_malformed_reports_themselves() -> None:
    for bad in ({"stage": 3}, {"outputs": {}}, [], "x", None, {"stage": "s", "outputs": [1]},
                {"stage": "s", "inputs": "none"}):
        lines = summarize([bad, good("src", outputs={"sink": OUT})])  # type: ignore[list-item]
        assert lines[1].startswith("  src -> sink: 40 items") and lines[-1].startswith("left out"), (bad, lines)
    assert summarize([{"stage": "s", "outputs": {"d": {"handoffs": "many"}}}]) == [
        "left out of the summary, not of the expected shape: s/None output to 'd': 'handoffs' is 'many', not a count"]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=12,
)
field_names = st.sampled_from(["handoffs", "bytes", "elapsed_s", "waiting_s", "latency_s", "sources", "occupancy",
                               "mono", "pid"])
stats_like = st.dictionaries(field_names, json_values, max_size=5) | json_values
report_like = st.fixed_dictionaries(
    {"stage": st.text(max_size=4) | json_values},
    optional={"replica": json_values, "v": st.just(1), "mono": st.floats() | st.integers(),
              "outputs": st.dictionaries(st.text(max_size=4), stats_like, max_size=3) | json_values,
              "inputs": st.dictionaries(st.text(max_size=4), stats_like, max_size=3) | json_values},
)


@settings(max_examples=150, deadline=None)
@given(st.lists(report_like, max_size=4))
def test_summary_never_fails(reports: list[dict[str, Any]]) -> None:
    lines = summarize(reports)
    assert all(isinstance(line, str) for line in lines)
    assert sum(line.startswith("left out") for line in lines) <= 1  # said once


@settings(max_examples=150, deadline=None)
@given(st.lists(report_like, max_size=4), st.lists(report_like, max_size=4))
def test_monitor_analysis_never_fails_on_cleaned_reports(prev: list[Any], cur: list[Any]) -> None:
    def table(reports: list[Any]) -> dict[Any, dict[str, Any]]:
        out = {}
        for i, r in enumerate(reports):
            clean, _ = clean_report(r, f"{i}.json")
            if clean is not None:
                out[(clean["stage"], i)] = clean
        return out

    before, now = table(prev), table(cur)
    a = analyze(before, now)
    status_lines(a, 1.0)
    json.dumps(stats_records(a, now, run_id="r", now=0.0, run_s=1.0, final=False))


def test_kept_stats_are_the_well_formed_ones() -> None:
    report, problems = clean_report(good("s", outputs={"a": OUT, "b": {"handoffs": "many"}}), "s.0.json")
    assert report is not None and set(report["outputs"]) == {"a"}
    assert problems == ["s/0 output to 'b': 'handoffs' is 'many', not a count"]
