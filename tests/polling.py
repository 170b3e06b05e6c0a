"""Polling a condition in tests: ``wait_until(cond, timeout)`` calls ``cond`` every 10 ms
until it is true (True) or ``timeout`` seconds passed (then one last call decides).
``in_call(thread, name, module)``: whether a thread is inside a call now (its stack has
a frame of function ``name`` from a file ending in ``module``), the observable state a
test waits for instead of sleeping and assuming a call has blocked.
Importable from tests/unit and tests/integration alike (this directory, the conftest's,
is on sys.path)."""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, Callable


def wait_until(cond: Callable[[], Any], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return bool(cond())


def in_call(thread: threading.Thread | int, name: str, module: str) -> bool:
    ident = thread if isinstance(thread, int) else thread.ident
    frame = sys._current_frames().get(ident) if ident is not None else None
    while frame is not None:
        if frame.f_code.co_name == name and frame.f_code.co_filename.endswith(module):
            return True
        frame = frame.f_back
    return False
