#!/usr/bin/env python3
"""GPU-pipeline encoder stage: makes each step's input on its device, runs the encoder and
hands the activations to the decoder replicas (``policy="shard"``: each step to one).

    python3 examples/gpu_pipeline/encoder.py --endpoint gpipe --replicas 2 --steps 500

``send()`` copies the activations into a slot on the current stream and returns without
a host sync; the decoder's stream waits on the slot's ready event. ``--single`` runs both
stages in this one process instead (the reference: the same steps, the same checksum).
"""

from __future__ import annotations

import time

import torch

import ipcsync
from stages import build, checksum, device_of, dtype_for, make_input, parser


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--replicas", type=int, default=1, help="decoder replicas to wait for")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--single", action="store_true", help="both stages here, no handoff")
    args = ap.parse_args()
    device = device_of(args)
    enc = build("encoder", args.dim, args.layers, args.vocab, device)
    t0 = time.monotonic()
    if args.single:
        dec = build("decoder", args.dim, args.layers, args.vocab, device)
        total = 0
        with torch.no_grad():
            for step in range(args.steps):
                total += int(checksum(dec(enc(make_input(step, args.batch, args.dim, device)))))
        rate = args.steps / (time.monotonic() - t0)
        print(f"single: done, {args.steps} steps, checksum {total}, {rate:.0f} steps/s", flush=True)
        return
    nbytes = args.batch * args.dim * torch.empty(0, dtype=dtype_for(device)).element_size() + (64 << 10)
    with ipcsync.Producer(args.endpoint, slots=args.slots, slot_bytes=nbytes, device=device, policy="shard",
                          timeout=args.timeout) as out:
        out.wait_for_consumers(args.replicas)
        print(f"encoder: {args.replicas} decoder replica(s) on {device}, {args.steps} steps of "
              f"{args.batch} x {args.dim}", flush=True)
        with torch.no_grad():
            for step in range(args.steps):
                made = time.monotonic()
                h = enc(make_input(step, args.batch, args.dim, device))
                out.send({"h": h}, meta={"step": step, "made": made})
        out.close(timeout=args.timeout)  # every step taken and released
    print(f"encoder: done, {args.steps} steps, {args.steps / (time.monotonic() - t0):.0f} steps/s", flush=True)


if __name__ == "__main__":
    main()
