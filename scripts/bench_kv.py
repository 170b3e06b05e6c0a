"""The ``kv`` suite of scripts/bench.py: KV-cache handoff from a prefill process to a decode
process on one device (examples/kv_handoff's KV and first decode step), two ways:

- ipcsync: the prefill writes each request's KV (2 x layers tensors, the prompt length
  varying per request) straight into a slot (``Producer.slot()``, ``--slots`` slots);
  the decode process runs the first decode step on the slot's views and releases them;
- torch.multiprocessing.Queue(maxsize=slots): the prefill makes the same KV as fresh
  tensors and puts ``(req, made, kv)``; on CUDA the tensors travel by torch's CUDA IPC (a
  handle per tensor per request, its event waited on by the receiver), and the prefill
  stays until the decode process is through (its tensors must outlive their use);
- and, as the ceiling both are measured against, the decode step alone: one process makes
  each request's KV on its own device (not timed) and times only the decode step over it,
  so ``x decode alone`` is the share of the decode's pace the pipeline keeps (the handoff's
  share of a request is what is missing).

The KV is drawn from a generator seeded by the request in both (the prefill's forward
pass stands for it), written in place. The decode step ends with ``int()`` of the first
token (one host sync per request); both methods' tokens must be equal (checked).
Reported after ``warmup`` requests: requests/s, time to first token (p50/p99, from the
prefill starting a request's KV to its first token on the decode host), and the KV
handed over per second (GB/s of KV bytes over the timed wall time).
"""

from __future__ import annotations

import os
import time
from types import SimpleNamespace
from typing import Any, Callable

import torch
from benchdevice import child_device
from benchprocs import ProcsError, load_example, report, run_procs, spawn

KV = load_example("kv_handoff/kv")
LABELS = {"ipcsync": "ipcsync slot(), prefill -> decode", "mpq": "torch.multiprocessing.Queue",
          "alone": "decode alone (KV made in place)"}


class KvBenchError(ProcsError):
    """A process of the suite failed, or the device cannot run it (the text says which)."""


def _prefill(results: Any, method: str, cfg: dict[str, Any], device: str, link: Any) -> None:
    def run() -> dict[str, Any]:
        import ipcsync

        dev = child_device(device)
        args = SimpleNamespace(**cfg)
        if method == "ipcsync":
            nbytes = KV.kv_bytes(args, dev) + 2 * cfg["layers"] * 256 + (64 << 10)
            with ipcsync.Producer(link, slots=cfg["slots"], slot_bytes=nbytes, device=dev,
                                  timeout=cfg["timeout"]) as out:
                out.wait_for_consumers(1)
                dtype = KV.dtype_for(dev)
                for req in range(cfg["requests"]):
                    fields = {str(i): (s, dtype) for i, s in enumerate(KV.shapes(req, args))}
                    with out.slot(fields, meta={"req": req, "made": time.monotonic()}) as s:
                        KV.fill_kv(req, [s[str(i)] for i in range(len(fields))])
            return {}
        steps, through = link
        for req in range(cfg["requests"]):
            made = time.monotonic()
            steps.put((req, made, KV.make_kv(req, args, dev)), timeout=cfg["timeout"])
        steps.put(None, timeout=cfg["timeout"])
        through.get(timeout=cfg["timeout"])  # CUDA tensors sent live only while their sender does
        return {}

    report(results, "prefill", run)


def _decode(results: Any, method: str, cfg: dict[str, Any], device: str, link: Any) -> None:
    def run() -> dict[str, Any]:
        import ipcsync

        dev = child_device(device)
        done = []

        def first(kv: list[torch.Tensor]) -> tuple[torch.Tensor, int]:
            return KV.first_token(kv), sum(t.numel() * t.element_size() for t in kv)

        def record(req: int, made: float, tok: torch.Tensor, nbytes: int) -> None:
            done.append((req, made, int(tok), time.monotonic(), nbytes))  # int(): waits for the step

        with torch.no_grad():
            if method == "ipcsync":
                with ipcsync.Consumer(link, device=dev, timeout=cfg["timeout"]) as inp:
                    for item in inp:
                        kv = [item[str(i)] for i in range(len(item.tensors))]
                        tok, nbytes = first(kv)
                        del kv  # no view of the slot kept past its release
                        item.release()  # after the step's kernels, on this stream
                        record(item.meta["req"], item.meta["made"], tok, nbytes)
            else:
                steps, through = link
                while (got := steps.get(timeout=cfg["timeout"])) is not None:
                    req, made, kv = got
                    tok, nbytes = first(kv)
                    del got, kv
                    record(req, made, tok, nbytes)
                through.put(True)
        return {"done": done}

    report(results, "decode", run)


