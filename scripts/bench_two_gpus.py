#!/usr/bin/env python3
"""A 2-stage pipeline across two GPUs against each stage alone (needs two GPUs).

    python3 scripts/bench_two_gpus.py [--items 1000] [--dim 4096] [--matmuls 8] [--slots 8]

Stage A (cuda:0) makes each item: `--matmuls` chained fp16 matmuls of (dim x dim),
written straight into an ipcsync slot. Stage B (cuda:1) takes the item, copies it to its
GPU over peer access (one device-to-device copy), releases the slot, and runs the same
number of matmuls; measured twice: copy and compute on one stream, and the copy of the
next item on a copy stream overlapping the compute of this one (what a pipeline stage
should do). "Alone" runs each stage's loop by itself in one process (B without the
copy and without ipcsync, so the comparison is strict). Target: the pipeline reaches at
least 90% of the slower stage alone.

Two more rows say where a shortfall comes from: B alone with its input copy from cuda:0
(the cost of moving the item between GPUs, with no ipcsync involved), and both stages'
loops at once in two processes with no handoff (what two busy GPUs deliver). On two
H200s (NV18) moving a 32 MiB item costs about 0.13 ms: 13% of a 4-matmul stage, 6% of
the default 8-matmul one.
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


def alone(device: str, items: int, dim: int, k: int, copy_from: str | None = None) -> float:
    """Items/s of one stage's work by itself; with ``copy_from``, each item is first copied
    from that GPU (the stage's input move, without ipcsync), on the same stream."""
    torch.manual_seed(0)
    x = torch.randn(dim, dim, device=device, dtype=torch.float16) / dim**0.5
    w = torch.randn(dim, dim, device=device, dtype=torch.float16) / dim**0.5
    src = None if copy_from is None else torch.randn(dim, dim, device=copy_from, dtype=torch.float16)
    out = torch.empty_like(x)
    with torch.cuda.device(device):
        for it in range(items + 10):
            if it == 10:
                torch.cuda.synchronize(device)
                t0 = time.perf_counter()
            if src is not None:
                x.copy_(src, non_blocking=True)
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


def stage_b(endpoint: str, items: int, dim: int, k: int, overlap: bool) -> float:
    """Items/s of B fed by A through ipcsync. ``overlap``: the peer copy of item i+1 runs
    on a copy stream while the compute stream works on item i (two local buffers);
    otherwise copy and compute share one stream."""
    torch.cuda.set_device(1)
    w = torch.randn(dim, dim, device="cuda:1", dtype=torch.float16) / dim**0.5
    out = torch.empty(dim, dim, device="cuda:1", dtype=torch.float16)
    compute = torch.cuda.current_stream(1)
    copier = torch.cuda.Stream(1) if overlap else compute
    bufs = [torch.empty(dim, dim, device="cuda:1", dtype=torch.float16) for _ in range(2)]
    copied = [torch.cuda.Event() for _ in range(2)]
    used = [torch.cuda.Event() for _ in range(2)]
    with ipcsync.Consumer(endpoint, device="cuda:1", timeout=60) as inp:
        t0 = 0.0
        i = 0
        with torch.cuda.stream(copier):  # the consumer's wait goes on the copy stream
            for item in inp:
                if item.meta == 10:  # warm-up done
                    torch.cuda.synchronize(1)
                    t0 = time.perf_counter()
                b = i % 2
                copier.wait_event(used[b])  # buffer b's previous compute is done with it
                bufs[b].copy_(item["x"], non_blocking=True)  # one peer copy, cuda:0 -> cuda:1
                item.release(copier)  # A may overwrite its slot once the copy ran
                copied[b].record(copier)
                compute.wait_event(copied[b])
                with torch.cuda.stream(compute):
                    work(bufs[b], w, k, out)
                used[b].record(compute)
                i += 1
        torch.cuda.synchronize(1)
    return items / (time.perf_counter() - t0)


def run_pipeline(args: argparse.Namespace, overlap: bool) -> tuple[float, int]:
    endpoint = f"{args.endpoint}-{int(overlap)}"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    prod = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--role", "a", "--endpoint", endpoint,
                             "--items", str(args.items), "--dim", str(args.dim), "--matmuls", str(args.matmuls),
                             "--slots", str(args.slots)], env=env)
    try:
        piped = stage_b(endpoint, args.items, args.dim, args.matmuls, overlap)
        rc = prod.wait(timeout=300)
    finally:
        if prod.poll() is None:
            prod.kill()
            prod.wait()
    return piped, rc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--items", type=int, default=1000)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--matmuls", type=int, default=8)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--role", choices=["main", "a", "alone"], default="main")
    ap.add_argument("--device", default="cuda:0", help="--role alone: the GPU")
    ap.add_argument("--endpoint", default=f"bench2gpu-{os.getpid()}")
    args = ap.parse_args()
    if args.role == "a":
        stage_a(args.endpoint, args.items, args.dim, args.matmuls, args.slots)
        return 0
    if args.role == "alone":
        print(alone(args.device, args.items, args.dim, args.matmuls), flush=True)
        return 0
    if torch.cuda.device_count() < 2:
        print("bench_two_gpus: needs two CUDA GPUs", file=sys.stderr)
        return 2
    a_alone = alone("cuda:0", args.items, args.dim, args.matmuls)
    b_alone = alone("cuda:1", args.items, args.dim, args.matmuls)
    peer = torch.cuda.can_device_access_peer(1, 0)
    b_copy = alone("cuda:1", args.items, args.dim, args.matmuls, copy_from="cuda:0")
    # Both stages' loops at once, in two processes, with no handoff: what the two GPUs
    # deliver when both are busy (a bound for any pipeline of the two).
    both = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--role", "alone", "--device", d,
                              "--items", str(args.items * 3), "--dim", str(args.dim),
                              "--matmuls", str(args.matmuls)], stdout=subprocess.PIPE, text=True)
            for d in ("cuda:0", "cuda:1")]
    concurrent = [float(p.communicate(timeout=300)[0].split()[-1]) for p in both]
    serial, rc1 = run_pipeline(args, overlap=False)
    piped, rc2 = run_pipeline(args, overlap=True)
    rc = rc1 or rc2
    slower = min(a_alone, b_alone)
    ratio = piped / slower
    name = torch.cuda.get_device_name(0)
    print(f"two-GPU pipeline: {name} x2, peer access {peer}, item {args.dim}x{args.dim} fp16 "
          f"({args.dim * args.dim * 2 >> 20} MiB), {args.matmuls} matmuls per stage, {args.items} items, "
          f"slots {args.slots}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    print(f"{'what':<44}{'items/s':>10}")
    print(f"{'stage A alone (cuda:0, matmuls)':<44}{a_alone:>10.1f}")
    print(f"{'stage B alone (cuda:1, matmuls, no copy)':<44}{b_alone:>10.1f}")
    print(f"{'stage B alone + its input copy from cuda:0':<44}{b_copy:>10.1f}")
    print(f"{'A and B alone at once, no handoff (slower)':<44}{min(concurrent):>10.1f}")
    print(f"{'pipeline, copy then compute on one stream':<44}{serial:>10.1f}  ({serial / slower:.1%})")
    print(f"{'pipeline, copy overlapped on a copy stream':<44}{piped:>10.1f}")
    print(f"{'pipeline (overlapped) / slower stage alone':<44}{ratio:>9.1%}")
    print(json.dumps({"a_alone": a_alone, "b_alone": b_alone, "b_alone_with_copy": b_copy, "concurrent_alone": concurrent, "pipeline_serial": serial, "pipeline": piped,
                      "ratio": ratio, "producer_rc": rc}))
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
