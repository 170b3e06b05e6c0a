"""Handoff traces as Chrome / Perfetto JSON (the ``traceEvents`` format that
ui.perfetto.dev and chrome://tracing open). Pure: the launcher reads the per-process
files (``runtime/telemetry.py`` writes them) and passes their contents here.

Per item of an edge (``edge`` is the producer's endpoint, ``loader.0-train`` under
ipcsync-run; ``seq`` its number there) up to five points, each a complete event of 1 us (less where the thread's next point is sooner)
(``ph: "X"``) on the thread that did it:

- ``send``: the producer committed the item to a slot (its ready event recorded);
- ``ready``: the producer sent READY to one consumer (one per consumer it went to);
- ``receipt``: the consumer's ``get()``/``next()`` returned the item;
- ``release``: the consumer released it (its release event recorded);
- ``freed``: the producer received the RELEASE that freed the slot.

Flow events (``ph`` ``s``/``t``/``f``, ``bp: "e"``) link send -> ready -> receipt ->
release of each (edge, seq, consumer process), so the UI draws an arrow across processes.
Metadata events name each process ``stage/replica`` and each thread. Timestamps are
microseconds from the earliest event (every process reads the same ``CLOCK_MONOTONIC``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

__all__ = ["ProcessTrace", "parse_lines", "chrome_trace", "TRACE_FORMAT_VERSION", "KINDS"]

TRACE_FORMAT_VERSION = 1
KINDS = ("send", "ready", "receipt", "release", "freed")
_FLOW_CAT = "ipcsync.item"


@dataclass
class ProcessTrace:
    """What one process recorded: its header, events ``(kind, edge, seq, ts_ns, tid,
    arg)``, thread names and how many events it dropped."""

    pid: int
    label: str
    events: list[tuple[str, str, int, int, int, Any]] = field(default_factory=list)
    threads: dict[int, str] = field(default_factory=dict)
    dropped: int = 0
    bad_lines: int = 0


def parse_lines(lines: Iterable[bytes | str], *, label: str | None = None, limit: int | None = None) -> ProcessTrace | None:
    """A process's trace file, line by line. A line that is not valid JSON of the
    expected shape (a partial last line of a killed process, say) is counted in
    ``bad_lines`` and skipped; None if there is no valid header. ``limit``: keep at most
    that many events (the rest counted as dropped)."""
    import json

    trace: ProcessTrace | None = None
    for raw in lines:
        try:
            obj = json.loads(raw)
        except (ValueError, RecursionError, UnicodeDecodeError):
            if trace is not None:
                trace.bad_lines += 1
            continue
        if trace is None:
            if isinstance(obj, dict) and obj.get("v") == TRACE_FORMAT_VERSION and _is_int(obj.get("pid")):
                stage, replica = obj.get("stage"), obj.get("replica")
                name = label or (f"{stage}/{replica}" if stage else f"pid {obj['pid']}")
                trace = ProcessTrace(pid=obj["pid"], label=str(name))
            continue
        if isinstance(obj, dict):
            if _is_int(obj.get("dropped")):
                trace.dropped = max(trace.dropped, obj["dropped"])
            else:
                trace.bad_lines += 1
            continue
        if not isinstance(obj, list):
            trace.bad_lines += 1
            continue
        if len(obj) == 3 and obj[0] == "T" and _is_int(obj[1]) and isinstance(obj[2], str):
            trace.threads[obj[1]] = obj[2][:100]
            continue
        if (len(obj) == 6 and obj[0] in KINDS and isinstance(obj[1], str) and _is_int(obj[2])
                and _is_int(obj[3]) and _is_int(obj[4])):
            if limit is not None and len(trace.events) >= limit:
                trace.dropped += 1
                continue
            trace.events.append((obj[0], obj[1], obj[2], obj[3], obj[4], obj[5]))
        else:
            trace.bad_lines += 1
    return trace


def _is_int(v: Any) -> bool:
    return type(v) is int


def _consumer_pid(arg: Any) -> int | None:
    """The consumer's pid in a ``ready`` event's argument (``"consumer pid N"``)."""
    if isinstance(arg, str):
        tail = arg.rsplit(" ", 1)[-1]
        if tail.isdigit():
            return int(tail)
    return None


def chrome_trace(processes: list[ProcessTrace], *, other: dict[str, Any] | None = None) -> dict[str, Any]:
    """The Chrome trace JSON object of ``processes`` (see the module docstring)."""
    out: list[dict[str, Any]] = []
    all_ts = [e[3] for p in processes for e in p.events]
    base = min(all_ts) if all_ts else 0

    def us(ns: int) -> float:
        return (ns - base) / 1000.0

    for order, p in enumerate(processes):
        out.append({"ph": "M", "name": "process_name", "pid": p.pid, "tid": 0,
                    "args": {"name": f"{p.label} (pid {p.pid})"}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": p.pid, "tid": 0, "args": {"sort_index": order}})
        for tid, name in sorted(p.threads.items()):
            out.append({"ph": "M", "name": "thread_name", "pid": p.pid, "tid": tid, "args": {"name": name}})
    # The points of each item, to chain them into flows: (edge, seq) -> kind -> [(pid, tid, ts, arg)]
    items: dict[tuple[str, int], dict[str, list[tuple[int, int, int, Any]]]] = {}
    for p in processes:
        # Each point lasts 1 us, or less where the same thread's next point comes sooner:
        # slices of one thread never overlap.
        nxt: dict[tuple[int, int], int] = {}
        durs: list[float] = [1.0] * len(p.events)
        for i in sorted(range(len(p.events)), key=lambda i: p.events[i][3], reverse=True):
            _k, _e, _s, ts, tid, _a = p.events[i]
            after = nxt.get((tid, 0))
            if after is not None:
                durs[i] = min(1.0, (after - ts) / 1000.0)
            nxt[(tid, 0)] = ts
        for (kind, edge, seq, ts, tid, arg), dur in zip(p.events, durs):
            args: dict[str, Any] = {"edge": edge, "seq": seq}
            if kind == "send" and isinstance(arg, list) and len(arg) == 2:
                args["slot"], args["bytes"] = arg[0], arg[1]
            elif kind == "ready":
                args["to"] = arg
            out.append({"ph": "X", "name": kind, "cat": "ipcsync", "pid": p.pid, "tid": tid, "ts": us(ts),
                        "dur": dur, "args": args})
            items.setdefault((edge, seq), {}).setdefault(kind, []).append((p.pid, tid, ts, arg))
    flow_id = 0
    for (edge, seq), points in sorted(items.items()):
        sends = points.get("send")
        if not sends:
            continue
        send = sends[0]
        for receipt in points.get("receipt", []):
            consumer = receipt[0]
            chain = [send]
            chain += [r for r in points.get("ready", []) if _consumer_pid(r[3]) == consumer][:1]
            chain.append(receipt)
            chain += [r for r in points.get("release", []) if r[0] == consumer][:1]
            flow_id += 1
            for i, (pid, tid, ts, _arg) in enumerate(chain):
                ph = "s" if i == 0 else ("f" if i == len(chain) - 1 else "t")
                ev: dict[str, Any] = {"ph": ph, "name": f"{edge}#{seq}", "cat": _FLOW_CAT, "id": flow_id,
                                      "pid": pid, "tid": tid, "ts": us(ts)}
                if ph != "s":
                    ev["bp"] = "e"
                out.append(ev)
    data: dict[str, Any] = {"version": TRACE_FORMAT_VERSION, "clock": "CLOCK_MONOTONIC",
                            "base_monotonic_ns": base,
                            "dropped_events": sum(p.dropped for p in processes),
                            "bad_lines": sum(p.bad_lines for p in processes)}
    if other:
        data.update(other)
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": data}
