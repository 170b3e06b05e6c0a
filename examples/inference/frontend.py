#!/usr/bin/env python3
"""Front-end stage of the inference example (run it with ipcsync-run
examples/inference/pipeline.toml).

Makes ``--requests`` requests (random token sequences, seeded) arriving at ``--rate``
requests/s, batches them dynamically (a batch leaves when it holds ``--batch-size``
requests or ``--max-wait-ms`` after its first request arrived), sends each batch to the
worker stage and receives the answers over the reply edge. Sending and receiving are two
asyncio tasks on one event loop (``await out.asend(...)``, ``async for item in inp``), as
in an asyncio server: neither ever blocks the other. Each answer is mapped back to its
requests by the ids in its meta and checked: every request answered exactly once, the
checksum of its token ids as the worker saw them, a prediction that is the argmax of the
returned logits. Prints progress, then
``frontend: done, N requests, R req/s, p50 X ms, p99 Y ms``; exits 1 on any mismatch or
missing answer.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import threading
import time
from typing import Any

import torch

import ipcsync.stage as stage


def checksum(ids: torch.Tensor) -> torch.Tensor:
    """Per-row checksum of token ids, position-weighted (the worker computes the same)."""
    weights = torch.arange(1, ids.shape[1] + 1, dtype=torch.int64)
    return (ids.to(torch.int64) * weights).sum(dim=1)


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    k = min(len(sorted_values) - 1, max(0, round(q / 100 * (len(sorted_values) - 1))))
    return sorted_values[k]


def sleep_until(t: float) -> None:
    d = t - time.monotonic()
    if d > 0:
        time.sleep(d)


async def asleep_until(t: float) -> None:
    d = t - time.monotonic()
    if d > 0:
        await asyncio.sleep(d)


class Checker:
    """Checks every answer and records per-request latency. ``all_done`` is set once every
    request was answered, or on the first error (then the sender stops)."""

    def __init__(self, inp: Any, n: int, vocab: int, expected_sums: list[int], arrivals: list[float],
                 log_every: int) -> None:
        self.inp, self.n, self.vocab = inp, n, vocab
        self.expected_sums, self.arrivals, self.log_every = expected_sums, arrivals, log_every
        self.latency: list[float | None] = [None] * n
        self.received = 0
        self.errors: list[str] = []
        self.per_worker: dict[str, int] = {}
        self.all_done = threading.Event()
        self.t0 = time.monotonic()

    def error(self, msg: str) -> None:
        if len(self.errors) < 20:
            self.errors.append(msg)
        self.all_done.set()  # the sender stops waiting

    async def receive(self, done: asyncio.Event) -> None:
        """Every answer of ``inp`` (a Consumer or FanIn), until its stream ends; ``done``
        is set whenever ``all_done`` is."""
        try:
            async for item in self.inp:
                self.check(item, time.monotonic())
                if self.all_done.is_set():
                    done.set()
        except Exception as exc:  # a worker died, a timeout, ...
            self.error(f"receiving answers: {type(exc).__name__}: {exc}")
        finally:
            self.all_done.set()
            done.set()

    def check(self, item: Any, now: float) -> None:
        ids = item.meta.get("ids") if isinstance(item.meta, dict) else None
        src = getattr(item, "source", "worker")
        if not isinstance(ids, list):
            self.error(f"answer from {src} without request ids: meta {item.meta!r}")
            return
        sums = item["checksum"].cpu().tolist()
        preds = item["pred"].cpu()
        logits = item["logits"].cpu()
        if not (len(sums) == len(ids) == preds.shape[0] == logits.shape[0]) or logits.shape[1] != self.vocab:
            self.error(f"answer from {src} for {len(ids)} requests has {len(sums)} checksums, "
                       f"pred {tuple(preds.shape)}, logits {tuple(logits.shape)}; expected "
                       f"{len(ids)} rows and a vocabulary of {self.vocab}")
            return
        if not bool(torch.isfinite(logits).all()) or not bool((logits.argmax(dim=1) == preds).all()):
            self.error(f"answer from {src} for requests {ids[:4]}...: pred is not the argmax of finite logits")
        for rid, got in zip(ids, sums):
            if not (isinstance(rid, int) and 0 <= rid < self.n):
                self.error(f"answer from {src} for unknown request id {rid!r}")
            elif self.latency[rid] is not None:
                self.error(f"request {rid} answered twice (again by {src})")
            elif got != self.expected_sums[rid]:
                self.error(f"request {rid}: checksum {got} from {src}, expected {self.expected_sums[rid]}")
            else:
                self.latency[rid] = now - self.arrivals[rid]
                self.received += 1
        self.per_worker[src] = self.per_worker.get(src, 0) + len(ids)
        if self.log_every and self.received // self.log_every != (self.received - len(ids)) // self.log_every:
            rate = self.received / max(now - self.t0, 1e-9)
            print(f"frontend: {self.received}/{self.n} answered, {rate:.0f} req/s", flush=True)
        if self.received == self.n:
            self.all_done.set()


class Receiver(Checker, threading.Thread):
    """The same checks on a thread of its own, for a blocking source of answers
    (scripts/bench.py runs it over torch.multiprocessing queues as well as ipcsync)."""

    def __init__(self, inp: Any, n: int, vocab: int, expected_sums: list[int], arrivals: list[float],
                 log_every: int) -> None:
        Checker.__init__(self, inp, n, vocab, expected_sums, arrivals, log_every)
        threading.Thread.__init__(self, name="receiver", daemon=True)

    def run(self) -> None:
        try:
            for item in self.inp:
                self.check(item, time.monotonic())
        except Exception as exc:  # a worker died, a timeout, ...
            self.error(f"receiving answers: {type(exc).__name__}: {exc}")
        finally:
            self.all_done.set()


async def serve(out: Any, rx: Checker, tokens: torch.Tensor, arrivals: list[float], batch_size: int,
                max_wait: float, timeout: float) -> tuple[int, float, float]:
    """Send every request in dynamic batches while ``rx`` receives the answers from
    ``rx.inp``, on one event loop; then close the output and wait for the answers to end.
    Returns (batches, when the last batch left, when the last answer was in)."""
    n = len(arrivals)
    done = asyncio.Event()
    receiving = asyncio.ensure_future(rx.receive(done))
    batches = 0
    sent_all = answered = time.monotonic()
    try:
        i = 0
        while i < n and not rx.errors:
            # Dynamic batching: the batch opens with the next arrival and leaves when full or
            # max_wait after that arrival, whichever comes first; when sending fell behind
            # (backpressure from busy workers), it takes every request that arrived meanwhile.
            await asleep_until(arrivals[i])
            deadline = max(arrivals[i] + max_wait, time.monotonic())
            j = i + 1
            while j < n and j - i < batch_size and arrivals[j] <= deadline:
                j += 1
            if j - i < batch_size and j < n:
                await asleep_until(deadline)  # not full: wait out the window (no arrival in it)
            else:
                await asleep_until(arrivals[j - 1])
            await out.asend({"ids": tokens[i:j]}, meta={"ids": list(range(i, j)), "sent": time.time()})
            batches += 1
            i = j
        sent_all = time.monotonic()
        try:
            await asyncio.wait_for(done.wait(), timeout)
        except asyncio.TimeoutError:
            rx.error(f"timed out after {timeout:.0f} s with {rx.received}/{n} answers")
        answered = time.monotonic()
    finally:
        # The workers' iteration ends; they close their replies, ending ours. Awaited, so
        # answers still arriving are received meanwhile.
        await out.aclose()
        try:
            await asyncio.wait_for(receiving, 60)
        except asyncio.TimeoutError:
            rx.error("the answers did not end after the front end closed its output")
    return batches, sent_all, answered


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--max-wait-ms", type=float, default=5.0)
    ap.add_argument("--rate", type=float, default=0.0, help="requests/s (0: all at once)")
    ap.add_argument("--seq", type=int, default=64, help="tokens per request")
    ap.add_argument("--vocab", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=512)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for all answers")
    args = ap.parse_args()
    if args.requests < 1 or args.batch_size < 1 or args.seq < 1:
        ap.error("--requests, --batch-size and --seq must be at least 1")

    me = stage.info()
    n = args.requests
    g = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, args.vocab, (n, args.seq), generator=g, dtype=torch.int64)
    expected_sums = checksum(tokens).tolist()
    rng = random.Random(args.seed)
    offsets, t = [], 0.0
    for _ in range(n):  # Poisson arrivals at --rate
        offsets.append(t)
        if args.rate > 0:
            t += rng.expovariate(args.rate)
    max_wait = args.max_wait_ms / 1000

    out = stage.output("worker")  # waits until every worker replica is attached
    inp = stage.input("worker")   # answers from every worker replica
    workers = len(getattr(inp, "sources", [None]))
    print(f"frontend on {me.device}: {n} requests of {args.seq} tokens, batch <= {args.batch_size}, "
          f"rate {args.rate or 'unlimited'} req/s, {workers} worker(s)", flush=True)
    t0 = time.monotonic()
    arrivals = [t0 + o for o in offsets]
    rx = Checker(inp, n, args.vocab, expected_sums, arrivals, args.log_every)
    rx.t0 = t0
    try:
        batches, sent_all, answered = asyncio.run(serve(out, rx, tokens, arrivals, args.batch_size, max_wait,
                                                        args.timeout))
        elapsed = answered - t0
    finally:
        out.close()  # (already closed, unless serve() failed before its end)
        inp.close()
    missing = [r for r, lat in enumerate(rx.latency) if lat is None]
    if missing and not rx.errors:
        rx.error(f"{len(missing)} requests not answered: {missing[:10]}")
    if rx.errors:
        for e in rx.errors:
            print(f"frontend: error: {e}", flush=True)
        return 1
    lat = sorted(x * 1000 for x in rx.latency if x is not None)
    shares = ", ".join(f"{k} {v}" for k, v in sorted(rx.per_worker.items()))
    print(f"frontend: {batches} batches (mean {n / batches:.1f} requests), sending took "
          f"{sent_all - t0:.2f} s; answers per worker: {shares}", flush=True)
    print(f"frontend: done, {n} requests, {n / elapsed:.0f} req/s, p50 {percentile(lat, 50):.1f} ms, "
          f"p99 {percentile(lat, 99):.1f} ms", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
