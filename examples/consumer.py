#!/usr/bin/env python3
"""Demo consumer: receives batches from examples/producer.py and uses them in place.

    python3 examples/consumer.py --endpoint demo
"""

from __future__ import annotations

import argparse

import ipcsync


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--endpoint", default="demo")
    ap.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if available)")
    ap.add_argument("--progress", type=int, default=100)
    args = ap.parse_args()

    total = 0.0  # keeps the work from being optimized away
    with ipcsync.Consumer(args.endpoint, device=args.device, timeout=60) as inp:
        print(f"consumer: connected to {args.endpoint!r} on {inp.device}", flush=True)
        for item in inp:  # on CUDA the stream waits on the producer's event, not the host
            images, labels = item["images"], item["labels"]
            step = item.meta["step"]
            pixel = float(images.float().mean())  # the "model": any work on the tensors
            if pixel != step % 256 or int(labels[0]) != step % 10:
                raise SystemExit(f"consumer: batch {step} has wrong contents")
            total += pixel
            if (step + 1) % args.progress == 0:
                print(f"consumer: step {step + 1}", flush=True)
            # item.release() is implicit at the next iteration
        stats = inp.stats()
    lat = stats.latency_s
    print(f"consumer: {stats.handoffs} batches, {stats.bytes / 2**20:.1f} MiB, "
          f"{stats.rate_per_s:.0f}/s, latency p50 {(lat.p50 or 0) * 1e3:.2f} ms p99 {(lat.p99 or 0) * 1e3:.2f} ms, "
          f"contents checked", flush=True)


if __name__ == "__main__":
    main()
