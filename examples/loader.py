#!/usr/bin/env python3
"""Loader stage of the demo pipeline (run it with ipcsync-run examples/pipeline.toml).

Makes synthetic image batches straight in ipcsync slots on the stage's device (no
intermediate tensor, no copy) and hands them to the downstream "train" stage. Each image
is noise with one bright square; its label is the cell of a GRID x GRID grid that holds
the square, so a conv net can learn it. A batch is a pure function of its seed
(``make_batch``), and the seed travels in the batch's meta, so the trainer can rebuild and
check every batch exactly.
"""

from __future__ import annotations

import argparse
import time

import torch

import ipcsync.stage as stage

GRID = 3  # classes: GRID * GRID cells
CELL = 8  # pixels per cell side; images are (GRID * CELL) pixels square
SQUARE = 4  # side of the bright square, placed anywhere inside its cell
NUM_CLASSES = GRID * GRID
SIZE = GRID * CELL


def batch_seed(replica: int, step: int) -> int:
    """The seed of batch ``step`` of loader ``replica``: distinct for every batch."""
    return 1_000_003 * (replica + 1) + step


def make_batch(seed: int, images: torch.Tensor, labels: torch.Tensor) -> None:
    """Fill ``images`` (uint8, (B, 3, SIZE, SIZE)) and ``labels`` (int64, (B,)) in place.

    Deterministic for a seed and a device type: the same seed on the same kind of device
    writes the same bytes. All work stays on the tensors' device (no host sync).
    """
    n, device = labels.shape[0], labels.device
    g = torch.Generator(device=device).manual_seed(seed)
    images.random_(0, 256, generator=g)  # noise
    labels.random_(0, NUM_CLASSES, generator=g)
    offset = torch.randint(0, CELL - SQUARE + 1, (2, n), generator=g, device=device)
    top = (labels // GRID) * CELL + offset[0]
    left = (labels % GRID) * CELL + offset[1]
    pixels = torch.arange(SIZE, device=device)
    rows = (pixels >= top[:, None]) & (pixels < top[:, None] + SQUARE)  # (B, SIZE)
    cols = (pixels >= left[:, None]) & (pixels < left[:, None] + SQUARE)
    images.masked_fill_((rows[:, :, None] & cols[:, None, :])[:, None], 255)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=32)
    args = ap.parse_args()

    me = stage.info()
    shape = (args.batch_size, 3, SIZE, SIZE)
    with stage.output("train") as out:
        print(f"loader {me.replica}/{me.replicas} on {me.device}: serving {args.batches} batches "
              f"of {tuple(shape)} uint8, {NUM_CLASSES} classes", flush=True)
        t0 = time.monotonic()
        for step in range(args.batches):
            seed = batch_seed(me.replica, step)
            with out.slot(images=(shape, torch.uint8), labels=((args.batch_size,), torch.int64),
                          meta={"replica": me.replica, "step": step, "seed": seed}) as s:
                make_batch(seed, s["images"], s["labels"])  # stands for decoding and augmenting
        rate = args.batches / (time.monotonic() - t0)
    print(f"loader {me.replica}: sent {args.batches} batches ({rate:.0f}/s)", flush=True)


if __name__ == "__main__":
    main()
