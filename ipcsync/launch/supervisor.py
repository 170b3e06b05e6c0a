"""The supervisor: starts a plan's processes, relays their output, and stops them.

Lifecycle of one attempt (torchrun's elastic agent is the model; one method each:
``_start_all``, ``_poll``, ``_close_attempt``, around ``_stop(death_sig, timeout)``):

1. start: the run directory (0700) holds every endpoint socket, the stats reports and
   ``owner.json`` (the launcher's and every stage's pid, start time and process group);
   each process starts in its own session and process group, stdin from /dev/null,
   stdout+stderr into a pipe, and gets SIGTERM if the launcher dies (``stageproc``);
2. poll: every line a process writes is printed as ``[stage/replica] line`` (``relay``);
   a process exiting 0 is done; the first one exiting non-zero (or killed) is the root
   cause (``rootcause``: unless it only died of a peer's failure); SIGINT or SIGTERM to
   the launcher (``signals``) sends SIGTERM to every process group (SIGTERM, not SIGINT:
   a Python stage then ends without a KeyboardInterrupt traceback);
3. close: SIGTERM to every group still running, up to ``stop_timeout`` for them to exit,
   then SIGKILL to every group (stragglers such as resource trackers included); with
   ``contain`` (the launcher), SIGKILL to every remaining descendant of the launcher
   (daemons that left their group: the launcher is a child subreaper, so they are its
   descendants); then the run directory and every shared-memory segment tagged with the
   run id are removed. What removes processes, directories and segments, here and after
   a launcher that was killed, is ``launch.cleanup``.

Invariants: nothing of an attempt outlives ``close`` (no process in its groups, with
``contain`` no descendant at all, no socket file, no /dev/shm segment of its run id); a
run directory is removed only once no process of its run lives (``sweep_abandoned``
kills what a SIGKILLed launcher left before removing its directory); the launcher's exit
code is the root cause's (128 + signal for a killed process or an interrupted launcher,
0 when all exited 0).
Over several nodes (``group``, a ``nodes.NodeGroup``): the root cause is the group's (the
first node to fail publishes it, every node stops its stages on it and prints it), an
attempt succeeds once every node's stages exited 0, and a node or a store that is gone
fails the group for good (no restart).
``restart = N`` in the spec starts the whole group again, up to N times, after a failure
(not after an interrupt): a stage that died mid-record may have wedged its partners'
GPU streams, so partners are restarted too, never reconnected.
"""

from __future__ import annotations

import logging
import os
import secrets
import selectors
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import IO, Any, Callable

from ..errors import ConfigError
from ..system import host
from ..stage_contract import STATS_DIR
from .cleanup import (
    OWNER_FILE, kill_descendants, reap_orphans, remove_run, set_child_subreaper, sweep_abandoned, write_owner,
)
from .plan import Plan
from .relay import OutputRelay
from .reports import incomplete_line, read_incomplete, read_stats
from .rootcause import fault_hint, root_cause
from .signals import LauncherSignals
from .stageproc import StageProc, exit_code_of, killpg, reap, spawn
from .summary import summarize

__all__ = ["Supervisor", "Outcome", "exit_code_of", "fault_hint", "sweep_abandoned", "summarize"]

# The supervisor's own debug lines (``ipcsync-run --log-level debug``); its status lines
# (starts, stops, root cause, summary) are program output, written by ``_say``.
log = logging.getLogger(__name__)

_ORPHAN_REAP_INTERVAL = 1.0  # seconds between reaping orphans re-parented to the launcher


@dataclass
class Outcome:
    """How an attempt ended."""

    code: int  # the launcher's exit code for it
    cause: str | None  # one line; None when every process exited 0
    interrupted: int | None = None  # the signal that stopped the launcher, if one did
    final: bool = False  # no restart, whatever the policy (a node of the group is gone)
    stats: list[dict[str, Any]] = field(default_factory=list)
    incomplete: bool = False  # some stage's telemetry could not be written: stats are partial


