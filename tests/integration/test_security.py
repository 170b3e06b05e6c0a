"""Who may talk to an endpoint: tcp:// needs CURVE keys or an explicit insecure=True (and
never binds every interface without CURVE); ipc endpoints accept only the producer's own
user, and only the process a HELLO names (the kernel's peer credentials)."""

from __future__ import annotations

import os
import socket
import threading
from typing import Any, Iterator

import msgpack
import pytest
import torch
import zmq

import ipcsync
from ipcsync.system import host as _host
from ipcsync.core import protocol as P
from ipcsync.runtime.transport.channel import resolve_endpoint


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stream(producer: ipcsync.Producer, consumer: ipcsync.Consumer, n: int = 20) -> list[int]:
    """Send n items from a thread and receive them; return the values received."""
    errors: list[BaseException] = []

    def send() -> None:
        try:
            for i in range(n):
                producer.send({"x": torch.full((16,), i)}, meta={"i": i})
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    t = threading.Thread(target=send)
    t.start()
    got = []
    try:
        for _ in range(n):
            item = consumer.get(timeout=10)
            assert item is not None
            assert bool((item["x"] == item.meta["i"]).all())
            got.append(item.meta["i"])
    finally:
        t.join(timeout=10)
    assert not errors, errors
    return got


# ---------------------------------------------------------------------------- tcp
class TestTcp:
    @pytest.mark.parametrize("role", ["producer", "consumer"])
    def test_plain_tcp_is_refused_without_insecure(self, role: str) -> None:
        cls = ipcsync.Producer if role == "producer" else ipcsync.Consumer
        with pytest.raises(ipcsync.ConfigError, match=r"needs CURVE keys.*insecure=True"):
            cls(f"tcp://127.0.0.1:{free_port()}", device="cpu", timeout=1)

    @pytest.mark.parametrize("url", ["tcp://*:{port}", "tcp://0.0.0.0:{port}", "tcp://[::]:{port}"])
    def test_every_interface_is_never_bound_without_curve(self, url: str) -> None:
        with pytest.raises(ipcsync.ConfigError, match="refusing to bind every interface"):
            ipcsync.Producer(url.format(port=free_port()), device="cpu", insecure=True)

    def test_insecure_tcp_on_one_interface_works_when_asked_for(self) -> None:
        url = f"tcp://127.0.0.1:{free_port()}"
        with ipcsync.Producer(url, device="cpu", insecure=True, slot_bytes=4096) as p, \
                ipcsync.Consumer(url, device="cpu", insecure=True, timeout=10) as c:
            assert stream(p, c) == list(range(20))

    def test_curve_handoff(self) -> None:
        url = f"tcp://127.0.0.1:{free_port()}"
        server = ipcsync.CurveKeys.generate()
        with ipcsync.Producer(url, device="cpu", curve=server, slot_bytes=4096) as p, \
                ipcsync.Consumer(url, device="cpu", curve=ipcsync.CurveKeys.generate(server=server.public),
                                 timeout=10) as c:
            assert stream(p, c) == list(range(20))

    def test_curve_with_every_interface_is_allowed(self) -> None:
        server = ipcsync.CurveKeys.generate()
        with ipcsync.Producer(f"tcp://*:{free_port()}", device="cpu", curve=server):
            pass

    @pytest.mark.timeout(30)
    def test_wrong_server_key_or_plaintext_never_gets_in(self) -> None:
        url = f"tcp://127.0.0.1:{free_port()}"
        server = ipcsync.CurveKeys.generate()
        impostor = ipcsync.CurveKeys.generate()
        with ipcsync.Producer(url, device="cpu", curve=server, slot_bytes=4096) as p:
            with pytest.raises(ipcsync.IpcTimeoutError):
                ipcsync.Consumer(url, device="cpu", curve=ipcsync.CurveKeys.generate(server=impostor.public),
                                 timeout=1)
            with pytest.raises(ipcsync.IpcTimeoutError):
                ipcsync.Consumer(url, device="cpu", insecure=True, timeout=1)
            assert p.stats()["consumers_attached"] == 0
            # The real consumer is served as if nothing happened.
            with ipcsync.Consumer(url, device="cpu", curve=ipcsync.CurveKeys.generate(server=server.public),
                                  timeout=10) as c:
                assert stream(p, c, 5) == list(range(5))

    def test_consumer_curve_needs_the_server_key(self) -> None:
        with pytest.raises(ipcsync.ConfigError, match="server=<the producer's public key>"):
            ipcsync.Consumer(f"tcp://127.0.0.1:{free_port()}", device="cpu",
                             curve=ipcsync.CurveKeys.generate(), timeout=1)

    def test_curve_keys_on_ipc_are_refused(self) -> None:
        with pytest.raises(ipcsync.ConfigError, match="protected by file permissions"):
            ipcsync.Producer("sec-ipc", device="cpu", curve=ipcsync.CurveKeys.generate())

    def test_repr_never_shows_the_secret(self) -> None:
        keys = ipcsync.CurveKeys.generate(server=b"x" * 40)
        assert keys.secret.decode() not in repr(keys)
        assert keys.public.decode() in repr(keys)


