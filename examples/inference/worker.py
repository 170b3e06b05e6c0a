#!/usr/bin/env python3
"""Worker stage of the inference example (run it with ipcsync-run
examples/inference/pipeline.toml).

Builds a small transformer encoder in code (random weights, seeded: nothing is
downloaded), then answers every batch of token ids the front end sends: for each row the
next-token logits at the last position, their argmax, and a checksum of the input ids (so
the front end can tell a mixed-up answer). Each answer carries the batch's meta back. Ends
when the front end closes its output.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch import nn

import ipcsync.stage as stage


class TinyLM(nn.Module):
    """Embedding + positional embedding, a TransformerEncoder, a linear head."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, max_seq: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_seq, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, dim_feedforward=4 * dim, dropout=0.0,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        return self.head(self.encoder(self.embed(ids) + self.pos(pos)))


def checksum(ids: torch.Tensor) -> torch.Tensor:
    """Per-row checksum of token ids, position-weighted (a permuted row changes it)."""
    weights = torch.arange(1, ids.shape[1] + 1, device=ids.device, dtype=torch.int64)
    return (ids.to(torch.int64) * weights).sum(dim=1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--vocab", type=int, default=1000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--max-seq", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                    help="model weights and activations (answers are returned as float32)")
    args = ap.parse_args()

    me = stage.info()
    torch.manual_seed(args.seed)  # every replica builds the same model
    model = TinyLM(args.vocab, args.dim, args.layers, args.heads, args.max_seq).to(me.device).eval()
    if args.dtype != "float32":
        model = model.to(getattr(torch, args.dtype))
    params = sum(p.numel() for p in model.parameters())
    batches = requests = 0
    busy = 0.0
    with stage.input("frontend") as inp, stage.output("frontend") as out:
        print(f"worker {me.replica}/{me.replicas} on {me.device}: model of {params} parameters "
              f"({args.layers} layers, dim {args.dim}, vocab {args.vocab}, {args.dtype})", flush=True)
        t0 = time.monotonic()
        with torch.inference_mode():
            for item in inp:
                t = time.monotonic()
                ids = item["ids"]
                if ids.dim() != 2 or ids.shape[1] > args.max_seq:
                    print(f"worker {me.replica}: bad batch of shape {tuple(ids.shape)}", flush=True)
                    return 1
                logits = model(ids)[:, -1, :].float().contiguous()  # a gapped view would ship its gaps
                reply = {"logits": logits, "pred": logits.argmax(dim=1), "checksum": checksum(ids)}
                meta = dict(item.meta, worker=me.replica)
                item.release()  # the request slot goes back once the work is queued
                out.send(reply, meta=meta)
                busy += time.monotonic() - t
                batches += 1
                requests += ids.shape[0]
        elapsed = max(time.monotonic() - t0, 1e-9)
    print(f"worker {me.replica}: done, {batches} batches, {requests} requests, "
          f"{requests / elapsed:.0f} req/s, busy {100 * busy / elapsed:.0f}%", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
