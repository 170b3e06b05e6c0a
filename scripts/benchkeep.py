"""The handoff suite's consumer that keeps received tensors (``bench.py --keep``; the
comparison for several devices is scripts/bench_kept.py): every received ``item["x"]``
goes into a list of the last ``keep`` items, no ``clone()``, so ipcsync moves each kept
item out of its slot for the ring to go on (the reference rule)."""

from __future__ import annotations

import time
from typing import Any

import torch

__all__ = ["kept_consumer"]


def kept_consumer(endpoint: str, n: int, device: str, wait: str, results: Any, refs_check: bool = True,
                  keep: int = 4) -> None:
    """bench.py's consumer, keeping the views of the last ``keep`` items."""
    import ipcsync
    from benchdevice import sync, touch

    lat = []
    kept: list[torch.Tensor] = []
    with ipcsync.Consumer(endpoint, device=device, wait=wait, heartbeat=None, timeout=60,
                          keep_refs_check=refs_check) as inp:
        t0 = None
        for k, item in enumerate(inp):
            x = item["x"]
            touch(x)
            kept.append(x)  # a view, kept past the item's release (no clone)
            if len(kept) > keep:
                del kept[0]
            del x
            now = time.monotonic_ns()
            if t0 is None:
                t0 = time.perf_counter()
            lat.append((now - item.meta) / 1e9)
            if k + 1 == n:
                break
        sync(device)
        elapsed = time.perf_counter() - t0
        moved = inp.stats()["kept_moved"]
    assert moved > 0 or n <= keep, "the kept views were never moved out of the ring"
    kept.clear()
    results.put((n - 1) / elapsed if n > 1 else float("nan"))
    results.put(lat)
