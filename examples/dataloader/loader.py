#!/usr/bin/env python3
"""Loader stage: an ordinary torch Dataset + DataLoader, served with ipcsync.data.serve.

The dataset makes synthetic images from the sample index with a seeded generator (nothing
is downloaded) and augments them on the CPU (random crop, horizontal flip). Each sample
carries its index and a label derived from it, so the trainer can check every batch.
Every replica serves its shard of the batches: together they serve each batch once.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.utils.data import Dataset

import ipcsync.stage as stage
from ipcsync.data import serve

CLASSES = 10
PAD = 4  # the crop's margin


def label_of(index: int) -> int:
    """The label of sample ``index`` (the trainer checks it)."""
    return (index * 7 + 3) % CLASSES


class SyntheticImages(Dataset):
    """``n`` images of 3 x size x size uint8, generated from the index, then augmented.
    With ``augment=False``: the images as generated, 3 x (size + 2 PAD) squared, for an
    augmentation on the GPU (``gpu_augment``)."""

    def __init__(self, n: int, size: int, seed: int = 0, augment: bool = True) -> None:
        self.n, self.size, self.seed, self.augment = n, size, seed, augment
        self.aug = torch.Generator().manual_seed(seed + 1)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        label = label_of(index)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        full = self.size + 2 * PAD
        img = torch.randint(0, 96, (3, full, full), generator=g, dtype=torch.uint8)
        img[label % 3] += 16 * (label + 1) // 2  # a class signal the net can learn
        if not self.augment:
            return {"image": img, "label": torch.tensor(label), "index": torch.tensor(index)}
        # Augmentation on the CPU: random crop, random horizontal flip.
        top, left = torch.randint(0, 2 * PAD + 1, (2,), generator=self.aug).tolist()
        img = img[:, top:top + self.size, left:left + self.size]
        if torch.rand((), generator=self.aug) < 0.5:
            img = img.flip(-1)
        return {"image": img.contiguous(), "label": torch.tensor(label), "index": torch.tensor(index)}


MEAN, STD = 0.25, 0.2  # of the synthetic images' pixels / 255, roughly


def gpu_augment(images: torch.Tensor, seed: int, size: int) -> torch.Tensor:
    """The same augmentation as ``SyntheticImages`` makes on the CPU, for a whole batch on
    its device (the GPU, in the loader process or the trainer): a random crop of
    ``size`` x ``size`` out of each (size + 2 PAD)-pixel image, a random horizontal flip,
    then normalized to float32. ``seed`` seeds the batch's crops and flips."""
    b, _, full, _ = images.shape
    dev = images.device
    g = torch.Generator(device=dev)
    g.manual_seed(seed)
    top = torch.randint(0, full - size + 1, (b,), generator=g, device=dev)
    left = torch.randint(0, full - size + 1, (b,), generator=g, device=dev)
    flip = torch.rand(b, generator=g, device=dev) < 0.5
    ar = torch.arange(size, device=dev)
    rows = top[:, None] + ar  # (b, size)
    cols = left[:, None] + torch.where(flip[:, None], size - 1 - ar, ar)
    crop = images[torch.arange(b, device=dev)[:, None, None], :, rows[:, :, None], cols[:, None, :]]
    return crop.permute(0, 3, 1, 2).float().div_(255).sub_(MEAN).div_(STD).contiguous()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batches", type=int, default=64, help="batches in the dataset (all replicas)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--size", type=int, default=64, help="image side in pixels")
    ap.add_argument("--epochs", type=int, default=1)
    args = ap.parse_args()

    me = stage.info()
    dataset = SyntheticImages(args.batches * args.batch_size, args.size)
    with stage.output("train") as out:
        print(f"loader {me.replica}/{me.replicas} on {me.device}: serving its shard of "
              f"{args.batches} batches x {args.epochs} epoch(s)", flush=True)
        t0 = time.monotonic()
        # The Dataset is wrapped in DataLoader(dataset, batch_size=..., num_workers=0);
        # with shard=, each replica loads only its own batches.
        n = serve(dataset, out, shard=(me.replica, me.replicas), epochs=args.epochs,
                  loader_kwargs={"batch_size": args.batch_size, "num_workers": 0})
        rate = n / max(time.monotonic() - t0, 1e-9)
    print(f"loader {me.replica}: sent {n} batches ({rate:.0f}/s)", flush=True)


if __name__ == "__main__":
    main()