@dataclass
class _Attempt:
    """What one attempt has: its run, its selector, and how it ended (``cause`` None
    while it runs)."""

    attempt: int
    run_id: str
    run_dir: str
    owner: dict[str, Any]  # owner.json's content
    sel: selectors.BaseSelector
    signals_before: int  # the launcher's signal count when the attempt began
    plan: Plan | None = None
    cause: str | None = None
    code: int = 0
    interrupted: int | None = None  # the signal that stopped the launcher, if one did
    final: bool = False  # no restart, whatever the policy
    owner_said: bool = False  # a failure to update owner.json was said

    def end(self, cause: str, code: int, final: bool = False) -> None:
        """The attempt's root cause and exit code."""
        self.cause, self.code, self.final = cause, code, final


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
        contain: bool = False,
        observer: Any = None,
        group: Any = None,
    ) -> None:
        """``contain``: this process does nothing but supervise (the launcher): it becomes
        a child subreaper, and at the end of every attempt kills every descendant it
        has, whichever group or session it moved to. ``observer``: a
        ``monitor.Observer`` (``--monitor``, ``--stats-file``, ``--trace``) or None. ``group``:
        a ``nodes.NodeGroup`` (``--nnodes``), whose ``rendezvous`` ``make_plan`` calls."""
        self._make_plan = make_plan
        self._base = runtime_base
        self._restart = restart
        self._stop_timeout = stop_timeout
        self._err = err if err is not None else sys.stderr
        self._summary = summary
        self._contain = contain
        self._signals = LauncherSignals()
        self._relay = OutputRelay(out if out is not None else sys.stdout.buffer,
                                  on_broken=lambda: self._signals.note(signal.SIGPIPE))
        self._procs: list[StageProc] = []
        self._observer = observer
        self._extra_env: dict[str, str] = {}  # the observer's, for this attempt's stages
        self._group = group

    # ------------------------------------------------------------------ public
    def run(self) -> int:
        """Run attempts until one succeeds, the launcher is interrupted, or restarts run
        out; return the launcher's exit code."""
        with self._signals.watching() as wakeup_fd:
            if self._contain and not set_child_subreaper():
                self._say("cannot become a child subreaper here (not Linux?): processes that a stage "
                          "daemonizes are not stopped with it")
            try:
                for run_id in sweep_abandoned(self._base, say=self._say):
                    self._say(f"removed what an earlier launcher (killed) left of run {run_id}")
                attempt = 0
                while True:
                    outcome = self._attempt(attempt, wakeup_fd)
                    if outcome.code == 0:
                        self._say("all stages finished")
                        if self._summary:
                            for line in summarize(outcome.stats, incomplete=outcome.incomplete):
                                self._say(line)
                        return 0
                    if outcome.interrupted is None and not outcome.final and attempt < self._restart:
                        attempt += 1
                        self._say(f"restarting the whole group (restart {attempt} of {self._restart}) "
                                  f"after: {outcome.cause}")
                        continue
                    self._say(f"failed: {outcome.cause}")
                    return outcome.code
            finally:
                if self._group is not None:
                    self._group.finish()

    # ------------------------------------------------------------------ one attempt
    def _attempt(self, attempt: int, wakeup_fd: int) -> Outcome:
        """One attempt: ``start``, ``poll`` until it ends, ``close`` (always)."""
        a = self._open(attempt, wakeup_fd)
        try:
            self._start_all(a)
            if a.cause is None:
                self._poll(a)
            if a.cause is not None and a.interrupted is None:
                self._say(f"root cause: {a.cause}; stopping the other stages")
        finally:
            outcome = self._close_attempt(a)
        return outcome

    def _open(self, attempt: int, wakeup_fd: int) -> _Attempt:
        """A fresh run id, its run directory (0700) with ``owner.json``, and the selector
        that relays output and notices signals. ConfigError if the directory cannot be
        written."""
        run_id = secrets.token_hex(4)
        run_dir = os.path.join(self._base, f"run-{run_id}")
        os.makedirs(os.path.join(run_dir, STATS_DIR), mode=0o700)
        os.chmod(run_dir, 0o700)
        owner: dict[str, Any] = {"pid": os.getpid(), "start_time": host.start_time(os.getpid()), "stages": []}
        try:
            write_owner(run_dir, owner)  # for sweep_abandoned
        except OSError as exc:
            remove_run(run_dir, run_id)
            raise ConfigError(f"cannot write to the runtime directory {self._base} ({exc.strerror or exc}): free "
                              "space there, or set IPCSYNC_RUNTIME_DIR to a directory with room") from None
        sel = selectors.DefaultSelector()
        sel.register(wakeup_fd, selectors.EVENT_READ, None)
        self._procs = []
        return _Attempt(attempt, run_id, run_dir, owner, sel, self._signals.count)

    def _start_all(self, a: _Attempt) -> None:
        """start: resolve the plan, start every process and record it in ``owner.json``;
        a process that cannot start is the root cause (exit 127), and the rest stay
        unstarted."""
        a.plan = self._make_plan(a.run_id, a.run_dir, a.attempt)
        if self._observer is not None:
            self._extra_env = self._observer.env(a.run_dir)
        for inst in a.plan.instances:
            proc = spawn(inst, self._extra_env)
            if proc.popen is not None:
                log.debug("started stage %s: pid %d, command %s, cwd %s", inst.label, proc.popen.pid,
                          list(inst.cmd), inst.cwd or os.getcwd())
            self._procs.append(proc)
            if proc.popen is None:  # could not even start: that is the root cause
                a.end(f"stage {inst.label} could not start: {proc.partial.decode()}", 127)
                proc.partial = b""
                return
            self._record_owner(a, proc.popen.pid, inst.label)
            assert proc.popen.stdout is not None
            a.sel.register(proc.popen.stdout, selectors.EVENT_READ, proc)
        n = len(a.plan.instances)
        self._say(
            f"started {n} process{'es' if n != 1 else ''} of pipeline {a.plan.spec.name!r} "
            f"(run {a.run_id}{f', restart {a.attempt}' if a.attempt else ''})"
        )

    def _record_owner(self, a: _Attempt, pid: int, label: str) -> None:
        """Add a started stage to ``owner.json`` (what ``sweep_abandoned`` kills if this
        launcher is killed); a full runtime directory is said once, not fatal."""
        a.owner["stages"].append({"label": label, "pid": pid, "start_time": host.start_time(pid), "pgid": pid})
        try:
            write_owner(a.run_dir, a.owner)
        except OSError as exc:
            if not a.owner_said:
                a.owner_said = True
                self._say(f"cannot update {OWNER_FILE} in {a.run_dir} ({exc.strerror or exc}): if this "
                          "launcher is killed, a later one may not find every stage to stop")

    def _poll(self, a: _Attempt) -> None:
        """poll: relay output and watch the processes, the launcher's signals and the
        node group until the attempt ends (``a.cause`` set) or every stage is done."""
        assert a.plan is not None
        stages = [s.name for s in a.plan.spec.stages]
        next_orphan_reap = time.monotonic() + _ORPHAN_REAP_INTERVAL
        while a.cause is None and (any(p.running for p in self._procs) or self._group is not None):
            self._relay.pump(a.sel, 0.1)
            if self._observer is not None:
                self._observer.tick(a.run_id, a.run_dir, stages)
            if self._contain and time.monotonic() >= next_orphan_reap:
                reap_orphans(self._popen_pids())
                next_orphan_reap = time.monotonic() + _ORPHAN_REAP_INTERVAL
            if self._signals.last is not None:
                self._interrupted(a, self._signals.last)
                return
            self._poll_stages(a)
            if self._poll_group(a):
                return

    def _interrupted(self, a: _Attempt, signum: int) -> None:
        """The launcher got ``signum``: SIGTERM to every stage (``close`` escalates), and
        the group told that it is over, with no restart."""
        name = signal.Signals(signum).name
        a.end(f"interrupted by {name}", 128 + signum)
        a.interrupted = signum
        running = sum(p.running for p in self._procs)
        self._say(f"interrupted ({name}); stopping {running} stage{'s' if running != 1 else ''}")
        # SIGTERM whatever the launcher got: a Python stage ends on it without a
        # KeyboardInterrupt traceback, and a closed output pipe is not the stages' business.
        self._signal_all(signal.SIGTERM)
        if self._group is not None:
            self._group.fail(f"ipcsync-run was interrupted by {name}", a.code, restart=False)

    def _poll_stages(self, a: _Attempt) -> None:
        """Reap the stages that exited; the first non-zero exit ends the attempt with its
        root cause (the group's, over several nodes)."""
        for p in self._procs:
            if p.running and reap(p) and p.returncode != 0 and a.cause is None:
                found = root_cause(p, self._procs, lambda timeout: self._relay.pump(a.sel, timeout))
                if self._group is not None:
                    failure = self._group.fail(found.line, found.code, consequence=found.consequence)
                    a.end(failure.cause, failure.code, final=not failure.restart)
                else:
                    a.end(found.line, found.code)

    def _poll_group(self, a: _Attempt) -> bool:
        """The node group's news: True once every node's stages are done; a failure
        elsewhere ends the attempt."""
        if self._group is None or a.cause is not None:
            return False
        news = self._group.poll(local_done=not any(p.running for p in self._procs))
        if news == "done":
            return True
        if news is not None:
            a.end(news.cause, news.code, final=not news.restart)
        return False

    def _close_attempt(self, a: _Attempt) -> Outcome:
        """close: stop every stage (``_stop``: SIGTERM unless just forwarded, up to
        ``stop_timeout``, then SIGKILL), with ``contain`` every other descendant too; read
        what the stages reported, let the observer finish, remove the run directory and
        the run's shm segments. Nothing of the attempt outlives this."""
        self._stop(a.sel, death_sig=None if a.interrupted is not None else signal.SIGTERM,
                   timeout=self._stop_timeout)
        if self._contain:
            left = kill_descendants(self._popen_pids())
            if left:
                self._say(
                    f"killed {len(left)} process(es) that the stages left running outside their "
                    f"process groups: {', '.join(f'pid {pid} ({comm})' for pid, comm in left)}"
                )
        if a.interrupted is None and self._signals.count != a.signals_before:
            # Interrupted while stopping a failed attempt: no restart; the failure stays
            # the root cause and sets the exit code.
            a.interrupted = self._signals.last
        stats_dir = os.path.join(a.run_dir, STATS_DIR)
        unwritten = read_incomplete(stats_dir)
        if unwritten:
            self._say(incomplete_line(unwritten))  # once: before any figure it concerns
        stats, skipped = read_stats(stats_dir) if a.cause is None else ([], [])
        if skipped:
            self._say(f"skipped exit stats that cannot be read: {'; '.join(skipped[:4])}"
                      + (f" and {len(skipped) - 4} more" if len(skipped) > 4 else ""))
        if self._observer is not None and a.plan is not None:
            self._observer.finish(a.run_id, a.run_dir, [s.name for s in a.plan.spec.stages],
                                  {p.popen.pid: p.inst.label for p in self._procs if p.popen is not None})
        remove_run(a.run_dir, a.run_id)
        a.sel.close()
        return Outcome(a.code, a.cause, a.interrupted, a.final, stats, bool(unwritten))

    def _signal_all(self, signum: int) -> None:
        for p in self._procs:
            if p.running and p.popen is not None:
                log.debug("sending %s to stage %s (process group %d)", signal.Signals(signum).name,
                          p.inst.label, p.popen.pid)
                killpg(p.popen.pid, signum)

    def _stop(self, sel: selectors.BaseSelector, death_sig: int | None, timeout: float) -> None:
        """Stop every process: ``death_sig`` to every group (None: already sent), up to
        ``timeout`` seconds for them to exit, then SIGKILL to every group; relay their last
        output. One line per stage stopped."""
        if death_sig is not None:
            self._signal_all(death_sig)
        stopping = [p for p in self._procs if p.running]
        deadline = time.monotonic() + timeout
        signals_before = self._signals.count
        again = False
        while True:
            for p in stopping:
                if p.running and reap(p):
                    self._stopped(p)
            if not any(p.running for p in self._procs) or time.monotonic() >= deadline:
                break
            if self._signals.count != signals_before:
                again = True
                break  # interrupted (again) while stopping: kill now
            self._relay.pump(sel, 0.05)
        for p in self._procs:
            if p.running and p.popen is not None:
                if again:
                    self._say(f"stage {p.inst.label} (pid {p.popen.pid}) is still running after a second "
                              "signal; sending SIGKILL")
                else:
                    sent = signal.Signals(death_sig).name if death_sig is not None else "SIGTERM"
                    self._say(f"stage {p.inst.label} (pid {p.popen.pid}) did not exit within "
                              f"{timeout:.1f} s of {sent}; sending SIGKILL")
                killpg(p.popen.pid, signal.SIGKILL)  # leader not reaped: the group id is still ours
                deadline = time.monotonic() + 5
                reaped = reap(p)  # (True once p no longer runs)
                while not reaped and time.monotonic() < deadline:
                    time.sleep(0.01)
                    reaped = reap(p)
                if reaped:
                    self._stopped(p)
        # Last output: pipes reach EOF once every holder is dead.
        end = time.monotonic() + 1.0
        while any(p.pipe_open for p in self._procs) and time.monotonic() < end:
            self._relay.pump(sel, 0.05)
        for p in self._procs:
            if p.popen is not None and p.popen.stdout is not None:
                if p.partial:
                    self._relay.emit(p, final=True)
                p.popen.stdout.close()
                p.pipe_open = False

    def _stopped(self, p: StageProc) -> None:
        """Say how a stage that was told to stop ended."""
        rc = p.returncode
        if rc is None:
            return
        if rc < 0:
            try:
                how = signal.Signals(-rc).name
            except ValueError:
                how = f"signal {-rc}"
        else:
            how = f"exit code {rc}"
        self._say(f"stage {p.inst.label} stopped ({how})")

    def _popen_pids(self) -> set[int]:
        """Stage leaders not reaped yet: their status belongs to their Popen."""
        return {p.popen.pid for p in self._procs if p.popen is not None and p.popen.returncode is None}

    def _say(self, line: str) -> None:
        try:
            self._err.write(f"ipcsync-run: {line}\n")
            self._err.flush()
        except (BrokenPipeError, ValueError, OSError):
            pass
