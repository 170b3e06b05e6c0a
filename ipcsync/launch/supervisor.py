"""The supervisor: starts a plan's processes, relays their output, and stops them.

Lifecycle of one attempt (torchrun's elastic agent is the model):

1. start: the run directory (0700) holds every endpoint socket and the stats reports;
   each process starts in its own session and process group, stdin from /dev/null,
   stdout+stderr into a pipe; on Linux it also gets SIGTERM if the launcher dies;
2. poll: every line a process writes is printed as ``[stage/replica] line``; a process
   exiting 0 is done; the first one exiting non-zero (or killed) is the root cause;
   SIGINT/SIGTERM to the launcher is forwarded to every process group;
3. close: SIGTERM to every group still running, up to ``stop_timeout`` for them to exit,
   then SIGKILL to every group (stragglers such as resource trackers included), then the
   run directory and every shared-memory segment tagged with the run id are removed.

Invariants: nothing of an attempt outlives ``close`` (no process in its groups, no socket
file, no /dev/shm segment of its run id); the launcher's exit code is the root cause's
(128 + signal for a killed process or an interrupted launcher, 0 when all exited 0).
``restart = N`` in the spec starts the whole group again, up to N times, after a failure
(not after an interrupt): a stage that died mid-record may have wedged its partners'
GPU streams, so partners are restarted too, never reconnected.
"""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import IO, Any, Callable

from .. import _host
from ..backends.cpu import remove_run_segments
from .plan import Instance, Plan

__all__ = ["Supervisor", "Outcome", "exit_code_of"]

_READ_CHUNK = 65536
_MAX_PARTIAL = 1 << 16  # a line longer than this is printed in pieces
_PR_SET_PDEATHSIG = 1
_OWNER = "owner.json"


@dataclass
class Outcome:
    """How an attempt ended."""

    code: int  # the launcher's exit code for it
    cause: str | None  # one line; None when every process exited 0
    interrupted: int | None = None  # the signal that stopped the launcher, if one did
    stats: list[dict[str, Any]] = field(default_factory=list)


