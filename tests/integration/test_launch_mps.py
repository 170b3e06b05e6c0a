"""ipcsync-run's private MPS daemon, on a machine without a GPU: the launcher
(tests/integration/fake_gpu_launch.py: ipcsync-run as if there were one GPU) runs stages
that stand for CUDA processes (stages/mps_stage.py) under a fake
``nvidia-cuda-mps-control`` (tests/fakemps.py) put first on PATH.

The daemon's whole life: started before the stages, its variables given to them, each
stage checked as its client, stopped and its directory removed after a run that succeeds,
fails, is interrupted (SIGINT) or whose launcher is SIGKILLed (the watchdog); ``--mps
off`` starts nothing; ``--mps on`` that cannot start a daemon is one line and exit 125;
``--dry-run`` says what a run would use. Then ``mps.cleanup`` of a daemon that ignores
``quit``, ``sweep_abandoned``, ``mps_attach.check_attached`` and ``ipcsync doctor``'s
MPS check, against the same fake daemon.

Every test kills what it started at teardown (the ``launcher`` fixture: every process
carrying the test's token, which the launcher, its watchdog, the daemon and its server
inherit; ``daemons``: the daemons started here directly)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import test_launch_cli as cli_tests
from fakemps import install
from specfile import toml_spec
from test_launch_cli import Launcher, Run, launcher, pid_alive, wait_until  # noqa: F401 (the fixture)

from ipcsync import doctor
from ipcsync.errors import ConfigError
from ipcsync.launch import mps as mpsmod
from ipcsync.launch import mps_daemon
from ipcsync.system.host import start_time
from ipcsync.mps_attach import ENV_CONTROL, ENV_PIPE, LOG_ENV, PIPE_ENV, ask, check_attached, clients

PY = sys.executable
HERE = Path(__file__).resolve().parent
WRAPPER = HERE / "fake_gpu_launch.py"
DAEMON_LINE = re.compile(r"ipcsync-run: started a private MPS daemon \(pid (\d+), pipe directory (\S+)\)")


# ---------------------------------------------------------------------------- helpers
@pytest.fixture
def fake(tmp_path: Path) -> Path:
    """The fake control program, in a directory of its own."""
    return install(tmp_path / "fakebin")


def start(ln: Launcher, fake: Path | None, *args: Any, env: dict[str, str | None] | None = None) -> Run:
    """ipcsync-run (one GPU, as the wrapper says) with the fake first on PATH."""
    extra: dict[str, str | None] = {"CUDA_MPS_PIPE_DIRECTORY": None, "CUDA_MPS_LOG_DIRECTORY": None}
    path = os.environ.get("PATH", os.defpath)
    extra["PATH"] = f"{fake.parent}{os.pathsep}{path}" if fake is not None else path
    extra.update(env or {})
    n = len(ln.runs)
    out_path, err_path = ln.tmp / f"launcher{n}.out", ln.tmp / f"launcher{n}.err"
    argv = [str(a) for a in args]
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        proc = subprocess.Popen([PY, str(WRAPPER), *argv], stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                cwd=str(cli_tests.ROOT), env=ln.env(extra), start_new_session=True)
    run = Run(proc, out_path, err_path, argv)
    ln.runs.append(run)
    return run


def spec(ln: Launcher, a: str = "ok", b: str = "ok", **top: Any) -> Path:
    """Two CUDA stages on GPU 0 (so mps = "auto" runs a daemon), each an mps_stage."""
    return ln.spec_file(toml_spec(
        {"a": {"cmd": cli_tests.stage("mps_stage.py", a), "device": "cuda"},
         "b": {"cmd": cli_tests.stage("mps_stage.py", b), "device": "cuda"}},
        stop_timeout=5, **top,
    ))


def mps_markers(ln: Launcher) -> dict[str, dict[str, Any]]:
    found = {}
    for f in ln.state.glob("mps-*"):
        if not f.name.endswith(".tmp"):
            label = "/".join(f.name.split("-")[1:3])
            found[label] = json.loads(f.read_text())
    return found


def daemon_of(run: Run) -> tuple[int, str]:
    m = DAEMON_LINE.search(run.err)
    assert m, run.dump()
    return int(m.group(1)), m.group(2)


def assert_daemon_gone(ln: Launcher, run: Run, pid: int, pipe: str, timeout: float = 30.0) -> None:
    """The daemon, its servers and its private directory are gone."""
    root = os.path.dirname(pipe)
    wait_until(lambda: not pid_alive(pid) and not os.path.exists(root), timeout, "the daemon and its directory gone")
    assert not mps_daemon.leftovers((pid, 0), pipe), run.dump()
    assert not list(ln.runtime_dir.glob("mps-*")), run.dump()


def check_stage_env(ln: Launcher, run: Run, fake: Path) -> str:
    """Both stages got the daemon's variables (a private pipe directory, not the default)
    and were its clients; returns the pipe directory."""
    markers = mps_markers(ln)
    assert set(markers) == {"a/0", "b/0"}, (markers, run.dump())
    pid, pipe = daemon_of(run)
    assert os.path.dirname(pipe).startswith(str(ln.runtime_dir / "mps-")) and pipe.endswith("/pipe")
    for m in markers.values():
        assert m[PIPE_ENV] == m[ENV_PIPE] == pipe, m
        assert m[LOG_ENV] == os.path.join(os.path.dirname(pipe), "log"), m
        assert m[ENV_CONTROL] == str(fake), m
    return pipe


# ---------------------------------------------------------------------------- the daemon's life
@pytest.mark.timeout(120)
def test_auto_runs_the_stages_under_a_private_daemon_and_removes_it(launcher: Launcher, fake: Path) -> None:
    run = start(launcher, fake, spec(launcher))
    assert run.wait() == 0, run.dump()
    pid, pipe = daemon_of(run)
    assert "mps auto: a private MPS daemon for the run's 2 CUDA processes (a/0, b/0 share GPU 0)" in run.err
    # Started before the stages: each stage attached and passed the check (mps_stage).
    assert run.err.index("started a private MPS daemon") < run.err.index("started 2 processes"), run.dump()
    check_stage_env(launcher, run, fake)
    assert "mps:" not in run.err.replace("mps auto:", ""), run.dump()  # stopped cleanly: nothing to say
    assert_daemon_gone(launcher, run, pid, pipe)
    launcher.assert_nothing_left()


@pytest.mark.timeout(120)
def test_a_failing_stage_stops_the_daemon_too(launcher: Launcher, fake: Path) -> None:
    run = start(launcher, fake, spec(launcher, b="fail"))
    assert run.wait() == 3, run.dump()
    pid, pipe = daemon_of(run)
    assert "root cause: stage b/0" in run.err, run.dump()
    assert_daemon_gone(launcher, run, pid, pipe)
    launcher.assert_nothing_left()


@pytest.mark.timeout(120)
def test_a_restart_keeps_one_daemon_for_the_run(launcher: Launcher, fake: Path) -> None:
    run = start(launcher, fake, spec(launcher, b="fail", restart=1))
    assert run.wait() == 3, run.dump()
    assert len(DAEMON_LINE.findall(run.err)) == 1 and "restart 1 of 1" in run.err, run.dump()
    pid, pipe = daemon_of(run)
    assert_daemon_gone(launcher, run, pid, pipe)
    launcher.assert_nothing_left()


@pytest.mark.timeout(120)
def test_ctrl_c_to_the_launcher_stops_the_daemon(launcher: Launcher, fake: Path) -> None:
    run = start(launcher, fake, spec(launcher, a="sleep", b="sleep"))
    launcher.wait_markers("ready", ["a/0", "b/0"], run)
    pid, pipe = daemon_of(run)
    assert pid_alive(pid) and os.path.exists(os.path.join(pipe, "control"))
    os.kill(run.proc.pid, signal.SIGINT)
    assert run.wait(cli_tests.STOP_TIMEOUT) == 130, run.dump()
    assert_daemon_gone(launcher, run, pid, pipe)
    launcher.assert_nothing_left()


@pytest.mark.timeout(150)
def test_a_sigkilled_launchers_watchdog_stops_the_daemon(launcher: Launcher, fake: Path) -> None:
    run = start(launcher, fake, spec(launcher, a="sleep", b="sleep"))
    launcher.wait_markers("ready", ["a/0", "b/0"], run)
    pid, pipe = daemon_of(run)
    check_stage_env(launcher, run, fake)
    servers = clients(pipe, str(fake))
    assert len(servers) == 1 and sorted(servers[next(iter(servers))]) == sorted(
        m["pid"] for m in mps_markers(launcher).values()), servers
    os.kill(run.proc.pid, signal.SIGKILL)
    run.wait(10)
    assert_daemon_gone(launcher, run, pid, pipe, timeout=60)
    for server in servers:
        assert not pid_alive(server)
    wait_until(lambda: "the launcher exited without stopping its MPS daemon" in run.err, 10, "the watchdog's line")
    wait_until(lambda: not launcher.token_pids(), 20, "no process of the run (stages, watchdog)")


@pytest.mark.timeout(120)
def test_mps_off_starts_nothing(launcher: Launcher, fake: Path) -> None:
    run = start(launcher, fake, spec(launcher, mps="on"), "--mps", "off")
    assert run.wait() == 0, run.dump()
    assert "MPS daemon" not in run.err, run.dump()
    for m in mps_markers(launcher).values():
        assert m[PIPE_ENV] is None and m[ENV_PIPE] is None, m
    assert not list(launcher.runtime_dir.glob("mps-*"))
    launcher.assert_nothing_left()


@pytest.mark.timeout(120)
def test_mps_on_that_cannot_start_a_daemon_is_one_line_and_exit_125(launcher: Launcher, fake: Path) -> None:
    run = start(launcher, fake, spec(launcher), "--mps", "on", env={"FAKE_MPS_FAIL_START": "no GPU for MPS here"})
    assert run.wait() == 125, run.dump()
    errors = [line for line in run.err.splitlines() if "error:" in line]
    assert len(errors) == 1, run.dump()
    assert errors[0].startswith("ipcsync-run: error: cannot start a private MPS daemon ("), run.dump()
    assert errors[0].endswith("it exited 1: no GPU for MPS here"), run.dump()
    assert "started 2 processes" not in run.err and not launcher.stage_pids()
    assert not list(launcher.runtime_dir.glob("mps-*"))
    launcher.assert_nothing_left()
    # Under "auto" the same failure is said and the run goes on without MPS.
    run = start(launcher, fake, spec(launcher), env={"FAKE_MPS_FAIL_START": "no GPU for MPS here"})
    assert run.wait() == 0, run.dump()
    assert "no GPU for MPS here; the run goes on without MPS" in run.err, run.dump()
    launcher.assert_nothing_left()


@pytest.mark.timeout(120)
def test_mps_on_without_the_control_program_is_exit_125(launcher: Launcher, tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    run = start(launcher, None, spec(launcher, mps="on"), env={"PATH": str(bare)})
    assert run.wait() == 125, run.dump()
    assert "ipcsync-run: error: cannot run a private MPS daemon: nvidia-cuda-mps-control is not found on PATH" \
        in run.err, run.dump()
    assert not launcher.stage_pids()
    launcher.assert_nothing_left()


@pytest.mark.timeout(120)
def test_a_stage_that_is_not_the_daemons_client_fails(launcher: Launcher, fake: Path) -> None:
    run = start(launcher, fake, spec(launcher, b="detached"))
    assert run.wait() != 0, run.dump()
    assert "root cause: stage b/0" in run.err, run.dump()
    assert "uses CUDA but is not a client of its run's MPS daemon" in run.out, run.dump()
    pid, pipe = daemon_of(run)
    assert_daemon_gone(launcher, run, pid, pipe)
    launcher.assert_nothing_left()


@pytest.mark.timeout(120)
def test_dry_run_says_what_mps_a_run_would_use(launcher: Launcher, fake: Path) -> None:
    cases = [
        ([], "mps auto: a private MPS daemon for the run's 2 CUDA processes (a/0, b/0 share GPU 0)"),
        (["--mps", "off"], "mps off: no MPS daemon (processes that share a GPU time-slice it)"),
        (["--device", "a=cpu", "--device", "b=cpu"], "mps auto: no MPS daemon: no process of the run uses CUDA"),
    ]
    for args, line in cases:
        run = start(launcher, fake, spec(launcher), "--dry-run", *args)
        assert run.wait() == 0, run.dump()
        assert line in run.out.splitlines(), (line, run.dump())
    run = start(launcher, None, spec(launcher), "--dry-run", "--mps", "on", env={"PATH": "/nonexistent"})
    assert run.wait() == 125 and "nvidia-cuda-mps-control is not found on PATH" in run.err, run.dump()
    assert "mps on: cannot run a private MPS daemon" in run.out, run.dump()
    assert not list(launcher.runtime_dir.glob("mps-*"))
    launcher.assert_nothing_left()  # (no daemon either: it would carry the test's token)


# ---------------------------------------------------------------------------- pieces, against the fake daemon
@pytest.fixture
def daemons(fake: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Private MPS roots made here (``mps_daemon.PrivateMps`` or ``by_hand``); every daemon
    and server of them killed and the directories removed at teardown."""
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ.get('PATH', '')}")
    roots: list[str] = []
    yield roots
    for root in roots:
        pipe = os.path.join(root, "pipe")
        for pid, _ in mps_daemon.leftovers(DAEMONS.get(root), pipe):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        shutil.rmtree(root, ignore_errors=True)


