"""The ZeroMQ layer (ipcsync.runtime.transport.channel): endpoints, the runtime dir, the exclusive bind,
round trips, disconnect detection and the frame-size limit. No Producer/Consumer here.

Every socket is closed (linger 0) by a fixture or a finally, and every wait is bounded by
a deadline of a few seconds.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import shutil
import socket
import stat
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import zmq

import ipcsync.runtime.transport.channel as ch
from ipcsync.runtime.transport.channel import (
    BindLock,
    ConsumerChannel,
    Endpoint,
    ProducerChannel,
    remove_stale,
    resolve_endpoint,
)
from ipcsync.errors import ConfigError

pytestmark = pytest.mark.timeout(20)

MAX_FRAME = 4096
DEADLINE = 5.0

ACCEPTED = zmq.EVENT_ACCEPTED
CONNECTED = zmq.EVENT_CONNECTED
DISCONNECTED = zmq.EVENT_DISCONNECTED


# --------------------------------------------------------------------------- helpers
def mode_of(path: str | Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def poll_until(pred: Callable[[], object], timeout: float = DEADLINE, step: float = 0.01) -> object:
    """Call ``pred`` until it returns something truthy or ``timeout`` passes; return its
    last result."""
    deadline = time.monotonic() + timeout
    while True:
        result = pred()
        if result or time.monotonic() > deadline:
            return result
        time.sleep(step)


class Events:
    """Accumulates a channel's monitor events across polls."""

    def __init__(self, chan: ch.SocketChannel) -> None:
        self.chan = chan
        self.seen: list[tuple[int, int]] = []

    def drain(self) -> list[tuple[int, int]]:
        self.seen.extend(self.chan.events())
        return self.seen

    def wait_for(self, event: int, fd: int | None = None, timeout: float = DEADLINE) -> tuple[int, int]:
        def find() -> tuple[int, int] | None:
            self.chan.wait(0.02)
            for ev, efd in self.drain():
                if ev == event and (fd is None or efd == fd):
                    return ev, efd
            return None

        found = poll_until(find, timeout, step=0.0)
        assert found, f"no event {event} (fd {fd}) within {timeout} s; saw {self.seen}"
        return found  # type: ignore[return-value]


def producer_recv(p: ProducerChannel, timeout: float = DEADLINE) -> tuple[bytes, list[bytes], int]:
    def once() -> tuple[bytes, list[bytes], int] | None:
        p.wait(0.02)
        return p.recv()

    got = poll_until(once, timeout, step=0.0)
    assert got is not None, f"the producer received nothing within {timeout} s"
    return got  # type: ignore[return-value]


def consumer_recv(c: ConsumerChannel, timeout: float = DEADLINE) -> list[bytes]:
    def once() -> list[bytes] | None:
        c.wait(0.02)
        return c.recv()

    got = poll_until(once, timeout, step=0.0)
    assert got is not None, f"the consumer received nothing within {timeout} s"
    return got  # type: ignore[return-value]


# --------------------------------------------------------------------------- fixtures
@pytest.fixture
def endpoint() -> Endpoint:
    return resolve_endpoint("chan")


@pytest.fixture
def closing() -> Iterator[Callable]:
    """Register channels/sockets to be closed at teardown, last first."""
    things: list = []

    def add(thing):
        things.append(thing)
        return thing

    try:
        yield add
    finally:
        for thing in reversed(things):
            if isinstance(thing, zmq.Socket):
                thing.close(linger=0)
            else:
                thing.close()


@pytest.fixture
def producer(endpoint: Endpoint, closing: Callable) -> ProducerChannel:
    return closing(ProducerChannel(endpoint, MAX_FRAME))


@pytest.fixture
def consumer(endpoint: Endpoint, closing: Callable) -> ConsumerChannel:
    return closing(ConsumerChannel(endpoint, b"consumer-1", MAX_FRAME))


@pytest.fixture
def scratch() -> Iterator[str]:
    """A short, fresh directory under /tmp (ipc paths are limited to 107 bytes)."""
    d = tempfile.mkdtemp(prefix="ipct-", dir="/tmp")
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


