"""The launcher's per-edge summary (``launch/supervisor.summarize``) on synthetic stage
reports: counted by the producers where their reports are here, by the consumers for
producers that run on another node."""

from __future__ import annotations

import re
from typing import Any

from ipcsync.launch.supervisor import summarize


def stats(handoffs: int, nbytes: int, elapsed: float = 2.0, **extra: Any) -> dict[str, Any]:
    return {"handoffs": handoffs, "bytes": nbytes, "elapsed_s": elapsed, "waiting_s": {},
            "latency_s": {"p50": 0.001, "p99": 0.002}, **extra}


def items(lines: list[str], src: str, dst: str) -> tuple[int, float]:
    m = next(re.search(rf"{src} -> {dst}: (\d+) items, ([0-9.]+) MB", line) for line in lines if f"{src} -> {dst}:" in line)
    assert m, lines
    return int(m.group(1)), float(m.group(2))


def test_the_producers_count_where_their_reports_are_here() -> None:
    reports = [
        {"stage": "loader", "replica": 0, "outputs": {"train": stats(32, 12_600_000)}},
        {"stage": "loader", "replica": 1, "outputs": {"train": stats(32, 12_600_000)}},
        {"stage": "train", "replica": 0, "inputs": {"loader": stats(64, 25_200_000, sources={
            "loader/0": stats(32, 12_600_000), "loader/1": stats(32, 12_600_000)})}},
    ]
    lines = summarize(reports)
    assert lines[0] == "edge summary:"
    assert items(lines, "loader", "train") == (64, 25.2)  # not 128: each item once


def test_a_node_with_only_the_consumers_counts_what_they_received() -> None:
    # Node 1 of a two-node run: the loaders report on node 0. Before: "0 items, 0.0 MB".
    fanin = stats(64, 25_200_000, sources={"loader/0": stats(32, 12_600_000), "loader/1": stats(32, 12_600_000)})
    lines = summarize([{"stage": "train", "replica": 0, "inputs": {"loader": fanin}}])
    assert items(lines, "loader", "train") == (64, 25.2)
    assert "32 items/s" in lines[1], lines
    one = summarize([{"stage": "sink", "replica": 0, "inputs": {"src": stats(40, 1_000_000)}}])  # one Consumer
    assert items(one, "src", "sink") == (40, 1.0)


def test_producers_split_over_nodes_are_each_counted_once() -> None:
    # loader/0 on this node, loader/1 on another: loader/0 as sent, loader/1 as received.
    fanin = stats(50, 5_000_000, sources={"loader/0": stats(20, 2_000_000), "loader/1": stats(30, 3_000_000)})
    lines = summarize([
        {"stage": "loader", "replica": 0, "outputs": {"train": stats(20, 2_000_000)}},
        {"stage": "train", "replica": 0, "inputs": {"loader": fanin}},
    ])
    assert items(lines, "loader", "train") == (50, 5.0)
