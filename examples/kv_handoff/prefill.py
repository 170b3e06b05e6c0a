#!/usr/bin/env python3
"""KV-handoff prefill worker: for each request, writes its KV cache (every layer's K and V,
the prompt's length varying per request) straight into an ipcsync slot and hands it to
the decode worker, which answers with the request's first token.

    python3 examples/kv_handoff/prefill.py --endpoint kvh --requests 64

The prefill never waits on a dead decode worker: when the decode worker's process is
gone, its held slots come back, the first-token edge reports the loss, and every request
not answered is reported as lost (``request 12: lost, its decode worker died``); the
prefill then stops and exits 0 with its summary.
"""

from __future__ import annotations

import time

import ipcsync
from kv import device_of, dtype_for, fill_kv, kv_bytes, parser, shapes


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--slots", type=int, default=4)
    args = ap.parse_args()
    device = device_of(args)
    dtype = dtype_for(device)
    slot_bytes = kv_bytes(args, device) + 2 * args.layers * 256 + (64 << 10)
    answered: dict[int, int] = {}
    outstanding: dict[int, float] = {}
    lost = False
    t0 = time.monotonic()
    with ipcsync.Producer(args.endpoint, slots=args.slots, slot_bytes=slot_bytes, device=device,
                          timeout=args.timeout) as out, \
            ipcsync.Consumer(f"{args.endpoint}-tok", device=device, timeout=args.timeout) as tokens:
        out.wait_for_consumers(1)
        print(f"prefill: {args.requests} requests of {2 * args.layers} KV tensors on {device}", flush=True)

        def collect(timeout: float) -> bool:
            """Take the first tokens that arrived, waiting up to ``timeout`` for the first
            of them; False once the decode worker is gone (or ended its stream)."""
            wait = timeout
            while True:
                try:
                    item = tokens.get(timeout=wait)
                except ipcsync.IpcTimeoutError:
                    return True
                except ipcsync.PeerLostError:
                    return False
                if item is None:
                    return False
                answered[item.meta["req"]] = item.meta["token"]
                outstanding.pop(item.meta["req"], None)
                item.release()
                wait = 0.0

        def send(req: int) -> bool:
            """Hand request ``req``'s KV over; False (not sent) once the decode worker is
            gone. A free slot is waited for a second at a time, between looks at the
            first-token edge: the slots of a dead decode worker may be full of queued
            requests that nobody will take."""
            fields = {str(i): (s, dtype) for i, s in enumerate(shapes(req, args))}
            while True:
                try:
                    with out.slot(fields, meta={"req": req, "made": time.monotonic()}, timeout=1.0) as s:
                        fill_kv(req, [s[str(i)] for i in range(len(fields))])
                    outstanding[req] = time.monotonic()
                    return True
                except ipcsync.IpcTimeoutError:
                    if not collect(0):
                        return False

        for req in range(args.requests):
            if not send(req) or not collect(0):
                lost = True
                break
        deadline = time.monotonic() + args.timeout
        while outstanding and not lost and time.monotonic() < deadline:
            lost = not collect(min(1.0, args.timeout))
        why = "its decode worker died" if lost else f"no answer within {args.timeout:g} s"
        for req in sorted(outstanding):
            print(f"request {req}: lost, {why}", flush=True)
        lost = lost or bool(outstanding)
        if lost:
            out.abort("the decode worker is gone")
    done = len(answered)
    print(f"prefill: done, {done} answered, {len(outstanding)} lost, {args.requests - done - len(outstanding)} "
          f"not sent, {done / (time.monotonic() - t0):.0f} req/s", flush=True)


if __name__ == "__main__":
    main()