DAEMONS: dict[str, tuple[int, int]] = {}  # root -> (pid, start time) of the daemons by_hand started


def by_hand(root: str, fake: Path, roots: list[str], **env: str) -> tuple[int, int]:
    """A fake daemon in a private root ``root`` made here; its (pid, start time)."""
    roots.append(root)
    for sub in ("pipe", "log"):
        os.makedirs(os.path.join(root, sub), mode=0o700)
    pipe = os.path.join(root, "pipe")
    e = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=pipe, CUDA_MPS_LOG_DIRECTORY=os.path.join(root, "log"), **env)
    assert subprocess.run([str(fake), "-d"], env=e, timeout=30).returncode == 0
    pid_file = Path(pipe, mps_daemon.PID_FILE)

    def pid_written() -> bool:  # the daemon creates the file, then writes it: both must have happened
        return os.path.exists(os.path.join(pipe, "control")) and pid_file.exists() \
            and pid_file.read_text().strip().isdigit()

    wait_until(pid_written, 20, "the fake daemon's pid file")
    pid = int(pid_file.read_text())
    DAEMONS[root] = (pid, start_time(pid))
    return DAEMONS[root]


@pytest.mark.timeout(90)
def test_cleanup_kills_a_daemon_that_does_not_quit_and_its_server(tmp_path: Path, fake: Path,
                                                                   daemons: list[str]) -> None:
    root = str(tmp_path / "mpsroot")
    daemon = by_hand(root, fake, daemons, FAKE_MPS_IGNORE_QUIT="1")
    pipe = os.path.join(root, "pipe")
    ask(pipe, f"attach {os.getpid()}", str(fake))
    (server,) = clients(pipe, str(fake))
    said = mps_daemon.cleanup(root, str(fake), None, quit_timeout=1.0)  # the pid file names the daemon
    assert said == [f"the MPS daemon (pid {daemon[0]}) did not quit within 1 s (clients still attached)"], said
    assert not pid_alive(daemon[0]) and not pid_alive(server)  # the server found by the daemon's session
    assert not os.path.exists(root)
    assert mps_daemon.cleanup(root, str(fake), daemon) == []  # twice: nothing left to do