# --------------------------------------------------------------------------- resolve_endpoint
def test_bare_name_maps_into_the_runtime_dir(runtime_dir: Path) -> None:
    ep = resolve_endpoint("frames.v1_a-b")
    expected = os.path.join(str(runtime_dir), "frames.v1_a-b.sock")
    assert ep == Endpoint("frames.v1_a-b", "ipc://" + expected, expected)
    assert ep.lock_path == expected + ".lock"


def test_name_of_64_characters_is_accepted(runtime_dir: Path) -> None:
    name = "a" * 64
    assert resolve_endpoint(name).path == os.path.join(str(runtime_dir), name + ".sock")


def test_absolute_ipc_path_is_taken_as_given() -> None:
    ep = resolve_endpoint("ipc:///tmp/somewhere/sock")
    assert ep.url == "ipc:///tmp/somewhere/sock"
    assert ep.path == "/tmp/somewhere/sock"
    assert ep.lock_path == "/tmp/somewhere/sock.lock"


@pytest.mark.parametrize("name", ["ipc://relative/sock", "ipc://sock", "ipc://"])
def test_relative_ipc_path_is_refused(name: str) -> None:
    with pytest.raises(ConfigError, match="absolute path"):
        resolve_endpoint(name)


@pytest.mark.parametrize("name", ["tcp://127.0.0.1:5555", "tcp://*:7000", "tcp://host.example:1"])
def test_tcp_is_taken_as_given(name: str) -> None:
    ep = resolve_endpoint(name)
    assert ep == Endpoint(name, name, None)
    assert ep.lock_path is None


@pytest.mark.parametrize("name", ["udp://1.2.3.4:5", "inproc://x", "pgm://x", "IPC:///tmp/x", "ws://h:1"])
def test_other_schemes_are_refused(name: str) -> None:
    with pytest.raises(ConfigError, match="only bare names, ipc:// and tcp://"):
        resolve_endpoint(name)


@pytest.mark.parametrize(
    "name",
    ["../x", "a/b", "-x", ".hidden", "_x", "a" * 65, "has space", " x", "x ", "tab\tx",
     "x\n", "n\u00e9", "a:b"],
)
def test_invalid_names_are_refused_naming_the_rule(name: str) -> None:
    with pytest.raises(ConfigError, match="1-64 characters of letters, digits") as info:
        resolve_endpoint(name)
    assert "starting with a letter or digit" in str(info.value)


@pytest.mark.parametrize("name", ["", None, b"bytes", 5, ["x"]])
def test_empty_or_non_str_endpoint_is_refused(name: object) -> None:
    with pytest.raises(ConfigError, match="non-empty string"):
        resolve_endpoint(name)  # type: ignore[arg-type]


def test_ipc_path_over_107_bytes_is_refused() -> None:
    path = "/tmp/" + "p" * 103
    assert len(path) == 108
    with pytest.raises(ConfigError, match="over the OS limit of 107") as info:
        resolve_endpoint("ipc://" + path)
    assert "108 bytes" in str(info.value)
    # Multi-byte characters count as bytes, not characters.
    with pytest.raises(ConfigError, match="OS limit"):
        resolve_endpoint("ipc:///tmp/" + "\u00e9" * 52)


def test_bare_name_in_a_long_runtime_dir_is_refused(monkeypatch: pytest.MonkeyPatch, scratch: str) -> None:
    long_dir = os.path.join(scratch, "d" * 60)
    monkeypatch.setenv("IPCSYNC_RUNTIME_DIR", long_dir)
    with pytest.raises(ConfigError, match="OS limit"):
        resolve_endpoint("n" * 40)


def test_ipc_path_of_exactly_107_bytes_binds(runtime_dir: Path, closing: Callable) -> None:
    base = str(runtime_dir) + "/"
    path = base + "p" * (107 - len(base))
    assert len(path.encode()) == 107
    ep = resolve_endpoint("ipc://" + path)
    p = closing(ProducerChannel(ep, MAX_FRAME))
    c = closing(ConsumerChannel(ep, b"c", MAX_FRAME))
    assert c.send(b"edge")
    assert producer_recv(p)[:2] == (b"c", [b"edge"])


