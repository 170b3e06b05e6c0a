#!/usr/bin/env python3
"""Weight-sync worker: holds its own copy of the model (an inference engine would generate
with it) and loads every sync from the trainer into it in place.

    python3 examples/weight_sync/worker.py --endpoint wsync --rank 0

A sync is one message holding every tensor, so the worker applies a sync only once all
of it arrived: ``param.copy_(received)`` for each parameter under ``torch.no_grad()``,
then ``release()`` gives the trainer's slot back. The received tensors are views of the
trainer's slot, read only (never written). After loading, the worker checks its weights
against the sync's fingerprint (a checksum of every tensor's bits; ``--exact`` also
redraws the seeded weights of that version and compares bit for bit).

When the trainer dies, the worker keeps the last sync it applied, whole: a sync the
trainer did not finish was never published. ``--die-at-sync K`` copies half of sync K and
kills the worker (the fault test); a worker started again gets the next full sync.
"""

from __future__ import annotations

import os
import signal
import time

import torch

import ipcsync
from weights import fingerprint, load_, matches, parser, setup


def main() -> None:
    ap = parser(__doc__, "loading")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--exact", action="store_true", help="also compare with the seeded weights bit for bit")
    args = ap.parse_args()
    device, model, params = setup(args)
    name = f"worker {args.rank}"
    version, applied, last_fp = 0, 0, fingerprint(params)
    try:
        with ipcsync.Consumer(args.endpoint, device=device, timeout=args.timeout) as inp:
            print(f"{name}: connected on {device}", flush=True)
            for item in inp:
                v, want = item.meta["version"], item.meta["fingerprint"]
                received = item.tensors
                t0 = time.perf_counter()
                if v == args.die_at_sync:
                    with torch.no_grad():
                        for p, r in zip(params[: len(params) // 2], received):
                            p.copy_(r)
                    print(f"{name}: dying halfway through loading sync {v}", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
                load_(model, received)
                del received
                item.release()  # after the copies queued on the current stream
                if device.type == "cuda":
                    torch.cuda.current_stream().synchronize()  # for the printed time only
                ms = (time.perf_counter() - t0) * 1e3
                version, applied = v, applied + 1
                last_fp = fingerprint(params)
                ok = last_fp == want
                exact = "" if not args.exact else (", exact" if matches(model, v, args.seed) else ", NOT EXACT")
                if not ok or exact == ", NOT EXACT":
                    raise SystemExit(f"{name}: sync {v} loaded but its weights differ from the trainer's")
                print(f"{name}: sync {v} applied in {ms:.1f} ms, fingerprint ok{exact}", flush=True)
    except ipcsync.PeerLostError as exc:
        # The trainer is gone: what this worker holds is the last sync applied, whole.
        exact = not args.exact or version == 0 or matches(model, version, args.seed)
        whole = fingerprint(params) == last_fp and exact
        if not whole:
            raise SystemExit(f"{name}: trainer lost, and the weights of sync {version} are not whole")
        print(f"{name}: trainer lost ({type(exc).__name__}); keeping sync {version}, whole, "
              f"{applied} syncs applied", flush=True)
        return
    print(f"{name}: done, {applied} syncs applied, last {version}", flush=True)


if __name__ == "__main__":
    main()
