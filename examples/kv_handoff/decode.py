#!/usr/bin/env python3
"""KV-handoff decode worker: receives each request's KV cache from the prefill worker,
runs the first decode step over it where it lies (views of the prefill's slot, only
read), releases the slot and sends the first token back (meta only, on ENDPOINT-tok).

    python3 examples/kv_handoff/decode.py --endpoint kvh

Every first token is checked against the same step over the request's KV made here
(``--check``). ``--die-at-request K`` kills this worker when request K arrives (the
fault test).
"""

from __future__ import annotations

import os
import signal
import time

import torch

import ipcsync
from kv import device_of, first_token, make_kv, parser


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--check", action="store_true", help="recompute each request's KV here and compare")
    ap.add_argument("--die-at-request", type=int, default=-1)
    args = ap.parse_args()
    device = device_of(args)
    ttft, nbytes = [], 0
    with ipcsync.Producer(f"{args.endpoint}-tok", slots=64, slot_bytes=4096, device=device,
                          timeout=args.timeout) as back, \
            ipcsync.Consumer(args.endpoint, device=device, timeout=args.timeout) as inp, torch.no_grad():
        for item in inp:
            req = item.meta["req"]
            if req == args.die_at_request:
                print(f"decode: dying at request {req}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            kv = [item[str(i)] for i in range(len(item.tensors))]
            tok = first_token(kv)
            nbytes += item.nbytes
            del kv
            item.release()  # after the step's kernels, on this stream
            token = int(tok)
            ttft.append(time.monotonic() - item.meta["made"])
            if args.check and token != int(first_token(make_kv(req, args, device))):
                raise SystemExit(f"decode: request {req}: first token {token} differs from its KV's")
            back.send({}, meta={"req": req, "token": token})
        back.close()
    ttft.sort()
    p50 = ttft[len(ttft) // 2] * 1e3 if ttft else 0.0
    print(f"decode: done, {len(ttft)} requests, {nbytes / 2**20:.1f} MiB of KV, first token p50 {p50:.2f} ms"
          f"{', checked' if args.check else ''}", flush=True)


if __name__ == "__main__":
    main()