def exit_code_of(returncode: int) -> int:
    """A Popen returncode as a shell would report it (killed by signal N -> 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


def _describe(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with code {returncode}"


class _Proc:
    """One running instance: its process, output pipe and partial line."""

    def __init__(self, inst: Instance, popen: subprocess.Popen[bytes] | None, started: float) -> None:
        self.inst = inst
        self.popen = popen
        self.started = started
        self.partial = b""
        self.returncode: int | None = None if popen is not None else 127
        self.pipe_open = popen is not None

    @property
    def running(self) -> bool:
        return self.returncode is None


class Supervisor:
    """Runs a pipeline: ``Supervisor(make_plan, stop_timeout, restart).run()``.

    ``make_plan(run_id, run_dir, attempt)`` resolves the spec for one attempt (pure);
    the supervisor owns everything with a side effect.
    """

    def __init__(
        self,
        make_plan: Callable[[str, str, int], Plan],
        *,
        runtime_base: str,
        restart: int = 0,
        stop_timeout: float = 10.0,
        out: IO[bytes] | None = None,
        err: IO[str] | None = None,
        summary: bool = True,
    ) -> None:
        self._make_plan = make_plan
        self._base = runtime_base
        self._restart = restart
        self._stop_timeout = stop_timeout
        self._out = out if out is not None else sys.stdout.buffer
        self._err = err if err is not None else sys.stderr
        self._summary = summary
        self._signal: int | None = None  # the last signal the launcher got
        self._signals = 0  # how many
        self._out_broken = False  # our stdout's reader is gone
        self._procs: list[_Proc] = []

    # ------------------------------------------------------------------ public
    def run(self) -> int:
        """Run attempts until one succeeds, the launcher is interrupted, or restarts run
        out; return the launcher's exit code."""
        rfd, wfd = os.pipe()
        os.set_blocking(rfd, False)
        os.set_blocking(wfd, False)
        old_handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        old_wakeup = signal.set_wakeup_fd(wfd, warn_on_full_buffer=False)
        try:
            for run_id in sweep_abandoned(self._base):
                self._say(f"removed what an earlier launcher (killed) left of run {run_id}")
            attempt = 0
            while True:
                outcome = self._attempt(attempt, rfd)
                if outcome.code == 0:
                    self._say("all stages finished")
                    if self._summary:
                        for line in summarize(outcome.stats):
                            self._say(line)
                    return 0
                if outcome.interrupted is None and attempt < self._restart:
                    attempt += 1
                    self._say(f"restarting the whole group (restart {attempt} of {self._restart}) after: {outcome.cause}")
                    continue
                self._say(f"failed: {outcome.cause}")
                return outcome.code
        finally:
            signal.set_wakeup_fd(old_wakeup)
            for s, h in old_handlers.items():
                signal.signal(s, h)
            os.close(rfd)
            os.close(wfd)

    # ------------------------------------------------------------------ one attempt
    def _attempt(self, attempt: int, wakeup_fd: int) -> Outcome:
        run_id = secrets.token_hex(4)
        run_dir = os.path.join(self._base, f"run-{run_id}")
        os.makedirs(os.path.join(run_dir, "stats"), mode=0o700)
        os.chmod(run_dir, 0o700)
        me = os.getpid()
        with open(os.path.join(run_dir, _OWNER), "w") as f:  # for sweep_abandoned
            json.dump({"pid": me, "start_time": _host.start_time(me)}, f)
        sel = selectors.DefaultSelector()
        sel.register(wakeup_fd, selectors.EVENT_READ, None)
        self._procs = []
        signals_before = self._signals
        cause: str | None = None
        code = 0
        interrupted: int | None = None
        stats: list[dict[str, Any]] = []
        try:
            plan = self._make_plan(run_id, run_dir, attempt)
            for inst in plan.instances:
                proc = self._start(inst)
                self._procs.append(proc)
                if proc.popen is None:  # could not even start: that is the root cause
                    cause, code = f"stage {inst.label} could not start: {proc.partial.decode()}", 127
                    proc.partial = b""
                    break
                assert proc.popen.stdout is not None
                sel.register(proc.popen.stdout, selectors.EVENT_READ, proc)
            if cause is None:
                self._say(
                    f"started {len(plan.instances)} processes of pipeline {plan.spec.name!r} "
                    f"(run {run_id}{f', restart {attempt}' if attempt else ''})"
                )
            while cause is None and interrupted is None and any(p.running for p in self._procs):
                self._pump(sel, 0.1)
                if self._signal is not None:
                    interrupted = self._signal
                    cause = f"interrupted by {signal.Signals(interrupted).name}"
                    code = 128 + interrupted
                    # Forwarded as is (close() escalates); a closed output pipe is not the
                    # stages' business: they get SIGTERM.
                    self._signal_all(signal.SIGTERM if interrupted == signal.SIGPIPE else interrupted)
                    break
                for p in self._procs:
                    if p.running and _reap(p):
                        if p.returncode != 0 and cause is None:
                            cause = (
                                f"stage {p.inst.label} (pid {p.popen.pid}) {_describe(p.returncode)} "
                                f"after {time.monotonic() - p.started:.1f} s"
                            )
                            code = exit_code_of(p.returncode)
            if cause is not None:
                self._say(f"root cause: {cause}; stopping the other stages")
        finally:
            self._close(sel, forwarded=interrupted is not None)
            if interrupted is None and self._signals != signals_before:
                # Interrupted while stopping a failed attempt: no restart; the failure
                # stays the root cause and sets the exit code.
                interrupted = self._signal
            if cause is None:
                stats = _read_stats(os.path.join(run_dir, "stats"))
            _remove_run(run_dir, run_id)
            sel.close()
        return Outcome(code, cause, interrupted, stats)

    def _start(self, inst: Instance) -> _Proc:
        env = dict(os.environ)
        env.update(inst.env)
        parent = os.getpid()
        try:
            popen = subprocess.Popen(
                list(inst.cmd), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, env=env, cwd=inst.cwd, start_new_session=True,
                preexec_fn=lambda: _die_with_parent(parent), close_fds=True,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            proc = _Proc(inst, None, time.monotonic())
            proc.partial = f"{exc} (cmd {list(inst.cmd)})".encode()
            return proc
        os.set_blocking(popen.stdout.fileno(), False)  # type: ignore[union-attr]
        return _Proc(inst, popen, time.monotonic())

    def _pump(self, sel: selectors.BaseSelector, timeout: float) -> None:
        """Relay output (and notice signals) for up to ``timeout`` seconds."""
        for key, _ in sel.select(timeout):
            if key.data is None:  # the signal wakeup pipe
                try:
                    os.read(key.fd, 512)
                except BlockingIOError:
                    pass
                continue
            proc: _Proc = key.data
            try:
                chunk = os.read(key.fd, _READ_CHUNK)
            except BlockingIOError:
                continue
            except OSError:
                chunk = b""
            if not chunk:
                sel.unregister(key.fileobj)
                proc.pipe_open = False
                self._emit(proc, final=True)
            else:
                proc.partial += chunk
                self._emit(proc)

    def _emit(self, proc: _Proc, final: bool = False) -> None:
        data = proc.partial
        lines = data.split(b"\n")
        proc.partial = lines.pop()
        if len(proc.partial) > _MAX_PARTIAL or (final and proc.partial):
            lines.append(proc.partial)
            proc.partial = b""
        if lines and not self._out_broken:
            prefix = f"[{proc.inst.label}] ".encode()
            try:
                self._out.write(b"".join(prefix + line + b"\n" for line in lines))
                self._out.flush()
            except (BrokenPipeError, ValueError, OSError):
                # Nobody reads our output (``| head`` exited): stop as if by SIGPIPE.
                self._out_broken = True
                self._on_signal(signal.SIGPIPE, None)

    def _signal_all(self, signum: int) -> None:
        for p in self._procs:
            if p.running and p.popen is not None:
                _killpg(p.popen.pid, signum)

    def _close(self, sel: selectors.BaseSelector, forwarded: bool) -> None:
        """Stop every process: SIGTERM (unless a signal was just forwarded), up to
        stop_timeout, then SIGKILL to every group; relay their last output."""
        if not forwarded:
            self._signal_all(signal.SIGTERM)
        deadline = time.monotonic() + self._stop_timeout
        signals_before = self._signals
        while True:
            for p in self._procs:
                if p.running:
                    _reap(p)
            if not any(p.running for p in self._procs) or time.monotonic() >= deadline:
                break
            if self._signals != signals_before:
                break  # interrupted (again) while stopping: kill now
            self._pump(sel, 0.05)
        for p in self._procs:
            if p.running and p.popen is not None:
                _killpg(p.popen.pid, signal.SIGKILL)  # leader not reaped: the group id is still ours
                deadline = time.monotonic() + 5
                while not _reap(p) and time.monotonic() < deadline:
                    time.sleep(0.01)
        # Last output: pipes reach EOF once every holder is dead.
        end = time.monotonic() + 1.0
        while any(p.pipe_open for p in self._procs) and time.monotonic() < end:
            self._pump(sel, 0.05)
        for p in self._procs:
            if p.popen is not None and p.popen.stdout is not None:
                if p.partial:
                    self._emit(p, final=True)
                p.popen.stdout.close()
                p.pipe_open = False

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._signal = signum
        self._signals += 1

    def _say(self, line: str) -> None:
        try:
            self._err.write(f"ipcsync-run: {line}\n")
            self._err.flush()
        except (BrokenPipeError, ValueError, OSError):
            pass


# ---------------------------------------------------------------------------- helpers
def _reap(p: _Proc) -> bool:
    """If ``p``'s leader has exited: SIGKILL what is left of its process group, then reap
    it, and return True. The group is killed while the leader is still a zombie, so its
    id cannot have been reused by an unrelated group."""
    if p.popen is None or not p.running:
        return True
    try:
        info = os.waitid(os.P_PID, p.popen.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped already (by Popen)
        info = True
    if info is None:
        return False
    _killpg(p.popen.pid, signal.SIGKILL)
    p.popen.wait()
    p.returncode = p.popen.returncode
    return True


def _killpg(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _die_with_parent(parent: int) -> None:
    """In the child before exec: get SIGTERM when the launcher dies (Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the launcher died before prctl took effect
        os._exit(1)


def _remove_run(run_dir: str, run_id: str) -> None:
    """Remove the run directory (sockets, locks, reports) and the run's shm segments."""
    shutil.rmtree(run_dir, ignore_errors=True)
    remove_run_segments(run_id)


def sweep_abandoned(base: str) -> list[str]:
    """Remove run directories (and their shm segments) of launchers that died without
    cleaning up (SIGKILL); their stages got SIGTERM when they died. Returns the run ids."""
    removed = []
    try:
        names = os.listdir(base)
    except OSError:
        return []
    for name in names:
        if not name.startswith("run-") or len(name) != 12:
            continue
        path = os.path.join(base, name)
        try:
            with open(os.path.join(path, _OWNER), "rb") as f:
                owner = json.loads(f.read(4096))
            pid, started = int(owner["pid"]), int(owner["start_time"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not ours, or being created right now
        if not _host.process_alive(pid, started):
            _remove_run(path, name[4:])
            removed.append(name[4:])
    return removed


def _read_stats(directory: str) -> list[dict[str, Any]]:
    """The per-process reports stages left (JSON written by ipcsync.stage at exit)."""
    reports = []
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    for name in names:
        if not name.endswith(".json"):
            continue
        try:
            with open(os.path.join(directory, name), "rb") as f:
                raw = f.read(1 << 20)
            report = json.loads(raw)
        except (OSError, ValueError):
            continue
        if isinstance(report, dict):
            reports.append(report)
    return reports


def summarize(reports: list[dict[str, Any]]) -> list[str]:
    """Per-edge lines from the stages' reports: items, bytes and rate as the producers
    counted them, latency (send to receipt) as the consumers measured it."""
    edges: dict[tuple[str, str], dict[str, Any]] = {}
    for r in reports:
        stage = r.get("stage")
        for dst, s in (r.get("outputs") or {}).items():
            e = edges.setdefault((stage, dst), {"items": 0, "bytes": 0, "elapsed": 0.0, "lat": [], "waits": {}})
            e["items"] += int(s.get("handoffs", 0))
            e["bytes"] += int(s.get("bytes", 0))
            e["elapsed"] = max(e["elapsed"], float(s.get("elapsed_s", 0.0)))
            for cause, sec in (s.get("waiting_s") or {}).items():
                e["waits"][f"producer:{cause}"] = e["waits"].get(f"producer:{cause}", 0.0) + float(sec)
        for src, s in (r.get("inputs") or {}).items():
            e = edges.setdefault((src, stage), {"items": 0, "bytes": 0, "elapsed": 0.0, "lat": [], "waits": {}})
            for one in (s.get("sources") or {"": s}).values():
                lat = one.get("latency_s") or {}
                if lat.get("p50") is not None:
                    e["lat"].append((lat["p50"], lat.get("p99") or lat["p50"]))
                for cause, sec in (one.get("waiting_s") or {}).items():
                    e["waits"][f"consumer:{cause}"] = e["waits"].get(f"consumer:{cause}", 0.0) + float(sec)
    if not edges:
        return []
    lines = ["edge summary:"]
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
    return lines
