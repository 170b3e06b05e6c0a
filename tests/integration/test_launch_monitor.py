"""``ipcsync-run --monitor --stats-file --trace``: real pipelines through the launcher
(helpers and the ``launcher`` fixture's class from test_launch_cli), the files they
leave parsed and checked, and snapshot or trace files the launcher cannot read skipped.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterator

import pytest

import test_launch_cli as cli
from specfile import toml_spec

from ipcsync.launch.monitor import read_snapshots, read_traces

KINDS = ("send", "ready", "receipt", "release", "freed")


@pytest.fixture
def launcher(tmp_path: Path, runtime_dir: Path) -> Iterator[cli.Launcher]:
    ln = cli.Launcher(tmp_path, runtime_dir)
    try:
        yield ln
    finally:
        ln.cleanup()


def load_trace(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    assert isinstance(data["traceEvents"], list) and data["otherData"]["version"] == 1
    return data


def item_points(data: dict[str, Any]) -> dict[tuple[str, int], dict[str, list[dict[str, Any]]]]:
    """(edge, seq) -> kind -> the complete events of that point."""
    items: dict[tuple[str, int], dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for e in data["traceEvents"]:
        if e["ph"] == "X":
            assert e["name"] in KINDS and e["cat"] == "ipcsync", e
            items[(e["args"]["edge"], e["args"]["seq"])][e["name"]].append(e)
    return items


def stats_lines(path: Path) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines and all(r["v"] == 1 and r["type"] in ("edge", "endpoint", "pipeline") for r in lines), lines[:3]
    return lines


@pytest.mark.timeout(240)
def test_three_stages_monitored_with_stats_file_and_trace(launcher: cli.Launcher, tmp_path: Path) -> None:
    n = 40
    spec = launcher.spec_file(toml_spec(
        {"src": {"cmd": cli.stage("src.py", "--to", "mid", "--n", n, "--delay", 0.01), "device": "cpu"},
         "mid": {"cmd": cli.stage("mid.py", "--from", "src", "--to", "sink"), "device": "cpu"},
         "sink": {"cmd": cli.stage("sink.py", "--from", "mid"), "device": "cpu"}},
        [{"from": "src", "to": "mid", "slots": 4, "slot_bytes": "64KiB"},
         {"from": "mid", "to": "sink", "slots": 4, "slot_bytes": "64KiB"}],
        name="mon", stop_timeout=2,
    ))
    stats, trace = tmp_path / "stats.jsonl", tmp_path / "trace.json"
    run = launcher.run(spec, "--monitor", "--monitor-interval", "0.2", "--stats-file", stats, "--trace", trace)
    assert run.proc.returncode == 0, run.dump()
    cli.assert_complete(run.result("sink/0"), {"src/0": n})
    pids = {p.label: p.pid for p in launcher.stage_pids()}
    assert set(pids) == {"src/0", "mid/0", "sink/0"}, pids

    # The monitor's lines: a headline and one line per edge, a final report.
    mon = [line for line in run.err.splitlines() if line.startswith("ipcsync-run: monitor (final)")]
    assert mon and ("bottleneck: " in mon[0] or "no bottleneck" in mon[0]), run.dump()
    assert "src -> mid: " in run.err and f"; {n} sent" in run.err, run.dump()
    assert "trace: " in run.err and "written to" in run.err, run.dump()

    # Stats file: the final edge records count every item sent and received.
    recs = stats_lines(stats)
    final = [r for r in recs if r["final"]]
    edges = {r["edge"]: r for r in final if r["type"] == "edge"}
    assert set(edges) == {"src->mid", "mid->sink"}, final
    for e in edges.values():
        assert e["items"] == n and e["received"] == n, e
        assert e["bound"] in ("downstream", "upstream", "flowing") and e["slots"] == 4, e
        assert 0.0 <= e["producer_wait"] <= 1.0 and 0.0 <= e["consumer_wait"] <= 1.0, e
    outs = [r for r in final if r["type"] == "endpoint" and r["direction"] == "output"]
    ins = [r for r in final if r["type"] == "endpoint" and r["direction"] == "input"]
    assert sum(r["handoffs"] for r in outs) == 2 * n and sum(r["handoffs"] for r in ins) == 2 * n, final
    assert {(r["stage"], r["pid"]) for r in outs} == {("src", pids["src/0"]), ("mid", pids["mid/0"])}
    assert len([r for r in final if r["type"] == "pipeline"]) == 1
    # Earlier records (while running) never count more than the final ones.
    assert all(r["items"] <= n for r in recs if r["type"] == "edge")

    # Trace: every item of each edge sent, made ready, received, released and freed,
    # each point in the process that does it, in that order.
    data = load_trace(trace)
    assert data["otherData"]["dropped_events"] == 0
    names = {e["pid"]: e["args"]["name"] for e in data["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"}
    for label, pid in pids.items():
        assert names.get(pid, "").startswith(label), names
    items = item_points(data)
    for edge, prod, cons in (("src.0-mid", "src/0", "mid/0"), ("mid.0-sink", "mid/0", "sink/0")):
        seqs = sorted(seq for (e, seq) in items if e == edge)
        assert seqs == list(range(n)), (edge, seqs)
        for seq in seqs:
            pts = items[(edge, seq)]
            assert all(len(pts[k]) == 1 for k in KINDS), (edge, seq, dict(pts))
            p = {k: pts[k][0] for k in KINDS}
            assert {p[k]["pid"] for k in ("send", "ready", "freed")} == {pids[prod]}, (edge, seq, p)
            assert {p[k]["pid"] for k in ("receipt", "release")} == {pids[cons]}, (edge, seq, p)
            ts = [p[k]["ts"] for k in KINDS]
            assert ts == sorted(ts), (edge, seq, p)
            assert p["ready"]["args"]["to"] == f"consumer pid {pids[cons]}"
    flows = defaultdict(list)
    for e in data["traceEvents"]:
        if e["ph"] in ("s", "t", "f"):
            flows[e["id"]].append(e)
    assert len(flows) == 2 * n
    for chain in flows.values():
        assert [e["ph"] for e in chain] == ["s", "t", "t", "f"], chain
        assert [e["ts"] for e in chain] == sorted(e["ts"] for e in chain), chain
    launcher.assert_nothing_left()


@pytest.mark.timeout(240)
def test_unreadable_snapshots_and_trace_files_are_skipped(launcher: cli.Launcher, tmp_path: Path) -> None:
    """A stage that litters the telemetry and trace directories with files that are not
    snapshots (not JSON, cut short, the wrong shape, too large) does not crash the
    launcher: the pipeline's own numbers still come out."""
    n = 20
    litter = (
        "import os, json, time\n"
        "t, r = os.environ['IPCSYNC_TELEMETRY_DIR'], os.environ['IPCSYNC_TRACE_DIR']\n"
        "files = {t: {'bad.json': b'{not json', 'cut.json': b'{\"stage\": \"x\", \"mono\": 1, \"inp',\n"
        "             'list.json': b'[1, 2, 3]', 'shape.json': json.dumps({'v': 1, 'stage': 'x', 'mono': 1.0,\n"
        "             'inputs': {'y': 5}, 'outputs': {'z': {'handoffs': 'lots', 'occupancy': [1]}}}).encode(),\n"
        "             'deep.json': b'[' * 100000, 'big.json': b' ' * (2 << 20)},\n"
        "         r: {'1.jsonl': b'\\xff\\xfe garbage\\n', '2.jsonl': b'{\"v\": 1, \"pid\": 2}\\n[\"send\", \"e\", \"x\"]\\n[\"rec',\n"
        "             '3.jsonl': b''}}\n"
        "for d, fs in files.items():\n"
        "    for name, data in fs.items():\n"
        "        with open(os.path.join(d, name), 'wb') as f: f.write(data)\n"
        "time.sleep(1.0)\n"
    )
    spec = launcher.spec_file(toml_spec(
        {"src": {"cmd": cli.stage("src.py", "--n", n, "--delay", 0.02), "device": "cpu"},
         "sink": {"cmd": cli.stage("sink.py"), "device": "cpu"},
         "litter": {"cmd": [cli.PY, "-c", litter], "device": "cpu"}},
        [{"from": "src", "to": "sink", "slots": 2, "slot_bytes": "64KiB"}],
        name="litter", stop_timeout=2,
    ))
    stats, trace = tmp_path / "stats.jsonl", tmp_path / "trace.json"
    run = launcher.run(spec, "--monitor", "--monitor-interval", "0.1", "--stats-file", stats, "--trace", trace)
    assert run.proc.returncode == 0, run.dump()
    assert "Traceback" not in run.err and "skipped an interval" not in run.err, run.dump()
    edges = {r["edge"]: r for r in stats_lines(stats) if r["final"] and r["type"] == "edge"}
    assert (edges["src->sink"]["items"], edges["src->sink"]["received"]) == (n, n), edges
    assert set(edges) <= {"src->sink", "x->z"}, edges  # (shape.json: fields of the wrong type count as 0)
    data = load_trace(trace)
    assert sorted(seq for (e, seq) in item_points(data) if e == "src.0-sink") == list(range(n))
    assert data["otherData"]["bad_lines"] >= 1  # the cut-short lines, counted
    launcher.assert_nothing_left()