# --------------------------------------------------------------------------- runtime_dir
def test_runtime_dir_is_created_0700(monkeypatch: pytest.MonkeyPatch, scratch: str) -> None:
    d = os.path.join(scratch, "rt", "nested")
    monkeypatch.setenv("IPCSYNC_RUNTIME_DIR", d)
    assert ch.runtime_dir() == d
    assert os.path.isdir(d)
    assert mode_of(d) == 0o700
    # Idempotent once it exists.
    assert ch.runtime_dir() == d
    assert resolve_endpoint("x").path == os.path.join(d, "x.sock")


def test_runtime_dir_readable_by_others_is_refused(monkeypatch: pytest.MonkeyPatch, scratch: str) -> None:
    d = os.path.join(scratch, "open")
    os.mkdir(d)
    os.chmod(d, 0o755)
    monkeypatch.setenv("IPCSYNC_RUNTIME_DIR", d)
    with pytest.raises(ConfigError, match=re.escape(f"chmod 700 {d}")) as info:
        ch.runtime_dir()
    assert "755" in str(info.value)
    with pytest.raises(ConfigError, match="chmod 700"):
        resolve_endpoint("x")


def test_runtime_dir_falls_back_to_xdg(monkeypatch: pytest.MonkeyPatch, scratch: str) -> None:
    monkeypatch.delenv("IPCSYNC_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", scratch)
    expected = os.path.join(scratch, "ipcsync")
    assert ch.runtime_dir() == expected
    assert mode_of(expected) == 0o700
    assert resolve_endpoint("x").path == os.path.join(expected, "x.sock")


def test_runtime_dir_uncreatable_is_a_config_error(monkeypatch: pytest.MonkeyPatch, scratch: str) -> None:
    blocker = os.path.join(scratch, "file")
    Path(blocker).write_bytes(b"")
    monkeypatch.setenv("IPCSYNC_RUNTIME_DIR", os.path.join(blocker, "sub"))
    with pytest.raises(ConfigError, match="cannot create the runtime directory"):
        ch.runtime_dir()


def test_runtime_dir_owned_by_another_user_is_refused(monkeypatch: pytest.MonkeyPatch, scratch: str) -> None:
    d = os.path.join(scratch, "theirs")
    os.mkdir(d, 0o700)
    try:
        os.chown(d, 12345, -1)
    except PermissionError:
        pytest.skip("cannot chown to another uid without root")
    monkeypatch.setenv("IPCSYNC_RUNTIME_DIR", d)
    with pytest.raises(ConfigError, match="belongs to uid 12345"):
        ch.runtime_dir()


# --------------------------------------------------------------------------- ProducerChannel / bind
def test_producer_binds_a_private_socket_and_lock(producer: ProducerChannel, endpoint: Endpoint) -> None:
    assert endpoint.path is not None and endpoint.lock_path is not None
    st = os.stat(endpoint.path)
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert os.path.isfile(endpoint.lock_path)


def test_second_producer_is_refused_and_the_first_keeps_working(
    producer: ProducerChannel, endpoint: Endpoint, closing: Callable
) -> None:
    with pytest.raises(ConfigError, match="held by a live producer"):
        closing(ProducerChannel(endpoint, MAX_FRAME))
    # The failed attempt touched nothing of the first producer's.
    assert stat.S_ISSOCK(os.stat(endpoint.path).st_mode)  # type: ignore[arg-type]
    assert os.path.exists(endpoint.lock_path)  # type: ignore[arg-type]
    assert not BindLock(endpoint).acquire()
    c = closing(ConsumerChannel(endpoint, b"c2", MAX_FRAME))
    assert c.send(b"ping")
    ident, frames, _fd = producer_recv(producer)
    assert (ident, frames) == (b"c2", [b"ping"])
    assert producer.send(ident, b"pong")
    assert consumer_recv(c) == [b"pong"]


def test_close_removes_socket_and_lock(endpoint: Endpoint) -> None:
    p = ProducerChannel(endpoint, MAX_FRAME)
    try:
        assert os.path.exists(endpoint.path)  # type: ignore[arg-type]
    finally:
        p.close()
    assert not os.path.exists(endpoint.path)  # type: ignore[arg-type]
    assert not os.path.exists(endpoint.lock_path)  # type: ignore[arg-type]
    p.close()  # idempotent
    # The endpoint is free again.
    ProducerChannel(endpoint, MAX_FRAME).close()


