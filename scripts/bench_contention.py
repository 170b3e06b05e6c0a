"""The ``contention`` suite of scripts/bench.py: does spinning before a wait parks
(``IPCSYNC_SPIN_US``) cost throughput on a small, busy host, and does an idle endpoint
stay cheap with it on?

Busy: P producer -> consumer pairs (``--contention-pairs``, default 4: 8 processes) run
at once, every thread of every process pinned to the same few CPUs
(``--contention-cores``, default the first 2 this process may use). Each producer
``send()``s ``{"x": 4 KiB uint8}`` ``--contention-count`` times (``--slots`` slots); its
consumer touches one byte of each item (the handoff suite's ``_touch``) and releases it.
After a short warm-up per pair, all 2P processes start together (a barrier); the timed
window runs from the barrier to each process's last item. Settings, interleaved per
round (``--contention-rounds``: off, on, off, on, ...):

- ``off``: ``IPCSYNC_SPIN_US`` unset in every process (the default: no spin);
- ``on``: ``IPCSYNC_SPIN_US=--contention-spin-us`` (default 200) in every process;
- ``on-nobackoff`` (only when asked for in ``--contention-settings``): the same spin with
  core.spin's backoff after fruitless spins disabled in each process
  (``MISSES_BEFORE_BACKOFF`` set out of reach), to show what the backoff does.

Reported per setting and round: the load average of the machine just before the run,
aggregate handoffs/s (all pairs' items over the window from the barrier to the last
consumer's last item), the slowest pair's handoffs/s, the CPU time of all 2P processes
in their windows (user + sys of every thread, ``getrusage(RUSAGE_SELF)`` in each) per
handoff and as a share of the pinned cores, and how the waits spun: spins per handoff
and the share of spins that found their answer (counted in each process by wrapping
``ipcsync.core.spin.AdaptiveSpin``'s ``plan``/``hit``, in every setting alike). Then
the ratio spin/no-spin of the mean rates and CPU per handoff.

Idle: one pair, pinned alike, with the spin on (and off, for reference): the producer
hands 50 items over, then sends nothing for ``--contention-idle`` seconds while the
consumer waits in ``get()``; each process's CPU time over that time as a share of one
core (scripts/bench_latency.py's idle pair).
"""

from __future__ import annotations

import os
import resource
import time
from typing import Any, Callable

import torch
from bench import _touch
from bench_latency import IDLE_WARM, child_device, idle_consumer, idle_producer
from benchprocs import ProcsError, report, run_procs, spawn

NBYTES = 4 << 10
WARM = 200  # items per pair before the barrier: connections, layouts and caches settled
SETTINGS = ("off", "on", "on-nobackoff")


class ContentionError(ProcsError):
    """A process of the suite failed, or the options cannot run (the text says which)."""


def parse_cores(text: str | None) -> list[int]:
    """``"0,1"`` or ``"0-3,6"`` -> CPU ids; None -> the first 2 CPUs this process may use.
    ValueError for CPUs this process may not use or a malformed list."""
    allowed = sorted(os.sched_getaffinity(0))
    if text is None:
        return allowed[:2]
    cores: set[int] = set()
    try:
        for part in filter(None, (p.strip() for p in text.split(","))):
            lo, _, hi = part.partition("-")
            cores.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ValueError(f"--contention-cores: CPU ids like 0,1 or 0-3, got {text!r}") from None
    if not cores or not cores <= set(allowed):
        raise ValueError(f"--contention-cores: {text!r} names no CPU or CPUs this process may not use "
                         f"(allowed: {','.join(map(str, allowed))})")
    return sorted(cores)


def setting_label(setting: str, spin_us: int) -> str:
    return {"off": "spin off", "on": f"IPCSYNC_SPIN_US={spin_us}",
            "on-nobackoff": f"IPCSYNC_SPIN_US={spin_us}, no backoff"}[setting]


# ------------------------------------------------------------------ in each process
def _pin(cores: list[int]) -> None:
    """Every thread of this process (and so every thread it starts later) on ``cores``."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


def _prepare(setting: str, cfg: dict[str, Any]) -> dict[str, int]:
    """Pin, set the spin for ``setting``, and count this process's spins from now on."""
    _pin(cfg["cores"])
    os.environ.pop("IPCSYNC_SPIN_US", None)
    if setting != "off":
        os.environ["IPCSYNC_SPIN_US"] = str(cfg["spin_us"])
    from ipcsync.core import spin as sp

    if setting == "on-nobackoff":
        sp.MISSES_BEFORE_BACKOFF = 1 << 62
    counts = {"spins": 0, "hits": 0}
    plan, hit = sp.AdaptiveSpin.plan, sp.AdaptiveSpin.hit

    def counted_plan(self: Any, timeout: float | None) -> float:
        s = plan(self, timeout)
        if s:
            counts["spins"] += 1
        return s

    def counted_hit(self: Any) -> None:
        counts["hits"] += 1
        hit(self)

    sp.AdaptiveSpin.plan, sp.AdaptiveSpin.hit = counted_plan, counted_hit  # type: ignore[method-assign]
    return counts


