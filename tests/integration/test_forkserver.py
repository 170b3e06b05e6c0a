"""The test peers' fork server (tests/forkserver.py) gives a peer what a fresh
``python -c`` would: environment, directory, session, stdin, SIGINT, and the exit status
and stderr of each way a program ends. Each case runs both ways and compares."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest

import conftest


@pytest.fixture(params=["fork", "spawn"])
def way(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "spawn":
        monkeypatch.setenv("IPCSYNC_TEST_FORKSERVER", "0")
    return str(request.param)


def test_a_peer_is_forked_unless_told_otherwise(procs: Any, way: str) -> None:
    peer = procs.start("describe", module="fork_roles", var="X")
    peer.result()
    forked = not hasattr(peer.proc, "communicate")
    assert forked == (way == "fork")


def test_a_peer_gets_its_environment_directory_session_and_stdin(procs: Any, way: str) -> None:
    peer = procs.start("describe", module="fork_roles", env={"FORK_ROLES_VAR": "set by the test"}, var="FORK_ROLES_VAR")
    line = peer.result()
    assert line["env"] == "set by the test"
    assert line["cwd"] == os.getcwd()
    assert line["sid"] == line["pid"] == peer.pid  # its own session, as start_new_session gives
    assert line["stdin"] == ""
    assert line["sigint"] is True


@pytest.mark.parametrize("how, code, in_stderr", [
    ("raise", 1, "RuntimeError: raised by the role"),
    ("exit3", 3, ""),
    ("exit_text", 1, "a text exit"),
    ("ctrl_c", -signal.SIGINT, "KeyboardInterrupt"),
    ("return", 0, ""),
])
def test_a_peer_ends_with_the_status_python_gives(procs: Any, way: str, how: str, code: int, in_stderr: str) -> None:
    peer = procs.start("end", module="fork_roles", how=how)
    peer.read_until(lambda l: l.get("event") == "ready")
    assert peer.proc.wait(timeout=30) == code
    assert peer.proc.returncode == code
    assert in_stderr in peer.stderr()


def test_a_killed_peer_reports_the_signal(procs: Any, way: str) -> None:
    peer = procs.start("end", module="fork_roles", how="wait")
    peer.read_until(lambda l: l.get("event") == "ready")
    assert peer.proc.poll() is None
    peer.proc.send_signal(signal.SIGKILL)
    assert peer.proc.wait(timeout=30) == -signal.SIGKILL


@pytest.mark.parametrize("how, line", [("thread", "thread done"), ("atexit", "atexit ran")])
def test_a_peer_ends_as_an_interpreter_does(procs: Any, way: str, how: str, line: str) -> None:
    """It waits for its non-daemon threads and runs its atexit hooks."""
    peer = procs.start("end", module="fork_roles", how=how)
    peer.read_until(lambda l: l.get("event") == line)
    assert peer.proc.wait(timeout=30) == 0


def test_an_environment_an_interpreter_reads_at_start_gets_a_fresh_one(procs: Any) -> None:
    server = conftest._fork_server(os.pathsep.join([str(conftest.ROOT), str(conftest.TESTS),
                                                    str(conftest.TESTS.parent), os.environ.get("PYTHONPATH", "")]))
    assert server is not None
    assert server.forkable(dict(server.env, IPCSYNC_ANYTHING="1"))
    assert not server.forkable(dict(server.env, PYTHONHASHSEED="1"))
    assert not server.forkable(dict(server.env, OMP_NUM_THREADS="1"))
    peer = procs.start("describe", module="fork_roles", env={"OMP_NUM_THREADS": "1"}, var="OMP_NUM_THREADS")
    assert peer.result()["env"] == "1"
    assert hasattr(peer.proc, "communicate")  # a subprocess.Popen: a fresh interpreter
