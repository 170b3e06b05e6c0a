#!/usr/bin/env python3
"""Weight-sync trainer: after each (stand-in) optimizer step, hands the whole model's bf16
weights to every inference worker in one ipcsync message (policy="broadcast").

    python3 examples/weight_sync/trainer.py --endpoint wsync --workers 2 --syncs 5

One message per sync: ``send()`` copies every parameter into one slot (one device copy on
CUDA, on the current stream, no host sync) and publishes it to every attached worker at
once. With ``--slots 1`` (the default) the slot is the trainer's only extra memory (one
copy of the model) and the next sync waits until every worker released the last one.
Before each sync the trainer waits for ``--workers`` workers: a worker that restarts gets
the next full sync. ``--die-at-sync K`` writes half of sync K's tensors straight into a
slot and kills the trainer (the fault test): nothing of sync K is ever published.
"""

from __future__ import annotations

import os
import signal
import time

import ipcsync
from weights import fingerprint, model_bytes, parser, setup, slot_bytes, update


def main() -> None:
    ap = parser(__doc__, "writing")
    ap.add_argument("--syncs", type=int, default=5)
    ap.add_argument("--workers", type=int, default=1, help="workers to wait for before each sync")
    ap.add_argument("--slots", type=int, default=1)
    args = ap.parse_args()
    device, model, params = setup(args)
    nbytes = slot_bytes(params)
    with ipcsync.Producer(args.endpoint, slots=args.slots, slot_bytes=nbytes, device=device,
                          policy="broadcast", timeout=args.timeout) as out:
        print(f"trainer: {len(params)} tensors, {model_bytes(model) / 2**20:.1f} MiB of bf16 on {device}, "
              f"{args.workers} worker(s), {args.syncs} syncs", flush=True)
        for version in range(1, args.syncs + 1):
            update(model, version, args.seed)  # stands for an optimizer step
            out.wait_for_consumers(args.workers)
            fp = fingerprint(params)
            if version == args.die_at_sync:
                with out.slot({str(i): (tuple(p.shape), p.dtype) for i, p in enumerate(params)},
                              meta={"version": version, "fingerprint": fp}) as s:
                    for i in range(len(params) // 2):
                        s[str(i)].copy_(params[i])
                    print(f"trainer: dying halfway through sync {version}", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
            t0 = time.perf_counter()
            out.send(params, meta={"version": version, "fingerprint": fp})
            print(f"trainer: sync {version} sent ({(time.perf_counter() - t0) * 1e3:.1f} ms to hand over)",
                  flush=True)
        # The last sync goes to the workers attached by now: a worker restarting after it
        # was sent gets it on attaching (it waits queued), so wait for them before closing.
        out.wait_for_consumers(args.workers)
        out.close(timeout=args.timeout)  # waits until every worker released the last sync
    print(f"trainer: done, {args.syncs} syncs", flush=True)


if __name__ == "__main__":
    main()