class _Window:
    """Wall and CPU time (user + sys, every thread) and spin counts from ``start()`` on."""

    def __init__(self, counts: dict[str, int]) -> None:
        self.counts = counts

    @staticmethod
    def cpu() -> float:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return ru.ru_utime + ru.ru_stime

    def start(self) -> None:
        for k in self.counts:
            self.counts[k] = 0
        self.t0, self.c0 = time.monotonic(), self.cpu()

    def end(self) -> dict[str, float]:
        return {"t0": self.t0, "t1": time.monotonic(), "cpu": self.cpu() - self.c0, **self.counts}


def _producer(results: Any, role: str, base: str, setting: str, cfg: dict[str, Any], barrier: Any) -> None:
    def run() -> dict[str, float]:
        window = _Window(_prepare(setting, cfg))
        import ipcsync

        dev = child_device(cfg["device"])
        src = torch.randint(0, 255, (NBYTES,), dtype=torch.uint8, device=dev)
        with ipcsync.Producer(base, slots=cfg["slots"], slot_bytes=NBYTES, device=dev, timeout=cfg["timeout"]) as out:
            out.wait_for_consumers(1, timeout=cfg["timeout"])
            for _ in range(WARM):
                out.send({"x": src})
            out.flush(timeout=cfg["timeout"])
            barrier.wait(cfg["timeout"])
            window.start()
            for _ in range(cfg["count"]):
                out.send({"x": src})
            return window.end()

    report(results, role, run)


def _consumer(results: Any, role: str, base: str, setting: str, cfg: dict[str, Any], barrier: Any) -> None:
    def run() -> dict[str, float]:
        window = _Window(_prepare(setting, cfg))
        import ipcsync

        dev = child_device(cfg["device"])
        with ipcsync.Consumer(base, device=dev, timeout=cfg["timeout"]) as inp:
            for k in range(WARM + cfg["count"]):
                if k == WARM:
                    barrier.wait(cfg["timeout"])
                    window.start()
                item = inp.get()
                if item is None:
                    raise ContentionError(f"the stream ended after {k} of {WARM + cfg['count']} items")
                _touch(item["x"])
                item.release()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            return window.end()

    report(results, role, run)


def _idle(results: Any, role: str, cfg: dict[str, Any], setting: str, kwargs: dict[str, Any]) -> None:
    def run() -> float:
        _prepare(setting, cfg)
        return (idle_producer if role == "producer" else idle_consumer)(**kwargs)

    report(results, role, run)


# ------------------------------------------------------------------ runner
def run_busy(setting: str, rnd: int, cfg: dict[str, Any], progress: Callable[[str], None]) -> dict[str, Any]:
    """One setting's run of P pairs at once; its aggregate numbers."""
    ctx, results = spawn()
    pairs = cfg["pairs"]
    barrier = ctx.Barrier(2 * pairs)
    base = f"cont-{os.getpid()}-{setting}-{rnd}"
    targets: dict[str, tuple[Callable[..., Any], tuple[Any, ...]]] = {}
    for i in range(pairs):
        for role, fn in (("producer", _producer), ("consumer", _consumer)):
            targets[f"{role} {i}"] = (fn, (results, f"{role} {i}", f"{base}-{i}", setting, cfg, barrier))
    load = os.getloadavg()[0]
    got = run_procs(f"contention {setting}-{rnd}", ctx, results, targets, cfg["timeout"], progress)
    t0 = min(w["t0"] for w in got.values())
    wall = max(w["t1"] for w in got.values()) - t0
    items = pairs * cfg["count"]
    cpu = sum(w["cpu"] for w in got.values())
    spins = sum(w["spins"] for w in got.values())
    return {"setting": setting, "round": rnd, "load": load, "rate": items / wall,
            "slowest": min(cfg["count"] / (got[f"consumer {i}"]["t1"] - t0) for i in range(pairs)),
            "cpu_us": cpu / items * 1e6, "busy": cpu / (wall * len(cfg["cores"])),
            "spins": spins / items, "hit": sum(w["hits"] for w in got.values()) / spins if spins else None}


