"""Exhaustion and hostile neighbours: what a dead producer's /dev/shm arena, a flood of
silent connections and a nested tensor do to an endpoint (see docs/reliability.md,
"Exhaustion and hostile neighbours")."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

import ipcsync
from conftest import Procs, shm_segments


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")  # (torch's, at making one)
def test_nested_tensor_is_refused_with_what_to_send_instead() -> None:
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    with ipcsync.Producer("nested", slots=1, slot_bytes=4096, device="cpu") as p:
        for msg in ({"x": nested}, nested, [nested]):
            with pytest.raises(ipcsync.ConfigError, match=r"nested tensors cannot be sent.*unbind\(\).*to_padded_tensor\(0\)"):
                p.send(msg)


@pytest.mark.timeout(60)
def test_consumer_reclaims_the_arena_of_a_producer_killed_with_its_process_group(procs: Procs) -> None:
    """The whole process group of the producer is SIGKILLed (as when a container stops
    one process tree): the consumer that sees it die removes its arena."""
    prod = procs.start("produce", module="peers.basic", endpoint="reclaim", n=1000, slots=4, slot_bytes=4096, heartbeat=0.5)
    prod.read_until(lambda l: l.get("event") == "bound")
    with ipcsync.Consumer("reclaim", device="cpu", timeout=20) as c:
        item = c.get(timeout=20)
        assert item is not None
        item.release()
        assert shm_segments(prod.pid), "the producer has an arena in /dev/shm"
        os.killpg(prod.pid, signal.SIGKILL)
        prod.proc.wait(timeout=10)
        with pytest.raises(ipcsync.PeerLostError):
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                got = c.get(timeout=5)
                if got is not None:
                    got.release()
        assert shm_segments(prod.pid) == [], "the dead producer's arena outlived it"


# --------------------------------------------------------------------------- a flood of silent connections
def limited_producer(a: dict) -> None:
    """Child role: a producer whose fd table holds ``a["nofile"]`` (soft and hard: nothing
    can raise it), serving ``a["n"]`` items of ``x = i`` to whoever connects."""
    import json
    import resource

    resource.setrlimit(resource.RLIMIT_NOFILE, (a["nofile"], a["nofile"]))
    with ipcsync.Producer(a["endpoint"], slots=2, slot_bytes=4096, device="cpu", heartbeat=1.0) as p:
        print(json.dumps({"event": "bound", "path": p.endpoint.path}), flush=True)
        for i in range(a["n"]):
            p.send({"x": torch.full((8,), i)}, meta={"i": i})
        p.close(timeout=30)
    print(json.dumps({"event": "done"}), flush=True)


def flooder(a: dict) -> None:
    """Child role: open ``a["count"]`` connections to the socket ``a["path"]`` and keep
    them open, silent."""
    import json
    import socket as so

    held, failed = [], 0
    for k in range(a["count"]):
        if k and k % a.get("burst", 16) == 0:
            time.sleep(a.get("pause", 0.02))  # bursts: shedding reacts after libzmq accepted
        s = so.socket(so.AF_UNIX, so.SOCK_STREAM)
        s.settimeout(2.0)
        try:
            s.connect(a["path"])
            held.append(s)
        except OSError:
            s.close()
            failed += 1
    print(json.dumps({"event": "flooded", "held": len(held), "failed": failed}), flush=True)
    time.sleep(3600)


@pytest.mark.timeout(180)
def test_producer_survives_a_flood_of_silent_connections(procs: Procs) -> None:
    """1,000 silent same-user connections (bursts of 16) against a producer that may hold
    256 fds: it used to abort in libzmq ("Too many open files (src/ipc_listener.cpp)");
    now it sheds half-open connections (oldest first) and a real consumer still gets
    every item."""
    prod = procs.start("limited_producer", module="test_exhaustion", endpoint="flooded", nofile=256, n=20)
    path = prod.read_until(lambda l: l.get("event") == "bound")["path"]
    flood = procs.start("flooder", module="test_exhaustion", path=path, count=1000)
    flood.read_until(lambda l: l.get("event") == "flooded", timeout=120)
    assert prod.proc.poll() is None, f"the producer died under the flood: {prod.stderr()[-2000:]}"
    with ipcsync.Consumer("flooded", device="cpu", timeout=60) as c:
        got = []
        for _ in range(20):
            item = c.get(timeout=60)
            assert item is not None
            assert bool((item["x"] == item.meta["i"]).all())
            got.append(item.meta["i"])
            item.release()
    assert got == list(range(20))
    prod.result(timeout=60)
    assert "Too many open files" not in prod.stderr() and "Bus error" not in prod.stderr()


def test_first_endpoint_raises_the_soft_fd_limit_to_the_hard_one() -> None:
    import subprocess
    import sys

    from conftest import ROOT

    code = (
        "import resource, ipcsync\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))\n"
        "with ipcsync.Producer('rl', slots=1, slot_bytes=4096, device='cpu'):\n"
        "    now = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "    assert now == (hard, hard) or hard == resource.RLIM_INFINITY, (now, hard)\n"
        "print('ok')\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == b"ok", out.stderr.decode()[-2000:]
