#!/usr/bin/env python3
"""Where does a handoff's time go? Runs N handoffs producer -> consumer (two processes)
under cProfile and prints, for each side, its rate, time spent waiting by cause and the
top functions by own time. A development tool; scripts/bench.py is the benchmark.

    python3 scripts/profile_handoff.py [--device cuda] [--n 20000] [--slots 16] [--mode send]

``--ops``: the host cost of each primitive the hot path is made of (torch ops, events,
msgpack, a ZeroMQ send, a lock, a Python call), one at a time, on this host: the budget
a handoff is built from.

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


def ops(n: int, device: str) -> None:
    import threading

    import msgpack
    import zmq

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    x = torch.zeros(1 << 20, dtype=torch.uint8, device=dev)
    src = torch.zeros(4096, dtype=torch.uint8, device=dev)
    dst = torch.empty(4096, dtype=torch.uint8, device=dev)
    sink = torch.empty(1, dtype=torch.uint8, device=dev)
    lock = threading.Lock()
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    for sock in (a, b):
        sock.sndhwm = sock.rcvhwm = 0  # unbounded: every timed send is taken
    path = tempfile.mktemp(prefix="ipcs-ops-", dir="/tmp")
    a.bind("ipc://" + path)
    b.connect("ipc://" + path)
    frame = msgpack.packb([2, 1, 5, 3, 123456789, 1, None], use_bin_type=True)

    def f() -> None:
        pass

    cases = {
        "python call": f,
        "lock acquire+release": lambda: (lock.acquire(), lock.release()),
        "time.monotonic_ns": time.monotonic_ns,
        "msgpack.packb (READY-sized)": lambda: msgpack.packb([2, 1, 5, 3, 123456789, 1, None], use_bin_type=True),
        "zmq send 1 frame (NOBLOCK)": lambda: a.send(frame, zmq.NOBLOCK, copy=True),
        "x[:1] (slice)": lambda: x[:1],
        "as_strided": lambda: x.as_strided((4096,), (1,), 0),
        "fill_ x[:1]": lambda: x[:1].fill_(7),
        "copy_ 4 KiB": lambda: dst.copy_(src, non_blocking=True),
        "copy_ 1 byte": lambda: sink.copy_(x[:1]),
    }
    if cuda:
        from ipcsync.backends.cuda import IpcEvent, current_stream

        ev, plain = IpcEvent(dev), torch.cuda.Event()
        st = current_stream(dev.index or 0)
        getcur = torch._C._cuda_getCurrentStream
        cases.update({
            "torch.cuda.current_stream()": torch.cuda.current_stream,
            "_cuda_getCurrentStream": lambda: getcur(0),
            "ipcsync current_stream": lambda: current_stream(0),
            "IpcEvent.record(stream)": lambda: ev.record(st),
            "torch.cuda.Event.record (not IPC)": lambda: plain.record(st),
            "IpcEvent.wait(stream)": lambda: ev.wait(st),
            "IpcEvent.query()": ev.query,
        })
    for name, fn in cases.items():
        for _ in range(200):
            fn()
        if cuda:
            torch.cuda.synchronize()
        while b.poll(0):
            b.recv()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        dt = time.perf_counter() - t0
        if cuda:
            torch.cuda.synchronize()
        while b.poll(0):
            b.recv()
        print(f"op {name:36s} {dt / n * 1e6:7.2f} us")
    a.close(0)
    b.close(0)
    ctx.term()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--mode", default="send")
    ap.add_argument("--no-touch", action="store_true")
    ap.add_argument("--per-call", action="store_true", help="time each hot call alone, in one process")
    ap.add_argument("--batch", type=int, default=4, help="--per-call: calls per timed round")
    ap.add_argument("--ops", action="store_true", help="time each primitive alone")
    a = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("IPCSYNC_RUNTIME_DIR", tempfile.mkdtemp(prefix="ipcs-prof-", dir="/tmp"))
    if a.ops:
        torch.set_num_threads(1)
        ops(min(a.n, 5000), a.device)
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
