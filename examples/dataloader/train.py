#!/usr/bin/env python3
"""Train stage: trains a small conv net on ipcsync.data.batches(stage.input("loader")).

Batches arrive on the stage's device (merged from every loader replica). Each one is
checked once: its indices form one whole batch of the dataset, its labels match the
indices, and no batch comes twice; at the end every batch must have come. Exits 1 on a
mismatch.

The step keeps nothing of a batch (the net reads a float copy of the images, the labels
are used within the step), so it reads them zero-copy, ``batches(inp, copy=False)``:
views of the loader's slot, no clone per step (on CUDA a device-to-device copy saved).
A trainer that keeps batches, or tensors of them, past the next one uses the default,
``batches(inp)``, which yields tensors it owns.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch import nn

import ipcsync.stage as stage
from ipcsync.data import batches

CLASSES = 10


def model_for(device: str) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, CLASSES),
    ).to(device)


def check(batch: dict[str, torch.Tensor], args: argparse.Namespace) -> str | None:
    """None if ``batch`` is one whole batch of the dataset with the right labels."""
    images, labels, index = batch["image"], batch["label"], batch["index"]
    bs = args.batch_size
    if tuple(images.shape) != (bs, 3, args.size, args.size) or images.dtype != torch.uint8:
        return f"images of shape {tuple(images.shape)} {images.dtype}"
    idx = index.cpu()
    first = int(idx[0])
    if first % bs or not torch.equal(idx, torch.arange(first, first + bs)):
        return f"indices {idx.tolist()} are not one batch"
    if not torch.equal(labels.cpu(), (idx * 7 + 3) % CLASSES):
        return f"labels of batch {first // bs} do not match its indices"
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batches", type=int, default=64, help="batches in the dataset (all loaders)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--log-every", type=int, default=16)
    args = ap.parse_args()

    me = stage.info()
    torch.manual_seed(0)
    model = model_for(me.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    seen: dict[int, int] = {}  # batch number -> times received (one per epoch)
    steps, samples, loss = 0, 0, torch.zeros(())
    t0 = time.monotonic()
    with stage.input("loader") as inp:
        # Views of the loader's slot, valid until the next batch is asked for: the step
        # queues all its work on them before that, and keeps none of them.
        for batch in batches(inp, copy=False):
            problem = check(batch, args)
            if problem is None:
                b = int(batch["index"][0]) // args.batch_size
                seen[b] = seen.get(b, 0) + 1
                if seen[b] > args.epochs:
                    problem = f"batch {b} received {seen[b]} times in {args.epochs} epoch(s)"
            if problem is not None:
                print(f"train: bad batch after {steps} steps: {problem}", flush=True)
                return 1
            x = batch["image"].float().div_(255)
            loss = nn.functional.cross_entropy(model(x), batch["label"])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            del batch  # views of the slot: none is kept past the next iteration
            steps += 1
            samples += x.shape[0]
            if steps % args.log_every == 0:
                rate = samples / (time.monotonic() - t0)
                print(f"train: step {steps}, loss {loss.item():.3f}, {rate:.0f} samples/s", flush=True)
    elapsed = max(time.monotonic() - t0, 1e-9)
    missing = [b for b in range(args.batches) if seen.get(b, 0) != args.epochs]
    if missing or steps != args.batches * args.epochs:
        print(f"train: got {steps} batches, expected {args.batches * args.epochs}; "
              f"batches not received {args.epochs} time(s): {missing[:10]}", flush=True)
        return 1
    print(f"train: done, {steps} batches on {me.device}, {samples / elapsed:.0f} samples/s, "
          f"final loss {loss.item():.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
