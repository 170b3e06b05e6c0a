#!/usr/bin/env python3
"""Loader stage of the demo pipeline (run it with ipcsync-run examples/pipeline.toml).

Makes synthetic image batches straight in ipcsync slots on the stage's device (no
intermediate tensor, no copy) and hands them to the downstream "train" stage. Each batch's
pixels encode (replica, step) so the trainer can check what it received.
"""

from __future__ import annotations

import argparse
import time

import torch

import ipcsync.stage as stage


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--size", type=int, default=64, help="image side in pixels")
    args = ap.parse_args()

    me = stage.info()
    shape = (args.batch_size, 3, args.size, args.size)
    g = torch.Generator(device=me.device).manual_seed(1000 + me.replica)
    with stage.output("train") as out:
        print(f"loader {me.replica}/{me.replicas} on {me.device}: serving {args.batches} batches "
              f"of {tuple(shape)} uint8", flush=True)
        t0 = time.monotonic()
        for step in range(args.batches):
            with out.slot(images=(shape, torch.uint8), labels=((args.batch_size,), torch.int64),
                          meta={"replica": me.replica, "step": step}) as s:
                # Stands for decoding and augmenting: a random image, then a marker the
                # trainer checks in the first pixel of every image.
                s["images"].random_(0, 256, generator=g)
                s["images"][:, 0, 0, 0] = (me.replica * 31 + step) % 256
                s["labels"].random_(0, 10, generator=g)
        rate = args.batches / (time.monotonic() - t0)
    print(f"loader {me.replica}: sent {args.batches} batches ({rate:.0f}/s)", flush=True)


if __name__ == "__main__":
    main()
