"""Polling a condition in tests: ``wait_until(cond, timeout)`` calls ``cond`` every 10 ms
until it is true (True) or ``timeout`` seconds passed (then one last call decides).
Importable from tests/unit and tests/integration alike (this directory, the conftest's,
is on sys.path)."""

from __future__ import annotations

import time
from typing import Any, Callable


def wait_until(cond: Callable[[], Any], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return bool(cond())
