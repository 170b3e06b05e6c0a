"""The ``gpupipe`` suite of scripts/bench.py: the two model stages of examples/gpu_pipeline
(an encoder, then a decoder with a head; seeded residual Linear+GELU blocks, bf16 on CUDA)
run three ways on one device, the same steps, the same inputs:

- one process: each step's input made, encoded and decoded in one process, one stream;
- the decoder alone: one process makes each step's activations itself (not timed) and
  times only the decoder's step (its forward and ``int()``): the pace no pipeline feeding
  this decoder can pass, so a pipeline's ratio to it is the share the handoff leaves;
- ipcsync: an encoder process ``send()``s each step's activations ``{"h": h}`` to R
  decoder replica processes (``policy="shard"``, ``--slots`` slots); a decoder runs on the
  slot's views and releases them. No host sync on the handoff path;
- torch.multiprocessing.Queue: the same processes with one shared
  ``torch.multiprocessing.Queue(maxsize=slots)`` carrying ``(step, made, h)``; on CUDA
  ``h`` travels as a CUDA tensor (torch's CUDA IPC: a handle per message, its event
  waited on by the receiver, the sender's memory kept until the receiver drops it).

Each step's decoder ends with ``int()`` of the step's checksum (the argmax tokens,
weighted by row): one host sync per step on the decoder's side, as a server handing
tokens back has; the methods' checksum totals must be equal (checked). Reported: steps/s
at the decoders after ``warmup`` steps (first to last step done), latency from a step's
input being made to its tokens on the host (p50/p99 over the timed steps), and the GPU
busy fraction: the share of the timed wall time the device spends on the stages' work,
that work measured once, alone, in the one-process run (CUDA events around each forward
there; on the CPU backend its host time): steps x that compute per step / wall time.
Per-process events would not do for the pipelines: processes time-slice one GPU, and an
event pair in one process also spans the other's kernels. What the busy fraction lacks
from 100% in a pipeline is the handoff, the host syncs and the time-slicing together.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

import torch
from benchdevice import child_device
from benchprocs import ProcsError, load_example, report, run_procs, spawn

METHODS = ("single", "alone", "ipcsync", "mpq")


class GpuPipeError(ProcsError):
    """A process of the suite failed, or the device cannot run it (the text says which)."""


ST = load_example("gpu_pipeline/stages")


def label(method: str, replicas: int) -> str:
    if method == "single":
        return "one process (both stages)"
    if method == "alone":
        return "decoder alone (input made in place)"
    dec = f"{replicas} decoder{'s' if replicas > 1 else ''}"
    return f"ipcsync, encoder -> {dec}" if method == "ipcsync" else f"torch.mp.Queue, encoder -> {dec}"


class _Clock:
    """A stage's compute time: CUDA events around each forward on the current stream
    (summed once at the end), or host time on the CPU."""

    def __init__(self, dev: torch.device) -> None:
        self.cuda = dev.type == "cuda"
        self.pairs: list[tuple[Any, Any]] = []
        self.host = 0.0

    def run(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        if self.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            y = fn(x)
            b.record()
            self.pairs.append((a, b))
            return y
        t = time.perf_counter()
        y = fn(x)
        self.host += time.perf_counter() - t
        return y

    def seconds(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return sum(a.elapsed_time(b) for a, b in self.pairs) / 1e3
        return self.host


def _models(cfg: dict[str, Any], dev: torch.device, kinds: tuple[str, ...]) -> list[torch.nn.Module]:
    return [ST.build(k, cfg["dim"], cfg["layers"], cfg["vocab"], dev) for k in kinds]


def _single(results: Any, cfg: dict[str, Any], device: str) -> None:
    def run() -> dict[str, Any]:
        dev = child_device(device)
        enc, dec = _models(cfg, dev, ("encoder", "decoder"))
        clock = _Clock(dev)
        done, total = [], 0
        with torch.no_grad():
            for step in range(cfg["steps"]):
                made = time.monotonic()
                x = ST.make_input(step, cfg["batch"], cfg["dim"], dev)
                if step < cfg["warmup"]:
                    h, logits = enc(x), None
                    logits = dec(h)
                else:
                    h = clock.run(enc, x)
                    logits = dec(h)
                total += int(ST.checksum(logits))
                done.append((step, made, time.monotonic()))
        return {"done": done, "checksum": total, "compute": clock.seconds()}

    report(results, "one process", run)


def _alone(results: Any, cfg: dict[str, Any], device: str) -> None:
    def run() -> dict[str, Any]:
        dev = child_device(device)
        enc, dec = _models(cfg, dev, ("encoder", "decoder"))
        done, total, busy = [], 0, 0.0
        with torch.no_grad():
            for step in range(cfg["steps"]):
                h = enc(ST.make_input(step, cfg["batch"], cfg["dim"], dev))
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)  # the input is made before the step is timed
                t0 = time.monotonic()
                total += int(ST.checksum(dec(h)))
                took = time.monotonic() - t0
                if step >= cfg["warmup"]:
                    busy += took
                # "made" and "done" on a clock that counts the decoder's timed steps only
                done.append((step, busy - took, busy))
        return {"done": done, "checksum": total}

    report(results, "decoder alone", run)


def _encoder(results: Any, method: str, cfg: dict[str, Any], device: str, link: Any) -> None:
    def run() -> dict[str, Any]:
        import ipcsync

        dev = child_device(device)
        (enc,) = _models(cfg, dev, ("encoder",))
        out = None
        if method == "ipcsync":
            nbytes = cfg["batch"] * cfg["dim"] * ST.dtype_for(dev).itemsize + (64 << 10)
            out = ipcsync.Producer(link, slots=cfg["slots"], slot_bytes=nbytes, device=dev, policy="shard",
                                   timeout=cfg["timeout"])
            out.wait_for_consumers(cfg["replicas"])
        with torch.no_grad():
            for step in range(cfg["steps"]):
                made = time.monotonic()
                h = enc(ST.make_input(step, cfg["batch"], cfg["dim"], dev))
                if out is not None:
                    out.send({"h": h}, meta={"step": step, "made": made})
                else:
                    link[0].put((step, made, h), timeout=cfg["timeout"])
        if out is not None:
            out.close()
        else:
            for _ in range(cfg["replicas"]):
                link[0].put(None, timeout=cfg["timeout"])
            # CUDA tensors sent through torch.multiprocessing live only while their sender
            # does: stay until every decoder is through.
            for _ in range(cfg["replicas"]):
                link[1].get(timeout=cfg["timeout"])
        return {}

    report(results, "encoder", run)


def _decoder(results: Any, method: str, cfg: dict[str, Any], device: str, rank: int, link: Any) -> None:
    def run() -> dict[str, Any]:
        import ipcsync

        dev = child_device(device)
        (dec,) = _models(cfg, dev, ("decoder",))
        done, total = [], 0
        with torch.no_grad():
            if method == "ipcsync":
                with ipcsync.Consumer(link, device=dev, timeout=cfg["timeout"]) as inp:
                    for item in inp:
                        logits = dec(item["h"])
                        item.release()  # after the decoder's kernels queued on this stream
                        total += int(ST.checksum(logits))
                        done.append((item.meta["step"], item.meta["made"], time.monotonic()))
            else:
                while True:
                    got = link[0].get(timeout=cfg["timeout"])
                    if got is None:
                        break
                    step, made, h = got
                    logits = dec(h)
                    del got, h
                    total += int(ST.checksum(logits))
                    done.append((step, made, time.monotonic()))
                link[1].put(rank)
        return {"done": done, "checksum": total}

    report(results, f"decoder {rank}", run)


def run_one(method: str, cfg: dict[str, Any], device: str, progress: Callable[[str], None]) -> dict[str, Any]:
    """One method: its steps/s, latency, checksum total (and for ``single`` the compute
    seconds of one timed step)."""
    ctx, results = spawn()
    link: Any = None
    if method == "single":
        targets = {"one process": (_single, (results, cfg, device))}
    elif method == "alone":
        targets = {"decoder alone": (_alone, (results, cfg, device))}
    else:
        if method == "ipcsync":
            link = f"gpipe-{os.getpid()}-{cfg['replicas']}"
        else:  # the steps' queue, and the decoders' "through" (see _encoder)
            link = (ctx.Queue(maxsize=cfg["slots"]), ctx.Queue())
        targets = {"encoder": (_encoder, (results, method, cfg, device, link))}
        for r in range(cfg["replicas"]):
            targets[f"decoder {r}"] = (_decoder, (results, method, cfg, device, r, link))
    got = run_procs(f"gpupipe {method}", ctx, results, targets, cfg["timeout"], progress,
                    queues=link if method == "mpq" else ())
    sides = list(got.values())
    done = sorted((d for s in sides for d in s.get("done", ())), key=lambda d: d[2])
    if len(done) != cfg["steps"] or sorted(d[0] for d in done) != list(range(cfg["steps"])):
        raise GpuPipeError(f"gpupipe {method}: {len(done)} steps done, not each of the {cfg['steps']} once")
    warm = cfg["warmup"]
    lat = sorted(d[2] - d[1] for d in done if d[0] >= warm)
    wall = done[-1][2] - done[warm - 1][2]
    out = {"rate": (len(done) - warm) / wall, "p50_ms": _pct(lat, .5) * 1e3, "p99_ms": _pct(lat, .99) * 1e3,
           "checksum": sum(s.get("checksum", 0) for s in sides)}
    if method == "single":
        out["step_compute"] = got["one process"]["compute"] / (cfg["steps"] - warm)
    return out


def _pct(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run_gpupipe(device: str, cfg: dict[str, Any], progress: Callable[[str], None]) -> dict[str, Any]:
    """Every method's results (``single``, then per replica count ``ipcsync``/``mpq``)."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise GpuPipeError("--suite gpupipe --device cuda needs a GPU")
    rows = []
    progress(f"gpupipe: {cfg['steps']} steps of {cfg['batch']} x {cfg['dim']}, {cfg['layers']} blocks per stage")
    single = run_one("single", {**cfg, "replicas": 1}, device, progress)
    rows.append({"method": "single", "replicas": 1, **single})
    rows.append({"method": "alone", "replicas": 1, **run_one("alone", {**cfg, "replicas": 1}, device, progress)})
    for r in cfg["replicas"]:
        for method in ("ipcsync", "mpq"):
            rows.append({"method": method, "replicas": r, **run_one(method, {**cfg, "replicas": r}, device, progress)})
    for r in rows:
        r["busy"] = single["step_compute"] * r["rate"]  # compute per step x steps per second
    bad = [r for r in rows if r["checksum"] != single["checksum"]]
    if bad:
        raise GpuPipeError(f"gpupipe: checksums differ from one process's {single['checksum']}: "
                           + ", ".join(f"{label(r['method'], r['replicas'])} {r['checksum']}" for r in bad))
    return {"rows": rows, "cfg": cfg}


