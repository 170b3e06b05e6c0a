"""What a stage process tells a monitoring launcher: periodic stats snapshots and a trace
of its handoffs. Off unless ``ipcsync-run`` asked for it through the environment; a
process not started by a monitoring launcher does nothing here (the endpoints' hooks see
``None`` and skip, one attribute check each).

- ``$IPCSYNC_TELEMETRY_DIR`` (``ipcsync-run --monitor`` / ``--stats-file``): a daemon
  thread writes ``report()`` (the stage's per-edge ``stats()``, see ``ipcsync.stage``) as
  JSON to ``<dir>/<stage>.<replica>.json`` every ``$IPCSYNC_TELEMETRY_INTERVAL`` seconds
  (default 0.5) and once more at exit; each write is a new file moved into place, so a
  reader sees a whole snapshot or the previous one.
- ``$IPCSYNC_TRACE_DIR`` (``ipcsync-run --trace``): every endpoint of the process gets an
  ``EdgeTracer`` whose events (send, ready, receipt, release, freed) go into one bounded
  per-process buffer; a daemon thread appends them to ``<dir>/<pid>.jsonl`` every
  interval and at exit. Memory is bounded: at most ``BUFFER_CAP`` events wait between
  flushes and at most ``$IPCSYNC_TRACE_MAX_EVENTS`` are written; the rest are counted as
  dropped (the file says how many).

Telemetry that cannot be written (a full runtime directory: ENOSPC) never disturbs the
stage, and is never silent: the first failure of the process is logged once (a warning:
what could not be written, and that the launcher's figures for this process will be
incomplete) and leaves an empty-or-short marker file (``set_failure_marker``: under
ipcsync-run, ``stats/<stage>.<replica>.incomplete``; creating an empty file needs no data
block, so it usually succeeds on a full disk) that the launcher reports and marks its
figures with. Trace events lost to a failed flush are counted as dropped.

Trace file lines (JSON, no pickle): a header object ``{"v": 1, "pid", "stage",
"replica"}``, then one array per event ``[kind, edge, seq, ts_ns, tid, arg]`` (``ts_ns``:
``time.monotonic_ns()``, one clock for every process of the host), ``["T", tid, name]``
the first time a thread records, and ``{"dropped": n}`` whenever the count grows. The
launcher (``ipcsync.launch.monitor``) merges the files into a Chrome trace.

Imports neither torch nor zmq.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import time
from collections import deque
from typing import Any, Callable

from ..envopts import TRACE_MAX_EVENTS
from ..stage_contract import REPLICA, STAGE, TELEMETRY_DIR, TELEMETRY_INTERVAL, TRACE_DIR
from ..system import files

log = logging.getLogger(__name__)

__all__ = [
    "ENV_TELEMETRY", "ENV_TRACE", "ENV_INTERVAL", "ENV_TRACE_MAX", "TRACE_VERSION", "SNAPSHOT_VERSION",
    "BUFFER_CAP", "EdgeTracer", "TraceBuffer", "tracer_for", "edge_key", "publish_periodically",
    "set_failure_marker", "write_failed",
]

ENV_TELEMETRY = TELEMETRY_DIR.name
ENV_TRACE = TRACE_DIR.name
ENV_INTERVAL = TELEMETRY_INTERVAL.name
ENV_TRACE_MAX = TRACE_MAX_EVENTS.name
TRACE_VERSION = 1
SNAPSHOT_VERSION = 1
BUFFER_CAP = 200_000  # events waiting for the next flush, at most
DEFAULT_TRACE_MAX = TRACE_MAX_EVENTS.default  # events one process writes, at most
DEFAULT_INTERVAL = TELEMETRY_INTERVAL.default

# Event kinds, as written.
SEND, READY, RECEIPT, RELEASE, FREED = "send", "ready", "receipt", "release", "freed"


def edge_key(name: str) -> str:
    """The name both ends of a connection use for endpoint ``name`` in a trace: for
    ``ipc://`` the socket's file name without ``.sock`` (``loader.0-train`` under
    ipcsync-run), else the name as given (a bare name, ``tcp://...``)."""
    if name.startswith("ipc://"):
        base = os.path.basename(name)
        return base[:-5] if base.endswith(".sock") else base
    return name


class TraceBuffer:
    """This process's trace events, flushed to ``<dir>/<pid>.jsonl`` by a daemon thread.

    ``add`` may be called from any thread: a deque's append and popleft are atomic, and
    only the flusher pops. Bounded: ``cap`` events between flushes, ``max_events`` in all;
    the others are counted in ``dropped``."""

    def __init__(self, directory: str, *, cap: int = BUFFER_CAP, max_events: int = DEFAULT_TRACE_MAX,
                 interval: float = DEFAULT_INTERVAL) -> None:
        self.path = os.path.join(directory, f"{os.getpid()}.jsonl")
        self.pid = os.getpid()
        self.cap = cap
        self.max_events = max_events
        self.interval = interval
        self.events: deque[Any] = deque()
        self.dropped = 0
        self.written = 0
        self.tids: set[int] = set()
        self._dropped_said = 0
        self._flush_lock = threading.Lock()
        self._stop = threading.Event()
        self._header = {"v": TRACE_VERSION, "pid": self.pid, "stage": STAGE.get() or "",
                        "replica": REPLICA.get() or ""}
        self._started = False

    def start(self) -> None:
        if self._started:
            return
        self._started = True
        threading.Thread(target=self._loop, name="ipcsync.trace", daemon=True).start()
        atexit.register(self.flush)

    def add(self, kind: str, edge: str, seq: int, ts_ns: int, arg: Any = None) -> None:
        if len(self.events) >= self.cap or self.written + len(self.events) >= self.max_events:
            self.dropped += 1
            return
        tid = threading.get_native_id()
        if tid not in self.tids:
            self.tids.add(tid)
            self.events.append(["T", tid, threading.current_thread().name])
        self.events.append([kind, edge, seq, ts_ns, tid, arg])

    def flush(self) -> None:
        """Append what is buffered to the file (never raises: a run directory removed
        under us means nobody wants the trace any more)."""
        if os.getpid() != self.pid:  # a forked child: the buffer is the parent's
            return
        with self._flush_lock:
            n = len(self.events)
            if not n and self.dropped == self._dropped_said and self.written:
                return
            lines = []
            if not self.written and not os.path.exists(self.path):
                lines.append(json.dumps(self._header))
            pop = self.events.popleft
            for _ in range(n):
                lines.append(json.dumps(pop(), separators=(",", ":"), default=str))
            if self.dropped != self._dropped_said:
                self._dropped_said = self.dropped
                lines.append(json.dumps({"dropped": self.dropped}))
            if not lines:
                return
            try:
                files.append(self.path, ("\n".join(lines) + "\n").encode())
            except OSError as exc:
                # Lost: counted as dropped (said in the next line that gets written).
                self.dropped += n
                write_failed("trace events", exc)
                return
            self.written += n

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.flush()


class EdgeTracer:
    """One endpoint's view of the process's ``TraceBuffer``: what it records per item.
    ``ts_ns`` arguments are clock readings the hot path made anyway; the others read the
    clock here (only ever when tracing)."""

    __slots__ = ("buf", "edge")

    def __init__(self, buf: TraceBuffer, edge: str) -> None:
        self.buf = buf
        self.edge = edge

    def sent(self, seq: int, slot: int, ts_ns: int, nbytes: int) -> None:
        self.buf.add(SEND, self.edge, seq, ts_ns, [slot, nbytes])

    def ready(self, seq: int, consumer: str) -> None:
        self.buf.add(READY, self.edge, seq, time.monotonic_ns(), consumer)

    def received(self, seq: int, ts_ns: int) -> None:
        self.buf.add(RECEIPT, self.edge, seq, ts_ns)

    def released(self, seq: int) -> None:
        self.buf.add(RELEASE, self.edge, seq, time.monotonic_ns())

    def freed(self, seq: int, ts_ns: int) -> None:
        self.buf.add(FREED, self.edge, seq, ts_ns)


_buffer: TraceBuffer | None = None
_buffer_lock = threading.Lock()


def tracer_for(name: str) -> EdgeTracer | None:
    """The tracer of the endpoint named ``name``, or None when this
    process is not traced (no ``$IPCSYNC_TRACE_DIR``): the endpoints' hooks then skip."""
    global _buffer
    directory = TRACE_DIR.get()
    if not directory:
        return None
    with _buffer_lock:
        if _buffer is None or _buffer.pid != os.getpid():
            _buffer = TraceBuffer(directory, max_events=TRACE_MAX_EVENTS.get(), interval=TELEMETRY_INTERVAL.get())
            _buffer.start()
        return EdgeTracer(_buffer, edge_key(name))


_publisher_started = False


def publish_periodically(name: str, report: Callable[[], dict[str, Any]]) -> bool:
    """With ``$IPCSYNC_TELEMETRY_DIR`` set, write ``report()`` to ``<dir>/<name>.json`` every
    interval and at exit (once per process; later calls do nothing). False when off.
    ConfigError for a ``$IPCSYNC_TELEMETRY_INTERVAL`` that is not seconds from 0.01 to 3600."""
    global _publisher_started
    directory = TELEMETRY_DIR.get()
    if not directory:
        return False
    interval = TELEMETRY_INTERVAL.get()
    with _buffer_lock:
        if _publisher_started:
            return True
        _publisher_started = True
    path = os.path.join(directory, f"{name}.json")
    # One write at a time, none after the final one: a periodic write landing after the
    # exit's would leave a stale, non-final snapshot as the last word.
    write_lock = threading.Lock()
    finished = False

    def write(final: bool) -> None:
        nonlocal finished
        with write_lock:
            if finished:
                return
            finished = final
            try:
                snap = report()
                snap.update(v=SNAPSHOT_VERSION, pid=os.getpid(), time=time.time(), mono=time.monotonic(),
                            final=final)
                files.write_atomic(path, json.dumps(snap, default=str))
            except OSError as exc:
                write_failed("stats snapshot", exc)
            except Exception:  # a snapshot is best effort: never disturb the stage
                pass

    def loop() -> None:
        while True:
            time.sleep(interval)
            write(False)

    threading.Thread(target=loop, name="ipcsync.telemetry", daemon=True).start()
    atexit.register(write, True)
    return True


_failure_marker: str | None = None
_failure_said = False


def set_failure_marker(path: str) -> None:
    """Where ``write_failed`` leaves its marker for the launcher (``ipcsync.stage`` sets it
    from the wiring)."""
    global _failure_marker
    _failure_marker = path


def write_failed(what: str, exc: OSError) -> None:
    """Telemetry of this process (``what``: "exit stats", "trace events", ...) could not be
    written. The first time in the process: log a warning and leave the marker (best
    effort: its text may not fit on a full disk, the empty file usually does). Never
    raises. A directory that is gone (the launcher removed the run's) is no failure:
    nobody reads it any more."""
    global _failure_said
    if isinstance(exc, FileNotFoundError):
        return
    with _buffer_lock:
        if _failure_said:
            return
        _failure_said = True
    reason = f"{what}: {exc.strerror or exc}"
    marker = _failure_marker
    where = (os.path.dirname(exc.filename) if isinstance(exc.filename, str)
             else os.path.dirname(os.path.dirname(marker)) if marker else "the runtime directory")
    log.warning("ipcsync: telemetry could not be written (%s); the launcher's figures for this process "
                "(summary, --stats-file, --monitor, --trace) will be incomplete. Free space in %s, or set "
                "IPCSYNC_RUNTIME_DIR to a directory with room.", reason, where)
    if marker is None:
        return
    try:
        fd = files.create_new(marker)
    except OSError:
        return  # there already (another thread's), or the directory is gone
    try:
        files.write_all(fd, reason.encode()[:400])
    except OSError:
        pass  # the empty marker says enough
    finally:
        os.close(fd)
