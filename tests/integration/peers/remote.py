"""Roles for remote edges (tests/integration/test_remote.py): a producer and a consumer that
count as different hosts (``IPCSYNC_HOST_ID`` differs in their environments) and talk over
tcp://127.0.0.1, so every item travels by torch.distributed (gloo)."""

from __future__ import annotations

import os
import signal
from typing import Any

import ipcsync

from .common import check, expected, plain, say


def _keys(a: dict[str, Any], side: str) -> dict[str, Any]:
    if a.get("insecure"):
        return {"insecure": True}
    if side == "producer":
        return {"curve": ipcsync.CurveKeys(a["public"].encode(), a["secret"].encode())}
    client = ipcsync.CurveKeys.generate(server=a["server"].encode())
    return {"curve": client}


def produce(a: dict[str, Any]) -> None:
    """Send ``n`` items ``expected(i)``; a send that times out ends the role with
    ``{"event": "timeout"}`` (what backpressure and a lost consumer look like)."""
    n, size = a["n"], a.get("size", 16)
    with ipcsync.Producer(a["endpoint"], slots=a.get("slots", 4), slot_bytes=a.get("slot_bytes", 1 << 16),
                          policy=a.get("policy", "shard"), heartbeat=a.get("heartbeat", 0.5),
                          timeout=a.get("timeout", 30.0), device="cpu", **_keys(a, "producer")) as out:
        say(event="bound", pid=os.getpid())
        out.wait_for_consumers(a.get("wait_consumers", 1), timeout=30)
        for i in range(n):
            if a.get("kill_after") == i:
                say(event="dying", sent=i)
                os.kill(os.getpid(), signal.SIGKILL)
            try:
                out.send(expected(i, size), meta={"i": i, "tag": f"item-{i}"})
            except ipcsync.IpcTimeoutError:
                say(event="timeout", sent=i, consumers=out.consumers, stats=plain(out.stats()))
                out.abort()
                say(event="done", sent=i)
                return
            say(event="sent", n=i + 1)
        stats = out.stats()
    say(event="done", sent=n, stats=plain(stats))


def consume(a: dict[str, Any]) -> None:
    """Receive and check every item; ``hold``: keep every item (never release);
    ``kill_after``: SIGKILL itself after that many items."""
    size = a.get("size", 16)
    got: list[int] = []
    errors: list[str] = []
    held: list[Any] = []
    try:
        inp = ipcsync.Consumer(a["endpoint"], heartbeat=a.get("heartbeat", 0.5), timeout=a.get("timeout", 30.0),
                               connect_timeout=a.get("connect_timeout", 30.0), device="cpu",
                               auto_release=not a.get("hold"), **_keys(a, "consumer"))
    except ipcsync.IpcSyncError as exc:
        say(event="refused", error=type(exc).__name__, message=str(exc))
        say(event="done")
        return
    say(event="connected", pid=os.getpid())
    end = "stop"
    try:
        for item in inp:
            i = item.meta["i"]
            problem = check(item, i, size)
            if problem:
                errors.append(problem)
            got.append(i)
            if a.get("hold"):
                held.append(item)
            say(event="got", i=i, n=len(got))
            if a.get("kill_after") == len(got):
                os.kill(os.getpid(), signal.SIGKILL)
    except ipcsync.PeerLostError as exc:
        end = "lost"
        say(event="lost", message=str(exc))
    finally:
        held.clear()
        inp.close()
    say(event="done", end=end, got=got, errors=errors)


__all__ = ["produce", "consume", "expected"]