def make_stale(endpoint: Endpoint) -> None:
    """What a killed producer leaves: a socket file nobody listens on and an unheld lock."""
    assert endpoint.path is not None and endpoint.lock_path is not None
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.bind(endpoint.path)
    finally:
        s.close()
    fd = os.open(endpoint.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    os.close(fd)
    assert stat.S_ISSOCK(os.stat(endpoint.path).st_mode)


def test_stale_endpoint_is_taken_over(endpoint: Endpoint, closing: Callable) -> None:
    make_stale(endpoint)
    p = closing(ProducerChannel(endpoint, MAX_FRAME))
    assert mode_of(endpoint.path) == 0o600  # type: ignore[arg-type]
    c = closing(ConsumerChannel(endpoint, b"c", MAX_FRAME))
    assert c.send(b"after-takeover")
    assert producer_recv(p)[:2] == (b"c", [b"after-takeover"])
    p.close()
    assert not os.path.exists(endpoint.path)  # type: ignore[arg-type]
    assert not os.path.exists(endpoint.lock_path)  # type: ignore[arg-type]


def test_tcp_producer_has_no_lock(closing: Callable) -> None:
    p = closing(ProducerChannel(resolve_endpoint("tcp://127.0.0.1:*"), MAX_FRAME))
    assert p.lock is None
    url = p.sock.getsockopt_string(zmq.LAST_ENDPOINT)
    c = closing(ConsumerChannel(resolve_endpoint(url), b"t", MAX_FRAME))
    assert c.send(b"over-tcp")
    ident, frames, fd = producer_recv(p)
    assert (ident, frames) == (b"t", [b"over-tcp"]) and fd >= 0
    assert p.send(ident, b"back")
    assert consumer_recv(c) == [b"back"]


def test_ipc_path_in_a_missing_directory_is_a_config_error(scratch: str) -> None:
    ep = resolve_endpoint("ipc://" + os.path.join(scratch, "missing", "s"))
    with pytest.raises(ConfigError, match="missing"):
        ProducerChannel(ep, MAX_FRAME)
    assert os.listdir(scratch) == []


# --------------------------------------------------------------------------- BindLock / remove_stale
def test_bind_lock_acquire_and_release(endpoint: Endpoint) -> None:
    a, b = BindLock(endpoint), BindLock(endpoint)
    assert a.acquire()
    try:
        assert os.path.isfile(endpoint.lock_path)  # type: ignore[arg-type]
        assert mode_of(endpoint.lock_path) == 0o600  # type: ignore[arg-type]
        assert not b.acquire()  # another open file description: refused while held
        assert not b.acquire()
        assert remove_stale(endpoint) is False
        assert os.path.exists(endpoint.lock_path)  # type: ignore[arg-type]
    finally:
        a.release(remove_socket=False)
    assert not os.path.exists(endpoint.lock_path)  # type: ignore[arg-type]
    a.release(remove_socket=False)  # a second release is a no-op
    assert b.acquire()
    b.release(remove_socket=True)


def test_bind_lock_release_removes_socket_only_when_asked(endpoint: Endpoint) -> None:
    Path(endpoint.path).write_bytes(b"")  # type: ignore[arg-type]
    lock = BindLock(endpoint)
    assert lock.acquire()
    lock.release(remove_socket=False)
    assert os.path.exists(endpoint.path)  # type: ignore[arg-type]
    assert lock.acquire()
    lock.release(remove_socket=True)
    assert not os.path.exists(endpoint.path)  # type: ignore[arg-type]
    assert not os.path.exists(endpoint.lock_path)  # type: ignore[arg-type]


def test_bind_lock_retries_when_the_holder_unlinks_during_acquire(
    endpoint: Endpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The holder releases (unlinking the lock file) between our open and our flock: we
    locked an orphan inode and must retry on a fresh file."""
    holder = BindLock(endpoint)
    assert holder.acquire()
    real_flock = fcntl.flock
    calls = []

    def flock(fd: int, op: int) -> None:
        calls.append(fd)
        if len(calls) == 1:
            holder.release(remove_socket=False)
        real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock)  # (the module runtime.transport.bindlock calls)
    lock = BindLock(endpoint)
    try:
        assert lock.acquire()
        assert len(calls) == 2
        assert os.stat(endpoint.lock_path).st_ino == os.fstat(lock._fd).st_ino  # type: ignore[arg-type]
    finally:
        monkeypatch.undo()
        lock.release(remove_socket=False)
        holder.release(remove_socket=False)
    assert not os.path.exists(endpoint.lock_path)  # type: ignore[arg-type]


def test_remove_stale_removes_an_unheld_endpoint(endpoint: Endpoint) -> None:
    make_stale(endpoint)
    assert remove_stale(endpoint) is True
    assert not os.path.exists(endpoint.path)  # type: ignore[arg-type]
    assert not os.path.exists(endpoint.lock_path)  # type: ignore[arg-type]
    assert remove_stale(endpoint) is False  # nothing left to remove


def test_remove_stale_leaves_a_live_producer_alone(producer: ProducerChannel, endpoint: Endpoint) -> None:
    assert remove_stale(endpoint) is False
    assert stat.S_ISSOCK(os.stat(endpoint.path).st_mode)  # type: ignore[arg-type]
    assert os.path.exists(endpoint.lock_path)  # type: ignore[arg-type]


def test_remove_stale_ignores_tcp() -> None:
    assert remove_stale(resolve_endpoint("tcp://127.0.0.1:5555")) is False


# --------------------------------------------------------------------------- round trips
def test_round_trip(producer: ProducerChannel, consumer: ConsumerChannel) -> None:
    assert producer.recv() is None  # nothing waits yet
    assert consumer.recv() is None
    assert consumer.send(b"\x00hello\xff")
    ident, frames, fd = producer_recv(producer)
    assert ident == b"consumer-1"
    assert frames == [b"\x00hello\xff"]
    assert isinstance(fd, int) and fd >= 0
    assert producer.recv() is None
    assert producer.send(ident, b"reply")
    assert consumer_recv(consumer) == [b"reply"]
    assert consumer.recv() is None


def test_frames_keep_their_order(producer: ProducerChannel, consumer: ConsumerChannel) -> None:
    for i in range(50):
        assert consumer.send(b"%d" % i)
    got = [producer_recv(producer)[1][0] for _ in range(50)]
    assert got == [b"%d" % i for i in range(50)]


def test_a_frame_of_max_frame_bytes_passes(producer: ProducerChannel, consumer: ConsumerChannel) -> None:
    big = bytes(range(256)) * (MAX_FRAME // 256)
    assert len(big) == MAX_FRAME
    assert consumer.send(big)
    assert producer_recv(producer)[1] == [big]


def test_wait_times_out_when_idle(producer: ProducerChannel) -> None:
    list(producer.events())
    # A wait that ignored its timeout would never return on an idle channel: the test's
    # timeout fails it. The lower bound stays: a clock cannot run fast.
    t0 = time.monotonic()
    assert producer.wait(0.1) is False
    assert 0.05 <= time.monotonic() - t0


def test_consumer_may_connect_before_the_producer_binds(endpoint: Endpoint, closing: Callable) -> None:
    c = closing(ConsumerChannel(endpoint, b"early", MAX_FRAME))
    assert c.send(b"first")  # queued until the producer appears
    time.sleep(0.2)  # a few failed reconnect attempts (RECONNECT_IVL is 50 ms)
    assert not os.path.exists(endpoint.path)  # type: ignore[arg-type]
    p = closing(ProducerChannel(endpoint, MAX_FRAME))
    ident, frames, _fd = producer_recv(p)
    assert (ident, frames) == (b"early", [b"first"])
    assert p.send(ident, b"welcome")
    assert consumer_recv(c) == [b"welcome"]


# --------------------------------------------------------------------------- monitor
def test_monitor_ties_connect_and_disconnect_to_the_fd(
    producer: ProducerChannel, endpoint: Endpoint
) -> None:
    pev = Events(producer)
    c = ConsumerChannel(endpoint, b"leaver", MAX_FRAME)
    try:
        cev = Events(c)
        assert c.send(b"hello")
        ident, _frames, fd = producer_recv(producer)
        assert ident == b"leaver"
        assert pev.wait_for(ACCEPTED) == (ACCEPTED, fd)
        cev.wait_for(CONNECTED)
        assert producer.send(ident, b"while-connected")
        assert consumer_recv(c) == [b"while-connected"]
    finally:
        c.close()
    c.close()  # idempotent
    assert pev.wait_for(DISCONNECTED) == (DISCONNECTED, fd)

    # With ROUTER_MANDATORY a send to the departed identity raises instead of vanishing.
    # (A send racing the disconnect itself may still be accepted: ZeroMQ learns of the
    # departure asynchronously; the bound below covers that window.)
    def send_raises() -> zmq.ZMQError | None:
        try:
            producer.send(ident, b"to-nobody")
        except zmq.ZMQError as exc:
            return exc
        return None

    exc = poll_until(send_raises, timeout=DEADLINE)
    assert isinstance(exc, zmq.ZMQError), "sending to a departed consumer never raised"
    assert exc.errno == errno.EHOSTUNREACH
    assert not isinstance(exc, zmq.Again)


def test_send_to_an_unknown_identity_raises(producer: ProducerChannel) -> None:
    with pytest.raises(zmq.ZMQError) as info:
        producer.send(b"nobody", b"x")
    assert info.value.errno == errno.EHOSTUNREACH


def test_two_consumers_have_distinct_fds(producer: ProducerChannel, endpoint: Endpoint, closing: Callable) -> None:
    a = closing(ConsumerChannel(endpoint, b"a", MAX_FRAME))
    b = closing(ConsumerChannel(endpoint, b"b", MAX_FRAME))
    assert a.send(b"1") and b.send(b"2")
    got = {}
    for _ in range(2):
        ident, frames, fd = producer_recv(producer)
        got[ident] = (frames, fd)
    assert got[b"a"][0] == [b"1"] and got[b"b"][0] == [b"2"]
    assert got[b"a"][1] != got[b"b"][1]
    pev = Events(producer)
    a.close()
    assert pev.wait_for(DISCONNECTED) == (DISCONNECTED, got[b"a"][1])
    # The other consumer is unaffected.
    assert producer.send(b"b", b"still-here")
    assert consumer_recv(b) == [b"still-here"]


def test_oversized_frame_drops_the_connection(producer: ProducerChannel, endpoint: Endpoint, sockets: Any) -> None:
    pev = Events(producer)
    raw = sockets(zmq.DEALER, routing_id=b"raw")
    raw.connect(endpoint.url)
    raw.send(b"x" * (MAX_FRAME + 1024 + 1))
    _, accepted_fd = pev.wait_for(ACCEPTED)
    assert pev.wait_for(DISCONNECTED, fd=accepted_fd) == (DISCONNECTED, accepted_fd)
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:
        producer.wait(0.05)
        assert producer.recv() is None, "an oversized frame reached the producer"


def test_frame_at_the_slack_limit_still_passes(producer: ProducerChannel, endpoint: Endpoint, sockets: Any) -> None:
    raw = sockets(zmq.DEALER, routing_id=b"raw")
    raw.connect(endpoint.url)
    frame = b"y" * (MAX_FRAME + 1024)
    raw.send(frame)
    assert producer_recv(producer)[:2] == (b"raw", [frame])


# --------------------------------------------------------------------------- runtime_dir: hostile neighbours
@pytest.fixture
def default_base(monkeypatch: pytest.MonkeyPatch, scratch: str) -> str:
    """The default runtime dir (no IPCSYNC_RUNTIME_DIR), placed under ``scratch`` through
    XDG_RUNTIME_DIR so a test never touches the real /tmp/ipcsync-<uid>."""
    monkeypatch.delenv("IPCSYNC_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", scratch)
    return os.path.join(scratch, "ipcsync")


def test_symlink_at_the_default_path_is_not_followed(default_base: str, scratch: str) -> None:
    target = os.path.join(scratch, "planted")
    os.mkdir(target, 0o700)  # a perfectly private directory: still not where we go
    os.symlink(target, default_base)
    with pytest.warns(RuntimeWarning, match=r"symbolic link.*IPCSYNC_RUNTIME_DIR"):
        got = ch.runtime_dir()
    assert got == default_base + "-alt"
    assert os.path.isdir(got) and not os.path.islink(got) and mode_of(got) == 0o700
    assert resolve_endpoint("x").path == os.path.join(got, "x.sock")  # the same in every process
    assert os.listdir(target) == []


def test_dangling_symlink_at_the_default_path_falls_back(default_base: str, scratch: str) -> None:
    os.symlink(os.path.join(scratch, "nowhere"), default_base)
    with pytest.warns(RuntimeWarning, match="symbolic link"):
        got = ch.runtime_dir()  # was: "[Errno 17] File exists"
    assert got == default_base + "-alt"
    assert not os.path.exists(os.path.join(scratch, "nowhere"))  # never created through the link


def test_default_path_of_another_user_falls_back(default_base: str) -> None:
    os.mkdir(default_base, 0o700)
    try:
        os.chown(default_base, 65534, -1)
    except PermissionError:
        pytest.skip("cannot chown to another uid without root")
    with pytest.warns(RuntimeWarning, match="belongs to uid 65534"):
        assert ch.runtime_dir() == default_base + "-alt"


def test_default_path_of_ours_with_a_wrong_mode_is_made_private(default_base: str) -> None:
    os.mkdir(default_base)
    os.chmod(default_base, 0o755)
    assert ch.runtime_dir() == default_base
    assert mode_of(default_base) == 0o700


def test_default_path_and_fallback_both_taken_is_a_config_error(default_base: str, scratch: str) -> None:
    os.symlink(scratch, default_base)
    os.symlink(scratch, default_base + "-alt")
    with pytest.raises(ConfigError, match="set IPCSYNC_RUNTIME_DIR") as info:
        ch.runtime_dir()
    assert default_base in str(info.value) and "symbolic link" in str(info.value)


def test_explicit_runtime_dir_that_is_a_symlink_is_an_error(monkeypatch: pytest.MonkeyPatch, scratch: str) -> None:
    target = os.path.join(scratch, "real")
    os.mkdir(target, 0o700)
    link = os.path.join(scratch, "link")
    os.symlink(target, link)
    monkeypatch.setenv("IPCSYNC_RUNTIME_DIR", link)
    with pytest.raises(ConfigError, match="IPCSYNC_RUNTIME_DIR.*symbolic link"):
        ch.runtime_dir()


def test_bind_lock_does_not_follow_a_planted_symlink(endpoint: Endpoint, scratch: str) -> None:
    victim = os.path.join(scratch, "victim")
    Path(victim).write_bytes(b"keep")
    assert endpoint.lock_path is not None
    os.symlink(victim, endpoint.lock_path)
    with pytest.raises(ConfigError, match="cannot open the bind lock"):
        BindLock(endpoint).acquire()
    assert Path(victim).read_bytes() == b"keep"


@pytest.mark.parametrize("between", ["send", "pending", "events", "nothing"])
def test_a_frame_reaching_a_quiet_socket_is_read_whatever_call_came_between(
    producer: ProducerChannel, endpoint: Endpoint, closing: Callable, between: str
) -> None:
    """A channel found empty skips its ZMQ_EVENTS queries until the socket's fd signals
    (socket_channel.SocketChannel). A call that processes the socket's commands (a send) consumes that
    signal: the frame must still be read, with no wait() in between (it would mask this)."""
    import select

    c = closing(ConsumerChannel(endpoint, b"quiet", MAX_FRAME))
    assert c.send(b"hello")
    ident, frames, _fd = producer_recv(producer)
    assert poll_until(lambda: c.recv() is None and c.events() == () and not c.pending() or None, DEADLINE)
    assert producer.send(ident, b"one")
    sock_fd = c.sock.getsockopt(zmq.FD)
    assert poll_until(lambda: select.select([sock_fd], [], [], 0.02)[0] or None, DEADLINE), "the frame never arrived"
    if between == "send":
        assert c.send(b"more")
    elif between == "pending":
        assert c.pending()
    elif between == "events":
        c.events()
    assert poll_until(c.recv, DEADLINE) == [b"one"]
