"""Shared test fixtures: per-test timeouts, a private runtime dir, tracked child processes,
tracked endpoints and sockets, leftover checks, and the `cuda` marker's skip.

Every multi-process test goes through the `procs` fixture, which kills every process group
it started and checks /dev/shm for segments those processes left, pass or fail. Endpoints
and raw zmq sockets a test makes in its own process go through the `endpoints` and
`sockets` fixtures, which close them at teardown; the autouse `no_leftovers` check then
fails a test that left an ipcsync service thread, a tracked socket or a segment of this
process behind. See tests/README.md.
"""

from __future__ import annotations

import faulthandler
import gc
import glob
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import zmq

import ipcsync

import forkserver  # tests/forkserver.py

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent / "integration"  # the child-process roles (peers/, ...)
# (SIGUSR1 prints every thread's stack to stderr: Peer.read_until asks for it at its deadline.)
_LAUNCH = ("import faulthandler, importlib, json, signal, sys; "
           "faulthandler.register(signal.SIGUSR1, all_threads=True); "
           "getattr(importlib.import_module(sys.argv[1]), sys.argv[2])(json.loads(sys.argv[3]))")
DEFAULT_TIMEOUT = 60.0
SHM_DIR = "/dev/shm"


def _native_threads(pid: int) -> str:
    """Every thread of ``pid`` as the kernel sees it (C++ threads included, which Python's
    stacks do not show): name, state and where it waits."""
    out = []
    for task in sorted(glob.glob(f"/proc/{pid}/task/*")):
        try:
            with open(f"{task}/comm") as f:
                name = f.read().strip()
            with open(f"{task}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            with open(f"{task}/wchan") as f:
                wchan = f.read().strip()
        except OSError:
            continue
        out.append(f"{name}:{state}:{wchan}")
    return ", ".join(out)


class TestTimeout(BaseException):
    """A test phase ran past its timeout. A BaseException, as KeyboardInterrupt is: code
    under test that ends a wait on any Exception (a producer's close() does) must not
    swallow it, or a test whose only guard against a hang is its timeout would pass."""


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


# --------------------------------------------------------------------------- Ctrl-C
# A suite started in the background (`cmd &` without job control, nohup under some shells,
# some CI runners) inherits SIGINT ignored, and an ignored signal stays ignored across
# exec: every child would then ignore the Ctrl-C the tests send it. Handled here, it is
# back to the default in each child (the Ctrl-C tests need a terminal's Ctrl-C).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# --------------------------------------------------------------------------- workers
WORKERS_ENV = "IPCSYNC_TEST_WORKERS"
EXTRA_WORKERS_MAX = 4  # most tests wait on child processes; measured in docs/testing.md


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: IPCSYNC_TEST_WORKERS if set, else one worker per usable core and one
    more per core, at most EXTRA_WORKERS_MAX more (2 cores: 4 workers)."""
    raw = os.environ.get(WORKERS_ENV, "").strip()
    if raw:
        if not raw.isdigit() or int(raw) < 1:
            raise pytest.UsageError(f"{WORKERS_ENV}={raw!r}: give a whole number of workers >= 1 "
                                    f"(or unset it for the default: twice the cores, at most "
                                    f"{EXTRA_WORKERS_MAX} more than the cores)")
        return int(raw)
    cores = len(os.sched_getaffinity(0))
    return cores + min(cores, EXTRA_WORKERS_MAX)


SCHED_CHUNK = 2  # tests xdist hands a worker at a time (unless --maxschedchunk says otherwise)


def pytest_configure(config: pytest.Config) -> None:
    # xdist's load scheduling otherwise gives each worker a block of a quarter of its share
    # of the tests at once, in collection order, and refills in large blocks: the long tests,
    # collected first (below), would all be in the first worker's block, and a worker that
    # drew slow blocks is the tail of the run while the others wait. In twos, every worker
    # takes the next tests whenever it is free.
    if getattr(config.option, "maxschedchunk", "absent") is None:  # (absent: xdist not installed)
        config.option.maxschedchunk = SCHED_CHUNK


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Tests marked `long` first (a stable sort: the rest keep their order), so that they
    # start at once, spread over the workers, with the short ones filling in around them,
    # instead of a long one starting late and being the tail of the run.
    items.sort(key=lambda item: item.get_closest_marker("long") is None)
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
    """Wait (for processes that are closing, or a consumer that reclaims a dead
    producer's arena) until no segment of ``pids`` is left; return what is left after
    ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        left = [s for p in pids for s in shm_segments(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


# --------------------------------------------------------------------------- endpoints, sockets, leftovers
SERVICE_THREAD_PREFIX = "ipcsync-"  # EndpointBase._start_service names its thread ipcsync-<role>-<endpoint>
LEFTOVER_GRACE_S = 2.0  # close is asynchronous in places (service threads join)

# zmq sockets made through the `sockets` fixture, in this process (xdist: one worker each).
_tracked_sockets: "weakref.WeakSet[zmq.Socket]" = weakref.WeakSet()


class Endpoints:
    """Factory for ipcsync endpoints that closes, at teardown, every one it made (last made,
    first closed): consumers and fan-ins with ``close(timeout=1)``, producers with
    ``abort()`` (bounded, no wait for items in flight). Closing one in the test is fine:
    close is idempotent. ``add`` tracks anything else with a ``close()``."""

    def __init__(self) -> None:
        self.made: list[Any] = []

    def producer(self, endpoint: str, **kw: Any) -> "ipcsync.Producer":
        return self.add(ipcsync.Producer(endpoint, **kw))

    def consumer(self, endpoint: str, **kw: Any) -> "ipcsync.Consumer":
        return self.add(ipcsync.Consumer(endpoint, **kw))

    def fanin(self, endpoints: Any, **kw: Any) -> "ipcsync.FanIn":
        return self.add(ipcsync.FanIn(endpoints, **kw))

    def add(self, obj: Any) -> Any:
        self.made.append(obj)
        return obj

    def close(self) -> list[str]:
        """Close everything; return what failed to close."""
        errors = []
        while self.made:
            obj = self.made.pop()
            try:
                if isinstance(obj, ipcsync.Producer):
                    obj.abort("test teardown")
                elif isinstance(obj, (ipcsync.Consumer, ipcsync.FanIn)):
                    obj.close(timeout=1.0)
                else:
                    obj.close()
            except Exception as exc:  # noqa: BLE001 - reported below, the rest still closed
                errors.append(f"{obj!r}: {type(exc).__name__}: {exc}")
        return errors


@pytest.fixture
def endpoints() -> Iterator[Endpoints]:
    """``endpoints.producer(name, **kw)``, ``.consumer(...)``, ``.fanin([...], ...)``:
    ipcsync endpoints closed at teardown, pass or fail."""
    eps = Endpoints()
    try:
        yield eps
    finally:
        errors = eps.close()
    assert not errors, f"closing the test's endpoints failed: {errors}"


def _use_copy(route: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make steady sends copy by ``route``: "native", the compiled copy (the test skipped
    where it is not built, with the reason), or "torch", the pure-Python fallback
    (endpoints made in this test and the processes it starts: IPCSYNC_NATIVE=0)."""
    from ipcsync.backends import native

    if route == "native":
        if native.reason() is not None:
            pytest.skip(f"the compiled copy is not in use: {native.reason()}")
    elif route == "torch":
        monkeypatch.setenv("IPCSYNC_NATIVE", "0")
        monkeypatch.setattr(native, "host_copy", lambda: None)
        monkeypatch.setattr(native, "cuda_copy_record", lambda: None)


def use_legacy_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA memory shared by name (CUDA IPC handles and interprocess events, the default),
    in this test's endpoints and the processes it starts (IPCSYNC_CUDA_VMM=0)."""
    monkeypatch.setenv("IPCSYNC_CUDA_VMM", "0")
    try:
        from ipcsync.backends import cuda as cuda_backend
    except ImportError:  # (a torch without CUDA support at all)
        return
    monkeypatch.setattr(cuda_backend, "_DESCRIPTOR_PROBLEM", {})


def use_cuda_descriptors(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA memory shared by descriptor (IPCSYNC_CUDA_VMM=1), in this test's endpoints and
    the processes it starts."""
    monkeypatch.setenv("IPCSYNC_CUDA_VMM", "1")
    try:
        from ipcsync.backends import cuda as cuda_backend
    except ImportError:
        return
    monkeypatch.setattr(cuda_backend, "_DESCRIPTOR_PROBLEM", {})


@pytest.fixture(params=["descriptor", "legacy"])
def cuda_sharing(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """How CUDA memory is shared: by descriptor (``use_cuda_descriptors``), then by name,
    the default (``use_legacy_cuda``)."""
    if request.param == "legacy":
        use_legacy_cuda(monkeypatch)
    else:
        use_cuda_descriptors(monkeypatch)
    return str(request.param)


@pytest.fixture(params=["native", "torch"])
def copy_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """How a steady send copies (ipcsync.backends.native): the compiled copy, then the
    pure-Python fallback (see ``_use_copy``)."""
    _use_copy(str(request.param), monkeypatch)
    return str(request.param)


class Sockets:
    """Factory for raw zmq sockets (LINGER 0, the process's shared context), all closed at
    teardown. ``sockets(zmq.DEALER, rcvtimeo=5000)``: options by lower-case name."""

    def __init__(self) -> None:
        self.made: list[zmq.Socket] = []

    def __call__(self, kind: int, **options: Any) -> zmq.Socket:
        sock = zmq.Context.instance().socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        for name, value in options.items():
            sock.setsockopt(getattr(zmq, name.upper()), value)
        self.made.append(sock)
        _tracked_sockets.add(sock)
        return sock

    def close(self) -> None:
        for sock in self.made:
            sock.close(linger=0)
        self.made.clear()


@pytest.fixture
def sockets() -> Iterator[Sockets]:
    socks = Sockets()
    try:
        yield socks
    finally:
        socks.close()


def _service_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith(SERVICE_THREAD_PREFIX) and t.is_alive()}


def _leftovers(threads_before: set[threading.Thread]) -> tuple[list[str], list[str], list[str]]:
    """(service threads, open tracked sockets, segments) this process still has."""
    threads = sorted(t.name for t in _service_threads() - threads_before)
    socks = [repr(s) for s in list(_tracked_sockets) if not s.closed]
    return threads, socks, shm_segments(os.getpid())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if report.when == "call":
        item.stash[_CALL_FAILED] = report.failed


_CALL_FAILED = pytest.StashKey[bool]()


@pytest.fixture(autouse=True)
def no_leftovers(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test (and the teardown of its other fixtures), this process must have no
    ipcsync service thread the test started, no socket of the `sockets` fixture open and
    no shared-memory segment of its own (``ipcsync-<pid>-...``; segments of child peers are
    the `procs` fixture's check). Waits up to LEFTOVER_GRACE_S, then cleans up (so the
    next test starts clean) and fails the test, unless it had already failed."""
    from ipcsync.runtime import endpoint as _endpoint_mod  # noqa: PLC0415 - registry of open endpoints

    before = set(_service_threads())
    open_before = set(map(id, _endpoint_mod._open_endpoints))
    yield
    deadline = time.monotonic() + LEFTOVER_GRACE_S
    threads, socks, segments = _leftovers(before)
    while (threads or socks or segments) and time.monotonic() < deadline:
        gc.collect()  # an unreferenced endpoint's service thread ends once it is collected
        time.sleep(0.05)
        threads, socks, segments = _leftovers(before)
    if not (threads or socks or segments):
        return
    # Clean up for the next test: endpoints opened during this test, sockets, segments.
    for ep in list(_endpoint_mod._open_endpoints):
        if id(ep) not in open_before:
            try:
                (getattr(ep, "abort", None) or ep.close)()
            except Exception:  # noqa: BLE001 - best effort
                pass
    for sock in list(_tracked_sockets):
        sock.close(linger=0)
    for name in segments:
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except FileNotFoundError:
            pass
    if request.node.stash.get(_CALL_FAILED, False):
        return  # the test's own failure is the report; its frames may hold what is left
    parts = []
    if threads:
        parts.append(f"ipcsync service threads still running (endpoints not closed): {threads}")
    if socks:
        parts.append(f"zmq sockets of the `sockets` fixture still open: {socks}")
    if segments:
        parts.append(f"shared-memory segments of this process left behind: {segments}")
    pytest.fail("left behind after the test: " + "; ".join(parts) +
                " (close endpoints through the `endpoints` fixture or a with block)", pytrace=False)


# --------------------------------------------------------------------------- processes
class Peer:
    """A child process running a role (tests/integration/peers/, ...); reads its JSON lines
    with deadlines."""

    def __init__(self, proc: subprocess.Popen[bytes] | forkserver.ForkedProcess, role: str) -> None:
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
                raise AssertionError(f"{self.role} pid {self.pid}: no matching line in time; got {self.lines[-5:]}"
                                     + self._stacks())
            r, _, _ = select.select([fd], [], [], remaining)
            if r:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise AssertionError(
                        f"{self.role} pid {self.pid} exited ({self.proc.wait()}) before a matching "
                        f"line; last lines {self.lines[-5:]}; stderr: {self.stderr()[-2000:]}"
                    )
                self._buf += chunk

    def _stacks(self) -> str:
        """Where a child still running is (its threads' stacks, from its stderr), else ""."""
        if self.proc.poll() is not None or self.proc.stderr is None:
            return ""
        try:
            os.kill(self.proc.pid, signal.SIGUSR1)
        except ProcessLookupError:
            return ""
        time.sleep(0.5)
        fd = self.proc.stderr.fileno()
        os.set_blocking(fd, False)
        chunks = []
        try:
            while chunk := os.read(fd, 1 << 16):
                chunks.append(chunk)
        except BlockingIOError:
            pass
        finally:
            os.set_blocking(fd, True)
        return ("; its stderr now (stacks last):\n" + b"".join(chunks).decode(errors="replace")[-6000:]
                + "\nits threads (name, state, kernel wait): " + _native_threads(self.proc.pid))

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


_FORK_SERVERS: dict[str, forkserver.ForkServer] = {}


def _pidfd_works() -> bool:
    """The server watches its children through pidfds (Linux 5.3+)."""
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError):
        return False
    return True


_PIDFD = _pidfd_works()


def _fork_server(pythonpath: str) -> forkserver.ForkServer | None:
    """This worker's fork server for peers with this PYTHONPATH (tests/forkserver.py), or
    None with IPCSYNC_TEST_FORKSERVER=0 (every peer a fresh interpreter, as a user's)."""
    if os.environ.get("IPCSYNC_TEST_FORKSERVER", "1") == "0" or not _PIDFD:
        return None
    server = _FORK_SERVERS.get(pythonpath)
    if server is None:
        server = _FORK_SERVERS[pythonpath] = forkserver.ForkServer(pythonpath)
    return server


def pytest_sessionfinish() -> None:
    for server in _FORK_SERVERS.values():
        server.close()


class Procs:
    """Starts peers in their own process groups; kills them all at teardown."""

    def __init__(self) -> None:
        self.peers: list[Peer] = []

    def start(self, role: str, *, module: str, env: dict[str, str] | None = None,
              **args: Any) -> Peer:
        """Run ``<module>.<role>(args)`` (a module of tests/integration: ``peers.basic``,
        ``peers.faults``, ``liveness_peers``, ...) in a child with ``env`` added to the
        environment."""
        full = dict(os.environ)
        full.update(env or {})
        full["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH", "")])
        full["PYTHONUNBUFFERED"] = "1"
        argv = [module, role, json.dumps(args)]
        server = _fork_server(full["PYTHONPATH"])
        proc: subprocess.Popen[bytes] | forkserver.ForkedProcess
        if server is not None and server.forkable(full):
            proc = server.start(argv, full)
        else:
            proc = subprocess.Popen(
                [sys.executable, "-c", _LAUNCH, *argv],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                env=full, start_new_session=True,
            )
        peer = Peer(proc, role)
        self.peers.append(peer)
        return peer

    def close(self) -> list[str]:
        """Kill everything; return shm segments any peer left behind (after cleanup): a
        peer that exited by itself must have removed its own; those of a peer killed by a
        signal (here or by the test) must be removed by ``reclaim_dead_segments``, which
        the next producer of the user and a consumer that lost its producer run."""
        exited = {p.pid for p in self.peers if p.proc.poll() is not None and p.proc.returncode >= 0}
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
        left = [s for p in exited for s in shm_segments(p)]
        from ipcsync.backends.cpu import reclaim_dead_segments  # noqa: PLC0415 - torch-heavy

        reclaim_dead_segments()
        left += [s for p in pids if p not in exited for s in shm_segments(p)]
        for name in left:
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except FileNotFoundError:
                pass
        # Kill anything left in the peers' process groups.
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
