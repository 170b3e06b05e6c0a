#!/usr/bin/env python3
"""Train stage of the demo pipeline (run it with ipcsync-run examples/pipeline.toml).

Receives image batches from every loader replica (merged fairly, each replica's order
kept), checks each one, and takes a training step of a small convolutional net on it,
on the stage's device. Prints progress while it runs.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch import nn

import ipcsync.stage as stage


def model_for(device: str) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
    ).to(device)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--log-every", type=int, default=100)
    args = ap.parse_args()

    me = stage.info()
    torch.manual_seed(0)
    model = model_for(me.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    next_step: dict[str, int] = {}
    steps, samples, loss = 0, 0, torch.zeros(())
    t0 = time.monotonic()
    with stage.input("loader") as inp:
        print(f"train on {me.device}: receiving from {len(getattr(inp, 'sources', [1]))} loader(s)", flush=True)
        for item in inp:
            images, labels = item["images"], item["labels"]
            replica, step = item.meta["replica"], item.meta["step"]
            # Per-source order and content: the loader marked every image with (replica, step).
            expected = next_step.get(item.source, 0)
            if step != expected:
                print(f"train: {item.source} sent step {step}, expected {expected}", flush=True)
                return 1
            next_step[item.source] = step + 1
            marks = images[:, 0, 0, 0]
            if not bool((marks == (replica * 31 + step) % 256).all()):
                print(f"train: batch {item.source} step {step} has wrong contents", flush=True)
                return 1
            x = images.float().div_(255)
            loss = nn.functional.cross_entropy(model(x), labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            item.release()  # after the step's work is queued: the slot goes back at once
            steps += 1
            samples += images.shape[0]
            del images, labels, marks  # views of the slot: keep none past release (see README)
            if steps % args.log_every == 0:
                rate = samples / (time.monotonic() - t0)
                print(f"train: step {steps}, loss {loss.item():.3f}, {rate:.0f} samples/s", flush=True)
    elapsed = time.monotonic() - t0
    print(f"train: done, {steps} steps from {len(next_step)} loaders, {samples / elapsed:.0f} samples/s, "
          f"final loss {loss.item():.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
