#!/usr/bin/env python3
"""GPU-pipeline decoder stage (one replica): takes the encoder's activations, runs the
decoder on them in place (views of the encoder's slot, only read), releases the slot.

    python3 examples/gpu_pipeline/decoder.py --endpoint gpipe --rank 0

Each step's argmax tokens are summed into a checksum (the int() is this stage's one host
sync per step, as a server returning tokens has); the replicas' checksums add up to the
single-process run's. Latency: from the encoder making a step's input to its tokens here.
"""

from __future__ import annotations

import time

import torch

import ipcsync
from stages import build, checksum, device_of, parser


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--rank", type=int, default=0)
    args = ap.parse_args()
    device = device_of(args)
    dec = build("decoder", args.dim, args.layers, args.vocab, device)
    total, lat = 0, []
    with ipcsync.Consumer(args.endpoint, device=device, timeout=args.timeout) as inp, torch.no_grad():
        for item in inp:
            logits = dec(item["h"])
            item.release()  # after the decoder's kernels queued on this stream
            total += int(checksum(logits))
            lat.append(time.monotonic() - item.meta["made"])
    lat.sort()
    p50, p99 = (lat[min(len(lat) - 1, int(q * len(lat)))] * 1e3 if lat else 0.0 for q in (0.5, 0.99))
    print(f"decoder {args.rank}: done, {len(lat)} steps, checksum {total}, p50 {p50:.2f} ms, p99 {p99:.2f} ms",
          flush=True)


if __name__ == "__main__":
    main()
