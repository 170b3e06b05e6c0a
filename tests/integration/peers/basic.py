"""Everyday roles: a producer and a consumer of ``expected(i)`` items, a tagged producer
(for FanIn), and two stages run as under ipcsync-run."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch

import ipcsync

from .common import check, expected, plain, say


def produce(a: dict[str, Any]) -> None:
    n, size = a["n"], a.get("size", 16)
    kill_after = a.get("kill_after")
    device = a.get("device", "cpu")
    with ipcsync.Producer(
        a["endpoint"], slots=a.get("slots", 4), slot_bytes=a.get("slot_bytes", 1 << 16),
        heartbeat=a.get("heartbeat", 1.0), timeout=a.get("timeout", 30.0), device=device,
        wait=a.get("wait", "host"),
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
            out.send(expected(i, size, device), meta={"i": i, "tag": f"item-{i}"})
            blocked = max(blocked, time.monotonic() - t0)
            if a.get("progress") and (i + 1) % a["progress"] == 0:
                say(event="sent", n=i + 1, consumers=out.consumers)
        say(event="sent-all", n=n)
        if a.get("linger"):
            time.sleep(a["linger"])
        stats = out.stats()
    say(event="done", sent=n, max_blocked=blocked, stats=plain(stats))


def consume(a: dict[str, Any]) -> None:
    size = a.get("size", 16)
    kill_after = a.get("kill_after")
    delay = a.get("delay", 0.0)
    start = a.get("start")
    errors: list[str] = []
    got: list[int] = []
    end = "stop"
    t0 = time.monotonic()
    device = a.get("device", "cpu")
    inp = ipcsync.Consumer(a["endpoint"], heartbeat=a.get("heartbeat", 1.0), timeout=a.get("timeout", 30.0),
                           device=device, wait=a.get("wait", "gpu"), credits=a.get("credits"))
    say(event="connected", pid=os.getpid(), producer=inp.producer_pid)
    try:
        for item in inp:
            i = item.meta["i"] if isinstance(item.meta, dict) else -1
            if a.get("sharded"):  # each item to one consumer: ours only increase
                if got and i <= got[-1]:
                    errors.append(f"order: {i} after {got[-1]}")
            elif not a.get("any_order") and got and i != got[-1] + 1:
                errors.append(f"order: {i} after {got[-1]}")
            if not got and start is not None and i != start:
                errors.append(f"first item {i}, expected {start}")
            err = check(item, i, size, device)
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
    if a.get("stay"):  # the stream has ended; live on without closing (as a trainer fed by others)
        say(event="ended", received=len(got))
        time.sleep(a["stay"])
    stats = inp.stats()
    inp.close()
    say(event="done", end=end, received=len(got), first=got[:1], last=got[-1:],
        distinct=len(set(got)), errors=errors[:20], stats=plain(stats))


def tagged_produce(a: dict[str, Any]) -> None:
    """Send ``n`` items whose contents encode (tag, i): ``x = [tag, i]``, ``y = i`` repeated,
    meta ``{"src": label, "i": i}``, ``pace`` seconds apart; then close (which waits for the
    consumer's releases)."""
    n, tag, label = a["n"], a["tag"], a["label"]
    size = a.get("size", 8)
    with ipcsync.Producer(a["endpoint"], slots=a.get("slots", 4), slot_bytes=a.get("slot_bytes", 4096),
                          device="cpu", timeout=a.get("timeout", 30.0), heartbeat=a.get("heartbeat", 1.0)) as out:
        say(event="bound", pid=os.getpid())
        if a.get("wait_consumers"):
            out.wait_for_consumers(a["wait_consumers"], timeout=30)
        for i in range(n):
            out.send({"x": torch.tensor([tag, i], dtype=torch.int64),
                      "y": torch.full((size,), float(i), dtype=torch.float32)},
                     meta={"src": label, "i": i})
            if a.get("pace"):
                time.sleep(a["pace"])
        say(event="sent-all", n=n)
        stats = out.stats()
    say(event="done", sent=n, stats=plain(stats))


def stage_src(a: dict[str, Any]) -> None:
    """A stage under (simulated) ipcsync-run: IPCSYNC_WIRING is in the environment. Sends
    ``n`` items ``{"x": [replica, i]}`` to downstream stage ``to`` via ipcsync.stage."""
    import ipcsync.stage as stage

    me = stage.info()
    say(event="info", info=plain(me.__dict__))
    with stage.output(a["to"]) as out:
        for i in range(a["n"]):
            out.send({"x": torch.tensor([me.replica, i], dtype=torch.int64)}, meta={"i": i, "from": me.stage})
        stats = out.stats()
    say(event="done", sent=a["n"], stats=plain(stats))  # the stats report is written at exit


def stage_sink(a: dict[str, Any]) -> None:
    """A stage that reads everything from upstream stage ``frm`` via ipcsync.stage."""
    import ipcsync.stage as stage

    me = stage.info()
    say(event="info", info=plain(me.__dict__))
    got: list[list[Any]] = []
    with stage.input(a["frm"]) as inp:
        kind = type(inp).__name__
        for item in inp:
            got.append([item.source, item["x"].tolist(), item.meta])
        stats = inp.stats()
    say(event="done", kind=kind, got=got, stats=plain(stats))


def native_state(a: dict[str, Any]) -> None:
    """What ``ipcsync.backends.native`` made of ``IPCSYNC_NATIVE`` at its import here."""
    from ipcsync.backends import native  # noqa: PLC0415 - the import is what is tested

    say(event="done", enabled=native.ENABLED, host_copy=native.host_copy() is not None)
