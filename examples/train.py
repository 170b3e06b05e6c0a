#!/usr/bin/env python3
"""Train stage of the demo pipeline (run it with ipcsync-run examples/pipeline.toml).

Receives image batches from every loader replica (merged fairly, each replica's order
kept), checks each one against what its loader must have sent (rebuilt from the seed in
its meta), and trains a small conv net to tell which grid cell holds the bright square,
on the stage's device. At the end it prints the loss against chance (ln of the number of
classes) and exits 1 if a batch did not match or the loss did not fall below half of
chance.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch
from torch import nn

import ipcsync.stage as stage
from loader import NUM_CLASSES, batch_seed, make_batch  # examples/loader.py, beside this file

LAST = 50  # the final loss and accuracy are taken over this many last batches


def model_for(device: str) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 4, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU(),
        nn.AdaptiveMaxPool2d(3), nn.Flatten(), nn.Linear(16 * 9, NUM_CLASSES),
    ).to(device)


def first_mismatch(pending: list[tuple[str, int, torch.Tensor]]) -> str | None:
    """The first batch whose contents differed, from flags computed on the device (one
    host sync for all of them)."""
    if not pending:
        return None
    flags = torch.stack([bad for _, _, bad in pending]).cpu()
    for (source, step, _), bad in zip(pending, flags.tolist()):
        if bad:
            return f"{source} step {step}"
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--log-every", type=int, default=100)
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args()

    me = stage.info()
    torch.manual_seed(0)
    model = model_for(me.device)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    chance = math.log(NUM_CLASSES)
    next_step: dict[str, int] = {}
    pending: list[tuple[str, int, torch.Tensor]] = []  # (source, step, mismatch flag)
    losses: list[torch.Tensor] = []
    correct: list[torch.Tensor] = []
    sizes: list[int] = []
    steps, samples = 0, 0
    t0 = time.monotonic()
    with stage.input("loader") as inp:
        print(f"train on {me.device}: receiving from {len(getattr(inp, 'sources', [1]))} loader(s)", flush=True)
        for item in inp:
            images, labels = item["images"], item["labels"]
            replica, step, seed = item.meta["replica"], item.meta["step"], item.meta["seed"]
            # Per-source order, then the exact contents the loader must have written.
            expected = next_step.get(item.source, 0)
            if step != expected or seed != batch_seed(replica, step):
                print(f"train: {item.source} sent step {step} (seed {seed}), expected step {expected} "
                      f"(seed {batch_seed(replica, expected)})", flush=True)
                return 1
            next_step[item.source] = step + 1
            want_images, want_labels = torch.empty_like(images), torch.empty_like(labels)
            make_batch(seed, want_images, want_labels)
            pending.append((item.source, step, torch.logical_or(
                (images != want_images).any(), (labels != want_labels).any())))

            logits = model(images.float().div_(255))
            loss = nn.functional.cross_entropy(logits, labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
            correct.append((logits.detach().argmax(1) == labels).sum())
            sizes.append(labels.shape[0])
            item.release()  # after the step's work is queued: the slot goes back at once
            steps += 1
            samples += images.shape[0]
            del images, labels, want_images, want_labels  # views of the slot: keep none past release
            if steps % args.log_every == 0:
                bad = first_mismatch(pending)
                if bad is not None:
                    print(f"train: batch {bad} does not hold what its loader sent", flush=True)
                    return 1
                pending.clear()
                rate = samples / (time.monotonic() - t0)
                print(f"train: step {steps}, loss {loss.item():.3f}, {rate:.0f} samples/s", flush=True)
    elapsed = time.monotonic() - t0
    bad = first_mismatch(pending)
    if bad is not None:
        print(f"train: batch {bad} does not hold what its loader sent", flush=True)
        return 1
    if not losses:
        print("train: no batches received", flush=True)
        return 1
    last = min(LAST, steps)
    first_loss = losses[0].item()
    final_loss = torch.stack(losses[-last:]).mean().item()
    accuracy = torch.stack(correct[-last:]).sum().item() / sum(sizes[-last:])
    print(f"train: done, {steps} steps from {len(next_step)} loaders, loss {first_loss:.3f} -> "
          f"{final_loss:.3f} (chance {chance:.3f}), accuracy {accuracy:.0%} on the last {last} "
          f"batches, every batch checked, {samples / elapsed:.0f} samples/s", flush=True)
    if final_loss >= chance / 2:
        print(f"train: did not learn: loss {final_loss:.2f} is not below half of chance "
              f"({chance / 2:.2f})", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
