"""Rate-limited logging for messages a peer can trigger (bad frames, refused HELLOs, bogus
releases): a flood of them must cost neither the log nor the process serving good peers.

Per key: the first ``first`` records are logged as they come; after that at most one per
``every`` seconds, carrying how many records of that key were suppressed since the last one
logged. Keys are a few fixed categories chosen by the caller (never a peer-chosen value,
which would let a peer open a fresh budget per identity); their number is bounded anyway.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

__all__ = ["RateLog", "best_effort"]

_log = logging.getLogger(__name__)


def best_effort(what: str, *steps: Callable[[], Any]) -> None:
    """Run each cleanup step in turn; one that raises is logged at debug level, naming
    ``what`` was being cleaned up, and the others still run. Never raises (a close or a
    teardown must not fail because one resource was already gone)."""
    for step in steps:
        try:
            step()
        except Exception as exc:
            _log.debug("ipcsync %s: %s", what, exc)


class RateLog:
    """A rate limiter in front of ``logger``. Not thread-safe: used under one endpoint's lock."""

    __slots__ = ("_log", "_first", "_every", "_clock", "_max_keys", "_keys")

    def __init__(self, logger: logging.Logger, *, first: int = 5, every: float = 10.0,
                 clock: Callable[[], float] = time.monotonic, max_keys: int = 64) -> None:
        self._log = logger
        self._first = first
        self._every = every
        self._clock = clock
        self._max_keys = max_keys
        # key -> [records logged so far (capped at first), suppressed since the last logged
        # record, earliest time of the next logged record once the first ones are out]
        self._keys: dict[Any, list[Any]] = {}

    def warning(self, key: Any, msg: str, *args: Any) -> bool:
        """``logger.warning(msg, *args)`` unless rate-limited; True if it was logged."""
        return self.log(logging.WARNING, key, msg, *args)

    def log(self, level: int, key: Any, msg: str, *args: Any) -> bool:
        st = self._keys.get(key)
        if st is None:
            if len(self._keys) >= self._max_keys:
                self._keys.clear()
            st = self._keys[key] = [0, 0, 0.0]
        if st[0] < self._first:
            st[0] += 1
            if st[0] == self._first:
                st[2] = self._clock() + self._every
            self._log.log(level, msg, *args)
            return True
        now = self._clock()
        if now < st[2]:
            st[1] += 1
            return False
        suppressed, st[1] = st[1], 0
        st[2] = now + self._every
        if suppressed:
            self._log.log(level, msg + " [%d similar message(s) suppressed since the last one]",
                          *args, suppressed)
        else:
            self._log.log(level, msg, *args)
        return True
