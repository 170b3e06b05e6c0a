#!/usr/bin/env python3
"""Soak: a long stream of handoffs with random sizes and idle gaps; resources must stay flat.

    python3 scripts/soak.py [--device cuda] [--handoffs 1000000] [--min-seconds 600]

The producer runs here, consumers in child processes; every `--reconnect-every` handoffs
the consumer closes and a fresh one connects (a new connection exports and imports the
arena again: the path most likely to leak). Every message is checked by the consumer
(its seq is written at both ends of the tensor). At every `--report-every` seconds a line
gives handoffs, rate, RSS and open fds of the producer and of the current consumer,
ipcsync segments in /dev/shm and, on CUDA, the device memory in use (all processes, from
cudaMemGetInfo) and the producer's allocated/reserved memory.

Every `--pause-every` handoffs the current consumer is paused (SIGSTOP) for
`--pause-seconds`, far past its heartbeat, at a random point of its receive/check loop:
the producer must wait for it (stalled, never lost: its held item stays intact), so the
run fails if any consumer was declared lost or any item's contents were wrong.

At the end the samples after warm-up (the first `--warmup` fraction of the run) are
compared with the first sample after warm-up: the run fails (exit 1) if RSS grew by more
than 5% + 16 MiB, if fds or /dev/shm entries grew, or if device memory grew by more than
64 MiB. The final line is a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import ipcsync  # noqa: E402

SLOT_BYTES = 4 << 20


def rss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


def shm_entries() -> int:
    try:
        return sum(1 for n in os.listdir("/dev/shm") if n.startswith("ipcsync-"))
    except OSError:
        return -1


def consumer_main(endpoint: str, device: str) -> int:
    """Receive and check until the producer says goodbye; print a JSON result."""
    checked = 0
    bad = 0
    with ipcsync.Consumer(endpoint, device=device) as inp:
        print(json.dumps({"event": "consumer-ready", "pid": os.getpid()}), flush=True)
        for item in inp:
            x = item["x"]
            seq = item.meta["seq"]
            if x.numel():
                ends = torch.stack([x[0], x[-1]]).tolist()  # one small host read per item
                if ends != [float(seq % 1_000_000), float(seq % 1_000_000)]:
                    bad += 1
            checked += 1
            if item.meta.get("last_for_this_consumer"):
                break
    print(json.dumps({"event": "consumer-done", "checked": checked, "bad": bad}), flush=True)
    return 0 if bad == 0 else 1


def start_consumer(endpoint: str, device: str) -> tuple[subprocess.Popen[bytes], int]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--role", "consumer",
                          "--endpoint", endpoint, "--device", device],
                         stdout=subprocess.PIPE, stderr=None, env=env)
    assert p.stdout is not None
    line = p.stdout.readline()
    msg = json.loads(line) if line.startswith(b"{") else {}
    if msg.get("event") != "consumer-ready":
        p.kill()
        raise SystemExit(f"soak: consumer did not start: {line!r}")
    return p, int(msg["pid"])


def finish_consumer(p: subprocess.Popen[bytes]) -> dict[str, Any]:
    assert p.stdout is not None
    out = p.stdout.read()
    rc = p.wait(timeout=60)
    result: dict[str, Any] = {}
    for line in out.splitlines():
        if line.startswith(b"{"):
            result = json.loads(line)
    result["rc"] = rc
    return result


def producer_main(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    device = args.device
    endpoint = f"soak-{os.getpid()}"
    cuda = device.startswith("cuda")
    samples: list[dict[str, Any]] = []
    checked = bad = 0
    failures: list[str] = []
    t0 = time.monotonic()
    next_report = t0
    # Reusable sources of every size we send (the soak is about ipcsync, not the allocator).
    pool = torch.zeros(SLOT_BYTES // 4, dtype=torch.float32, device=device)
    with ipcsync.Producer(endpoint, slots=args.slots, slot_bytes=SLOT_BYTES, device=device) as out:
        cons, cons_pid = start_consumer(endpoint, device)
        out.wait_for_consumers(1, timeout=60)
        seq = 0
        since_reconnect = 0
        pauses = 0
        while True:
            elapsed = time.monotonic() - t0
            done = seq >= args.handoffs and elapsed >= args.min_seconds
            if time.monotonic() >= next_report or done:
                next_report += args.report_every
                s = {
                    "t": round(elapsed, 1), "handoffs": seq,
                    "rate": round(seq / max(elapsed, 1e-9)),
                    "rss_prod_mib": round(rss_kib(os.getpid()) / 1024, 1),
                    "rss_cons_mib": round(rss_kib(cons_pid) / 1024, 1),
                    "fds_prod": fds(os.getpid()), "fds_cons": fds(cons_pid),
                    "shm": shm_entries(),
                }
                if cuda:
                    free, total = torch.cuda.mem_get_info()
                    s["dev_used_mib"] = (total - free) >> 20
                    s["prod_alloc_mib"] = torch.cuda.memory_allocated() >> 20
                    s["prod_reserved_mib"] = torch.cuda.memory_reserved() >> 20
                samples.append(s)
                print("soak: " + json.dumps(s), flush=True)
            if done:
                break
            # Random size, log-uniform from 4 B to 4 MiB; about 1 in 2000 handoffs is
            # followed by an idle gap of up to 0.3 s (heartbeats flow, nothing else).
            n = max(1, int(math.exp(rng.uniform(0, math.log(SLOT_BYTES // 4)))))
            src = pool[:n]
            src[0] = src[n - 1] = seq % 1_000_000
            last = since_reconnect + 1 >= args.reconnect_every
            out.send({"x": src}, meta={"seq": seq, "last_for_this_consumer": last})
            seq += 1
            since_reconnect += 1
            if rng.random() < 1 / 2000:
                time.sleep(rng.uniform(0, 0.3))
            if args.pause_every and seq % args.pause_every == args.pause_every // 2:
                # The consumer stops wherever it is (often holding an item); the next
                # sends block on backpressure until the timer resumes it.
                os.kill(cons_pid, signal.SIGSTOP)
                threading.Timer(args.pause_seconds, os.kill, (cons_pid, signal.SIGCONT)).start()
                pauses += 1
            if last:  # this consumer stops after this item; a fresh one takes over
                out.flush(timeout=60)
                r = finish_consumer(cons)
                checked += r.get("checked", 0)
                bad += r.get("bad", 0)
                if r.get("rc") != 0:
                    failures.append(f"consumer exited {r.get('rc')}: {r}")
                    break
                cons, cons_pid = start_consumer(endpoint, device)
                out.wait_for_consumers(1, timeout=60)
                since_reconnect = 0
        pool[0] = seq % 1_000_000
        out.send({"x": pool[:1]}, meta={"seq": seq, "last_for_this_consumer": True})
        out.flush(timeout=60)
        r = finish_consumer(cons)
        checked += r.get("checked", 0)
        bad += r.get("bad", 0)
        stats = out.stats()
    failures += check_flat(samples, args.warmup)
    if stats["consumers_lost"]:
        failures.append(f"{stats['consumers_lost']} consumer(s) declared lost (paused ones must only stall)")
    if bad:
        failures.append(f"{bad} items had wrong contents")
    summary = {
        "event": "soak-done", "device": device, "handoffs": seq, "checked": checked, "bad": bad,
        "seconds": round(time.monotonic() - t0, 1), "consumers": seq // args.reconnect_every + 1,
        "pauses": pauses, "pause_s": args.pause_seconds, "stalls_seen": stats["consumers_stalled_total"],
        "consumers_lost": stats["consumers_lost"],
        "producer_latency_p50_ms": round((stats["latency_s"]["p50"] or 0) * 1e3, 3),
        "first_after_warmup": samples[max(1, int(len(samples) * args.warmup))] if len(samples) > 1 else None,
        "last": samples[-1], "flat": not failures, "failures": failures,
    }
    print(json.dumps(summary), flush=True)
    return 0 if not failures else 1


def check_flat(samples: list[dict[str, Any]], warmup: float) -> list[str]:
    if len(samples) < 3:
        return ["too few samples to judge (run longer or report more often)"]
    base = samples[max(1, int(len(samples) * warmup))]
    later = samples[samples.index(base):]
    problems = []
    for key in ("rss_prod_mib",):
        worst = max(s[key] for s in later)
        if worst > base[key] * 1.05 + 16:
            problems.append(f"{key} grew from {base[key]} to {worst}")
    for key in ("fds_prod", "shm"):
        worst = max(s[key] for s in later)
        if worst > base[key] + 2:  # a reconnect in progress may hold a couple
            problems.append(f"{key} grew from {base[key]} to {worst}")
    if "dev_used_mib" in base:
        for key in ("dev_used_mib", "prod_reserved_mib"):
            worst = max(s[key] for s in later)
            if worst > base[key] + 64:
                problems.append(f"{key} grew from {base[key]} to {worst}")
    return problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", choices=["producer", "consumer"], default="producer")
    ap.add_argument("--endpoint", default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--handoffs", type=int, default=1_000_000)
    ap.add_argument("--min-seconds", type=float, default=0.0)
    ap.add_argument("--report-every", type=float, default=30.0)
    ap.add_argument("--reconnect-every", type=int, default=100_000)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--warmup", type=float, default=0.1, help="fraction of samples ignored")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pause-every", type=int, default=50_000,
                    help="SIGSTOP the consumer once every N handoffs (0: never)")
    ap.add_argument("--pause-seconds", type=float, default=3.0, help="how long each pause lasts")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.role == "consumer":
        return consumer_main(args.endpoint, args.device)
    if args.device.startswith("cuda"):
        args.device = str(torch.device(args.device if ":" in args.device else "cuda:0"))
    return producer_main(args)


if __name__ == "__main__":
    sys.exit(main())