@pytest.mark.timeout(90)
def test_private_mps_stops_through_its_watchdog(tmp_path: Path, fake: Path, daemons: list[str],
                                                runtime_dir: Path) -> None:
    said: list[str] = []
    mps = mps_daemon.PrivateMps(str(fake), str(runtime_dir), say=said.append)
    mps.start()
    try:
        assert mps.root is not None and mps.daemon is not None and mps.watchdog is not None
        daemons.append(mps.root)
        DAEMONS[mps.root] = mps.daemon
        root, daemon, watchdog = mps.root, mps.daemon, mps.watchdog
        assert oct(os.stat(root).st_mode & 0o777) == "0o700"
        assert _ppid(watchdog) != os.getpid()  # out of this process's tree
        assert clients(mps.pipe, str(fake)) == {}  # answers; no server before a client
    finally:
        mps.stop()
    assert not os.path.exists(root) and not pid_alive(daemon[0], daemon[1]) and said == []
    wait_until(lambda: not pid_alive(watchdog), 10, "the watchdog's exit")
    mps.stop()  # twice: nothing


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return int(data[data.rfind(b")") + 2:].split()[1])


@pytest.mark.timeout(90)
def test_sweep_removes_what_a_launcher_and_its_watchdog_both_left(tmp_path: Path, fake: Path, daemons: list[str],
                                                                  runtime_dir: Path) -> None:
    gone = subprocess.run([PY, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(gone.stdout)  # a pid that no longer runs (its start time cannot match)
    left = str(runtime_dir / "mps-abcdefgh")
    daemon = by_hand(left, fake, daemons)
    Path(left, "owner.json").write_text(json.dumps({"launcher": [dead, 1], "watchdog": [dead, 1],
                                                    "daemon": list(daemon)}))
    live = str(runtime_dir / "mps-alive000")
    os.makedirs(live)
    Path(live, "owner.json").write_text(json.dumps({"launcher": [os.getpid(), start_time(os.getpid())]}))
    assert mps_daemon.sweep_abandoned(str(runtime_dir), str(fake)) == [left]
    assert not pid_alive(daemon[0], daemon[1]) and not os.path.exists(left) and os.path.exists(live)


# ---------------------------------------------------------------------------- the attachment check
@pytest.mark.timeout(90)
def test_check_attached_asks_the_daemon_for_this_process(tmp_path: Path, fake: Path, daemons: list[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import ipcsync.mps_attach as attach

    root = str(tmp_path / "mpsroot")
    by_hand(root, fake, daemons)
    pipe = os.path.join(root, "pipe")
    monkeypatch.setattr(attach, "_attached_pid", None)
    check_attached()  # not under ipcsync-run's daemon: nothing to check
    monkeypatch.setenv(ENV_PIPE, pipe)
    monkeypatch.setenv(ENV_CONTROL, str(fake))
    monkeypatch.setenv(PIPE_ENV, pipe)
    with pytest.raises(ConfigError, match=r"pid \d+\) uses CUDA but is not a client of its run's MPS daemon "
                       r".*no server running.*Cause: its CUDA driver did not connect.*--mps off"):
        check_attached(timeout=0.3)
    monkeypatch.setenv(PIPE_ENV, "/elsewhere")
    with pytest.raises(ConfigError, match=r"Cause: its CUDA_MPS_PIPE_DIRECTORY is '/elsewhere', not the run's"):
        check_attached(timeout=0.3)
    ask(pipe, f"attach {os.getpid()}", str(fake))
    check_attached(timeout=5)  # listed: fine, whatever the variable says now
    assert attach._attached_pid == os.getpid()
    monkeypatch.setattr(attach, "_attached_pid", None)
    monkeypatch.setenv(ENV_PIPE, str(tmp_path / "nodaemon"))
    with pytest.raises(ConfigError, match=r"cannot ask its run's MPS daemon .* whether it is one of its clients"):
        check_attached(timeout=0.3)


# ---------------------------------------------------------------------------- ipcsync doctor
@pytest.mark.timeout(90)
def test_doctor_sees_a_daemon_by_its_full_name_and_says_what_auto_does(tmp_path: Path, fake: Path,
                                                                        daemons: list[str],
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PIPE_ENV, raising=False)
    root = str(tmp_path / "mpsroot")
    daemon = by_hand(root, fake, daemons)
    state = doctor.mps_state()
    # The kernel keeps 15 characters of a command name ("nvidia-cuda-mps"): the full name
    # comes from the command line.
    assert state is not None and f"nvidia-cuda-mps-control running (pid {daemon[0]})" in state, state
    c = doctor.check_mps(state)
    assert c.status == "PASS" and c.name == "mps", c
    assert "none at CUDA_MPS_PIPE_DIRECTORY or the default path" in c.found, c
    assert f"available ({fake})" in c.found and mpsmod.AUTO_RULE in c.found and mpsmod.SHARES in c.found, c
    # A daemon named by the environment is the one the stages would use.
    pipe = os.path.join(root, "pipe")
    monkeypatch.setenv(PIPE_ENV, pipe)
    c = doctor.check_mps(doctor.mps_state())
    assert c.status == "PASS" and f"an MPS daemon listens at {pipe}" in c.found, c
    assert "ipcsync-run's auto mode runs the stages under it" in c.found, c

