"""End-to-end tests of ``ipcsync-run``: real pipelines launched through the command line.

Every test runs ``python -m ipcsync.launch ...`` as a subprocess, with stage scripts from
``tests/integration/stages/`` (``src.py`` sends items whose contents encode (replica, i), ``mid.py``
forwards, ``sink.py`` checks contents, per-source order, no loss and no duplicate and
prints a JSON result line, ``sleeper.py`` sleeps until stopped). Stages record their pid
(and markers such as "ready", "recv", "sig-SIGTERM") in files under ``$TEST_STAGE_DIR``.

The ``launcher`` fixture starts the launcher in its own session with a per-test token in
its environment (inherited by every stage and any helper they start), and at teardown,
pass or fail, SIGKILLs the launcher, every process carrying the token and every recorded
stage pid, and removes the run's /dev/shm segments. After each run the tests check that
nothing of the run is left: no process, no ``run-*`` directory, no shared-memory segment.

Sections: helpers and fixtures; pipelines that succeed; failures and teardown; signals to
the launcher; restart policy; spec errors; dry run; the stage API outside the launcher;
the README's example.
"""

from __future__ import annotations

import json
import os
import re
import select
import shlex
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from specfile import toml_spec

ROOT = Path(__file__).resolve().parents[2]
STAGES = Path(__file__).resolve().parent / "stages"
PY = sys.executable
SHM_DIR = "/dev/shm"

RUN_TIMEOUT = 150.0  # a whole pipeline run, on a loaded 2-core machine
STOP_TIMEOUT = 45.0  # from a failure or a signal to the launcher's exit
START_TIMEOUT = 90.0  # until stages are up (python + torch imports under load)
LEFT_TIMEOUT = 10.0  # for processes to disappear after the launcher exited

STARTED_RE = re.compile(r"ipcsync-run: started (\d+) process(?:es)? of pipeline '[^']*' \(run ([0-9a-f]{8})")


# ---------------------------------------------------------------------------- helpers
def stage(script: str, *args: Any) -> list[str]:
    """The command of a stage script in tests/integration/stages."""
    return [PY, str(STAGES / script), *(str(a) for a in args)]


def proc_state(pid: int) -> tuple[str, int] | None:
    """(state letter, start time) of a process from /proc, or None if there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    rest = data[data.rindex(b")") + 2:].split()
    return rest[0].decode(), int(rest[19])


def pid_alive(pid: int, start: int | None = None) -> bool:
    """Whether ``pid`` runs (zombies count as dead; with ``start``, a reused pid too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False  # not ours: the pid was reused
    st = proc_state(pid)
    if st is None or st[0] in ("Z", "X"):
        return False
    return start is None or st[1] == start


def shm_names() -> list[str]:
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith("ipcsync-"))
    except FileNotFoundError:
        return []


def shm_of(run_ids: set[str], pids: set[int]) -> list[str]:
    """ipcsync segments tagged with one of ``run_ids`` or made by one of ``pids``."""
    left = []
    for name in shm_names():
        parts = name.split("-")
        if any(f"-r{r}-" in name for r in run_ids) or (len(parts) > 1 and parts[1].isdigit() and int(parts[1]) in pids):
            left.append(name)
    return left


def wait_until(pred: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


@dataclass(frozen=True)
class StagePid:
    stage: str
    replica: int
    restart: int
    pid: int
    start: int | None

    @property
    def label(self) -> str:
        return f"{self.stage}/{self.replica}"

    def alive(self) -> bool:
        return pid_alive(self.pid, self.start)


@dataclass
class Run:
    """One launcher process; its stdout and stderr go to files (no pipe to fill up)."""

    proc: subprocess.Popen[bytes]
    out_path: Path
    err_path: Path
    args: list[str]
    started: float = field(default_factory=time.monotonic)
    ended: float | None = None

    def wait(self, timeout: float = RUN_TIMEOUT) -> int:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"ipcsync-run did not exit within {timeout:.0f} s\n--- stderr:\n{self.err[-3000:]}"
                f"\n--- stdout:\n{self.out[-3000:]}"
            ) from None
        if self.ended is None:
            self.ended = time.monotonic()
        return rc

    @property
    def out(self) -> str:
        return self.out_path.read_text(errors="replace")

    @property
    def err(self) -> str:
        return self.err_path.read_text(errors="replace")

    def dump(self) -> str:
        return f"rc {self.proc.returncode}\n--- stderr:\n{self.err[-4000:]}\n--- stdout:\n{self.out[-4000:]}"

    @property
    def run_ids(self) -> list[str]:
        return [m.group(2) for m in STARTED_RE.finditer(self.err)]

    @property
    def started_lines(self) -> list[tuple[int, str]]:
        return [(int(m.group(1)), m.group(2)) for m in STARTED_RE.finditer(self.err)]

    def lines_of(self, label: str) -> list[str]:
        prefix = f"[{label}] "
        return [line[len(prefix):] for line in self.out.splitlines() if line.startswith(prefix)]

    def events(self, label: str, event: str) -> list[dict[str, Any]]:
        found = []
        for line in self.lines_of(label):
            if line.startswith("{"):
                try:
                    obj = json.loads(line)
                except ValueError:
                    continue
                if obj.get("event") == event:
                    found.append(obj)
        return found

    def result(self, label: str) -> dict[str, Any]:
        """The sink's final result line (the last one: that of the last attempt)."""
        found = self.events(label, "result")
        assert found, f"no result line from {label}\n{self.dump()}"
        return found[-1]


