"""The launcher's SIGINT and SIGTERM while it supervises: noted, never raised.

While ``LauncherSignals.watching()`` holds, each of them only sets ``last`` and counts in
``count`` (the supervisor's poll reads both and decides), and Python's wakeup fd writes a
byte to a non-blocking pipe whose read end the attempt's selector holds, so a wait in
``select`` ends at once. On leaving, the handlers and wakeup fd from before are restored
and the pipe is closed. ``note`` is also how the relay reports a closed stdout (SIGPIPE).
"""

from __future__ import annotations

import contextlib
import os
import signal
from types import FrameType
from typing import Iterator

__all__ = ["LauncherSignals", "WATCHED"]

WATCHED = (signal.SIGINT, signal.SIGTERM)


class LauncherSignals:
    """The last signal the launcher got (None: none yet) and how many it got."""

    def __init__(self) -> None:
        self.last: int | None = None
        self.count = 0

    def note(self, signum: int, frame: FrameType | None = None) -> None:
        """The handler: remember ``signum``; nothing else (the poll loop acts on it)."""
        self.last = signum
        self.count += 1

    @contextlib.contextmanager
    def watching(self) -> Iterator[int]:
        """Handle ``WATCHED`` with ``note`` and wake a selector on each; yields the read
        end of the wakeup pipe (non-blocking)."""
        rfd, wfd = os.pipe()
        os.set_blocking(rfd, False)
        os.set_blocking(wfd, False)
        old_handlers = {s: signal.signal(s, self.note) for s in WATCHED}
        old_wakeup = signal.set_wakeup_fd(wfd, warn_on_full_buffer=False)
        try:
            yield rfd
        finally:
            signal.set_wakeup_fd(old_wakeup)
            for s, h in old_handlers.items():
                signal.signal(s, h)
            os.close(rfd)
            os.close(wfd)
