"""Child-process roles for tests/integration/test_liveness.py: ``procs.start(ROLE, module="liveness_peers", ...)``.

Each prints JSON lines ({"event": ...}) so the test can follow it. Item ``i`` has
deterministic contents (``content(i)``), checked by the consumer on every item, and on a
held item again after a pause.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

import torch
from polling import in_call

import ipcsync


def say(**kw: Any) -> None:
    print(json.dumps(kw), flush=True)


def content(i: int, n: int, device: str) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32, device=device) + float(i) * 1000.0


def intact(t: torch.Tensor, i: int) -> bool:
    return bool(torch.equal(t, content(i, t.numel(), str(t.device))))


def say_once(event: str, cond: Any) -> None:
    """Say ``{"event": event}`` once ``cond()`` is true: a daemon thread polls it every
    10 ms (the observable state a test waits for, instead of sleeping)."""

    def watch() -> None:
        while not cond():
            time.sleep(0.01)
        say(event=event)

    threading.Thread(target=watch, daemon=True).start()


def stalled_after(mark: str, endpoint: Any, key: str) -> bool:
    """The peer is reported stalled now (``stats()[key]``), sampled after ``mark`` exists:
    a stall that lasts while the test has the peer stopped (it makes ``mark`` after)."""
    return os.path.exists(mark) and bool(endpoint.stats()[key])


def blocked_alone(out: ipcsync.Producer) -> bool:
    """The main thread is in ``send()`` with its consumer lost and none left: a send that
    can only wait."""
    stats = out.stats()
    return (stats["consumers"] == 0 and stats["consumers_lost"] >= 1
            and in_call(threading.main_thread(), "send", "runtime/producer/port.py"))


def produce(a: dict[str, Any]) -> None:
    """Send ``n`` items with the endpoint's default timeouts (waiting on a living peer is
    the default); optionally raise at item ``fail_at`` inside the with-block; with
    ``say_blocked``, say when a send blocks for want of a consumer ("blocked"); with
    ``stalled_after`` (a path), when a consumer is reported stalled once that file exists
    ("peer-stalled": the test makes it after SIGSTOPping the consumer)."""
    dev, n, elems = a.get("device", "cpu"), a["n"], a.get("elems", 1024)
    with ipcsync.Producer(a["endpoint"], slots=a.get("slots", 2), slot_bytes=elems * 4 + 4096,
                          device=dev, heartbeat=a.get("heartbeat", 0.2)) as out:
        say(event="bound", pid=os.getpid())
        if a.get("say_blocked"):
            say_once("blocked", lambda: blocked_alone(out))
        if a.get("stalled_after"):
            say_once("peer-stalled", lambda: stalled_after(a["stalled_after"], out, "consumers_stalled"))
        if a.get("wait_consumers"):
            out.wait_for_consumers(a["wait_consumers"], timeout=30)
        for i in range(n):
            if a.get("fail_at") == i:
                raise ValueError(f"loader broke at item {i}")
            out.send({"x": content(i, elems, dev)}, meta=i)
            if a.get("every"):
                time.sleep(a["every"])
            if a.get("progress") and (i + 1) % a["progress"] == 0:
                say(event="sent", n=i + 1)
        stats = out.stats()
        say(event="sent-all", lost=stats["consumers_lost"], stalled=stats["consumers_stalled_total"])
    say(event="done", lost=stats["consumers_lost"], stalled=stats["consumers_stalled_total"])


def consume(a: dict[str, Any]) -> None:
    """Iterate with default timeouts; hold item ``hold`` for ``hold_s`` seconds (the test
    pauses the process meanwhile), check it is still intact, then go on checking; with
    ``stalled_after`` (a path), say when the producer is reported stalled once that file
    exists ("peer-stalled")."""
    dev = a.get("device", "cpu")
    got, bad = 0, []
    error = None
    with ipcsync.Consumer(a["endpoint"], device=dev, heartbeat=a.get("heartbeat", 0.2),
                          wait=a.get("wait", "gpu")) as inp:
        say(event="connected", pid=os.getpid())
        if a.get("stalled_after"):
            say_once("peer-stalled", lambda: stalled_after(a["stalled_after"], inp, "producer_stalled"))
        try:
            for item in inp:
                i = item.meta
                x = item["x"]
                if i == a.get("hold"):
                    # The hold counts from before "holding": the test stops this process as
                    # soon as it reads that line, so a deadline taken after it could start
                    # only once the process is continued, doubling a long pause.
                    end = time.monotonic() + a["hold_s"]
                    say(event="holding", i=i)
                    while time.monotonic() < end:  # paused (SIGSTOP) in here by the test
                        time.sleep(0.01)
                    if dev.startswith("cuda"):
                        torch.cuda.synchronize()
                    if not intact(x, i):
                        bad.append({"i": i, "held": True, "x0": float(x[0])})
                    say(event="held-checked", i=i, ok=not bad)
                elif not intact(x, i):
                    bad.append({"i": i, "x0": float(x[0])})
                if i != got:
                    bad.append({"order": i, "expected": got})
                got += 1
                del x
                if a.get("progress") and got % a["progress"] == 0:
                    say(event="received", n=got)
        except ipcsync.IpcSyncError as exc:
            error = f"{type(exc).__name__}: {exc}"
        stats = inp.stats()
    say(event="done", received=got, bad=bad[:10], error=error, stalled=stats["producer_stalled_total"])


def consume_fanin(a: dict[str, Any]) -> None:
    """Iterate a FanIn (or ipcsync.data.batches over one) until it ends or raises."""
    kind = a.get("kind", "fanin")
    got, error = 0, None
    inp: Any
    if kind == "fanin":
        inp = ipcsync.FanIn(a["endpoints"])
    else:
        inp = ipcsync.Consumer(a["endpoints"][0])
    with inp:
        say(event="connected", pid=os.getpid())
        try:
            if kind == "batches":
                from ipcsync.data import batches

                for _batch in batches(inp):
                    got += 1
            else:
                for _item in inp:
                    got += 1
        except ipcsync.IpcSyncError as exc:
            error = f"{type(exc).__name__}: {exc}"
            failed = isinstance(exc, ipcsync.ProducerFailedError)
        else:
            failed = False
    say(event="done", received=got, error=error, producer_failed=failed)


def fork_child_exit(a: dict[str, Any]) -> None:
    """Make a producer and a consumer (holding an item), fork; the child tries every call
    of both, then the parent uses them, closes them while the child still lives, and only
    then lets the child exit normally (atexit runs): the child's calls must each raise
    ClosedError naming the fork (close() is a no-op there), its exit must be prompt, and
    it must never touch the parent's endpoints."""
    out = ipcsync.Producer(a["endpoint"], slots=2, slot_bytes=4096)
    inp = ipcsync.Consumer(a["endpoint"], auto_release=False)
    out.send({"x": torch.ones(4)}, meta=0)
    held = inp.get(timeout=10)
    go_r, go_w = os.pipe()  # the parent closed its endpoints: the child may exit
    pid = os.fork()
    if pid == 0:
        os.close(go_w)
        calls = {
            "send": lambda: out.send({"x": torch.ones(4)}, meta=1),
            "slot": lambda: out.slot(x=((4,), torch.float32)).__enter__(),
            "flush": lambda: out.flush(timeout=1),
            "wait_for_consumers": lambda: out.wait_for_consumers(1, timeout=1),
            "get": lambda: inp.get(timeout=1),
            "next": lambda: next(iter(inp)),
        }
        code = 0
        for k, call in enumerate(calls.values()):
            try:
                call()
                code = code or 10 + k  # must not work
            except ipcsync.ClosedError as exc:
                code = code or (0 if "forked child" in str(exc) else 30 + k)
            except BaseException:  # noqa: BLE001 (an exit code says which call)
                code = code or 50 + k
        held.release()  # a no-op: the item is the parent's
        inp.close()
        out.close()
        os.read(go_r, 1)  # the parent closed everything meanwhile
        sys.stdout.flush()
        sys.exit(code)  # atexit handlers run here
    os.close(go_r)
    # The child acts meanwhile; the parent's endpoints keep working.
    assert not held.released and held["x"].tolist() == [1.0] * 4
    held.release()
    out.send({"x": torch.full((4,), 2.0)}, meta=2)
    metas = [0, inp.get(timeout=10).meta]
    inp.close()
    out.close()  # the child still lives
    t0 = time.monotonic()
    os.write(go_w, b"x")
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() - t0 > 25:  # a hang (the child's exit takes ~3 s of torch teardown)
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            status = -1
            break
        time.sleep(0.01)
    child_s = time.monotonic() - t0
    say(event="done", child_status=status, child_s=child_s, metas=metas)


def produce_unmanaged(a: dict[str, Any]) -> None:
    """A producer made without a with-block whose program dies of an exception: the exit
    hook must end its consumers with an error, not cleanly."""
    out = ipcsync.Producer(a["endpoint"], slots=8, slot_bytes=8192)
    say(event="bound", pid=os.getpid())
    out.wait_for_consumers(1, timeout=30)
    for i in range(3):
        out.send({"x": content(i, 16, "cpu")}, meta=i)
    raise RuntimeError("unhandled in the loader")