def print_gpupipe(res: dict[str, Any], device: str, header: Callable[[], None]) -> None:
    header()
    cfg = res["cfg"]
    busy = "GPU busy" if device.startswith("cuda") else "compute busy"
    print(f"setup: examples/gpu_pipeline stages, {cfg['layers']} residual Linear+GELU blocks of dim {cfg['dim']} "
          f"each (+ a head of {cfg['vocab']}), batches of {cfg['batch']} rows; {cfg['steps']} steps, the first "
          f"{cfg['warmup']} not timed; slots/queue size {cfg['slots']}; every method's checksum equal")
    head = ("method", "steps/s", "x mp.Queue", "x 1 process", "p50 ms", "p99 ms", busy)
    widths = (36, 10, 10, 11, 9, 9, 16)
    print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(head, widths))))
    rates = {(r["method"], r["replicas"]): r["rate"] for r in res["rows"]}
    single = rates[("single", 1)]
    for r in res["rows"]:
        mpq = rates.get(("mpq", r["replicas"]))
        cells = (label(r["method"], r["replicas"]), f"{r['rate']:,.1f}",
                 "-" if r["method"] in ("single", "alone") or not mpq else f"{r['rate'] / mpq:.2f}x",
                 f"{r['rate'] / single:.2f}x", f"{r['p50_ms']:.3f}", f"{r['p99_ms']:.3f}", f"{r['busy'] * 100:.1f}%")
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))))
    alone = rates[("alone", 1)]
    print("of the decoder alone's pace: " + ", ".join(
        f"{label(m, r)} {rate / alone:.2f}x" for (m, r), rate in rates.items() if m in ("ipcsync", "mpq")))
    print(f"{busy}: steps/s x the stages' compute per step, measured alone in the one-process run "
          f"({'CUDA events' if device.startswith('cuda') else 'host time'}: "
          f"{res['rows'][0]['step_compute'] * 1e3:.3f} ms)")
