"""Spawned processes of one comparison run of scripts/bench.py's suites that live in their
own modules (weightsync, gpupipe): each process reports one result through ``report``;
``run_procs`` starts them, collects every result, and joins or kills them all, pass or
fail. ``context()`` is the start method of every process any suite starts
(``--start-method``, set once by ``use_start_method``)."""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import queue
import time
import traceback
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent


def load_example(name: str) -> Any:
    """examples/<name>.py (e.g. "weight_sync/weights") as a module of a private name: the
    examples' own module names are generic, and their directories are not on sys.path."""
    path = ROOT / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location("ipcsync_bench_" + name.replace("/", "_"), path)
    assert spec is not None and spec.loader is not None, path
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class ProcsError(Exception):
    """A process failed, died without a result or ran out of time (the text says which)."""


def report(results: Any, role: str, fn: Callable[[], Any]) -> None:
    """What a spawned process runs: ``fn()``, its value or its traceback put on ``results``."""
    try:
        value = fn()
    except BaseException:
        results.put(("error", role, traceback.format_exc()))
        raise SystemExit(1)
    results.put(("ok", role, value))


def run_procs(what: str, ctx: Any, results: Any, targets: dict[str, tuple[Callable[..., Any], tuple[Any, ...]]],
              timeout: float, progress: Callable[[str], None], queues: tuple[Any, ...] = ()) -> dict[str, Any]:
    """Start ``role: (target, args)`` with ``ctx`` (each calls ``report(results, role, ...)``)
    and return every role's value. ProcsError as soon as one fails or dies, or after
    ``timeout`` seconds; every process is gone when this returns or raises, and
    ``results`` and ``queues`` (the run's other queues) are closed."""
    procs = {role: ctx.Process(target=fn, args=args, name=role) for role, (fn, args) in targets.items()}
    got: dict[str, Any] = {}
    try:
        for role, p in procs.items():
            p.start()
            progress(f"{what}: started {role} (pid {p.pid})")
        deadline = time.monotonic() + timeout
        dead_since: dict[str, float] = {}
        while len(got) < len(procs):
            left = deadline - time.monotonic()
            if left <= 0:
                raise ProcsError(f"{what}: no result from {', '.join(sorted(set(procs) - set(got)))} "
                                 f"within {timeout:.0f} s")
            try:
                status, role, value = results.get(timeout=min(left, 0.5))
            except queue.Empty:
                now = time.monotonic()
                for role, p in procs.items():
                    # Exited without a result: it may still be in the pipe, for a few seconds.
                    if role not in got and p.exitcode is not None and now - dead_since.setdefault(role, now) > 5:
                        raise ProcsError(f"{what}: {role} (pid {p.pid}) exited with code {p.exitcode} "
                                         "without a result") from None
                continue
            if status != "ok":
                raise ProcsError(f"{what}: {role} failed:\n{value}")
            got[role] = value
    finally:
        grace = 30.0 if len(got) == len(procs) else 1.0
        for p in procs.values():
            p.join(grace)
            if p.is_alive():
                p.kill()
                p.join(5)
        for q in (results, *queues):
            q.close()
    return got


START_METHODS = ("spawn", "forkserver")
# forkserver: one server process imports these once; every process is then a fork of it,
# without an interpreter start and torch's import of its own (what makes a smoke run slow).
# ipcsync is not among them: a process imports it after setting its own environment.
FORKSERVER_PRELOAD = ["__main__", "torch", "torch.multiprocessing"]
_start_method = "spawn"


def use_start_method(method: str) -> None:
    """Start every later process with ``method`` ("spawn", the default: a fresh
    interpreter per process; "forkserver": a fork of a server that imported torch once,
    with the same pickled targets and arguments)."""
    global _start_method
    if method not in START_METHODS:
        raise ValueError(f"start method {method!r}: choose from {', '.join(START_METHODS)}")
    _start_method = method


def context() -> Any:
    """The multiprocessing context every suite starts its processes with."""
    ctx = mp.get_context(_start_method)
    if _start_method == "forkserver":
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    return ctx


def spawn() -> tuple[Any, Any]:
    """The context of ``context()`` and a results queue for ``run_procs``."""
    ctx = context()
    return ctx, ctx.Queue()
