"""Child-process programs for the multi-process tests: ``peers.py ROLE JSON-ARGS``.

Each prints JSON lines on stdout ({"event": ...}) so the test can follow it, and a final
{"event": "done", ...} summary. Item ``i`` has deterministic contents (``expected(i)``), so
the consumer checks every tensor, the order and the meta.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from typing import Any

import torch

import ipcsync

logging.basicConfig(level=os.environ.get("IPCSYNC_TEST_LOG", "WARNING"), format="%(levelname)s %(name)s: %(message)s")


def say(**kw: Any) -> None:
    print(json.dumps(kw), flush=True)


def expected(i: int, size: int) -> dict[str, Any]:
    """Message ``i``: several dtypes, a nested list and tuple, a non-contiguous view."""
    base = torch.arange(size, dtype=torch.int64) * 7 + i
    return {
        "a": base,
        "b": [torch.full((3, 2), float(i), dtype=torch.float32).t(), (torch.tensor(i % 2 == 0),)],
        "c": torch.arange(12, dtype=torch.float64).reshape(3, 4)[:, ::2] + i,
    }


def check(item: ipcsync.Item, i: int, size: int) -> str | None:
    """None if item holds message ``i``, else what is wrong."""
    exp = expected(i, size)
    got = item.tensors
    if item.meta != {"i": i, "tag": f"item-{i}"}:
        return f"meta {item.meta!r} != item {i}"
    pairs = [
        (got["a"], exp["a"]),
        (got["b"][0], exp["b"][0]),
        (got["b"][1][0], exp["b"][1][0]),
        (got["c"], exp["c"]),
    ]
    if not isinstance(got["b"][1], tuple):
        return "tuple came back as " + type(got["b"][1]).__name__
    for g, e in pairs:
        if g.dtype != e.dtype or g.shape != e.shape or g.stride() != e.stride() or not torch.equal(g, e):
            return f"item {i}: tensor mismatch {g.dtype}{tuple(g.shape)} vs {e.dtype}{tuple(e.shape)}"
    return None


def produce(a: dict[str, Any]) -> None:
    n, size = a["n"], a.get("size", 16)
    kill_after = a.get("kill_after")
    with ipcsync.Producer(
        a["endpoint"], slots=a.get("slots", 4), slot_bytes=a.get("slot_bytes", 1 << 16),
        heartbeat=a.get("heartbeat", 1.0), timeout=a.get("timeout", 30.0),
    ) as out:
        say(event="bound", pid=os.getpid())
        if a.get("wait_consumers"):
            out.wait_for_consumers(a["wait_consumers"], timeout=30)
        blocked = 0.0
        for i in range(n):
            if kill_after is not None and i == kill_after:
                say(event="dying", sent=i)
                os.kill(os.getpid(), signal.SIGKILL)
            t0 = time.monotonic()
            out.send(expected(i, size), meta={"i": i, "tag": f"item-{i}"})
            blocked = max(blocked, time.monotonic() - t0)
            if a.get("progress") and (i + 1) % a["progress"] == 0:
                say(event="sent", n=i + 1, consumers=out.consumers)
        say(event="sent-all", n=n)
        if a.get("linger"):
            time.sleep(a["linger"])
        stats = out.stats()
    say(event="done", sent=n, max_blocked=blocked, stats=_plain(stats))


def consume(a: dict[str, Any]) -> None:
    size = a.get("size", 16)
    kill_after = a.get("kill_after")
    delay = a.get("delay", 0.0)
    start = a.get("start")
    errors: list[str] = []
    got: list[int] = []
    end = "stop"
    t0 = time.monotonic()
    inp = ipcsync.Consumer(a["endpoint"], heartbeat=a.get("heartbeat", 1.0), timeout=a.get("timeout", 30.0))
    say(event="connected", pid=os.getpid(), producer=inp.producer_pid)
    try:
        for item in inp:
            i = item.meta["i"] if isinstance(item.meta, dict) else -1
            if not a.get("any_order") and got and i != got[-1] + 1:
                errors.append(f"order: {i} after {got[-1]}")
            if not got and start is not None and i != start:
                errors.append(f"first item {i}, expected {start}")
            err = check(item, i, size)
            if err:
                errors.append(err)
            got.append(i)
            if kill_after is not None and len(got) == kill_after:
                say(event="dying", received=len(got))
                os.kill(os.getpid(), signal.SIGKILL)
            if a.get("progress") and len(got) % a["progress"] == 0:
                say(event="received", n=len(got))
            if delay:
                time.sleep(delay)
            if a.get("limit") and len(got) >= a["limit"]:
                break
    except ipcsync.PeerLostError as exc:
        end = "peer-lost"
        say(event="peer-lost", message=str(exc), after=time.monotonic() - t0)
    stats = inp.stats()
    inp.close()
    say(event="done", end=end, received=len(got), first=got[:1], last=got[-1:],
        distinct=len(set(got)), errors=errors[:20], stats=_plain(stats))


def _plain(x: Any) -> Any:
    return json.loads(json.dumps(x, default=str))


if __name__ == "__main__":
    role, args = sys.argv[1], json.loads(sys.argv[2])
    {"produce": produce, "consume": consume}[role](args)
