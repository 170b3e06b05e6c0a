"""The launcher's edge summary at the end of a run (``summarize``): per edge, items, bytes
and rate as the producers counted them, latency as the consumers measured it, and the
time each side waited, from the stages' exit stats read as typed ``reported.Reported``."""

from __future__ import annotations

from typing import Any

from .reported import Reported
from .reports import INCOMPLETE, clean_reports

__all__ = ["summarize"]


def summarize(reports: list[dict[str, Any]], incomplete: bool = False) -> list[str]:
    """Per-edge lines from the stages' reports: items, bytes and rate as the producers
    counted them, latency (send to receipt) as the consumers measured it. A producer
    whose report is not here (it runs on another node) is counted by its consumers.
    Reports are the stages' (untrusted): what is not of the expected shape
    (``reports.clean_report``) is left out, and one last line says what. ``incomplete``:
    some stage's telemetry could not be written (the header says so, also when no report
    could be read)."""
    edges: dict[tuple[str, str], dict[str, Any]] = {}
    reports, skipped = clean_reports([("a stage's exit stats", r) for r in reports])

    def edge(key: tuple[str, str]) -> dict[str, Any]:
        return edges.setdefault(key, {"items": 0, "bytes": 0, "elapsed": 0.0, "lat": [], "waits": {},
                                      "producers": set(), "received": {}})

    for r in reports:
        stage: str = r["stage"]  # clean_reports: a string, its endpoints' stats typed (Reported)
        outputs: dict[str, Reported] = r.get("outputs") or {}
        for dst, s in outputs.items():
            e = edge((stage, dst))
            e["producers"].add(f"{stage}/{r.get('replica')}")
            e["items"] += s.handoffs
            e["bytes"] += s.bytes
            e["elapsed"] = max(e["elapsed"], s.elapsed_s)
            for cause, sec in s.waiting_s.items():
                e["waits"][f"producer:{cause}"] = e["waits"].get(f"producer:{cause}", 0.0) + sec
        inputs: dict[str, Reported] = r.get("inputs") or {}
        for src, s in inputs.items():
            e = edge((src, stage))
            for source, one in (s.sources or {f"{src}/0": s}).items():
                e["received"].setdefault(source, []).append(one)
                latency = one.latency_s
                if latency is not None and latency.p50 is not None:
                    e["lat"].append((latency.p50, latency.p99 or latency.p50))
                for cause, sec in one.waiting_s.items():
                    e["waits"][f"consumer:{cause}"] = e["waits"].get(f"consumer:{cause}", 0.0) + sec
    for e in edges.values():  # sources whose producer reported elsewhere: as received
        for source, seen in e["received"].items():
            if source not in e["producers"]:
                e["items"] += sum(one.handoffs for one in seen)
                e["bytes"] += sum(one.bytes for one in seen)
                e["elapsed"] = max([e["elapsed"], *(one.elapsed_s for one in seen)])
    head = f"edge summary ({INCOMPLETE})" if incomplete else "edge summary"
    lines = [f"{head}:"] if edges else [f"{head}: no stage's exit stats could be read"] if incomplete else []
    for (src, dst), e in sorted(edges.items()):
        rate = e["items"] / e["elapsed"] if e["elapsed"] > 0 else 0.0
        lat = ""
        if e["lat"]:
            p50 = max(p for p, _ in e["lat"]) * 1e3
            p99 = max(q for _, q in e["lat"]) * 1e3
            lat = f", latency p50 {p50:.2f} ms p99 {p99:.2f} ms"
        waits = ", ".join(f"{k} {v:.2f} s" for k, v in sorted(e["waits"].items()) if v >= 0.005)
        lines.append(
            f"  {src} -> {dst}: {e['items']} items, {e['bytes'] / 1e6:.1f} MB, {rate:.0f} items/s"
            f"{lat}{'; waited ' + waits if waits else ''}"
        )
    if skipped:
        lines.append(f"left out of the summary, not of the expected shape: {skipped[0]}"
                     + (f" (and {len(skipped) - 1} more)" if len(skipped) > 1 else ""))
    return lines
