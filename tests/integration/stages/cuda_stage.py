"""A CUDA stage for tests/integration/test_launch_cuda.py, run by ipcsync-run.

    cuda_stage.py src N [--die-mid-record]   send N items; item i of replica r is full of
                                             r * 1000 + i, written after a GPU spin
    cuda_stage.py mid                        forward every item from "src" to "sink" (+0.5)
    cuda_stage.py sink TOTAL [UPSTREAM]      check every item; print a JSON result line

--die-mid-record (first attempt only): after 5 items, queue ~2 s of GPU work before
recording a slot's ready event, send it, and SIGKILL itself while that work is pending:
the event is left poisoned, the situation the restart policy exists for.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import torch

import ipcsync.stage as stage

SPIN = 2_000_000_000  # GPU cycles, about a second on an H200


def spin(cycles: int) -> None:
    if torch.cuda.is_available():  # (on a CPU-only machine the script still runs, unraced)
        torch.cuda._sleep(cycles)


def src(n: int, die: bool) -> None:
    me = stage.info()
    with stage.output("mid" if "mid" in me.outputs else "sink") as out:
        for i in range(n):
            with out.slot(x=((1024,), torch.float32), meta={"r": me.replica, "i": i}) as s:
                spin(SPIN // 100)  # the value lands late: a wait is needed
                s["x"].fill_(me.replica * 1000 + i)
                if die and me.restart == 0 and i == 5:
                    spin(2 * SPIN)
            if die and me.restart == 0 and i == 5:
                print(json.dumps({"event": "dying", "attempt": me.restart}), flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
    print(json.dumps({"event": "src-done", "replica": me.replica, "attempt": me.restart}), flush=True)


def mid() -> None:
    with stage.input("src") as inp, stage.output("sink") as out:
        for item in inp:
            out.send({"x": item["x"] + 0.5}, meta=item.meta)  # GPU work on the item, then a copy
    print(json.dumps({"event": "mid-done"}), flush=True)


def sink(total: int, upstream: str) -> None:
    me = stage.info()
    seen: dict[int, int] = {}
    bad = []
    offset = 0.5 if upstream == "mid" else 0.0
    with stage.input(upstream) as inp:
        for item in inp:
            r, i = item.meta["r"], item.meta["i"]
            if i != seen.get(r, 0):
                bad.append(("order", r, i))
            seen[r] = i + 1
            x = item["x"]
            want = r * 1000 + i + offset
            if not bool((x == want).all()):  # a host sync, on purpose: the check must see the data
                bad.append(("content", r, i, float(x[0])))
    got = sum(seen.values())
    ok = not bad and got == total
    print(json.dumps({"event": "sink-done", "ok": ok, "got": got, "bad": bad[:5], "attempt": me.restart,
                      "device": me.device}), flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    role = sys.argv[1]
    if role == "src":
        src(int(sys.argv[2]), "--die-mid-record" in sys.argv)
    elif role == "mid":
        mid()
    else:
        sink(int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "src")
