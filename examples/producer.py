#!/usr/bin/env python3
"""Demo producer: makes synthetic image batches and hands them to consumers via ipcsync.

    python3 examples/producer.py --endpoint demo --batches 300
"""

from __future__ import annotations

import argparse
import time

import torch

import ipcsync


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--endpoint", default="demo")
    ap.add_argument("--batches", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if available)")
    ap.add_argument("--slots", type=int, default=4)
    args = ap.parse_args()

    shape = (args.batch_size, 3, 64, 64)
    nbytes = args.batch_size * 3 * 64 * 64 + 4096
    with ipcsync.Producer(args.endpoint, slots=args.slots, slot_bytes=nbytes, device=args.device) as out:
        print(f"producer: serving {args.endpoint!r} on {out.device} ({args.slots} slots)", flush=True)
        out.wait_for_consumers(1, timeout=60)
        t0 = time.monotonic()
        for step in range(args.batches):
            # Write the batch straight into a slot: no intermediate tensor, no copy.
            with out.slot(images=(shape, torch.uint8), labels=((args.batch_size,), torch.int64),
                          meta={"step": step}) as s:
                s["images"].fill_(step % 256)  # stands for decoding/augmenting a real batch
                s["labels"].fill_(step % 10)
        stats = out.stats()
        print(f"producer: sent {stats.handoffs} batches in {time.monotonic() - t0:.2f} s "
              f"({stats.rate_per_s:.0f}/s), waited {dict(stats.waiting_s)}", flush=True)


if __name__ == "__main__":
    main()