def test_reading_files_that_are_not_snapshots(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_bytes(b"\x00\x01")
    (tmp_path / "b.json").write_text('{"v": 1, "stage": "s", "replica": 0, "mono": 2.0, "inputs": {}, "outputs": {}}')
    (tmp_path / "c.json").write_text('{"v": 1, "stage": 3, "mono": 2.0}')
    (tmp_path / "e.json").write_text('{"v": 99, "stage": "t", "mono": 2.0}')
    (tmp_path / "d.json").mkdir()
    assert list(read_snapshots(str(tmp_path))) == [("s", 0)]
    assert read_snapshots(str(tmp_path / "missing")) == {}
    (tmp_path / "5.jsonl").write_text('{"v": 1, "pid": 5, "stage": "s", "replica": "0"}\n["send", "e", 0, 1, 5, null]\n{')
    (tmp_path / "6.jsonl").write_bytes(b"\x80\x81\n")
    (traces,) = read_traces(str(tmp_path), {}, 100)
    assert (traces.pid, traces.label, len(traces.events), traces.bad_lines) == (5, "s/0", 1, 1)


@pytest.mark.timeout(240)
def test_trace_is_written_when_a_stage_fails(launcher: cli.Launcher, tmp_path: Path) -> None:
    spec = launcher.spec_file(toml_spec(
        {"src": {"cmd": cli.stage("src.py", "--n", 50, "--raise-after", 10), "device": "cpu"},
         "sink": {"cmd": cli.stage("sink.py"), "device": "cpu"}},
        [{"from": "src", "to": "sink", "slots": 4, "slot_bytes": "64KiB"}],
        name="fails", stop_timeout=2,
    ))
    trace = tmp_path / "trace.json"
    run = launcher.run(spec, "--trace", trace)
    assert run.proc.returncode != 0, run.dump()
    items = item_points(load_trace(trace))
    sent = sorted(seq for (e, seq), pts in items.items() if e == "src.0-sink" and "send" in pts)
    assert sent == list(range(10)), run.dump()
    launcher.assert_nothing_left()


@pytest.mark.timeout(200)
def test_an_edge_whose_stages_finished_it_shows_finished_while_they_still_run(launcher: cli.Launcher,
                                                                              tmp_path: Path) -> None:
    """Before: the monitor kept printing "flowing" for an edge both stages had closed,
    as long as one of their processes lived. The source here holds on after closing
    its output until the test has seen the edge shown as finished."""
    go = tmp_path / "go"
    spec = launcher.spec_file(toml_spec(
        {"src": {"cmd": cli.stage("src.py", "--n", 5, "--hold-until", go), "device": "cpu"},
         "sink": {"cmd": cli.stage("sink.py"), "device": "cpu"}},
        [{"from": "src", "to": "sink", "slot_bytes": "64KiB"}],
    ))
    run = launcher.start(spec, "--monitor", "--monitor-interval", "0.2")
    try:
        cli.wait_until(lambda: "src -> sink:" in run.err and ": finished; 5 sent" in run.err
                       or run.proc.poll() is not None, 120, "the edge shown as finished")
        assert run.proc.poll() is None, run.dump()  # the source still runs
    finally:
        go.write_text("")
    assert run.wait() == 0, run.dump()
    lines = run.err.splitlines()
    end = next(i for i, line in enumerate(lines) if "monitor (final)" in line)  # (the lifetime view)
    live = [line for line in lines[:end] if "src -> sink:" in line]
    finished = [i for i, line in enumerate(live) if ": finished;" in line]
    assert finished and all("flowing" not in line for line in live[finished[0]:]), run.dump()
    assert cli.assert_complete(run.result("sink/0"), {"src/0": 5}) is None
    launcher.assert_nothing_left()
