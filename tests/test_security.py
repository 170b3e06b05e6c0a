"""Who may talk to an endpoint: tcp:// needs CURVE keys or an explicit insecure=True (and
never binds every interface without CURVE); ipc endpoints accept only the producer's own
user, and only the process a HELLO names (the kernel's peer credentials)."""

from __future__ import annotations

import os
import socket
import threading
from typing import Iterator

import msgpack
import pytest
import torch
import zmq

import ipcsync
from ipcsync import _host
from ipcsync import protocol as P
from ipcsync.channel import resolve_endpoint


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


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
def raw_hello(ctx: zmq.Context, url: str, pid: int) -> P.Message:
    """Send a HELLO naming ``pid`` from a raw DEALER; return the producer's answer."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(url)
        hello = P.Hello(
            version=P.PROTOCOL_VERSION, pid=pid, start_time=_host.start_time(os.getpid()),
            boot_id=_host.boot_id(), pid_ns=_host.pid_namespace(), backend="cpu", device="cpu",
            credits=4, heartbeat_ms=0,
        )
        sock.send(P.encode(hello))
        assert sock.poll(5000), "no answer to HELLO"
        return P.decode(sock.recv())
    finally:
        sock.close(linger=0)


class TestIpcCredentials:
    def test_hello_naming_another_process_is_refused(self, ctx: zmq.Context) -> None:
        with ipcsync.Producer("sec-cred", device="cpu") as p:
            answer = raw_hello(ctx, p.endpoint.url, os.getpid() + 100_000)
            assert isinstance(answer, P.Error) and answer.code == "identity", answer
            assert "belongs to pid" in answer.message
            assert p.stats()["consumers_attached"] == 0

    def test_hello_from_the_named_process_is_answered(self, ctx: zmq.Context) -> None:
        with ipcsync.Producer("sec-cred-ok", device="cpu") as p:
            assert isinstance(raw_hello(ctx, p.endpoint.url, os.getpid()), P.Setup)

    def test_another_user_is_refused(self, ctx: zmq.Context, monkeypatch: pytest.MonkeyPatch) -> None:
        # Simulated: the kernel reports another uid for the connection.
        real = _host.peer_credentials
        monkeypatch.setattr(_host, "peer_credentials",
                            lambda fd: None if real(fd) is None else (real(fd)[0], 4242, 4242))
        with ipcsync.Producer("sec-uid", device="cpu") as p:
            answer = raw_hello(ctx, p.endpoint.url, os.getpid())
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


