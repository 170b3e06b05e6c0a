#!/usr/bin/env python3
"""Where does a handoff's time go? Runs N handoffs producer -> consumer (two processes)
under cProfile and prints, for each side, its rate, time spent waiting by cause and the
top functions by own time. A development tool; scripts/bench.py is the benchmark.

    python3 scripts/profile_handoff.py [--device cuda] [--n 20000] [--slots 16] [--mode send]

``--per-call``: instead, the host cost of each hot call alone (no profiler): producer and
consumer in one process, in rounds of ``--batch`` sends (or ``slot()`` blocks), then as many
``next()``, then as many ``release()``, each phase timed apart with the sockets settled
between phases, so no phase waits on the other side. Prints microseconds per call.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import multiprocessing as mp
import os
import pstats
import tempfile
import time

import torch


PROFILE = os.environ.get("NO_PROFILE") != "1"


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
                item["x"][:1].sum()
        prof.disable() if PROFILE else None
        _report("consumer", prof, inp.stats(), time.perf_counter() - t0, n - 1, q)


def per_call(n: int, batch: int, slots: int, device: str, mode: str) -> None:
    import ipcsync

    src = torch.zeros(4096, dtype=torch.uint8, device=device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    settle = 3e-4
    spent = {"call": 0.0, "next": 0.0, "release": 0.0}
    with ipcsync.Producer("percall", slots=slots, slot_bytes=8192, device=device, heartbeat=None, timeout=60) as out, \
            ipcsync.Consumer("percall", device=device, heartbeat=None, timeout=60, auto_release=False) as inp:
        out.wait_for_consumers(1, timeout=60)
        it = iter(inp)
        done = -3 * batch  # three warm-up rounds
        while done < n:
            t0 = time.perf_counter()
            for _ in range(batch):
                if mode == "slot":
                    with out.slot(x=((4096,), torch.uint8)):
                        pass
                else:
                    out.send({"x": src})
            t1 = time.perf_counter()
            sync()
            time.sleep(settle)
            t2 = time.perf_counter()
            items = [next(it) for _ in range(batch)]
            t3 = time.perf_counter()
            for item in items:
                item.release()
            t4 = time.perf_counter()
            sync()
            time.sleep(settle)
            if done >= 0:
                spent["call"] += t1 - t0
                spent["next"] += t3 - t2
                spent["release"] += t4 - t3
            done += batch
    print(f"per call ({device}, {n} handoffs in rounds of {batch}, {slots} slots): "
          f"{mode} {spent['call'] / n * 1e6:.2f} us, next {spent['next'] / n * 1e6:.2f} us, "
          f"release {spent['release'] / n * 1e6:.2f} us")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--mode", default="send")
    ap.add_argument("--no-touch", action="store_true")
    ap.add_argument("--per-call", action="store_true", help="time each hot call alone, in one process")
    ap.add_argument("--batch", type=int, default=4, help="--per-call: calls per timed round")
    a = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("IPCSYNC_RUNTIME_DIR", tempfile.mkdtemp(prefix="ipcs-prof-", dir="/tmp"))
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
