"""``ipcsync-run --monitor``, ``--stats-file`` and ``--trace``: a live view of a running
pipeline, as status lines, JSON lines and a Chrome/Perfetto trace.

How the numbers get here: the launcher sets ``$IPCSYNC_TELEMETRY_DIR`` (and
``$IPCSYNC_TRACE_DIR`` for ``--trace``) to directories of the attempt's run directory;
every stage process writes its per-edge ``stats()`` there every interval
(``runtime/telemetry.py``, from ``ipcsync.stage``) and appends its trace events. The
``Observer`` reads the snapshots each interval (a file that is missing, partial, not
JSON or of the wrong shape is skipped, never fatal), turns the differences between two
snapshots into per-edge rates and waits (``analyze``, pure), prints and writes them, and
at the end of each attempt merges the trace files (``core/trace.py``).

Who waits on whom. A producer waiting for a free slot (``waiting_s["slot"]``, and
``"release_event"``) is held up by its consumers: the edge is *downstream-bound*. A
consumer waiting for an item (``waiting_s["producer"]``) is held up by its producer: the
edge is *upstream-bound*. The *bottleneck* is the stage that is busy (neither waiting
for its inputs nor for its outputs) while its neighbours wait on it: the stage with the
highest ``busy + (how much its producers wait on it) + (how much its consumers wait on
it)``, named only when some edge is bound (someone waits at least ``BOUND`` of the time).

Stats file (``--stats-file PATH``): JSON lines, each an object with ``"v": 1`` (the
schema version) and ``"type"``:

- ``"edge"``: ``run_id``, ``time`` (Unix), ``run_s`` (since the launcher started),
  ``edge`` (``"src->dst"``), ``src``, ``dst``, ``items`` and ``bytes`` (sent so far, summed
  over the producers), ``received`` (summed over the consumers), ``items_per_s``,
  ``bytes_per_s`` (over the last interval), ``slots``, ``slots_used``, ``occupancy``
  (``free``/``writing``/``queued``/``in_flight``), ``producer_wait`` and ``consumer_wait``
  (fraction of the interval), ``bound`` (``"downstream"``, ``"upstream"``, ``"flowing"``,
  or ``"finished"``: every end of the edge closed or its process exited), ``producers``,
  ``consumers``, ``final``;
- ``"endpoint"``: ``run_id``, ``time``, ``run_s``, ``stage``, ``replica``, ``pid``,
  ``direction`` (``"output"``/``"input"``), ``peer`` (the stage at the other end),
  ``handoffs``, ``bytes``, ``waiting_s``, ``final``;
- ``"pipeline"``: ``run_id``, ``time``, ``run_s``, ``bottleneck`` (a stage or null),
  ``stages`` (per stage ``busy``, ``in_wait``, ``out_wait``), ``final``.

One set per interval (rates and waits over that interval); the last set of an attempt
(``final: true``) holds the counts the stages reported at exit, with rates and waits over
each process's lifetime. Every record also has ``incomplete``: true when some stage's
telemetry could not be written (``reports.read_incomplete``: a full runtime directory) or,
in the final set, when some stage left no final snapshot (it was killed): its figures
then lag behind what really happened. The monitor's headline carries the same mark.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import IO, Any, Iterable

from .. import stage_contract as contract
from ..core.trace import ProcessTrace, chrome_trace, parse_lines
from ..system import files
from ..runtime.telemetry import SNAPSHOT_VERSION
from .reported import Reported, parse
from .reports import INCOMPLETE, MAX_REPORT, clean_report, read_incomplete

__all__ = [
    "STATS_VERSION", "BOUND", "EdgeView", "Analysis", "analyze", "read_snapshots", "status_lines",
    "stats_records", "merge_trace", "Observer",
]

STATS_VERSION = 1
BOUND = 0.2  # a side waiting at least this fraction of the time makes an edge bound
_MAX_SNAPSHOT = MAX_REPORT
_MAX_TRACE_BYTES = 1 << 28  # of one process's trace file
_MAX_TRACE_EVENTS = 2_000_000  # merged, over all processes and attempts
_PRODUCER_WAITS = ("slot", "release_event")


# ---------------------------------------------------------------------------- pure analysis
@dataclass
class EdgeView:
    """One edge over one interval."""

    src: str
    dst: str
    items: int = 0
    bytes: int = 0
    received: int = 0
    items_per_s: float = 0.0
    bytes_per_s: float = 0.0
    slots: int = 0
    occupancy: dict[str, int] = field(default_factory=dict)
    producer_wait: float = 0.0
    consumer_wait: float = 0.0
    producers: int = 0
    consumers: int = 0
    open_ends: int = 0  # producers and consumers neither closed nor exited

    @property
    def name(self) -> str:
        return f"{self.src}->{self.dst}"

    @property
    def slots_used(self) -> int:
        return self.slots - self.occupancy.get("free", 0)

    @property
    def bound(self) -> str:
        """``finished`` (every end closed, or its process exited), ``downstream``
        (producers wait for slots), ``upstream`` (consumers wait for items) or
        ``flowing`` (neither waits ``BOUND`` of the time)."""
        if not self.open_ends:
            return "finished"
        p, c = self.producer_wait, self.consumer_wait
        if p >= BOUND and p >= c:
            return "downstream"
        if c >= BOUND:
            return "upstream"
        return "flowing"


@dataclass
class Analysis:
    edges: list[EdgeView]
    stages: dict[str, dict[str, float]]  # name -> busy, in_wait, out_wait
    bottleneck: str | None


def _key(report: dict[str, Any]) -> tuple[str, Any]:
    return (str(report.get("stage")), report.get("replica"))


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _num(v: Any) -> float:
    return float(v) if _finite(v) else 0.0


def _stats(raw: Any) -> Reported | None:
    """An endpoint's stats as the monitor reads them: a cleaned report's (``Reported``), or
    a raw object read leniently (a field of the wrong type as absent); None for a value
    that is not stats at all."""
    if isinstance(raw, Reported):
        return raw
    try:
        return parse(raw, lenient=True)
    except ValueError:
        return None


def _waits(stats: Reported | None, causes: Iterable[str] | None) -> float:
    if stats is None:
        return 0.0
    return sum(v for k, v in stats.waiting_s.items() if causes is None or k in causes)


def _consumer_wait(stats: Reported | None) -> float:
    """Seconds a consumer (or a FanIn: its own wait plus its sources') waited for items."""
    total = _waits(stats, ("producer",))
    if stats is not None and stats.sources:
        total += sum(_waits(s, ("producer",)) for s in stats.sources.values())
    return total


def _open(report: dict[str, Any], stats: Reported) -> bool:
    """Whether an end of an edge may still move items: not closed, in a process that
    has not exited (a snapshot written at exit is ``final``)."""
    return not stats.closed and report.get("final") is not True


def _frac(now: float, before: float, dt: float) -> float:
    return min(1.0, max(0.0, (now - before) / dt)) if dt > 0 else 0.0


def analyze(prev: dict[tuple[str, Any], dict[str, Any]], cur: dict[tuple[str, Any], dict[str, Any]],
            order: Iterable[str] = (), *, final: bool = False) -> Analysis:
    """Edges, stages and bottleneck over the interval between two sets of stage reports
    (keyed by (stage, replica); each as ``ipcsync.stage`` writes it, with ``mono``: the
    monotonic time it was taken). A report without a predecessor counts from zero over
    its own ``elapsed_s``. ``order``: stage names in spec order (for a stable output).
    ``final``: the reports of a whole attempt, whose every end has finished: edges are
    classified by their waits over the lifetime, never as ``finished``."""
    edges: dict[tuple[str, str], EdgeView] = {}
    in_wait: dict[str, list[float]] = {}
    out_wait: dict[str, list[float]] = {}
    stage_names = list(order)

    def edge(src: str, dst: str) -> EdgeView:
        return edges.setdefault((src, dst), EdgeView(src, dst))

    for key, r in sorted(cur.items(), key=lambda kv: (str(kv[0][0]), str(kv[0][1]))):
        stage = key[0]
        if stage not in stage_names:
            stage_names.append(stage)
        before = prev.get(key) or {}
        dt = _num(r.get("mono")) - _num(before.get("mono")) if before else 0.0
        outs, ins = r.get("outputs"), r.get("inputs")
        b_outs, b_ins = before.get("outputs") or {}, before.get("inputs") or {}
        waits_out: list[float] = []
        waits_in: list[float] = []
        for dst, raw in (outs.items() if isinstance(outs, dict) else ()):
            s = _stats(raw)
            if s is None:
                continue
            b = _stats(b_outs.get(dst))
            b_items, b_bytes = (b.handoffs, b.bytes) if b is not None else (0, 0)
            span = dt if before else s.elapsed_s
            e = edge(stage, str(dst))
            e.producers += 1
            e.open_ends += final or _open(r, s)
            items, nbytes = s.handoffs, s.bytes
            e.items += items
            e.bytes += nbytes
            if span > 0:
                e.items_per_s += max(0, items - b_items) / span
                e.bytes_per_s += max(0, nbytes - b_bytes) / span
            occ = s.occupancy
            if occ is not None:
                for k, v in occ.items():
                    e.occupancy[k] = e.occupancy.get(k, 0) + v
                e.slots += sum(occ.values())
            w = _frac(_waits(s, _PRODUCER_WAITS), _waits(b, _PRODUCER_WAITS), span)
            # A wait is counted when it ends: a producer stuck in one with every slot
            # taken and nothing sent this interval is waiting all along.
            if before and items == b_items and occ and occ.get("free", 0) == 0:
                w = 1.0
            waits_out.append(w)
            e.producer_wait += w
        for src, raw in (ins.items() if isinstance(ins, dict) else ()):
            s = _stats(raw)
            if s is None:
                continue
            b = _stats(b_ins.get(src))
            span = dt if before else s.elapsed_s
            e = edge(str(src), stage)
            e.consumers += 1
            e.open_ends += final or _open(r, s)
            e.received += s.handoffs
            w = _frac(_consumer_wait(s), _consumer_wait(b), span)
            waits_in.append(w)
            e.consumer_wait += w
        in_wait.setdefault(stage, []).append(sum(waits_in))
        out_wait.setdefault(stage, []).append(sum(waits_out))
    for e in edges.values():
        if e.producers:
            e.producer_wait /= e.producers
        if e.consumers:
            e.consumer_wait /= e.consumers
    stages: dict[str, dict[str, float]] = {}
    score: dict[str, float] = {}
    for name in stage_names:
        if name not in in_wait:
            continue
        iw = sum(in_wait[name]) / len(in_wait[name])
        ow = sum(out_wait[name]) / len(out_wait[name])
        busy = max(0.0, 1.0 - min(1.0, iw + ow))
        stages[name] = {"busy": busy, "in_wait": min(1.0, iw), "out_wait": min(1.0, ow)}
        ups = [e.producer_wait for e in edges.values() if e.dst == name]
        downs = [e.consumer_wait for e in edges.values() if e.src == name]
        score[name] = (busy + (sum(ups) / len(ups) if ups else 0.0)
                       + (sum(downs) / len(downs) if downs else 0.0))
    bottleneck = None
    if score and any(e.bound in ("downstream", "upstream") for e in edges.values()):
        bottleneck = max(score, key=lambda n: (score[n], -stage_names.index(n)))
    ordered = sorted(edges.values(), key=lambda e: (_index(stage_names, e.src), _index(stage_names, e.dst)))
    return Analysis(ordered, stages, bottleneck)


def _index(names: list[str], name: str) -> int:
    return names.index(name) if name in names else len(names)


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB/s" if n >= 1e5 else f"{n / 1e3:.1f} kB/s"


def status_lines(a: Analysis, run_s: float) -> list[str]:
    """The monitor's lines for one interval: a headline naming the bottleneck, then one
    line per edge."""
    if a.bottleneck is not None:
        st = a.stages.get(a.bottleneck, {})
        waiting = [f"{e.src} waits for slots {e.producer_wait:.0%}" for e in a.edges
                   if e.dst == a.bottleneck and e.bound == "downstream"]
        waiting += [f"{e.dst} waits for items {e.consumer_wait:.0%}" for e in a.edges
                    if e.src == a.bottleneck and e.bound == "upstream"]
        head = (f"bottleneck: {a.bottleneck} (busy {st.get('busy', 0):.0%}"
                + (f"; {', '.join(waiting)}" if waiting else "") + ")")
    elif a.edges and all(e.bound == "finished" for e in a.edges):
        head = "every edge finished (its ends closed)"
    elif a.edges:
        head = "no bottleneck: no stage waits on another"
    else:
        head = "waiting for the stages' first report"
    lines = [f"monitor {run_s:6.1f} s  {head}"]
    for e in a.edges:
        occ = e.occupancy
        bound = {"downstream": "downstream-bound", "upstream": "upstream-bound"}.get(e.bound, e.bound)
        lines.append(
            f"  {e.src} -> {e.dst}: {e.items_per_s:7.1f} items/s {_mb(e.bytes_per_s):>10}, "
            f"slots {e.slots_used}/{e.slots} used ({occ.get('queued', 0)} queued, {occ.get('in_flight', 0)} in flight), "
            f"producer waits for slots {e.producer_wait:4.0%}, consumer waits for items {e.consumer_wait:4.0%}: "
            f"{bound}; {e.items} sent"
        )
    return lines


def stats_records(a: Analysis, reports: dict[tuple[str, Any], dict[str, Any]], *, run_id: str,
                  now: float, run_s: float, final: bool, incomplete: bool = False) -> list[dict[str, Any]]:
    """The ``--stats-file`` objects of one interval (schema: the module docstring)."""
    common = {"v": STATS_VERSION, "run_id": run_id, "time": now, "run_s": round(run_s, 3), "final": final,
              "incomplete": incomplete}
    out: list[dict[str, Any]] = []
    for e in a.edges:
        out.append({**common, "type": "edge", "edge": e.name, "src": e.src, "dst": e.dst, "items": e.items,
                    "bytes": e.bytes, "received": e.received, "items_per_s": e.items_per_s,
                    "bytes_per_s": e.bytes_per_s, "slots": e.slots, "slots_used": e.slots_used,
                    "occupancy": dict(e.occupancy), "producer_wait": e.producer_wait,
                    "consumer_wait": e.consumer_wait, "bound": e.bound, "producers": e.producers,
                    "consumers": e.consumers})
    for (stage, replica), r in sorted(reports.items(), key=lambda kv: (str(kv[0][0]), str(kv[0][1]))):
        for direction, key in (("output", "outputs"), ("input", "inputs")):
            side = r.get(key)
            for peer, raw in (side.items() if isinstance(side, dict) else ()):
                s = _stats(raw)
                if s is None:
                    continue
                waiting = {"producer": _consumer_wait(s)} if direction == "input" else dict(s.waiting_s)
                out.append({**common, "type": "endpoint", "stage": stage, "replica": replica,
                            "pid": r.get("pid"), "direction": direction, "peer": peer,
                            "handoffs": s.handoffs, "bytes": s.bytes, "waiting_s": waiting})
    out.append({**common, "type": "pipeline", "bottleneck": a.bottleneck, "stages": a.stages})
    return out


# ---------------------------------------------------------------------------- files
def read_snapshots(directory: str, skipped: list[str] | None = None) -> dict[tuple[str, Any], dict[str, Any]]:
    """The stages' latest snapshots in ``directory``, keyed by (stage, replica). Files
    that cannot be read, are too large, are not JSON, not of this snapshot version or
    not of the expected shape are skipped, and so are endpoints whose stats are not
    (``reports.clean_report``); ``skipped`` (if given) gets a line for each of those."""
    out: dict[tuple[str, Any], dict[str, Any]] = {}
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return out
    for name in names:
        if not name.endswith(".json"):
            continue
        try:
            report = files.read_json(os.path.join(directory, name), _MAX_SNAPSHOT)
        except FileNotFoundError:  # its stage is replacing it right now
            continue
        except (OSError, ValueError) as exc:
            if skipped is not None:
                skipped.append(f"{name}: {files.why(exc)}")
            continue
        if isinstance(report, dict) and report.get("v") == SNAPSHOT_VERSION and _finite(report.get("mono")):
            report, problems = clean_report(report, name)
            if skipped is not None:
                skipped += problems
            if report is not None:
                out[_key(report)] = report
    return out


def read_traces(directory: str, labels: dict[int, str], limit: int,
                skipped: list[str] | None = None) -> list[ProcessTrace]:
    """The per-process trace files of ``directory`` (``<pid>.jsonl``, regular files only,
    at most _MAX_TRACE_BYTES read of each); unreadable ones skipped, with a line in
    ``skipped`` (if given). ``labels``: pid -> ``stage/replica`` for processes whose
    header lacks it."""
    traces: list[ProcessTrace] = []
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return traces
    for name in names:
        if not name.endswith(".jsonl"):
            continue
        try:
            t = parse_lines(files.read_lines(os.path.join(directory, name), _MAX_TRACE_BYTES), limit=max(0, limit))
        except OSError as exc:
            if skipped is not None:
                skipped.append(f"{name}: {files.why(exc)}")
            continue
        if t is None:
            continue
        if t.label.startswith("pid ") and t.pid in labels:
            t.label = labels[t.pid]
        limit -= len(t.events)
        traces.append(t)
    return traces


def merge_trace(traces: list[ProcessTrace], path: str, *, other: dict[str, Any] | None = None) -> int:
    """Write the Chrome trace of ``traces`` to ``path`` (whole, then moved into place);
    returns its number of events."""
    data = chrome_trace(traces, other=other)
    files.write_atomic(path, json.JSONEncoder(separators=(",", ":")).iterencode(data), files.SHARED)
    return len(data["traceEvents"])


def _incomplete(run_dir: str, cur: dict[tuple[str, Any], dict[str, Any]], final: bool) -> str | None:
    """Why this interval's figures are incomplete, or None: some stage's telemetry could
    not be written, or (at the end) some stage left no final snapshot."""
    if read_incomplete(os.path.join(run_dir, contract.STATS_DIR)):
        return INCOMPLETE
    if final and any(r.get("final") is not True for r in cur.values()):
        return "incomplete: some stages left no final report"
    return None


# ---------------------------------------------------------------------------- the launcher's part
class Observer:
    """What the supervisor calls: ``env(run_dir)`` before starting an attempt's stages,
    ``tick(run_id, run_dir, order)`` in its poll loop, ``finish(...)`` before it removes
    the run directory (after the stages exited, also when one failed), ``close()`` at
    the end."""

    def __init__(self, *, monitor: bool = False, stats_file: str | None = None, trace_file: str | None = None,
                 interval: float = 1.0, out: IO[str] | None = None) -> None:
        self.monitor = monitor
        self.interval = interval
        self.trace_file = trace_file
        self.out = out if out is not None else sys.stderr
        self.started = time.monotonic()
        self._stats = files.open_append(stats_file, files.SHARED) if stats_file else None
        self._next = time.monotonic() + interval
        self._prev: dict[tuple[str, Any], dict[str, Any]] = {}
        self._traces: list[ProcessTrace] = []
        self._trace_budget = _MAX_TRACE_EVENTS
        self._skipped_said = False  # said that stage telemetry of the wrong shape was skipped
        self._stats_file = stats_file
        self._stats_failed = False  # said that --stats-file could not be written

    @property
    def telemetry(self) -> bool:
        return self.monitor or self._stats is not None

    def env(self, run_dir: str) -> dict[str, str]:
        """Variables for the attempt's stages; creates the directories they name."""
        telemetry_dir: str | None = None
        trace_dir: str | None = None
        if self.telemetry:
            telemetry_dir = os.path.join(run_dir, contract.TELEMETRY_SUBDIR)
            os.makedirs(telemetry_dir, mode=0o700, exist_ok=True)
        if self.trace_file:
            trace_dir = os.path.join(run_dir, contract.TRACE_SUBDIR)
            os.makedirs(trace_dir, mode=0o700, exist_ok=True)
        return contract.observer_env(telemetry_dir=telemetry_dir, interval=max(0.05, min(self.interval / 2, 0.5)),
                                     trace_dir=trace_dir)

    def tick(self, run_id: str, run_dir: str, order: Iterable[str]) -> None:
        """Every interval: read the snapshots, print and write what changed. Never raises."""
        if not self.telemetry or time.monotonic() < self._next:
            return
        self._next = time.monotonic() + self.interval
        try:
            self._report(run_id, run_dir, list(order), final=False)
        except Exception as exc:  # the view must never take the pipeline down
            self._say(f"monitor: skipped an interval ({type(exc).__name__}: {exc})")

    def finish(self, run_id: str, run_dir: str, order: Iterable[str], labels: dict[int, str]) -> None:
        """The attempt is over (its stages exited): the final stats and the merged trace."""
        if self.telemetry:
            try:
                self._report(run_id, run_dir, list(order), final=True)
            except Exception as exc:
                self._say(f"monitor: no final report ({type(exc).__name__}: {exc})")
        self._prev = {}
        if self.trace_file:
            try:
                unread: list[str] = []
                traces = read_traces(os.path.join(run_dir, contract.TRACE_SUBDIR), labels, self._trace_budget, unread)
                if unread:
                    self._say(f"trace: skipped trace files that cannot be read: {'; '.join(unread[:4])}"
                              + (f" and {len(unread) - 4} more" if len(unread) > 4 else ""))
                for t in traces:
                    t.label = f"{t.label} run {run_id}" if len(self._traces) else t.label
                self._trace_budget -= sum(len(t.events) for t in traces)
                self._traces.extend(traces)
                n = merge_trace(self._traces, self.trace_file, other={"run_ids": run_id})
                dropped = sum(t.dropped for t in self._traces)
                self._say(f"trace: {n} events from {len(self._traces)} processes written to {self.trace_file}"
                          + (f" ({dropped} events dropped: over the cap or not written)" if dropped else "")
                          + (f" ({INCOMPLETE})" if read_incomplete(os.path.join(run_dir, contract.STATS_DIR)) else ""))
            except Exception as exc:
                self._say(f"trace: not written ({type(exc).__name__}: {exc})")

    def close(self) -> None:
        if self._stats is not None:
            os.close(self._stats)
            self._stats = None

    def _report(self, run_id: str, run_dir: str, order: list[str], final: bool) -> None:
        skipped: list[str] = []
        cur = read_snapshots(os.path.join(run_dir, contract.TELEMETRY_SUBDIR), skipped)
        if skipped and not self._skipped_said:
            self._skipped_said = True
            self._say(f"monitor: skipping stage telemetry that cannot be used: {skipped[0]}"
                      + (f" (and {len(skipped) - 1} more)" if len(skipped) > 1 else ""))
        if not cur and not final:
            return
        # The final report covers the whole attempt (rates and waits over each
        # process's lifetime); the others, the last interval.
        a = analyze({} if final else self._prev, cur, order, final=final)
        run_s = time.monotonic() - self.started
        note = _incomplete(run_dir, cur, final)
        if self.monitor and (cur or final):
            for i, line in enumerate(status_lines(a, run_s)):
                line = line if not final else line.replace("monitor", "monitor (final)", 1)
                self._say(f"{line} ({note})" if note and i == 0 else line)
        if self._stats is not None and not self._stats_failed:
            records = stats_records(a, cur, run_id=run_id, now=time.time(), run_s=run_s, final=final,
                                    incomplete=note is not None)
            try:
                files.write_all(self._stats,
                                "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records).encode())
            except OSError as exc:
                self._stats_failed = True
                self._say(f"cannot write --stats-file {self._stats_file} ({exc.strerror or exc}): it stops here, "
                          "incomplete")
        self._prev = cur

    def _say(self, line: str) -> None:
        try:
            print(f"ipcsync-run: {line}", file=self.out, flush=True)
        except (OSError, ValueError):
            pass
