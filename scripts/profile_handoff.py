#!/usr/bin/env python3
"""Where does a handoff's time go? Runs N handoffs producer -> consumer (two processes)
under cProfile and prints, for each side, its rate, time spent waiting by cause and the
top functions by own time. A development tool; scripts/bench.py is the benchmark.

    python3 scripts/profile_handoff.py [--device cuda] [--n 20000] [--slots 16] [--mode send]
    python3 scripts/profile_handoff.py --roundtrip [--read] [--device cuda]

``--roundtrip``: request/reply with one request in flight, as ``bench.py --suite latency``
runs it: the host time of each step on each side per round trip, and what is left for
transport and wake-ups.

``--ops``: the host cost of each primitive the hot path is made of (torch ops, events,
msgpack, a ZeroMQ send, a lock, a Python call), one at a time, on this host: the budget
a handoff is built from.

``--per-call``: instead, the host cost of each hot call alone (no profiler): producer and
consumer in one process, in rounds of ``--batch`` sends (or ``slot()`` blocks), then as many
``next()``, then as many ``release()``, each phase timed apart with the sockets settled
between phases, so no phase waits on the other side. Prints microseconds per call.

``--doorbell``: the floor the shared-memory doorbell (``runtime.doorbell``, not wired into
the endpoints yet) gives a request/reply: two processes ping-pong one entry each way,
waiting by a spin of ``IPCSYNC_SPIN_US`` (``os.sched_yield`` between looks) then parked
on the eventfd; against the same ping-pong over an AF_UNIX SOCK_SEQPACKET pair (a lane).

``--calls``: the same phases, counting instead of timing: the Python calls (functions,
generator resumptions) and C calls (builtins, C methods) the calling thread makes per
``send`` (or ``slot()`` block), ``next`` and ``release`` on the steady path, as one table.
"""

from __future__ import annotations

import argparse
import cProfile
import faulthandler
import io
import multiprocessing as mp
import os
import pstats
import sys
import tempfile
import time

import torch


PROFILE = os.environ.get("NO_PROFILE") != "1"
_SINK: list[torch.Tensor] = []


def _touch(x: torch.Tensor) -> None:
    # As scripts/bench.py's consumer does: a 1-byte device copy (a reduction such as
    # x[:1].sum() costs more host time than the handoff itself on the H200's host).
    if not x.is_cuda:
        int(x[0])
        return
    if not _SINK:
        _SINK.append(torch.empty(1, dtype=x.dtype, device=x.device))
    _SINK[0].copy_(x[:1])


def _report(name: str, prof: cProfile.Profile, stats: dict, elapsed: float, n: int, q) -> None:
    out = io.StringIO()
    if PROFILE:
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
    waits = {k: round(v, 3) for k, v in stats["waiting_s"].items()}
    q.put(f"== {name}: {n / elapsed:,.0f}/s over {elapsed:.2f} s; waiting {waits}\n{out.getvalue()}")


def producer(ep, n, slots, device, mode, q, ready):
    import ipcsync

    src = torch.zeros(4096, dtype=torch.uint8, device=device)
    prof = cProfile.Profile()
    with ipcsync.Producer(ep, slots=slots, slot_bytes=8192, device=device, heartbeat=None, timeout=60) as out:
        ready.set()
        out.wait_for_consumers(1, timeout=60)
        t0 = time.perf_counter()
        prof.enable() if PROFILE else None
        for _ in range(n):
            if mode == "slot":
                with out.slot(x=((4096,), torch.uint8)) as s:
                    s["x"][:1].fill_(1)
            else:
                out.send({"x": src})
        prof.disable() if PROFILE else None
        _report("producer", prof, out.stats(), time.perf_counter() - t0, n, q)


def consumer(ep, n, device, touch, q):
    import ipcsync

    prof = cProfile.Profile()
    with ipcsync.Consumer(ep, device=device, heartbeat=None, timeout=60) as inp:
        it = iter(inp)
        next(it)
        t0 = time.perf_counter()
        prof.enable() if PROFILE else None
        for _ in range(n - 1):
            item = next(it)
            if touch:
                _touch(item["x"])
        prof.disable() if PROFILE else None
        _report("consumer", prof, inp.stats(), time.perf_counter() - t0, n - 1, q)