def _alone(results: Any, cfg: dict[str, Any], device: str) -> None:
    def run() -> dict[str, Any]:
        dev = child_device(device)
        args = SimpleNamespace(**cfg)
        done, busy = [], 0.0
        with torch.no_grad():
            for req in range(cfg["requests"]):
                kv = KV.make_kv(req, args, dev)
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)  # the KV is made before the step is timed
                t0 = time.monotonic()
                tok = int(KV.first_token(kv))
                t1 = time.monotonic()
                if req >= cfg["warmup"]:
                    busy += t1 - t0
                # "made" and "done" on a clock that counts the decode steps only
                done.append((req, busy - (t1 - t0), tok, busy, sum(t.numel() * t.element_size() for t in kv)))
                del kv
        return {"done": done}

    report(results, "decode", run)


def run_one(method: str, cfg: dict[str, Any], device: str, progress: Callable[[str], None]) -> dict[str, Any]:
    ctx, results = spawn()
    if method == "alone":
        got = run_procs("kv alone", ctx, results, {"decode": (_alone, (results, cfg, device))},
                        cfg["timeout"], progress)
        return _summary(method, cfg, got["decode"]["done"])
    link: Any = (f"kvb-{os.getpid()}" if method == "ipcsync"
                 else (ctx.Queue(maxsize=cfg["slots"]), ctx.Queue()))
    targets = {"prefill": (_prefill, (results, method, cfg, device, link)),
               "decode": (_decode, (results, method, cfg, device, link))}
    got = run_procs(f"kv {method}", ctx, results, targets, cfg["timeout"], progress,
                    queues=link if method == "mpq" else ())
    return _summary(method, cfg, got["decode"]["done"])


def _summary(method: str, cfg: dict[str, Any], done: list[tuple[int, float, int, float, int]]) -> dict[str, Any]:
    if [d[0] for d in done] != list(range(cfg["requests"])):
        raise KvBenchError(f"kv {method}: requests decoded out of order or missing")
    warm = cfg["warmup"]
    timed = done[warm:]
    wall = done[-1][3] - done[warm - 1][3]
    ttft = sorted(d[3] - d[1] for d in timed)
    return {"rps": len(timed) / wall, "gbs": sum(d[4] for d in timed) / wall / 1e9,
            "p50_ms": ttft[len(ttft) // 2] * 1e3, "p99_ms": ttft[min(len(ttft) - 1, int(.99 * len(ttft)))] * 1e3,
            "tokens": [d[2] for d in done], "mib": sum(d[4] for d in done) / len(done) / 2**20}


def run_kv(device: str, cfg: dict[str, Any], progress: Callable[[str], None]) -> dict[str, Any]:
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise KvBenchError("--suite kv --device cuda needs a GPU")
    progress(f"kv: {cfg['requests']} requests of {2 * cfg['layers']} KV tensors, prompts up to {cfg['max_seq']} tokens")
    res = {m: run_one(m, cfg, device, progress) for m in LABELS}
    if not res["ipcsync"]["tokens"] == res["mpq"]["tokens"] == res["alone"]["tokens"]:
        raise KvBenchError("kv: the first tokens differ between ipcsync, the torch.multiprocessing queue "
                           "and the decode step alone")
    return {"methods": res, "cfg": cfg}


def print_kv(res: dict[str, Any], header: Callable[[], None]) -> None:
    header()
    cfg, m = res["cfg"], res["methods"]
    print(f"setup: examples/kv_handoff KV, {cfg['layers']} layers x K,V of {cfg['heads']} heads x prompt x "
          f"{cfg['head_dim']}, prompts of {max(1, cfg['max_seq'] // 4)}..{cfg['max_seq']} tokens "
          f"({m['ipcsync']['mib']:.3g} MiB per request on average); {cfg['requests']} requests, the first "
          f"{cfg['warmup']} not timed; slots/queue size {cfg['slots']}; first tokens equal all ways; "
          "decode alone: the decode step over KV made in its own process, the pace a pipeline can reach")
    head = ("method", "req/s", "KV GB/s", "TTFT p50 ms", "TTFT p99 ms", "x mp.Queue", "x decode alone")
    widths = (34, 10, 9, 12, 12, 10, 14)
    print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(head, widths))))
    for method, r in m.items():
        alone = method == "alone"  # its "TTFT" is the decode step alone
        cells = (LABELS[method], f"{r['rps']:,.1f}", "-" if alone else f"{r['gbs']:.2f}", f"{r['p50_ms']:.3f}",
                 f"{r['p99_ms']:.3f}", f"{r['rps'] / m['mpq']['rps']:.2f}x", f"{r['rps'] / m['alone']['rps']:.2f}x")
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))))