def run_idle(setting: str, cfg: dict[str, Any], progress: Callable[[str], None]) -> dict[str, Any]:
    ctx, results = spawn()
    done = ctx.Event()
    kwargs = {"base": f"cont-{os.getpid()}-idle-{setting}", "seconds": cfg["idle"], "device": cfg["device"],
              "done": done}
    load = os.getloadavg()[0]
    got = run_procs(f"contention idle-{setting}", ctx, results,
                    {role: (_idle, (results, role, cfg, setting, kwargs)) for role in ("producer", "consumer")},
                    cfg["timeout"], progress)
    return {"setting": setting, "load": load, **got}


def run_contention(cfg: dict[str, Any], progress: Callable[[str], None]) -> dict[str, Any]:
    """``cfg``: device, pairs, cores, rounds, count, idle (seconds), spin_us, settings,
    slots, timeout. The busy rows in the order run, and the idle rows."""
    if cfg["device"].startswith("cuda") and not torch.cuda.is_available():
        raise ContentionError("--suite contention --device cuda needs a GPU")
    busy = []
    for rnd in range(1, cfg["rounds"] + 1):
        for setting in cfg["settings"]:
            progress(f"contention round {rnd}, {setting_label(setting, cfg['spin_us'])}: {cfg['pairs']} pairs x "
                     f"{cfg['count']} sends on CPUs {','.join(map(str, cfg['cores']))}")
            busy.append(run_busy(setting, rnd, cfg, progress))
    idle = []
    for setting in ("on", "off"):
        progress(f"contention idle pair, {setting_label(setting, cfg['spin_us'])}: {cfg['idle']:g} s")
        idle.append(run_idle(setting, cfg, progress))
    return {"cfg": cfg, "busy": busy, "idle": idle}


def means(res: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per setting: the mean over rounds of rate and cpu_us."""
    out: dict[str, dict[str, float]] = {}
    for setting in res["cfg"]["settings"]:
        rows = [r for r in res["busy"] if r["setting"] == setting]
        out[setting] = {k: sum(r[k] for r in rows) / len(rows) for k in ("rate", "cpu_us")}
    return out


def print_contention(res: dict[str, Any], header: Callable[[], None]) -> None:
    header()
    cfg = res["cfg"]
    spin_us = cfg["spin_us"]
    print(f"setup: {cfg['pairs']} producer->consumer pairs ({2 * cfg['pairs']} processes) at once, every thread "
          f"pinned to CPUs {','.join(map(str, cfg['cores']))}; each pair {cfg['count']:,} send()s of 4 KiB after "
          f"{WARM} untimed, slots {cfg['slots']}; settings interleaved per round; load = 1-minute load average "
          f"before the run")
    head = ("round", "setting", "load", "handoffs/s", "slowest pair/s", "CPU us/handoff", "cores busy",
            "spins/handoff", "spin hits")
    widths = (5, 34, 5, 10, 14, 14, 10, 13, 9)

    def row(cells: tuple[str, ...]) -> str:
        return "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    print(row(head))
    for r in res["busy"]:
        hit = "-" if r["hit"] is None else f"{100 * r['hit']:.0f}%"
        print(row((str(r["round"]), setting_label(r["setting"], spin_us), f"{r['load']:.1f}", f"{r['rate']:,.0f}",
                   f"{r['slowest']:,.0f}", f"{r['cpu_us']:.1f}", f"{r['busy']:.2f}", f"{r['spins']:.2f}", hit)))
    m = means(res)
    base = m.get("off")
    for setting, v in m.items():
        ratio = "" if base is None or setting == "off" else (
            f"  {v['rate'] / base['rate']:.2f}x the handoffs/s of spin off, {v['cpu_us'] / base['cpu_us']:.2f}x "
            f"its CPU per handoff")
        print(f"mean over {cfg['rounds']} round(s), {setting_label(setting, spin_us)}: {v['rate']:,.0f} handoffs/s, "
              f"{v['cpu_us']:.1f} CPU us/handoff{ratio}")
    for r in res["idle"]:
        print(f"idle pair, {setting_label(r['setting'], spin_us)} (load {r['load']:.1f}; {IDLE_WARM} items handed "
              f"over, then nothing for {cfg['idle']:g} s): producer {100 * r['producer']:.2f}% of a core, "
              f"consumer {100 * r['consumer']:.2f}% of a core")