def _steady_rounds(n: int, batch: int, slots: int, device: str, mode: str, phase) -> None:
    """Producer and consumer in one process, in rounds of ``batch`` sends (or ``slot()``
    blocks), then as many ``next()``, then as many ``release()``, the sockets settled
    between phases so no phase waits on the other side. ``phase(op, calls, counted)`` runs
    each phase's list of calls; ``counted`` is False for the three warm-up rounds."""
    import ipcsync

    src = torch.zeros(4096, dtype=torch.uint8, device=device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    settle = 3e-4

    def produce() -> None:
        if mode == "slot":
            with out.slot(x=((4096,), torch.uint8)):
                pass
        else:
            out.send({"x": src})

    with ipcsync.Producer("steady", slots=slots, slot_bytes=8192, device=device, heartbeat=None, timeout=60) as out, \
            ipcsync.Consumer("steady", device=device, heartbeat=None, timeout=60, auto_release=False) as inp:
        out.wait_for_consumers(1, timeout=60)
        it = iter(inp)
        done = -3 * batch  # three warm-up rounds
        while done < n:
            phase(mode, [produce] * batch, done >= 0)
            sync()
            time.sleep(settle)
            items: list = []
            phase("next", [lambda: items.append(next(it))] * batch, done >= 0)
            phase("release", [item.release for item in items], done >= 0)
            sync()
            time.sleep(settle)
            done += batch


def per_call(n: int, batch: int, slots: int, device: str, mode: str) -> None:
    spent = {mode: 0.0, "next": 0.0, "release": 0.0}

    def phase(op: str, fns: list, counted: bool) -> None:
        t0 = time.perf_counter()
        for fn in fns:
            fn()
        if counted:
            spent[op] += time.perf_counter() - t0

    _steady_rounds(n, batch, slots, device, mode, phase)
    print(f"per call ({device}, {n} handoffs in rounds of {batch}, {slots} slots): "
          + ", ".join(f"{op} {t / n * 1e6:.2f} us" for op, t in spent.items()))


class _CallCounter:
    """Counts the calling thread's Python and C calls while on (``sys.setprofile``)."""

    def __init__(self) -> None:
        self.py = self.c = 0

    def _hook(self, frame, event, arg) -> None:
        if event == "call":
            self.py += 1
        elif event == "c_call":
            self.c += 1

    def __enter__(self) -> "_CallCounter":
        sys.setprofile(self._hook)
        return self

    def __exit__(self, *exc) -> None:
        sys.setprofile(None)
        self.c -= 1  # setprofile(None) itself is a C call counted on the way out


def calls(n: int, batch: int, slots: int, device: str, mode: str) -> None:
    """Python and C calls per send (or slot() block)/next/release on the steady path (the
    --per-call rounds): the mean over every call, which includes the per-wake-up work some
    calls do for all (a send that finds no slot free handles the releases that arrived),
    and the median, the one call alone."""
    counts: dict[str, list[tuple[int, int]]] = {op: [] for op in (mode, "next", "release")}

    def phase(op: str, fns: list, counted: bool) -> None:
        for fn in fns:
            with _CallCounter() as k:
                fn()
            if counted:
                counts[op].append((k.py, k.c))

    _steady_rounds(n, batch, slots, device, mode, phase)
    print(f"calls per operation on the steady path ({device}, {n} handoffs in rounds of {batch}, {slots} slots)")
    print(f"{'operation':10s} {'Python calls':>13s} {'C calls':>9s} {'median Py':>10s} {'median C':>9s}")
    # What the rounds' wrappers call themselves, not the library: produce() (one Python
    # call); the next lambda (one Python call) with next() and list.append (two C calls);
    # and the counter's own __exit__ (one Python call, on every operation).
    harness = {mode: (2, 0), "next": (2, 2), "release": (1, 0)}
    for op, got in counts.items():
        hp, hc = harness[op]
        py = sorted(p for p, _ in got)
        c = sorted(c for _, c in got)
        print(f"{op:10s} {sum(py) / len(got) - hp:13.1f} {sum(c) / len(got) - hc:9.1f} "
              f"{py[len(py) // 2] - hp:10d} {c[len(c) // 2] - hc:9d}")
    if mode == "slot":
        print("(slot: one whole `with out.slot(...)` block, the context manager's enter and exit included)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--mode", default="send")
    ap.add_argument("--no-touch", action="store_true")
    ap.add_argument("--per-call", action="store_true", help="time each hot call alone, in one process")
    ap.add_argument("--doorbell", action="store_true",
                    help="request/reply floor over the shared-memory doorbell against a raw AF_UNIX lane")
    ap.add_argument("--calls", action="store_true",
                    help="count Python and C calls per send/next/release on the steady path, in one process")
    ap.add_argument("--batch", type=int, default=4, help="--per-call/--calls: calls per round")
    ap.add_argument("--ops", action="store_true", help="time each primitive alone")
    ap.add_argument("--roundtrip", action="store_true",
                    help="request/reply, one in flight: host time of each step on each side")
    ap.add_argument("--read", action="store_true", help="--roundtrip: read the answer on the host")
    ap.add_argument("--profile", action="store_true", help="--roundtrip: also under cProfile, top functions")
    a = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("IPCSYNC_RUNTIME_DIR", tempfile.mkdtemp(prefix="ipcs-prof-", dir="/tmp"))
    if a.ops:
        torch.set_num_threads(1)
        ops(min(a.n, 5000), a.device)
        return
    if a.roundtrip:
        roundtrip(min(a.n, 5000), a.device, a.read, PROFILE and a.profile)
        return
    if a.doorbell:
        doorbell(min(a.n, 20000))
        return
    if a.calls:
        torch.set_num_threads(1)
        calls(min(a.n, 2000), a.batch, a.slots, a.device, a.mode)
        return
    if a.per_call:
        torch.set_num_threads(1)
        per_call(a.n, a.batch, a.slots, a.device, a.mode)
        return
    ctx = mp.get_context("spawn")
    q, ready = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=producer, args=("prof", a.n, a.slots, a.device, a.mode, q, ready))
    p.start()
    ready.wait(60)
    c = ctx.Process(target=consumer, args=("prof", a.n, a.device, not a.no_touch, q))
    c.start()
    for _ in range(2):
        print(q.get(timeout=300))
    p.join(60)
    c.join(60)


if __name__ == "__main__":
    main()
