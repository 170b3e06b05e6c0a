"""What every child-process role shares: ``say`` (a JSON line on stdout for the test to
follow) and the deterministic item ``expected(i)`` that ``check`` verifies."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import torch

import ipcsync

__all__ = ["say", "expected", "check", "plain"]

logging.basicConfig(level=os.environ.get("IPCSYNC_TEST_LOG", "WARNING"), format="%(levelname)s %(name)s: %(message)s")


def say(**kw: Any) -> None:
    print(json.dumps(kw), flush=True)


def expected(i: int, size: int, device: str = "cpu") -> dict[str, Any]:
    """Message ``i``: several dtypes, a nested list and tuple, a non-contiguous view."""
    base = torch.arange(size, dtype=torch.int64, device=device) * 7 + i
    return {
        "a": base,
        "b": [torch.full((3, 2), float(i), dtype=torch.float32, device=device).t(),
              (torch.tensor(i % 2 == 0, device=device),)],
        "c": torch.arange(12, dtype=torch.float64, device=device).reshape(3, 4)[:, ::2] + i,
    }


def check(item: ipcsync.Item, i: int, size: int, device: str = "cpu") -> str | None:
    """None if item holds message ``i``, else what is wrong."""
    exp = expected(i, size, device)
    got = item.tensors
    if item.meta != {"i": i, "tag": f"item-{i}"}:
        return f"meta {item.meta!r} != item {i}"
    pairs = [
        (got["a"], exp["a"]),
        (got["b"][0], exp["b"][0]),
        (got["b"][1][0], exp["b"][1][0]),
        (got["c"], exp["c"]),
    ]
    if not isinstance(got["b"][1], tuple):
        return "tuple came back as " + type(got["b"][1]).__name__
    for g, e in pairs:
        if g.dtype != e.dtype or g.shape != e.shape or g.stride() != e.stride() or not torch.equal(g, e):
            return f"item {i}: tensor mismatch {g.dtype}{tuple(g.shape)} vs {e.dtype}{tuple(e.shape)}"
    return None


def plain(x: Any) -> Any:
    """``x`` as JSON would give it back (a stats snapshot as its ``as_dict()``, odd values
    as text)."""
    return json.loads(json.dumps(x, default=lambda v: v.as_dict() if hasattr(v, "as_dict") else str(v)))