class Launcher:
    """Starts ``python -m ipcsync.launch``; kills everything of its runs at teardown."""

    def __init__(self, tmp_path: Path, runtime_dir: Path) -> None:
        self.tmp = tmp_path
        self.runtime_dir = runtime_dir
        self.state = tmp_path / "stage-state"
        self.state.mkdir()
        self.token = uuid.uuid4().hex
        self.runs: list[Run] = []

    # ------------------------------------------------------------------ running
    def env(self, extra: dict[str, str | None] | None = None) -> dict[str, str]:
        """The launcher's environment; ``extra`` sets variables (None: removes one)."""
        env = dict(os.environ)
        for k in ("IPCSYNC_WIRING", "IPCSYNC_RUN_ID", "IPCSYNC_STAGE", "IPCSYNC_REPLICA", "IPCSYNC_DEVICE"):
            env.pop(k, None)
        env["PYTHONUNBUFFERED"] = "1"
        env["OMP_NUM_THREADS"] = "1"
        env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env["TEST_STAGE_DIR"] = str(self.state)
        env["IPCSYNC_TEST_TOKEN"] = self.token
        env["IPCSYNC_RUNTIME_DIR"] = str(self.runtime_dir)
        for k, v in (extra or {}).items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v
        return env

    def start(self, *args: Any, cwd: Path = ROOT, pipe_stdout: bool = False,
              env: dict[str, str | None] | None = None) -> Run:
        """Start the launcher; its stdout goes to a file, or to a pipe (``run.proc.stdout``)."""
        n = len(self.runs)
        out_path, err_path = self.tmp / f"launcher{n}.out", self.tmp / f"launcher{n}.err"
        out_path.write_bytes(b"")
        argv = [str(a) for a in args]
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(
                [PY, "-m", "ipcsync.launch", *argv], stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE if pipe_stdout else out, stderr=err, cwd=str(cwd),
                env=self.env(env), start_new_session=True,
            )
        run = Run(proc, out_path, err_path, argv)
        self.runs.append(run)
        return run

    def run(self, *args: Any, cwd: Path = ROOT, timeout: float = RUN_TIMEOUT,
            env: dict[str, str | None] | None = None) -> Run:
        run = self.start(*args, cwd=cwd, env=env)
        run.wait(timeout)
        return run

    def spec_file(self, text: str, name: str = "pipeline.toml") -> Path:
        path = self.tmp / name
        path.write_text(text)
        return path

    # ------------------------------------------------------------------ stage state
    def stage_pids(self) -> list[StagePid]:
        pids = []
        for f in sorted(self.state.glob("pid-*")):
            if f.name.endswith(".tmp"):
                continue
            try:
                d = json.loads(f.read_text())
            except (OSError, ValueError):
                continue
            pids.append(StagePid(d["stage"], int(d["replica"]), int(d["restart"]), int(d["pid"]), d["start"]))
        return pids

    def pid_of(self, label: str, restart: int = 0) -> StagePid:
        stage_name, replica = label.split("/")
        found = [p for p in self.stage_pids() if p.stage == stage_name and p.replica == int(replica)
                 and p.restart == restart]
        assert len(found) == 1, f"pid files of {label} (restart {restart}): {found}"
        return found[0]

    def markers(self, kind: str, label: str | None = None) -> list[str]:
        """Names of marker files ``<kind>-<stage>-<replica>-<restart>-<pid>``."""
        names = [f.name for f in self.state.glob(f"{kind}-*") if not f.name.endswith(".tmp")]
        if label is not None:
            stage_name, replica = label.split("/")
            names = [n for n in names if n.startswith(f"{kind}-{stage_name}-{replica}-")]
        return names

    def wait_markers(self, kind: str, labels: list[str], run: Run, timeout: float = START_TIMEOUT) -> None:
        def ready() -> bool:
            if run.proc.poll() is not None:
                raise AssertionError(f"ipcsync-run exited before {kind} of {labels}\n{run.dump()}")
            return all(self.markers(kind, label) for label in labels)

        wait_until(ready, timeout, f"{kind} markers of {labels}")

    # ------------------------------------------------------------------ leftovers
    def token_pids(self) -> list[int]:
        """Live processes (not zombies) whose environment carries this test's token."""
        needle = f"IPCSYNC_TEST_TOKEN={self.token}".encode()
        found = []
        me = os.getpid()
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == me:
                continue
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    env = f.read()
            except OSError:
                continue
            if needle + b"\0" in env or env.endswith(needle):
                st = proc_state(int(entry))
                if st is not None and st[0] not in ("Z", "X"):
                    found.append(int(entry))
        return found

    def run_ids(self) -> set[str]:
        ids = {r for run in self.runs for r in run.run_ids}
        ids |= {p.name[4:] for p in self.runtime_dir.glob("run-*")}
        return ids

    def assert_nothing_left(self, timeout: float = LEFT_TIMEOUT) -> None:
        """No process of the runs alive (allowing ``timeout`` for them to go), no run
        directory, no shm segment of the runs."""
        for run in self.runs:
            assert run.proc.poll() is not None, "the launcher is still running"
        pids = self.stage_pids()

        def leftovers() -> list[str]:
            return [f"{p.label} pid {p.pid}" for p in pids if p.alive()] + [
                f"pid {p} (token)" for p in self.token_pids()
            ]

        deadline = time.monotonic() + timeout
        while (alive := leftovers()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive, f"processes of the run still alive: {alive}"
        dirs = sorted(p.name for p in self.runtime_dir.glob("run-*"))
        assert not dirs, f"run directories left in {self.runtime_dir}: {dirs}"
        left = shm_of(self.run_ids(), {p.pid for p in pids})
        assert not left, f"shared-memory segments left: {left}"

    def cleanup(self) -> None:
        """Kill everything (pass or fail) and remove what the runs left."""
        for run in self.runs:
            if run.proc.poll() is None:
                try:
                    os.killpg(run.proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                try:
                    run.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
            if run.proc.stdout is not None:
                run.proc.stdout.close()
        stage_pids = self.stage_pids()
        for _ in range(3):  # processes might start helpers meanwhile
            victims = set(self.token_pids()) | {p.pid for p in stage_pids if p.alive()}
            if not victims:
                break
            for pid in victims:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            time.sleep(0.2)
        for name in shm_of(self.run_ids(), {p.pid for p in stage_pids}):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except FileNotFoundError:
                pass


@pytest.fixture
def launcher(tmp_path: Path, runtime_dir: Path) -> Iterator[Launcher]:
    ln = Launcher(tmp_path, runtime_dir)
    try:
        yield ln
    finally:
        ln.cleanup()


def assert_no_helper_left(run: Run) -> None:
    """Stages stopped by the launcher leave no multiprocessing resource tracker behind: no
    "leaked shared_memory objects" or "[Errno 2]" line from one, no stray process for the
    launcher to kill."""
    both = run.out + run.err
    assert "resource_tracker" not in both and "leaked shared_memory" not in both, run.dump()
    assert "left running outside their process groups" not in run.err, run.dump()


def assert_summary(run: Run, src: str, dst: str, items: int | None) -> None:
    assert "ipcsync-run: edge summary:" in run.err, run.dump()
    m = re.search(rf"ipcsync-run:\s+{src} -> {dst}: (\d+) items", run.err)
    assert m, f"no summary line for {src} -> {dst}\n{run.dump()}"
    if items is not None:
        assert int(m.group(1)) == items, run.dump()


def assert_complete(result: dict[str, Any], counts: dict[str, int]) -> None:
    """A sink result saw exactly items 0..n-1 of each origin, in order, with the right contents."""
    assert result["errors"] == [], result
    assert result["dups"] == 0, result
    assert result["counts"] == counts, result
    assert all(result["contiguous"].values()), result
    assert result["total"] == sum(counts.values()), result


def root_cause(run: Run) -> str:
    lines = [l for l in run.err.splitlines() if l.startswith("ipcsync-run: root cause: ")]
    assert lines, f"no root cause line\n{run.dump()}"
    return lines[-1]


# ---------------------------------------------------------------------------- pipelines that succeed
@pytest.mark.timeout(200)
@pytest.mark.parametrize("zero_copy", [False, True], ids=["send", "slot"])
def test_two_stage_pipeline_from_toml(launcher: Launcher, zero_copy: bool) -> None:
    n = 60
    spec = launcher.spec_file(toml_spec(
        {"src": {"cmd": stage("src.py", "--n", n, *(["--zero-copy"] if zero_copy else [])), "device": "cpu"},
         "sink": {"cmd": stage("sink.py"), "device": "cpu"}},
        [{"from": "src", "to": "sink", "slots": 4, "slot_bytes": "64KiB"}],
        name="two", stop_timeout=2,
    ))
    run = launcher.run(spec)
    assert run.proc.returncode == 0, run.dump()
    assert run.started_lines and run.started_lines[0][0] == 2, run.dump()
    assert "ipcsync-run: all stages finished" in run.err, run.dump()
    assert_complete(run.result("sink/0"), {"src/0": n})
    assert run.events("src/0", "sent") == [{"event": "sent", "stage": "src", "replica": 0, "restart": 0, "n": n}]
    # Every line a stage printed came out prefixed with its label.
    out_lines = run.out.splitlines()
    assert out_lines and all(l.startswith(("[src/0] ", "[sink/0] ")) for l in out_lines), run.dump()
    assert_summary(run, "src", "sink", n)
    launcher.assert_nothing_left()


@pytest.mark.timeout(240)
def test_three_stage_pipeline_with_replicas_from_toml(launcher: Launcher) -> None:
    n = 40
    spec = launcher.spec_file(toml_spec(
        {"src": {"cmd": stage("src.py", "--to", "mid", "--n", n), "replicas": 2},
         "mid": {"cmd": stage("mid.py", "--from", "src", "--to", "sink"), "replicas": 2},
         "sink": {"cmd": stage("sink.py", "--from", "mid")}},
        [{"from": "src", "to": "mid", "slots": 3, "slot_bytes": "64KiB"},
         {"from": "mid", "to": "sink", "slots": 4, "slot_bytes": 65536}],
        name="three", stop_timeout=2,
    ))
    run = launcher.run(spec)
    assert run.proc.returncode == 0, run.dump()
    assert run.started_lines[0][0] == 5, run.dump()
    result = run.result("sink/0")
    # Every item of every source replica, in each source's order (checked per mid replica
    # it went through), contents as sent.
    assert_complete(result, {"src/0": n, "src/1": n})
    assert set(result["by_source"]) <= {"mid/0", "mid/1"}, result
    forwarded = [run.events(f"mid/{r}", "forwarded") for r in (0, 1)]
    assert all(len(f) == 1 for f in forwarded), run.dump()
    assert sum(f[0]["n"] for f in forwarded) == 2 * n, forwarded
    for r in (0, 1):
        assert result["by_source"].get(f"mid/{r}", 0) == forwarded[r][0]["n"], (result, forwarded)
    labels = {l.split("] ")[0] + "]" for l in run.out.splitlines()}
    assert labels == {"[src/0]", "[src/1]", "[mid/0]", "[mid/1]", "[sink/0]"}, labels
    assert_summary(run, "src", "mid", 2 * n)
    assert_summary(run, "mid", "sink", 2 * n)
    assert {(p.stage, p.replica) for p in launcher.stage_pids()} == {
        ("src", 0), ("src", 1), ("mid", 0), ("mid", 1), ("sink", 0)}
    launcher.assert_nothing_left()


@pytest.mark.timeout(200)
def test_two_stage_pipeline_from_command_line(launcher: Launcher, tmp_path: Path) -> None:
    n = 30
    run = launcher.run(
        "--stage", f"src={shlex.join(stage('src.py', '--n', n))}",
        "--stage", f"sink={shlex.join(stage('sink.py'))}",
        "--edge", "src:sink", "--replicas", "src=2", "--device", "src=cpu", "--device", "sink=cpu",
        "--edge-option", "src:sink:slots=2", "--edge-option", "src:sink:slot_bytes=32KiB",
        "--stop-timeout", "2",
        cwd=tmp_path,
    )
    assert run.proc.returncode == 0, run.dump()
    assert run.started_lines[0][0] == 3, run.dump()
    result = run.result("sink/0")
    assert_complete(result, {"src/0": n, "src/1": n})
    assert result["by_source"] == {"src/0": n, "src/1": n}, result
    assert run.lines_of("src/1"), run.dump()
    assert_summary(run, "src", "sink", 2 * n)
    launcher.assert_nothing_left()


@pytest.mark.timeout(200)
@pytest.mark.parametrize("how", ["edge-option", "toml"])
def test_broadcast_every_sink_replica_sees_every_item(launcher: Launcher, how: str) -> None:
    n = 30
    if how == "toml":
        spec = launcher.spec_file(toml_spec(
            {"src": {"cmd": stage("src.py", "--n", n)},
             "sink": {"cmd": stage("sink.py"), "replicas": 2}},
            [{"from": "src", "to": "sink", "policy": "broadcast", "slots": 3, "slot_bytes": "32KiB"}],
            stop_timeout=2,
        ))
        run = launcher.run(spec)
    else:
        run = launcher.run(
            "--stage", f"src={shlex.join(stage('src.py', '--n', n))}",
            "--stage", f"sink={shlex.join(stage('sink.py'))}",
            "--edge", "src:sink", "--replicas", "sink=2",
            "--edge-option", "src:sink:policy=broadcast", "--stop-timeout", "2",
        )
    assert run.proc.returncode == 0, run.dump()
    for r in (0, 1):
        result = run.result(f"sink/{r}")
        assert_complete(result, {"src/0": n})
        assert result["by_source"] == {"src/0": n}, result
    assert_summary(run, "src", "sink", None)
    launcher.assert_nothing_left()


# ---------------------------------------------------------------------------- failures and teardown
@pytest.mark.timeout(200)
@pytest.mark.parametrize("crasher", ["src/1", "sink/0"])
def test_stage_crash_mid_stream_stops_everything(launcher: Launcher, crasher: str) -> None:
    crash = ["--crash-after", 10, "--crash-code", 7]
    src_args: list[Any] = ["--n", 100000, "--delay", 0.02]
    sink_args: list[Any] = []
    if crasher == "src/1":
        src_args += [*crash, "--crash-replica", 1]
    else:
        sink_args += crash
    spec = launcher.spec_file(toml_spec(
        {"src": {"cmd": stage("src.py", *src_args), "replicas": 2},
         "sink": {"cmd": stage("sink.py", *sink_args)}},
        [{"from": "src", "to": "sink", "slot_bytes": "64KiB"}],
        stop_timeout=2,
    ))
    run = launcher.run(spec)
    assert run.proc.returncode == 7, run.dump()
    victim = launcher.pid_of(crasher)
    cause = root_cause(run)
    assert f"stage {crasher} (pid {victim.pid}) exited with code 7" in cause, run.dump()
    assert f"ipcsync-run: failed: stage {crasher}" in run.err, run.dump()
    assert run.events(crasher, "crashing"), run.dump()
    assert "all stages finished" not in run.err
    # The other stages were running when it crashed, and were torn down.
    others = [p for p in launcher.stage_pids() if p.label != crasher]
    assert {p.label for p in others} == {"src/0", "src/1", "sink/0"} - {crasher}, others
    assert not run.events("sink/0", "result") and not run.events("src/0", "sent"), run.dump()
    assert_no_helper_left(run)
    launcher.assert_nothing_left()


@pytest.mark.timeout(200)
def test_a_loader_that_raises_never_looks_like_a_finished_stream(launcher: Launcher) -> None:
    """A producer stage whose with-block raises at item 13: its consumer stage must not end
    its stream cleanly (before: the sink printed its result, 'done 13', while the
    launcher reported the loader's crash); it fails with ProducerFailedError, or is
    stopped by the launcher first."""
    spec = launcher.spec_file(toml_spec(
        {"src": {"cmd": stage("src.py", "--n", 100, "--raise-after", 13, "--delay", 0.01)},
         "sink": {"cmd": stage("sink.py")}},
        [{"from": "src", "to": "sink", "slot_bytes": "64KiB"}],
        stop_timeout=5,
    ))
    run = launcher.run(spec)
    assert run.proc.returncode == 1, run.dump()
    assert "stage src/0" in root_cause(run), run.dump()
    assert "RuntimeError: src broke after 13 items" in run.out, run.dump()
    assert not run.events("sink/0", "result"), run.dump()
    assert "all stages finished" not in run.err
    launcher.assert_nothing_left()


@pytest.mark.timeout(200)
@pytest.mark.parametrize("raiser", ["src", "mid"])
def test_a_stage_ended_by_its_peers_failure_prints_one_line_and_the_root_cause_its_traceback(
        launcher: Launcher, raiser: str) -> None:
    """One failure, one story. Before: every stage downstream of the one that raised
    printed a 17-line traceback of its PeerLostError, burying the root cause. Now each
    prints one line naming the input that failed; the traceback is the root cause's.
    The downstream stages ignore SIGTERM here, so that the launcher's stop cannot end
    them before their peer's failure reaches them."""
    def raises(name: str) -> list[Any]:
        return ["--raise-after", 13] if raiser == name else []

    spec = launcher.spec_file(toml_spec(
        {"src": {"cmd": stage("src.py", "--to", "mid", "--n", 100000, "--delay", 0.01, *raises("src"))},
         "mid": {"cmd": stage("mid.py", *raises("mid"))},
         "sink": {"cmd": stage("sink.py", "--from", "mid"), "env": {"TEST_IGNORE_SIGTERM": "1"}}},
        [{"from": "src", "to": "mid", "slot_bytes": "64KiB"}, {"from": "mid", "to": "sink", "slot_bytes": "64KiB"}],
        stop_timeout=60,
    ))
    if raiser == "src":  # mid is downstream too: it must end by itself as well
        spec.write_text(spec.read_text().replace(
            '[stages.mid]\n', '[stages.mid]\nenv = { TEST_IGNORE_SIGTERM = "1" }\n'))
    run = launcher.run(spec)
    assert run.proc.returncode == 1, run.dump()
    assert f"stage {raiser}/0" in root_cause(run), run.dump()
    own = run.lines_of(f"{raiser}/0")
    assert "Traceback (most recent call last):" in own, run.dump()
    assert own[-1] == f"RuntimeError: {raiser} broke after 13 items", run.dump()
    downstream = {"src": [("mid/0", "src/0"), ("sink/0", "mid/0")], "mid": [("sink/0", "mid/0")]}[raiser]
    for label, upstream in downstream:
        lines = run.lines_of(label)
        assert len(lines) == 1, run.dump()
        assert lines[0].startswith(f"stopped: its input from {upstream} failed; ipcsync-run shows the "
                                   "root cause ("), run.dump()
        assert "PeerLostError: " in lines[0] or "ProducerFailedError: " in lines[0], run.dump()
    assert run.out.count("Traceback") == 1, run.dump()
    launcher.assert_nothing_left()


@pytest.mark.timeout(200)
@pytest.mark.parametrize("victim_label", ["src/0", "sink/0"])
def test_stage_killed_by_sigkill(launcher: Launcher, victim_label: str) -> None:
    spec = launcher.spec_file(toml_spec(  # cpu: the producer's arena is in /dev/shm
        {"src": {"cmd": stage("src.py", "--n", 100000, "--delay", 0.01), "device": "cpu"},
         "sink": {"cmd": stage("sink.py"), "device": "cpu"}},
        [{"from": "src", "to": "sink", "slot_bytes": "64KiB"}],
        stop_timeout=2,
    ))
    run = launcher.start(spec)
    launcher.wait_markers("recv", ["sink/0"], run)
    victim = launcher.pid_of(victim_label)
    run_id = wait_until(lambda: run.run_ids, 10, "the started line")[0]
    # The producer's arena is in /dev/shm, tagged with the run id: the launcher must remove it.
    src_pid = launcher.pid_of("src/0").pid
    assert [n for n in shm_names() if n.startswith(f"ipcsync-{src_pid}-r{run_id}-")], shm_names()
    os.kill(victim.pid, signal.SIGKILL)
    rc = run.wait(STOP_TIMEOUT)
    assert rc == 128 + signal.SIGKILL, run.dump()
    cause = root_cause(run)
    assert f"stage {victim_label} (pid {victim.pid}) was killed by SIGKILL" in cause, run.dump()
    assert "killed by SIGKILL" in cause
    launcher.assert_nothing_left()


@pytest.mark.timeout(120)
def test_command_that_does_not_exist(launcher: Launcher) -> None:
    spec = launcher.spec_file(toml_spec(
        {"first": {"cmd": stage("sleeper.py")},
         "ghost": {"cmd": ["/nonexistent/prog", "--flag"]}},
        stop_timeout=2,
    ))
    run = launcher.run(spec, timeout=STOP_TIMEOUT + 30)
    assert run.proc.returncode == 127, run.dump()
    cause = root_cause(run)
    assert "stage ghost/0 could not start" in cause, run.dump()
    assert "/nonexistent/prog" in cause, run.dump()
    assert "ipcsync-run: failed: stage ghost/0 could not start" in run.err, run.dump()
    launcher.assert_nothing_left()


# ---------------------------------------------------------------------------- signals to the launcher
@pytest.mark.timeout(200)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_to_launcher_stops_all_stages(launcher: Launcher, signum: int) -> None:
    spec = launcher.spec_file(toml_spec(
        {"sleepy": {"cmd": stage("sleeper.py"), "replicas": 2},
         "src": {"cmd": stage("src.py", "--n", 100000, "--delay", 0.01)},
         "sink": {"cmd": stage("sink.py")}},
        [{"from": "src", "to": "sink", "slot_bytes": "64KiB"}],
        stop_timeout=2,
    ))
    run = launcher.start(spec)
    launcher.wait_markers("ready", ["sleepy/0", "sleepy/1"], run)
    launcher.wait_markers("recv", ["sink/0"], run)
    os.kill(run.proc.pid, signum)
    rc = run.wait(STOP_TIMEOUT)
    assert rc == 128 + signum, run.dump()
    name = signal.Signals(signum).name
    assert f"interrupted by {name}" in run.err, run.dump()
    # SIGTERM was sent to the stages whichever signal the launcher got (a Python stage
    # ends on it without a KeyboardInterrupt traceback); nothing restarts.
    assert f"ipcsync-run: interrupted ({name}); stopping 4 stages" in run.err, run.dump()
    for label in ("sleepy/0", "sleepy/1"):
        assert launcher.markers("sig-SIGTERM", label), (label, os.listdir(launcher.state))
        assert not launcher.markers("sig-SIGINT", label), (label, os.listdir(launcher.state))
    assert len(run.started_lines) == 1, run.dump()
    assert "restarting" not in run.err
    assert_no_helper_left(run)
    launcher.assert_nothing_left()


@pytest.mark.timeout(200)
@pytest.mark.parametrize("trigger", ["stage-failure", "launcher-SIGTERM"])
def test_stage_ignoring_sigterm_is_killed_after_stop_timeout(launcher: Launcher, tmp_path: Path,
                                                             trigger: str) -> None:
    go = tmp_path / "go"
    spec = launcher.spec_file(toml_spec(
        {"stubborn": {"cmd": stage("sleeper.py", "--ignore-term")},
         "quitter": {"cmd": stage("sleeper.py", "--exit-when", go, "--code", 3)}},
    ))
    run = launcher.start(spec, "--stop-timeout", "1")
    launcher.wait_markers("ready", ["stubborn/0", "quitter/0"], run)
    t0 = time.monotonic()
    if trigger == "stage-failure":
        go.touch()
    else:
        os.kill(run.proc.pid, signal.SIGTERM)
    rc = run.wait(STOP_TIMEOUT)
    elapsed = time.monotonic() - t0
    if trigger == "stage-failure":
        assert rc == 3, run.dump()
        assert "stage quitter/0" in root_cause(run) and "exited with code 3" in root_cause(run), run.dump()
    else:
        assert rc == 143, run.dump()
    # It got SIGTERM, ignored it, and was SIGKILLed once the stop timeout had passed.
    assert launcher.markers("sig-SIGTERM", "stubborn/0"), os.listdir(launcher.state)
    stubborn = launcher.pid_of("stubborn/0")
    assert (f"ipcsync-run: stage stubborn/0 (pid {stubborn.pid}) did not exit within 1.0 s of SIGTERM; "
            "sending SIGKILL") in run.err, run.dump()
    assert "ipcsync-run: stage stubborn/0 stopped (SIGKILL)" in run.err, run.dump()
    assert elapsed >= 0.9, elapsed
    launcher.assert_nothing_left()


# ---------------------------------------------------------------------------- restart policy
@pytest.mark.timeout(240)
def test_restart_recovers_from_a_first_attempt_failure(launcher: Launcher) -> None:
    n = 30
    spec = launcher.spec_file(toml_spec(
        {"src": {"cmd": stage("src.py", "--n", n, "--crash-after", 5, "--crash-code", 3, "--crash-restart", 0)},
         "sink": {"cmd": stage("sink.py")}},
        [{"from": "src", "to": "sink", "slot_bytes": "64KiB"}],
        restart=1, stop_timeout=2,
    ))
    run = launcher.run(spec)
    assert run.proc.returncode == 0, run.dump()
    assert "ipcsync-run: restarting the whole group (restart 1 of 1)" in run.err, run.dump()
    restart_line = [l for l in run.err.splitlines() if "restarting the whole group" in l][0]
    assert "stage src/0" in restart_line and "exited with code 3" in restart_line, restart_line
    started = run.started_lines
    assert [c for c, _ in started] == [2, 2], run.dump()
    assert started[0][1] != started[1][1], "each attempt has its own run id"
    assert "all stages finished" in run.err
    result = run.result("sink/0")
    assert result["restart"] == 1, result
    assert_complete(result, {"src/0": n})
    assert_summary(run, "src", "sink", n)
    # Both attempts ran, each with fresh processes.
    assert {(p.label, p.restart) for p in launcher.stage_pids()} == {
        ("src/0", 0), ("sink/0", 0), ("src/0", 1), ("sink/0", 1)}
    launcher.assert_nothing_left()


@pytest.mark.timeout(240)
def test_restart_gives_up_after_the_last_attempt(launcher: Launcher) -> None:
    spec = launcher.spec_file(toml_spec(
        {"src": {"cmd": stage("src.py", "--n", 30, "--crash-after", 5, "--crash-code", 5)},
         "sink": {"cmd": stage("sink.py")}},
        [{"from": "src", "to": "sink", "slot_bytes": "64KiB"}],
        stop_timeout=2,
    ))
    run = launcher.run(spec, "--restart", "1")
    assert run.proc.returncode == 5, run.dump()
    assert len(run.started_lines) == 2, run.dump()  # exactly 1 + restart attempts
    assert run.err.count("restarting the whole group") == 1, run.dump()
    assert "ipcsync-run: failed: stage src/0" in run.err and "exited with code 5" in root_cause(run), run.dump()
    assert len(run.events("src/0", "crashing")) == 2, run.dump()
    assert sorted(p.restart for p in launcher.stage_pids() if p.stage == "src") == [0, 1]
    launcher.assert_nothing_left()


# ---------------------------------------------------------------------------- spec errors
def _good_stages() -> dict[str, dict[str, Any]]:
    return {"a": {"cmd": stage("sleeper.py")}, "b": {"cmd": stage("sleeper.py")}}


SPEC_ERRORS = {
    "unknown-stage-in-edge": (
        lambda: toml_spec(_good_stages(), [{"from": "a", "to": "nope"}]),
        "edges[0].to", "unknown stage 'nope'"),
    "cycle": (
        lambda: toml_spec(_good_stages(), [{"from": "a", "to": "b"}, {"from": "b", "to": "a"}]),
        "edges", "cycle"),
    "bad-device": (
        lambda: toml_spec({**_good_stages(), "a": {"cmd": stage("sleeper.py"), "device": "tpu:0"}}),
        "stages.a.device", "'tpu:0' is not a device"),
    "unavailable-device": (
        lambda: toml_spec({**_good_stages(), "a": {"cmd": stage("sleeper.py"), "device": "cuda:99"}}),
        "stages.a.device", "'cuda:99' for replica 0"),
    "zero-replicas": (
        lambda: toml_spec({**_good_stages(), "a": {"cmd": stage("sleeper.py"), "replicas": 0}}),
        "stages.a.replicas", "from 1"),
    "unknown-stage-key": (
        lambda: toml_spec({**_good_stages(), "a": {"cmd": stage("sleeper.py"), "colour": "red"}}),
        "stages.a.colour", "unknown key"),
    "unknown-top-key": (
        lambda: toml_spec(_good_stages(), restarts=1),
        "restarts", "unknown key"),
    "missing-cmd": (
        lambda: toml_spec({**_good_stages(), "a": {"replicas": 2}}),
        "stages.a.cmd", "missing"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(SPEC_ERRORS))
def test_spec_error_in_file(launcher: Launcher, case: str) -> None:
    make, key, phrase = SPEC_ERRORS[case]
    path = launcher.spec_file(make(), name="bad.toml")
    run = launcher.run(path, timeout=50)
    assert run.proc.returncode == 125, run.dump()
    err_lines = run.err.strip().splitlines()
    assert len(err_lines) == 1, run.dump()
    assert err_lines[0].startswith(f"ipcsync-run: error: {path}: {key}: "), run.dump()
    assert phrase in err_lines[0], run.dump()
    assert run.out == "", run.dump()
    assert not launcher.stage_pids() and not list(launcher.runtime_dir.glob("run-*"))
    launcher.assert_nothing_left()


CLI_ERRORS = {
    "unknown-stage-in-edge": (["--edge", "a:nope"], "edges[0].to", "unknown stage 'nope'"),
    "cycle": (["--edge", "a:b", "--edge", "b:a"], "edges", "cycle"),
    "bad-device": (["--device", "a=gpu"], "stages.a.device", "'gpu' is not a device"),
    "zero-replicas": (["--replicas", "a=0"], "stages.a.replicas", "from 1"),
    "unknown-edge-option": (["--edge", "a:b", "--edge-option", "a:b:colour=red"], "edges[0].colour", "unknown key"),
    "replicas-of-unknown-stage": (["--replicas", "c=2"], "--replicas c=2", "unknown stage 'c'"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(CLI_ERRORS))
def test_spec_error_on_command_line(launcher: Launcher, case: str) -> None:
    extra, key, phrase = CLI_ERRORS[case]
    sleeper = shlex.join(stage("sleeper.py"))
    run = launcher.run("--stage", f"a={sleeper}", "--stage", f"b={sleeper}", *extra, timeout=50)
    assert run.proc.returncode == 125, run.dump()
    assert run.err.startswith(f"ipcsync-run: error: <command line>: {key}: "), run.dump()
    assert phrase in run.err, run.dump()
    assert not launcher.stage_pids() and not list(launcher.runtime_dir.glob("run-*"))
    launcher.assert_nothing_left()


@pytest.mark.timeout(60)
def test_missing_spec_file(launcher: Launcher, tmp_path: Path) -> None:
    path = tmp_path / "absent.toml"
    run = launcher.run(path, timeout=50)
    assert run.proc.returncode == 125, run.dump()
    assert run.err.startswith(f"ipcsync-run: error: {path}: cannot read the spec"), run.dump()
    launcher.assert_nothing_left()


# ---------------------------------------------------------------------------- dry run
@pytest.mark.timeout(60)
def test_dry_run_prints_the_plan_and_starts_nothing(launcher: Launcher) -> None:
    spec = launcher.spec_file(toml_spec(
        {"src": {"cmd": stage("src.py", "--n", 5), "replicas": 2, "device": "cpu"},
         "sink": {"cmd": stage("sink.py"), "replicas": 2, "device": "cpu"}},
        [{"from": "src", "to": "sink", "policy": "broadcast", "slots": 3, "slot_bytes": "64KiB",
          "timeout": 12}],
        name="drydemo", restart=1, stop_timeout=2,
    ))
    run = launcher.run(spec, "--dry-run", timeout=50)
    assert run.proc.returncode == 0, run.dump()
    out = run.out
    assert "pipeline 'drydemo'" in out and "2 stages, 4 processes" in out, out
    assert "restart up to 1" in out and "stop timeout 2 s" in out, out
    for label in ("src/0", "src/1", "sink/0", "sink/1"):
        assert re.search(rf"^\s+{re.escape(label)}\s+device cpu\s+cmd: .*(src|sink)\.py", out, re.M), (label, out)
    assert re.search(r"src -> sink: 2 producer\(s\) x 2 consumer\(s\), policy broadcast, slots 3, "
                     r"slot_bytes 65536, timeout 12 s", out), out  # (no wait mode on the CPU)
    base = re.escape(str(launcher.runtime_dir))
    for i in (0, 1):
        assert re.search(rf"src/{i}: ipc://{base}/run-[^/\s]+/src\.{i}-sink\.sock", out), out
    assert "started" not in run.err, run.dump()
    # Nothing was started or created.
    time.sleep(0.5)
    assert not launcher.stage_pids(), launcher.stage_pids()
    assert not list(launcher.runtime_dir.glob("run-*"))
    launcher.assert_nothing_left()


@pytest.mark.timeout(60)
def test_dry_run_from_command_line(launcher: Launcher) -> None:
    run = launcher.run(
        "--stage", f"a={shlex.join(stage('src.py'))}", "--stage", f"b={shlex.join(stage('sink.py'))}",
        "--edge", "a:b", "--replicas", "b=3", "--edge-option", "a:b:slots=7",
        "--edge-option", "a:b:wait=host", "--restart", "2", "--stop-timeout", "3", "--dry-run",
        timeout=50,
    )
    assert run.proc.returncode == 0, run.dump()
    out = run.out
    assert "from <command line>: 2 stages, 4 processes, restart up to 2, stop timeout 3 s" in out, out
    assert "a -> b: 1 producer(s) x 3 consumer(s), policy shard, slots 7" in out, out
    assert re.search(r"^\s+b/2\s+device ", out, re.M), out
    device = re.search(r"^\s+b/0\s+device (\S+)", out, re.M)
    assert device, out
    assert ("wait host" in out) == (device.group(1) != "cpu"), out  # the wait mode where it applies
    assert not launcher.stage_pids() and not list(launcher.runtime_dir.glob("run-*"))
    launcher.assert_nothing_left()


# ---------------------------------------------------------------------------- stage API outside the launcher
STAGE_CALLS = ["s.input('x')", "s.output('x')", "s.info()"]


@pytest.mark.timeout(60)
def test_stage_api_outside_launcher_explains(launcher: Launcher) -> None:
    """Each stage call outside ipcsync-run ends the program with a ConfigError that names
    the call, ipcsync-run, IPCSYNC_WIRING and the endpoints to use instead. One
    interpreter makes every call (torch is imported once): each in a child process
    forked after the import, so that each ends its program uncaught, as a stage's would."""
    script = (
        "import os, sys, ipcsync.stage as s\n"
        f"for call in {STAGE_CALLS!r}:\n"
        "    print('@@ ' + call, file=sys.stderr, flush=True)\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        exec(call)\n"
        "        os._exit(0)\n"
        "    print('@@ exit', os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), file=sys.stderr, flush=True)\n"
    )
    proc = subprocess.run([PY, "-c", script], stdin=subprocess.DEVNULL, capture_output=True, env=launcher.env(),
                          cwd=str(ROOT), timeout=50)
    err = proc.stderr.decode(errors="replace")
    assert proc.returncode == 0, err
    parts = re.split(r"^@@ ", err, flags=re.M)[1:]
    assert len(parts) == 2 * len(STAGE_CALLS), err
    for call, ran, ended in zip(STAGE_CALLS, parts[0::2], parts[1::2]):
        assert ran.startswith(call + "\n") and ended.strip() == "exit 1", err
        last = ran.strip().splitlines()[-1]
        assert last.startswith("ipcsync.errors.ConfigError: "), ran
        assert "ipcsync-run" in last and "IPCSYNC_WIRING" in last, last
        assert "ipcsync.Producer" in last and "ipcsync.Consumer" in last, last
        assert call.replace("s.", "ipcsync.stage.") in last, last


# ---------------------------------------------------------------------------- the README's example
@pytest.mark.long
@pytest.mark.timeout(180)
def test_readme_example_pipeline(launcher: Launcher) -> None:
    run = launcher.run("examples/pipeline.toml", cwd=ROOT, timeout=120)
    assert run.proc.returncode == 0, run.dump()
    assert "train: done" in run.out, run.dump()
    assert "[train/0] train: done, 400 steps from 2 loaders" in run.out, run.dump()
    assert "[loader/0] " in run.out and "[loader/1] " in run.out
    assert "ipcsync-run: edge summary:" in run.err, run.dump()
    assert_summary(run, "loader", "train", 400)
    launcher.assert_nothing_left()


# ---------------------------------------------------------------------------- more lifecycle cases
@pytest.mark.timeout(200)
def test_empty_streams(launcher: Launcher) -> None:
    """Producers that send nothing: the sink sees both streams end, everything exits 0."""
    run = launcher.run(
        "--stage", f"src={shlex.join(stage('src.py', '--n', 0))}",
        "--stage", f"sink={shlex.join(stage('sink.py'))}",
        "--edge", "src:sink", "--replicas", "src=2", "--stop-timeout", "2",
    )
    assert run.proc.returncode == 0, run.dump()
    assert_complete(run.result("sink/0"), {})
    assert len(run.events("src/0", "sent")) == 1 and len(run.events("src/1", "sent")) == 1, run.dump()
    assert_summary(run, "src", "sink", 0)
    launcher.assert_nothing_left()


@pytest.mark.timeout(120)
def test_straggler_in_a_finished_stage_group_is_killed(launcher: Launcher) -> None:
    """A stage that exits 0 but leaves a child in its process group (which ignores SIGTERM):
    the launcher kills the child at the end. A last line without a newline is relayed too."""
    sleeper = shlex.join(stage("sleeper.py", "--ignore-term"))
    script = (
        f"{sleeper} > /dev/null & "
        'while ! ls "$TEST_STAGE_DIR" | grep -q "^ready-"; do sleep 0.05; done; '
        "printf 'leader done, no newline'; exit 0"
    )
    spec = launcher.spec_file(toml_spec({"leader": {"cmd": ["sh", "-c", script]}}, stop_timeout=2))
    run = launcher.run(spec, timeout=RUN_TIMEOUT)
    assert run.proc.returncode == 0, run.dump()
    assert "[leader/0] leader done, no newline" in run.out.splitlines(), run.dump()
    assert "all stages finished" in run.err, run.dump()
    straggler = launcher.pid_of("leader/0")  # the sleeper shares the stage's identity
    assert launcher.markers("ready", "leader/0")
    wait_until(lambda: not straggler.alive(), LEFT_TIMEOUT, f"straggler pid {straggler.pid} to die")
    launcher.assert_nothing_left()


@pytest.mark.timeout(200)
def test_launcher_killed_stages_get_sigterm_and_next_launcher_sweeps(launcher: Launcher, tmp_path: Path) -> None:
    """SIGKILL to the launcher: its stages get SIGTERM (parent-death signal) and exit; the
    run directory it could not remove is swept by the next launcher."""
    spec = launcher.spec_file(toml_spec(
        {"sleepy": {"cmd": stage("sleeper.py")},
         "src": {"cmd": stage("src.py", "--n", 100000, "--delay", 0.01)},
         "sink": {"cmd": stage("sink.py")}},
        [{"from": "src", "to": "sink", "slot_bytes": "64KiB"}],
        stop_timeout=2,
    ))
    first = launcher.start(spec)
    launcher.wait_markers("ready", ["sleepy/0"], first)
    launcher.wait_markers("recv", ["sink/0"], first)
    run_id = first.run_ids[0]
    os.kill(first.proc.pid, signal.SIGKILL)
    assert first.wait(STOP_TIMEOUT) == -signal.SIGKILL
    pids = launcher.stage_pids()
    wait_until(lambda: not any(p.alive() for p in pids), STOP_TIMEOUT, "the stages to exit")
    assert launcher.markers("sig-SIGTERM", "sleepy/0"), os.listdir(launcher.state)
    assert (launcher.runtime_dir / f"run-{run_id}").is_dir()  # nobody removed it yet
    done = tmp_path / "done"
    done.touch()
    second = launcher.run("--stage", f"quick={shlex.join(stage('sleeper.py', '--exit-when', done))}",
                          "--stop-timeout", "2")
    assert second.proc.returncode == 0, second.dump()
    assert f"removed what an earlier launcher (killed) left of run {run_id}" in second.err, second.dump()
    launcher.assert_nothing_left()


# ---------------------------------------------------------------------------- regressions
@pytest.mark.timeout(200)
def test_signal_during_failure_teardown_does_not_restart(launcher: Launcher, tmp_path: Path) -> None:
    go = tmp_path / "go"
    spec = launcher.spec_file(toml_spec(
        {"stubborn": {"cmd": stage("sleeper.py", "--ignore-term-on-restart", 0)},
         "quitter": {"cmd": stage("sleeper.py", "--exit-when", go, "--code", 3)}},
        restart=1, stop_timeout=10,
    ))
    run = launcher.start(spec)
    launcher.wait_markers("ready", ["stubborn/0", "quitter/0"], run)
    go.touch()
    # The quitter failed; the launcher now waits up to 10 s for the stubborn stage.
    wait_until(lambda: "ipcsync-run: root cause: stage quitter/0" in run.err, STOP_TIMEOUT, "the root cause line")
    os.kill(run.proc.pid, signal.SIGTERM)
    rc = run.wait(STOP_TIMEOUT)
    assert len(run.started_lines) == 1, f"a new group was started after SIGTERM\n{run.dump()}"
    assert "restarting the whole group" not in run.err, run.dump()
    # The failure stays the root cause; the interrupt only rules out the restart.
    assert rc == 3, run.dump()
    launcher.assert_nothing_left()


@pytest.mark.timeout(120)
def test_closed_stdout_pipe_still_tears_down(launcher: Launcher) -> None:
    spec = launcher.spec_file(toml_spec(
        {"chatty": {"cmd": stage("sleeper.py", "--chatty", "--ignore-term")},
         "stubborn": {"cmd": stage("sleeper.py", "--ignore-term")}},
        stop_timeout=1,
    ))
    run = launcher.start(spec, pipe_stdout=True)
    launcher.wait_markers("ready", ["chatty/0", "stubborn/0"], run)
    assert run.proc.stdout is not None
    r, _, _ = select.select([run.proc.stdout], [], [], START_TIMEOUT)
    assert r and run.proc.stdout.readline().startswith(b"["), run.dump()
    run.proc.stdout.close()  # like `| head -1` exiting
    rc = run.wait(STOP_TIMEOUT)
    launcher.assert_nothing_left(timeout=3)
    assert rc != 0, run.dump()
    assert "Traceback" not in run.err, run.dump()


# ---------------------------------------------------------------------------- the interpreter, threads, output
def _fake_python(tmp_path: Path) -> str:
    """A directory whose ``python3`` and ``python`` are shell scripts exiting 97; the
    PATH to give the launcher with it first."""
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir()
    for name in ("python3", "python"):
        fake = bin_dir / name
        fake.write_text("#!/bin/sh\necho 'fake python ran' >&2\nexit 97\n")
        fake.chmod(0o755)
    return f"{bin_dir}{os.pathsep}{os.environ.get('PATH', os.defpath)}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("word", ["python3", "python", f"python{sys.version_info[0]}.{sys.version_info[1]}"])
def test_python_command_runs_under_the_launchers_interpreter(launcher: Launcher, tmp_path: Path, word: str) -> None:
    """`python3 ...` in a stage means the launcher's own interpreter (as with torchrun),
    not whatever python3 comes first on PATH."""
    path = _fake_python(tmp_path)
    cmd = f"{word} -c 'import sys; print(\"exe\", sys.executable)'"
    run = launcher.run("--stage", f"p={cmd}", "--stop-timeout", "2", env={"PATH": path})
    assert run.proc.returncode == 0, run.dump()
    assert f"exe {PY}" in run.lines_of("p/0"), run.dump()
    assert "fake python ran" not in run.out, run.dump()
    dry = launcher.run("--stage", f"p={cmd}", "--dry-run", env={"PATH": path})
    assert dry.proc.returncode == 0, dry.dump()
    assert re.search(rf"^\s+p/0\s+device cpu\s+cmd: {re.escape(PY)} -c ", dry.out, re.M), dry.dump()


OMP_NOTE = "ipcsync-run: setting OMP_NUM_THREADS=1 for each stage"
PRINT_OMP = shlex.join([PY, "-c", "import os; print('omp', os.environ.get('OMP_NUM_THREADS'))"])


@pytest.mark.timeout(120)
def test_omp_num_threads_is_one_unless_set(launcher: Launcher) -> None:
    spec = launcher.spec_file(toml_spec(
        {"plain": {"cmd": PRINT_OMP}, "own": {"cmd": PRINT_OMP, "env": {"OMP_NUM_THREADS": "4"}}},
        stop_timeout=2,
    ))
    run = launcher.run(spec, env={"OMP_NUM_THREADS": None})
    assert run.proc.returncode == 0, run.dump()
    assert run.lines_of("plain/0") == ["omp 1"], run.dump()
    assert run.lines_of("own/0") == ["omp 4"], run.dump()
    assert run.err.count(OMP_NOTE) == 1, run.dump()
    assert "set it yourself to change that" in run.err, run.dump()
    # Set in the launcher's environment: every stage inherits it, and nothing is said.
    run = launcher.run(spec, env={"OMP_NUM_THREADS": "3"})
    assert run.proc.returncode == 0, run.dump()
    assert (run.lines_of("plain/0"), run.lines_of("own/0")) == (["omp 3"], ["omp 4"]), run.dump()
    assert OMP_NOTE not in run.err, run.dump()
    launcher.assert_nothing_left()


@pytest.mark.timeout(120)
def test_carriage_return_progress_reaches_the_output_live(launcher: Launcher, tmp_path: Path) -> None:
    """tqdm-style `\\r` updates are relayed as they come (prefixed), not as one line at exit."""
    go = tmp_path / "go"
    run = launcher.start("--stage", f"bar={shlex.join(stage('progress.py', '--exit-when', go))}",
                         "--stop-timeout", "2")
    wait_until(lambda: b"[bar/0] progress 1/3\r" in run.out_path.read_bytes(), START_TIMEOUT,
               "the first progress segment while the stage runs")
    assert run.proc.poll() is None, run.dump()
    launcher.wait_markers("drawn", ["bar/0"], run)
    wait_until(lambda: b"[bar/0] progress 3/3\r" in run.out_path.read_bytes(), LEFT_TIMEOUT, "the last segment")
    assert run.proc.poll() is None and not go.exists()  # still running: relayed live
    go.touch()
    assert run.wait() == 0, run.dump()
    assert run.out_path.read_bytes() == (
        b"[bar/0] progress 1/3\r[bar/0] progress 2/3\r[bar/0] progress 3/3\r[bar/0] \n"), run.dump()
    launcher.assert_nothing_left()


# ---------------------------------------------------------------------------- the command line itself
def _run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT) + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
    e.update(env or {})
    return subprocess.run([PY, *args], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          env=e, cwd=str(ROOT), timeout=50)


# What the launcher may load before a pipeline runs: the package root, its errors and
# limits, segment naming (the run id's variable), the launcher's pure layers and the wait
# strategies' registry (core.waits, pure: the spec accepts the modes it names). No
# endpoint, backend, channel, torch or zmq.
LAUNCHER_MODULES = {"ipcsync", "ipcsync.errors", "ipcsync.limits", "ipcsync.logs", "ipcsync.system", "ipcsync.system.shm",
                    "ipcsync.envopts", "ipcsync.stage_contract",  # the switches' table, the launcher-stage contract
                    "ipcsync.core", "ipcsync.core.waits",
                    "ipcsync.launch", "ipcsync.launch.spec", "ipcsync.launch.plan", "ipcsync.launch.cli",
                    "ipcsync.launch.config", "ipcsync.launch.commands", "ipcsync.launch.__main__"}
HEAVY = {"torch", "zmq", "msgpack"}


def _imported(importtime_stderr: str) -> set[str]:
    """Modules named by ``python -X importtime``'s report."""
    return {line.rsplit("|", 1)[1].strip() for line in importtime_stderr.splitlines()
            if line.startswith("import time:")}


@pytest.mark.timeout(60)
def test_help_loads_neither_torch_nor_zmq() -> None:
    proc = _run_cli("-X", "importtime", "-m", "ipcsync.launch", "--help")
    assert proc.returncode == 0, proc.stderr
    assert "usage: ipcsync-run" in proc.stdout and "125" in proc.stdout and "128+N" in proc.stdout, proc.stdout
    imported = _imported(proc.stderr)
    assert "ipcsync.launch.cli" in imported, proc.stderr[-2000:]
    assert not imported & HEAVY, sorted(imported & HEAVY)
    ours = {m for m in imported if m.split(".")[0] == "ipcsync"}
    assert ours <= LAUNCHER_MODULES, sorted(ours - LAUNCHER_MODULES)


@pytest.mark.timeout(60)
def test_launcher_modules_load_neither_torch_nor_zmq_nor_the_endpoints() -> None:
    check = ("import sys, ipcsync, ipcsync.launch.cli, ipcsync.launch.spec, ipcsync.launch.plan, ipcsync.launch; "
             "import json; print(json.dumps(sorted(m for m in sys.modules "
             "if m.split('.')[0] in ('ipcsync', 'torch', 'zmq', 'msgpack'))))")
    proc = _run_cli("-c", check)
    assert proc.returncode == 0, proc.stderr
    loaded = set(json.loads(proc.stdout))
    assert not {m.split(".")[0] for m in loaded} & HEAVY, sorted(loaded)
    assert loaded <= LAUNCHER_MODULES, sorted(loaded - LAUNCHER_MODULES)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_dry_run_loads_neither_torch_nor_zmq(launcher: Launcher, device: str) -> None:
    from ipcsync.launch.cli import GPU_DRIVER_FILES

    spec = launcher.spec_file(toml_spec(
        {"src": {"cmd": stage("src.py"), "device": device}, "sink": {"cmd": stage("sink.py"), "device": device}},
        [{"from": "src", "to": "sink"}],
    ))
    proc = _run_cli("-X", "importtime", "-m", "ipcsync.launch", str(spec), "--dry-run",
                    env={"IPCSYNC_RUNTIME_DIR": str(launcher.runtime_dir)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "src -> sink: 1 producer(s) x 1 consumer(s)" in proc.stdout, proc.stdout
    imported = _imported(proc.stderr)
    heavy = HEAVY if device == "cpu" or not any(os.path.exists(p) for p in GPU_DRIVER_FILES) else HEAVY - {"torch"}
    assert not imported & heavy, sorted(imported & heavy)  # "auto" on a GPU host: torch counts the GPUs
    ours = {m for m in imported if m.split(".")[0] == "ipcsync"}
    allowed = LAUNCHER_MODULES | {"ipcsync.system.paths",  # the runtime directory
                                  "ipcsync.launch.mps", "ipcsync.mps_attach"}  # the MPS decision
    assert ours <= allowed, sorted(ours - allowed)
    assert not list(launcher.runtime_dir.glob("run-*"))
    launcher.assert_nothing_left()


@pytest.mark.timeout(60)
def test_package_names_load_on_first_use() -> None:
    check = ("import sys, ipcsync; assert 'torch' not in sys.modules; "
             "assert set(ipcsync.__all__) <= set(dir(ipcsync)); "
             "from ipcsync import Producer, forward; import ipcsync.forwarding; "
             "assert ipcsync.forward is forward and callable(forward), ipcsync.forward; "
             "assert 'torch' in sys.modules and ipcsync.Producer is Producer; "
             "print(ipcsync.PROTOCOL_VERSION)")
    proc = _run_cli("-c", check)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.timeout(60)
def test_version() -> None:
    import ipcsync

    proc = _run_cli("-m", "ipcsync.launch", "--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"ipcsync-run {ipcsync.__version__}", proc.stdout


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args", [["--bogus"], ["--restart", "many", "x.toml"], ["--stop-timeout"]],
                         ids=["unknown-option", "bad-int", "missing-value"])
def test_usage_errors_exit_125(launcher: Launcher, args: list[str]) -> None:
    run = launcher.run(*args, timeout=50)
    assert run.proc.returncode == 125, run.dump()
    assert "usage: ipcsync-run" in run.err and "ipcsync-run: error: " in run.err, run.dump()
    launcher.assert_nothing_left()


@pytest.mark.timeout(60)
def test_dry_run_that_finds_a_stage_unable_to_start_exits_125(launcher: Launcher, tmp_path: Path) -> None:
    """Each check (cwd, command on PATH, script path, executable): test_launch_plan.py."""
    spec = launcher.spec_file(toml_spec({"good": {"cmd": stage("sleeper.py")},
                                         "bad": {"cmd": ["ipcsync-no-such-program-xyz", "--flag"]}}))
    run = launcher.run(spec, "--dry-run", timeout=50)
    assert run.proc.returncode == 125, run.dump()
    assert "ipcsync-run: error: the dry run found stages that cannot start" in run.err, run.dump()
    problems = [l.strip() for l in run.err.splitlines() if f"{spec}: stages." in l]
    assert len(problems) == 1 and problems[0].startswith(f"{spec}: stages.bad.cmd:"), run.dump()
    assert not launcher.stage_pids() and not list(launcher.runtime_dir.glob("run-*"))


# ---------------------------------------------------------------------------- Ctrl-C, daemons, killed launchers
@pytest.mark.timeout(200)
def test_ctrl_c_prints_one_line_per_stage_and_no_traceback(launcher: Launcher) -> None:
    spec = launcher.spec_file(toml_spec(
        {"train": {"cmd": stage("loop.py")}, "load": {"cmd": stage("loop.py")}}, stop_timeout=20))
    run = launcher.start(spec)
    launcher.wait_markers("ready", ["train/0", "load/0"], run)
    os.kill(run.proc.pid, signal.SIGINT)
    assert run.wait(STOP_TIMEOUT) == 130, run.dump()
    both = run.out + run.err
    assert "Traceback" not in both and "KeyboardInterrupt" not in both, run.dump()
    assert "ipcsync-run: interrupted (SIGINT); stopping 2 stages" in run.err, run.dump()
    for label in ("train/0", "load/0"):
        assert run.err.count(f"ipcsync-run: stage {label} stopped (SIGTERM)") == 1, run.dump()
    assert run.err.count(" stopped (") == 2, run.dump()
    launcher.assert_nothing_left()


@pytest.mark.timeout(120)
def test_daemon_of_a_stage_does_not_outlive_a_successful_run(launcher: Launcher) -> None:
    run = launcher.run("--stage", f"d={shlex.join(stage('daemonize.py'))}", "--stop-timeout", "2")
    assert run.proc.returncode == 0, run.dump()
    assert "daemon started; leader done" in run.lines_of("d/0"), run.dump()
    names = launcher.markers("daemon", "d/0")
    assert len(names) == 1, names
    daemon = int(names[0].rsplit("-", 1)[1])
    try:
        wait_until(lambda: not pid_alive(daemon), LEFT_TIMEOUT, f"the daemon pid {daemon} to be gone")
        assert re.search(rf"killed 1 process\(es\) that the stages left running .*pid {daemon} \(sleep\)", run.err), \
            run.dump()
        launcher.assert_nothing_left()
    finally:
        if pid_alive(daemon):
            os.kill(daemon, signal.SIGKILL)


@pytest.mark.timeout(200)
def test_sweep_kills_a_killed_launchers_stage_before_removing_its_run(launcher: Launcher, tmp_path: Path) -> None:
    """A stage that ignores SIGTERM outlives a SIGKILLed launcher; the next launcher kills
    it first, and only then removes its run directory."""
    spec = launcher.spec_file(toml_spec(
        {"stubborn": {"cmd": stage("sleeper.py", "--ignore-term", "--watch-run-dir")}}, stop_timeout=2))
    first = launcher.start(spec)
    launcher.wait_markers("ready", ["stubborn/0"], first)
    run_id = first.run_ids[0]
    stubborn = launcher.pid_of("stubborn/0")
    try:
        os.kill(first.proc.pid, signal.SIGKILL)
        assert first.wait(STOP_TIMEOUT) == -signal.SIGKILL
        wait_until(lambda: launcher.markers("sig-SIGTERM", "stubborn/0"), STOP_TIMEOUT, "the parent-death SIGTERM")
        assert stubborn.alive(), ("the stage ignores SIGTERM: it must still run; its markers: "
                                  f"{sorted(f.name for f in launcher.state.iterdir())}")
        done = tmp_path / "done"
        done.touch()
        second = launcher.run("--stage", f"quick={shlex.join(stage('sleeper.py', '--exit-when', done))}",
                              "--stop-timeout", "2")
        assert second.proc.returncode == 0, second.dump()
        assert re.search(rf"killed 1 process\(es\) still running of run {run_id} .*pid {stubborn.pid} ",
                         second.err), f"{second.dump()}\nthe stage (pid {stubborn.pid}) alive now: {stubborn.alive()}"
        assert f"removed what an earlier launcher (killed) left of run {run_id}" in second.err, second.dump()
        assert not stubborn.alive(), second.dump()
        # Killed before its run directory went: it never saw the directory gone.
        assert not launcher.markers("run-dir-gone"), os.listdir(launcher.state)
        launcher.assert_nothing_left()
    finally:
        if stubborn.alive():
            os.kill(stubborn.pid, signal.SIGKILL)
