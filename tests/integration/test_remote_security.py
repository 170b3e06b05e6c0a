"""A producer's remote edges against an outsider on localhost: its per-edge store (the
data plane's rendezvous), the CURVE client allow-list, and a flood of HELLOs that never
ATTACH. The producer runs in the test process (its host identity set by
``IPCSYNC_HOST_ID``), the real consumers in processes of their own, with other host ids.
"""

from __future__ import annotations

import datetime
import os
import re
import socket
import time
from typing import Any

import pytest
import zmq

import ipcsync
from peers.common import expected
from ipcsync.core import protocol as P
from ipcsync.system import host as _host
from ipcsync.runtime.remote.io import MAX_PENDING_JOINS

MODULE = "peers.remote"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def listening() -> list[tuple[str, int]]:
    """(address, port) of every listening TCP socket of this process."""
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            mine.add(target[8:-1])
    out = []
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] != "0A" or f[9] not in mine:  # LISTEN
                continue
            addr, port = f[1].split(":")
            if len(addr) == 8:
                ip = socket.inet_ntop(socket.AF_INET, bytes.fromhex(addr)[::-1])
            else:
                raw = b"".join(bytes.fromhex(addr[i:i + 8])[::-1] for i in range(0, 32, 8))
                ip = socket.inet_ntop(socket.AF_INET6, raw)
            out.append((ip, int(port, 16)))
    return out


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.timeout(120)
def test_a_keyless_client_of_an_edge_store_lists_nothing_usable(procs: Any, monkeypatch: Any) -> None:
    # Before: the store listened on every interface and list_keys() showed
    # "ipcsync/<edge key>//0/0", with which an outsider joined the next edge as rank 1.
    import torch.distributed as dist

    monkeypatch.setenv("IPCSYNC_HOST_ID", "producer-host")
    url = f"tcp://127.0.0.1:{free_port()}"
    keys = ipcsync.CurveKeys.generate()
    with ipcsync.Producer(url, device="cpu", curve=keys, policy="broadcast", slot_bytes=1 << 16) as p:
        args = {"endpoint": url, "server": keys.public.decode()}
        c1 = procs.start("consume", module=MODULE, env={"IPCSYNC_HOST_ID": "consumer-1"}, **args)
        p.wait_for_consumers(1, timeout=60)
        # Every listening socket binds the endpoint's address, the edge store's too.
        assert {addr for addr, _ in listening()} == {"127.0.0.1"}, listening()
        store_port = p.port.remote_hub.store.port
        outsider = dist.TCPStore("127.0.0.1", store_port, None, False, timeout=datetime.timedelta(seconds=10))
        names = outsider.list_keys()
        assert names and all(re.fullmatch(r"[0-9a-f]{32}", k) for k in names), names
        for k in names:
            value = outsider.get(k)
            assert socket.inet_aton("127.0.0.1") not in value  # gloo's address is sealed
            outsider.set(k, b"garbage")  # breaks nothing that is still to come
        c2 = procs.start("consume", module=MODULE, env={"IPCSYNC_HOST_ID": "consumer-2"}, **args)
        p.wait_for_consumers(2, timeout=60)
        for i in range(20):
            p.send(expected(i, 16), meta={"i": i, "tag": f"item-{i}"})
    for c in (c1, c2):
        got = c.result(60)
        assert got["end"] == "stop" and got["got"] == list(range(20)), got


@pytest.mark.timeout(90)
def test_a_producer_admits_only_the_client_keys_it_allows(procs: Any, monkeypatch: Any) -> None:
    monkeypatch.setenv("IPCSYNC_HOST_ID", "producer-host")
    url = f"tcp://127.0.0.1:{free_port()}"
    allowed = ipcsync.CurveKeys.generate()
    server = ipcsync.CurveKeys.generate(clients=[allowed.public])
    common = {"endpoint": url, "server": server.public.decode(), "connect_timeout": 10.0}
    stranger = procs.start("consume", module=MODULE, env={"IPCSYNC_HOST_ID": "stranger"}, **common)
    with ipcsync.Producer(url, device="cpu", curve=server, slot_bytes=1 << 16) as p:
        refused = stranger.read_until(lambda line: line.get("event") in ("refused", "connected"), 60)
        assert refused["event"] == "refused" and refused["error"] == "IpcTimeoutError", refused
        friend = procs.start("consume", module=MODULE, env={"IPCSYNC_HOST_ID": "friend"},
                             client_public=allowed.public.decode(), client_secret=allowed.secret.decode(), **common)
        p.wait_for_consumers(1, timeout=60)
        for i in range(5):
            p.send(expected(i, 16), meta={"i": i, "tag": f"item-{i}"})
    assert friend.result(60)["got"] == list(range(5))


def rogue_hello(ctx: zmq.Context, url: str, n: int) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(url)
    sock.send(P.encode(P.Hello(
        version=P.PROTOCOL_VERSION, pid=100000 + n, start_time=0, boot_id=f"rogue-host-{n}",
        pid_ns=_host.pid_namespace(), backend="cpu", device="cpu", credits=4, heartbeat_ms=0,
    )))
    return sock


def pump(p: ipcsync.Producer, seconds: float) -> None:
    try:
        p.wait_for_consumers(1, timeout=seconds)
    except ipcsync.IpcTimeoutError:
        pass


@pytest.mark.timeout(120)
def test_a_hello_flood_that_never_attaches_is_bounded_and_freed_at_once(monkeypatch: Any) -> None:
    # Before: 300 such connections took a producer from 5 to 818 threads and 302
    # listening sockets, most of them kept until the remote timeout (120 s).
    monkeypatch.setenv("IPCSYNC_HOST_ID", "producer-host")
    monkeypatch.setenv("IPCSYNC_REMOTE_TIMEOUT", "90")
    url = f"tcp://127.0.0.1:{free_port()}"
    rogues = 60
    ctx = zmq.Context()
    socks: list[zmq.Socket] = []
    try:
        with ipcsync.Producer(url, device="cpu", insecure=True, slot_bytes=1 << 16) as p:
            pump(p, 0.1)
            base_threads, base_listening = threads(), len(listening())
            socks = [rogue_hello(ctx, url, n) for n in range(rogues)]
            answers: list[Any] = []
            deadline = time.monotonic() + 60
            while len(answers) < rogues:
                assert time.monotonic() < deadline, f"{len(answers)} of {rogues} rogues answered"
                pump(p, 0.1)
                answers += [P.decode(s.recv()) for s in socks if s.poll(0)]
            setups = [a for a in answers if isinstance(a, P.Setup)]
            busy = [a for a in answers if isinstance(a, P.Error)]
            assert len(setups) == MAX_PENDING_JOINS and len(busy) == rogues - MAX_PENDING_JOINS
            assert "remote consumers are joining already" in busy[0].message
            # Each pending join: its thread and gloo's (device loop), one listening socket.
            assert threads() - base_threads <= 4 * MAX_PENDING_JOINS, threads() - base_threads
            assert len(listening()) - base_listening <= MAX_PENDING_JOINS + 1
            for s in socks:
                s.close()
            socks = []
            # Gone, and freed now, not at the remote timeout (90 s here).
            deadline = time.monotonic() + 30
            # (what stays: the edge store made at the first remote HELLO, its listener and threads)
            while threads() > base_threads + 4 or len(listening()) > base_listening + 1:
                assert time.monotonic() < deadline, (threads() - base_threads, len(listening()) - base_listening)
                pump(p, 0.1)
            assert p.port.remote_hub.pending_joins() == 0
    finally:
        for s in socks:
            s.close()
        ctx.term()
