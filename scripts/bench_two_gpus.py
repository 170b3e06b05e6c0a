#!/usr/bin/env python3
"""A 2-stage pipeline across two GPUs against each stage alone (needs two GPUs).

    python3 scripts/bench_two_gpus.py [--items 400] [--dim 4096] [--matmuls 4]

Stage A (cuda:0) makes each item: `--matmuls` chained fp16 matmuls of (dim x dim),
written straight into an ipcsync slot. Stage B (cuda:1) takes the item, copies it to its
GPU over peer access (one device-to-device copy), releases the slot, and runs the same
number of matmuls. "Alone" runs each stage's loop by itself in one process (B without the
copy and without ipcsync, so the comparison is strict). Target: the pipeline reaches at
least 90% of the slower stage alone.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ipcsync  # noqa: E402


def work(x: torch.Tensor, w: torch.Tensor, k: int, out: torch.Tensor | None = None) -> torch.Tensor:
    for j in range(k):
        x = torch.matmul(x, w, out=out if j == k - 1 else None)
    return x


def alone(device: str, items: int, dim: int, k: int) -> float:
    """Items/s of one stage's work by itself."""
    torch.manual_seed(0)
    x = torch.randn(dim, dim, device=device, dtype=torch.float16) / dim**0.5
    w = torch.randn(dim, dim, device=device, dtype=torch.float16) / dim**0.5
    out = torch.empty_like(x)
    for _ in range(10):
        work(x, w, k, out)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(items):
        work(x, w, k, out)
    torch.cuda.synchronize(device)
    return items / (time.perf_counter() - t0)


def stage_a(endpoint: str, items: int, dim: int, k: int, slots: int) -> None:
    torch.cuda.set_device(0)
    torch.manual_seed(0)
    x = torch.randn(dim, dim, device="cuda:0", dtype=torch.float16) / dim**0.5
    w = torch.randn(dim, dim, device="cuda:0", dtype=torch.float16) / dim**0.5
    with ipcsync.Producer(endpoint, slots=slots, slot_bytes=dim * dim * 2, device="cuda:0") as out:
        out.wait_for_consumers(1, timeout=60)
        for i in range(items + 10):
            with out.slot(x=((dim, dim), torch.float16), meta=i) as s:
                work(x, w, k, s["x"])  # computed straight into the slot
        out.flush(timeout=120)


def stage_b(endpoint: str, items: int, dim: int, k: int) -> float:
    torch.cuda.set_device(1)
    w = torch.randn(dim, dim, device="cuda:1", dtype=torch.float16) / dim**0.5
    out = torch.empty(dim, dim, device="cuda:1", dtype=torch.float16)
    with ipcsync.Consumer(endpoint, device="cuda:1", timeout=60) as inp:
        t0 = 0.0
        for item in inp:
            if item.meta == 10:  # warm-up done
                torch.cuda.synchronize(1)
                t0 = time.perf_counter()
            x = item["x"].to("cuda:1", non_blocking=True)
            item.release()
            work(x, w, k, out)
        torch.cuda.synchronize(1)
    return items / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--items", type=int, default=400)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--matmuls", type=int, default=4)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--role", choices=["main", "a"], default="main")
    ap.add_argument("--endpoint", default=f"bench2gpu-{os.getpid()}")
    args = ap.parse_args()
    if args.role == "a":
        stage_a(args.endpoint, args.items, args.dim, args.matmuls, args.slots)
        return 0
    if torch.cuda.device_count() < 2:
        print("bench_two_gpus: needs two CUDA GPUs", file=sys.stderr)
        return 2
    a_alone = alone("cuda:0", args.items, args.dim, args.matmuls)
    b_alone = alone("cuda:1", args.items, args.dim, args.matmuls)
    peer = torch.cuda.can_device_access_peer(1, 0)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    prod = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--role", "a", "--endpoint", args.endpoint,
                             "--items", str(args.items), "--dim", str(args.dim), "--matmuls", str(args.matmuls),
                             "--slots", str(args.slots)], env=env)
    try:
        piped = stage_b(args.endpoint, args.items, args.dim, args.matmuls)
        rc = prod.wait(timeout=300)
    finally:
        if prod.poll() is None:
            prod.kill()
            prod.wait()
    slower = min(a_alone, b_alone)
    ratio = piped / slower
    name = torch.cuda.get_device_name(0)
    print(f"two-GPU pipeline: {name} x2, peer access {peer}, item {args.dim}x{args.dim} fp16 "
          f"({args.dim * args.dim * 2 >> 20} MiB), {args.matmuls} matmuls per stage, {args.items} items, "
          f"slots {args.slots}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    print(f"{'what':<44}{'items/s':>10}")
    print(f"{'stage A alone (cuda:0, matmuls)':<44}{a_alone:>10.1f}")
    print(f"{'stage B alone (cuda:1, matmuls, no copy)':<44}{b_alone:>10.1f}")
    print(f"{'pipeline A -> ipcsync -> B (peer copy)':<44}{piped:>10.1f}")
    print(f"{'pipeline / slower stage alone':<44}{ratio:>9.1%}")
    print(json.dumps({"a_alone": a_alone, "b_alone": b_alone, "pipeline": piped, "ratio": ratio,
                      "producer_rc": rc}))
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
