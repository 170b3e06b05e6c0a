#!/usr/bin/env python3
"""Handoff benchmark: ipcsync against torch.multiprocessing.Queue and a host copy.

Same run, same machine, same tensors. For each message size a producer process sends N
messages holding one uint8 tensor to a consumer process, which touches one byte of each
and lets it go; both sides are separate processes started with the spawn method.

- ipcsync send:     Producer.send({"x": src}) copies src into a free slot.
- ipcsync slot:     Producer.slot() hands out the slot and the producer writes its output
                    there (here one element): the zero-copy path, no copy per handoff.
- mp.Queue:         torch.multiprocessing.Queue(maxsize=slots); each message is a fresh
                    tensor (src.clone()), as a data loader makes a new batch each step.
- host copy:        dst.copy_(src) in one process: the floor of a copying handoff.

Throughput is handoffs/s at the consumer (first to last item). Latency is producer send to
consumer receipt with the pipeline full, so it includes queueing behind up to `slots`
earlier items. Usage: python3 scripts/bench.py [--quick] [--sizes 4K,1M,64M] [--slots 4]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import time
from typing import Any

import torch

SIZES = {"4K": 4 << 10, "1M": 1 << 20, "64M": 64 << 20, "256M": 256 << 20}
COUNT = {"4K": 20_000, "1M": 3_000, "64M": 60, "256M": 20}  # CPU backend: host memcpy speeds
COUNT_CUDA = {"4K": 20_000, "1M": 10_000, "64M": 2_000, "256M": 500}


# ------------------------------------------------------------------ ipcsync
def _ipc_producer(endpoint: str, nbytes: int, n: int, slots: int, mode: str, device: str,
                  wait: str, ready: Any) -> None:
    import ipcsync

    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    with ipcsync.Producer(endpoint, slots=slots, slot_bytes=max(nbytes, 4096), device=device,
                          wait=wait, heartbeat=None, timeout=120) as out:
        ready.set()
        out.wait_for_consumers(1, timeout=60)
        for _ in range(n):
            if mode == "slot":
                # Zero-copy: the producer's own work writes its output in place (here: one
                # element), so no copy is on the handoff path.
                with out.slot(x=((nbytes,), torch.uint8), meta=time.monotonic_ns()) as s:
                    s["x"][:1].fill_(7)
            else:
                out.send({"x": src}, meta=time.monotonic_ns())


def _ipc_consumer(endpoint: str, n: int, device: str, wait: str, results: Any) -> None:
    import ipcsync

    lat = []
    with ipcsync.Consumer(endpoint, device=device, wait=wait, heartbeat=None, timeout=60) as inp:
        t0 = None
        for k, item in enumerate(inp):
            x = item["x"]
            _touch(x)
            now = time.monotonic_ns()
            if t0 is None:
                t0 = time.perf_counter()
            lat.append((now - item.meta) / 1e9)
            if k + 1 == n:
                break
        _sync(device)
        elapsed = time.perf_counter() - t0
    results.put((n - 1) / elapsed if n > 1 else float("nan"))
    results.put(lat)


# ------------------------------------------------------------------ torch.multiprocessing
def _mpq_producer(q: Any, nbytes: int, n: int, device: str, done: Any) -> None:
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    for _ in range(n):
        q.put((src.clone(), time.monotonic_ns()))
    done.wait()  # CUDA tensors must outlive their use by the consumer


def _mpq_consumer(q: Any, n: int, device: str, results: Any) -> None:
    lat = []
    t0 = None
    for _ in range(n):
        x, sent = q.get()
        _touch(x)
        now = time.monotonic_ns()
        if t0 is None:
            t0 = time.perf_counter()
        lat.append((now - sent) / 1e9)
        del x
    _sync(device)
    elapsed = time.perf_counter() - t0
    results.put((n - 1) / elapsed if n > 1 else float("nan"))
    results.put(lat)


def _touch(x: torch.Tensor) -> None:
    # Read one byte on the tensor's device: proves the data is reachable without a host sync
    # on CUDA (the sum is queued on the stream).
    if x.is_cuda:
        x[:1].sum()
    else:
        int(x[0])


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ------------------------------------------------------------------ runners
def run_ipcsync(nbytes: int, n: int, slots: int, mode: str, device: str, wait: str) -> tuple[float, list[float]]:
    ctx = mp.get_context("spawn")
    endpoint = f"bench-{os.getpid()}-{mode}-{nbytes}-{wait}"
    results, ready = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=_ipc_producer, args=(endpoint, nbytes, n, slots, mode, device, wait, ready))
    p.start()
    ready.wait(120)
    c = ctx.Process(target=_ipc_consumer, args=(endpoint, n, device, wait, results))
    c.start()
    rate = results.get(timeout=600)
    lat = results.get(timeout=60)
    c.join(60)
    p.join(60)
    return rate, lat


def run_mpq(nbytes: int, n: int, slots: int, device: str) -> tuple[float, list[float]]:
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")
    q, results, done = ctx.Queue(maxsize=slots), ctx.Queue(), ctx.Event()
    p = ctx.Process(target=_mpq_producer, args=(q, nbytes, n, device, done))
    c = ctx.Process(target=_mpq_consumer, args=(q, n, device, results))
    p.start()
    c.start()
    rate = results.get(timeout=600)
    lat = results.get(timeout=60)
    done.set()
    c.join(60)
    p.join(60)
    return rate, lat


def run_host_copy(nbytes: int, n: int, device: str) -> float:
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        dst.copy_(src)
    _sync(device)
    return n / (time.perf_counter() - t0)


def pct(lat: list[float], p: float) -> float:
    s = sorted(lat)
    return s[min(len(s) - 1, int(p * len(s)))] if s else float("nan")


def fmt_rate(r: float) -> str:
    return f"{r:,.0f}"


def fmt_ms(s: float) -> str:
    return f"{s * 1e3:.3f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    ap.add_argument("--sizes", default="4K,1M,64M")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--quick", action="store_true", help="fewer messages (a smoke run)")
    ap.add_argument("--modes", default="send,slot")
    ap.add_argument("--waits", default=None, help="wait modes (CUDA): gpu,host")
    args = ap.parse_args(argv)
    # One intra-op thread per process for every method (as torchrun does), so the two
    # processes of a run do not spin against each other in OpenMP on a small machine.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("IPCSYNC_RUNTIME_DIR", tempfile.mkdtemp(prefix="ipcs-bench-", dir="/tmp"))
    device = args.device
    waits = (args.waits or ("gpu,host" if device.startswith("cuda") else "gpu")).split(",")
    modes = args.modes.split(",")

    rows = []
    for name in args.sizes.split(","):
        nbytes = SIZES[name]
        n = (COUNT_CUDA if device.startswith("cuda") else COUNT)[name] // (10 if args.quick else 1)
        n = max(n, 10)
        host = run_host_copy(nbytes, n, device)
        mrate, mlat = run_mpq(nbytes, n, args.slots, device)
        for mode in modes:
            for wait in waits:
                rate, lat = run_ipcsync(nbytes, n, args.slots, mode, device, wait)
                label = f"ipcsync {mode}" + (f" wait={wait}" if device.startswith("cuda") else "")
                rows.append((name, label, rate, pct(lat, .5), pct(lat, .99), rate / mrate, host))
        rows.append((name, "torch.multiprocessing.Queue", mrate, pct(mlat, .5), pct(mlat, .99), 1.0, host))

    cpu = len(os.sched_getaffinity(0))
    dev = (f"{torch.cuda.get_device_name(torch.device(device))}, {cpu} CPU cores" if device.startswith("cuda")
           else f"{cpu} CPU cores")
    print(f"\nipcsync bench: device={device} ({dev}), slots={args.slots}, torch {torch.__version__}, "
          f"python {sys.version.split()[0]}, {time.strftime('%Y-%m-%d')}")
    head = ("size", "method", "handoffs/s", "p50 ms", "p99 ms", "x mp.Queue", "host copy/s")
    widths = (5, 32, 12, 9, 9, 10, 12)
    print("  ".join(h.ljust(w) if i < 2 else h.rjust(w) for i, (h, w) in enumerate(zip(head, widths))))
    for name, label, rate, p50, p99, ratio, host in rows:
        cells = (name, label, fmt_rate(rate), fmt_ms(p50), fmt_ms(p99), f"{ratio:.1f}x", fmt_rate(host))
        print("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
