"""Shared test fixtures: per-test timeouts, a private runtime dir, tracked child processes,
shared-memory leak checks, and the `cuda` marker's skip.

Every multi-process test goes through the `procs` fixture, which kills every process group
it started and checks /dev/shm for segments those processes left, pass or fail.
"""

from __future__ import annotations

import faulthandler
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent / "integration"  # the child-process roles (peers.py, ...)
_LAUNCH = ("import importlib, json, sys; "
           "getattr(importlib.import_module(sys.argv[1]), sys.argv[2])(json.loads(sys.argv[3]))")
DEFAULT_TIMEOUT = 60.0
SHM_DIR = "/dev/shm"


class TestTimeout(Exception):
    """A test phase ran past its timeout."""


# --------------------------------------------------------------------------- timeouts
def _timeout_of(item: pytest.Item) -> float:
    marker = item.get_closest_marker("timeout")
    return float(marker.args[0]) if marker else DEFAULT_TIMEOUT


def _with_alarm(item: pytest.Item, phase: str) -> Iterator[None]:
    seconds = _timeout_of(item)

    def on_alarm(signum: int, frame: Any) -> None:
        raise TestTimeout(f"{phase} of {item.nodeid} ran past its {seconds:.0f} s timeout")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    # Backstop if the alarm cannot interrupt (stuck in C): dump stacks and exit the worker.
    faulthandler.dump_traceback_later(seconds + 30, exit=True)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        faulthandler.cancel_dump_traceback_later()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    yield from _with_alarm(item, "setup")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    yield from _with_alarm(item, "call")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    yield from _with_alarm(item, "teardown")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run scripts/gpu-tests.sh on one)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:  # the marker, not a keyword match
            item.add_marker(skip)


# --------------------------------------------------------------------------- runtime dir
@pytest.fixture(autouse=True)
def runtime_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private, short runtime dir per test (ipc paths are limited to 107 bytes)."""
    d = Path(tempfile.mkdtemp(prefix="ipcs-", dir="/tmp"))
    os.chmod(d, 0o700)
    monkeypatch.setenv("IPCSYNC_RUNTIME_DIR", str(d))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def shm_segments(pid: int) -> list[str]:
    """ipcsync shared-memory segments created by process ``pid``."""
    prefix = f"ipcsync-{pid}-"
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))
    except FileNotFoundError:
        return []


def wait_no_segments(pids: list[int], timeout: float = 10.0) -> list[str]:
    """Wait (for resource trackers of killed processes) until no segment of ``pids`` is
    left; return what is left after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        left = [s for p in pids for s in shm_segments(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


@pytest.fixture(autouse=True)
def no_leaked_segments_in_process() -> Iterator[None]:
    """Segments made by this test process itself must be gone after each test."""
    yield
    pid = os.getpid()
    left = wait_no_segments([pid], timeout=2.0)
    for name in left:
        os.unlink(os.path.join(SHM_DIR, name))
    assert not left, f"shared-memory segments left behind: {left}"


# --------------------------------------------------------------------------- processes
class Peer:
    """A child process running tests/integration/peers.py; reads its JSON lines with deadlines."""

    def __init__(self, proc: subprocess.Popen[bytes], role: str) -> None:
        self.proc = proc
        self.role = role
        self._buf = b""
        self.lines: list[dict[str, Any]] = []

    @property
    def pid(self) -> int:
        return self.proc.pid

    def read_until(self, pred: Any, timeout: float = 30.0) -> dict[str, Any]:
        """Read lines until one satisfies ``pred``; AssertionError on timeout or exit."""
        deadline = time.monotonic() + timeout
        for line in self.lines:
            if pred(line):
                return line
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while True:
            while b"\n" in self._buf:
                raw, self._buf = self._buf.split(b"\n", 1)
                try:
                    line = json.loads(raw)
                except ValueError:
                    continue
                self.lines.append(line)
                if pred(line):
                    return line
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"{self.role} pid {self.pid}: no matching line in time; got {self.lines[-5:]}")
            r, _, _ = select.select([fd], [], [], remaining)
            if r:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise AssertionError(
                        f"{self.role} pid {self.pid} exited ({self.proc.wait()}) before a matching "
                        f"line; last lines {self.lines[-5:]}; stderr: {self.stderr()[-2000:]}"
                    )
                self._buf += chunk

    def result(self, timeout: float = 60.0) -> dict[str, Any]:
        """The final {"event": "done"} line and a zero exit code."""
        line = self.read_until(lambda l: l.get("event") == "done", timeout)
        rc = self.proc.wait(timeout=timeout)
        assert rc == 0, f"{self.role} exited {rc}: {self.stderr()[-3000:]}"
        return line

    def stderr(self) -> str:
        if self.proc.stderr is None:
            return ""
        if self.proc.poll() is None:
            return "(still running)"
        return self.proc.stderr.read().decode(errors="replace")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


class Procs:
    """Starts peers in their own process groups; kills them all at teardown."""

    def __init__(self) -> None:
        self.peers: list[Peer] = []

    def start(self, role: str, *, module: str = "peers", env: dict[str, str] | None = None,
              **args: Any) -> Peer:
        """Run ``<module>.<role>(args)`` (a module of tests/, peers.py by default) in a child
        with ``env`` added to the environment."""
        full = dict(os.environ)
        full.update(env or {})
        full["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")])
        full["PYTHONUNBUFFERED"] = "1"
        proc = subprocess.Popen(
            [sys.executable, "-c", _LAUNCH, module, role, json.dumps(args)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
            env=full, start_new_session=True,
        )
        peer = Peer(proc, role)
        self.peers.append(peer)
        return peer

    def close(self) -> list[str]:
        """Kill everything; return shm segments any peer left behind (after cleanup)."""
        for p in self.peers:
            if p.proc.poll() is None:
                try:
                    os.killpg(p.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                p.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            for stream in (p.proc.stdout, p.proc.stderr):
                if stream is not None:
                    stream.close()
        pids = [p.pid for p in self.peers]
        left = wait_no_segments(pids, timeout=10.0)
        for name in left:
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except FileNotFoundError:
                pass
        # Kill anything left in the peers' process groups (resource trackers included).
        for p in self.peers:
            try:
                os.killpg(p.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        return left


@pytest.fixture
def procs() -> Iterator[Procs]:
    ps = Procs()
    try:
        yield ps
    finally:
        left = ps.close()
    assert not left, f"shared-memory segments left behind by peers: {left}"