# ---------------------------------------------------------------------------- ipc credentials
def raw_hello(sockets: Any, url: str, pid: int) -> P.Message:
    """Send a HELLO naming ``pid`` from a raw DEALER; return the producer's answer."""
    return raw_hello_socket(sockets, url, pid)[1]


def raw_hello_socket(sockets: Any, url: str, pid: int) -> tuple[zmq.Socket, P.Message]:
    """Send a HELLO naming ``pid`` from a raw DEALER; return it and the producer's answer."""
    sock = sockets(zmq.DEALER)
    sock.connect(url)
    hello = P.Hello(
        version=P.PROTOCOL_VERSION, pid=pid, start_time=_host.start_time(os.getpid()),
        boot_id=_host.boot_id(), pid_ns=_host.pid_namespace(), backend="cpu", device="cpu",
        credits=4, heartbeat_ms=0,
    )
    sock.send(P.encode(hello))
    assert sock.poll(5000), "no answer to HELLO"
    return sock, P.decode(sock.recv())


class TestIpcCredentials:
    def test_hello_naming_another_process_is_refused(self, sockets: Any) -> None:
        with ipcsync.Producer("sec-cred", device="cpu") as p:
            answer = raw_hello(sockets, p.endpoint.url, os.getpid() + 100_000)
            assert isinstance(answer, P.Error) and answer.code == "identity", answer
            assert "belongs to pid" in answer.message
            assert p.stats()["consumers_attached"] == 0

    def test_hello_from_the_named_process_is_answered(self, sockets: Any) -> None:
        with ipcsync.Producer("sec-cred-ok", device="cpu") as p:
            sock, answer = raw_hello_socket(sockets, p.endpoint.url, os.getpid())
            assert isinstance(answer, P.Setup), answer
            # Leave as a consumer does; a peer that is alive and silent is waited for (close()
            # would wait out its whole timeout for it).
            sock.send(P.encode(P.Bye(reason="done")))

    def test_another_user_is_refused(self, sockets: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        # Simulated: the kernel reports another uid for the connection.
        real = _host.peer_credentials
        monkeypatch.setattr(_host, "peer_credentials",
                            lambda fd: None if real(fd) is None else (real(fd)[0], 4242, 4242))
        with ipcsync.Producer("sec-uid", device="cpu") as p:
            answer = raw_hello(sockets, p.endpoint.url, os.getpid())
            assert isinstance(answer, P.Error) and answer.code == "uid", answer
            assert "uid 4242" in answer.message

    def test_peer_credentials_of_a_unix_socket(self) -> None:
        a, b = socket.socketpair()
        try:
            assert _host.peer_credentials(a.fileno()) == (os.getpid(), os.getuid(), os.getgid())
        finally:
            a.close()
            b.close()
        assert _host.peer_credentials(-1) is None

    def test_socket_file_and_directory_modes(self) -> None:
        with ipcsync.Producer("sec-modes", device="cpu") as p:
            path = resolve_endpoint("sec-modes").path
            assert path is not None and p.endpoint.path == path
            assert os.stat(path).st_mode & 0o777 == 0o600
            assert os.stat(os.path.dirname(path)).st_mode & 0o777 == 0o700


def test_pickle_is_nowhere_on_a_read_path() -> None:
    """No module of the library can unpickle: no pickle import, recv_pyobj or eval."""
    import pathlib

    root = pathlib.Path(ipcsync.__file__).parent
    for path in root.rglob("*.py"):
        text = path.read_text()
        for banned in ("import pickle", "recv_pyobj", "eval(", "loads(raw, ext_hook", "pickle.loads"):
            assert banned not in text, f"{path}: {banned}"
    assert msgpack  # the codec in use




# ---------------------------------------------------------------------------- who the producer is
def fake_setup_producer(a: dict) -> None:
    """Child role (``procs.start(..., module="test_security")``): bind ``a["path"]`` as a
    raw ROUTER, optionally as another uid, and answer the first HELLO with a SETUP naming
    the arena ``a["arena"]`` (not its own); then keep heartbeating."""
    import json
    import time

    from ipcsync.backends import backend_for

    event = backend_for(torch.device("cpu")).create_event().handle()
    if a.get("uid") is not None:
        os.setgid(a["uid"])
        os.setuid(a["uid"])  # after the imports: our modules may lie where it cannot read
    c = zmq.Context()
    sock = c.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind("ipc://" + a["path"])
    print(json.dumps({"event": "bound", "uid": os.getuid()}), flush=True)
    if not sock.poll(30_000):
        return
    identity, _frame = sock.recv_multipart()
    me = os.getpid()
    setup = P.Setup(
        version=P.PROTOCOL_VERSION, pid=me, start_time=_host.start_time(me), pid_ns=_host.pid_namespace(),
        backend="cpu", device=None, arenas=[a["arena"]], arena_bytes=[a["nbytes"]],
        slots=[(0, 0, a["nbytes"])], ready_events=[event], heartbeat_ms=500,
    )
    sock.send_multipart([identity, P.encode(setup)])
    while True:
        sock.send_multipart([identity, P.encode(P.Heartbeat())])
        time.sleep(0.1)


@pytest.fixture
def shared_dir() -> Iterator[str]:
    """A sticky, world-writable directory, like /tmp: anyone may bind a socket there."""
    import shutil
    import tempfile

    d = tempfile.mkdtemp(prefix="ipcsh-", dir="/tmp")
    os.chmod(d, 0o1777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


class TestProducerIdentity:
    @pytest.mark.timeout(60)
    def test_producer_of_another_uid_is_refused(self, procs, endpoints, shared_dir: str) -> None:  # type: ignore[no-untyped-def]
        """Another user binds the path first and names the victim's own segment: before,
        the consumer attached and read the victim's memory under the stranger's layouts."""
        if os.getuid() != 0:
            pytest.skip("needs root to run a process as another uid")
        from ipcsync.backends.cpu import CpuBackend

        victim = endpoints.add(CpuBackend().create_arena(4096))
        path = os.path.join(shared_dir, "evil.sock")
        fake = procs.start("fake_setup_producer", module="test_security", path=path,
                           arena=victim.handle, nbytes=4096, uid=65534)
        assert fake.read_until(lambda l: l.get("event") == "bound")["uid"] == 65534
        with pytest.raises(ipcsync.ConfigError,
                           match=r"runs as uid 65534.*not as this user.*refusing its data"):
            ipcsync.Consumer("ipc://" + path, device="cpu", timeout=10)

    @pytest.mark.timeout(60)
    def test_segment_of_another_pid_is_refused(self, procs, endpoints, shared_dir: str) -> None:  # type: ignore[no-untyped-def]
        from ipcsync.backends.cpu import CpuBackend

        other = endpoints.add(CpuBackend().create_arena(4096))  # ours: pid of this test process
        path = os.path.join(shared_dir, "named.sock")
        fake = procs.start("fake_setup_producer", module="test_security", path=path,
                           arena=other.handle, nbytes=4096)
        fake.read_until(lambda l: l.get("event") == "bound")
        with pytest.raises(ipcsync.ConfigError, match=rf"names shared memory {other.handle} of pid {os.getpid()}"):
            ipcsync.Consumer("ipc://" + path, device="cpu", timeout=10)

    def test_identity_check_with_fake_file_and_credentials(self) -> None:
        from types import SimpleNamespace

        from ipcsync.runtime.transport.channel import Endpoint, producer_identity_problem

        ep = Endpoint("ipc:///x/p.sock", "ipc:///x/p.sock", "/x/p.sock")
        ns = _host.pid_namespace()

        def check(file_uid: int, cred: tuple[int, int, int] | None, pid: int = 42, pid_ns: str = ns) -> str | None:
            return producer_identity_problem(
                ep, 7, pid, pid_ns, uid=1000,
                lstat=lambda p: SimpleNamespace(st_uid=file_uid),
                credentials=lambda fd: cred)

        assert check(1000, (42, 1000, 1000)) is None
        assert check(1000, None) is None  # the OS cannot say: the file owner spoke
        msg = check(65534, (42, 1000, 1000))
        assert msg and "runs as uid 65534" in msg and "/x/p.sock" in msg and "refusing its data" in msg
        msg = check(1000, (42, 65534, 65534))
        assert msg and "runs as uid 65534, not as this user (uid 1000)" in msg
        msg = check(1000, (43, 1000, 1000))
        assert msg and "says it is pid 42" in msg and "pid 43" in msg
        assert check(1000, (0, 1000, 1000)) is None  # pid not visible in our namespace
        assert check(1000, (43, 1000, 1000), pid_ns="pid:[1]") is None  # another namespace
        tcp = Endpoint("tcp://127.0.0.1:1", "tcp://127.0.0.1:1", None)
        assert producer_identity_problem(tcp, 7, 42, ns, uid=1000) is None


# ---------------------------------------------------------------------------- why nobody answered
def consumer_as(a: dict) -> None:
    """Child role: as uid ``a["uid"]``, connect a Consumer to ``a["url"]`` and report the
    error it raised."""
    import json

    import ipcsync.consumer  # noqa: F401 (imported before the uid change: ipcsync loads lazily)

    os.setgid(a["uid"])
    os.setuid(a["uid"])
    try:
        ipcsync.Consumer(a["url"], device="cpu", timeout=a.get("timeout", 2.0)).close()
        out = {"event": "done", "error": None}
    except ipcsync.IpcSyncError as exc:
        out = {"event": "done", "error": type(exc).__name__, "message": str(exc)}
    print(json.dumps(out), flush=True)


class TestWhyNobodyAnswered:
    @pytest.mark.timeout(60)
    def test_cross_uid_connect_names_the_permission_problem(self, procs, shared_dir: str) -> None:  # type: ignore[no-untyped-def]
        """Before: 'no producer answered ... is it running?' while the producer ran."""
        if os.getuid() != 0:
            pytest.skip("needs root to run a process as another uid")
        url = "ipc://" + os.path.join(shared_dir, "mine.sock")
        with ipcsync.Producer(url, slots=1, slot_bytes=4096, device="cpu"):
            peer = procs.start("consumer_as", module="test_security", url=url, uid=65534)
            out = peer.result(timeout=40)
        assert out["error"] == "ConfigError", out
        msg = out["message"]
        assert "permission denied" in msg and "uid 0" in msg and "mode 600" in msg and "uid 65534" in msg, msg

    def test_stale_socket_is_named(self, shared_dir: str) -> None:
        path = os.path.join(shared_dir, "stale.sock")
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(path)  # bound, never listening: as a killed producer leaves it
        try:
            with pytest.raises(ipcsync.IpcTimeoutError, match="nothing listens on .*stale.sock"):
                ipcsync.Consumer("ipc://" + path, device="cpu", timeout=0.5)
        finally:
            s.close()

    def test_missing_socket_is_named(self, shared_dir: str) -> None:
        with pytest.raises(ipcsync.IpcTimeoutError, match="there is no socket .*none.sock.*is it running"):
            ipcsync.Consumer("ipc://" + os.path.join(shared_dir, "none.sock"), device="cpu", timeout=0.3)
