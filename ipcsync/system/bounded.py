"""A blocking call that may never return, waited for a bounded time.

For calls into libraries that give no timeout of their own: c10d's ``TCPStore`` client
waits for its server's answer in ``recv()`` with none (its constructor's validation,
``check``, ``add``, ``set``), so a server whose process is paused holds the caller for
ever. Torch-free: the launcher uses it too.

Invariant: the call runs on a daemon thread; the caller waits at most the bound, and a
call past it is left running (it ends when the server answers or the process exits;
nothing waits for it, and whatever it returns is dropped).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from ..interrupts import wait_point

__all__ = ["Job", "within"]


class Job:
    """One call, run by ``run`` (on whichever thread): ``done`` is set once it returned
    or raised."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.submitted = time.monotonic()
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.value = self.fn()
        except BaseException as exc:  # handed to whoever waits for it
            self.error = exc
        finally:
            self.done.set()

    def result(self) -> Any:
        """The call's value, or its exception raised here (only once ``done``)."""
        if self.error is not None:
            raise self.error
        return self.value


@wait_point
def within(fn: Callable[[], Any], bound: float, name: str) -> Any:
    """``fn()``'s value (or exception), waited for at most ``bound`` seconds on a daemon
    thread called ``name``; TimeoutError past it."""
    job = Job(fn)
    threading.Thread(target=job.run, name=name, daemon=True).start()
    if not job.done.wait(bound):
        raise TimeoutError(f"no answer within {bound:g} s")
    return job.result()
