"""How ipcsync logs, and the one place its log level is taken from the environment.

Every module of the library logs through ``logging.getLogger(__name__)``: loggers named
``ipcsync.<module>`` (``ipcsync.producer``, ``ipcsync.runtime.producer.peers``, ...), all below the
``ipcsync`` logger; the library never prints (``tests/unit/test_logging_rules.py``). Only
the command lines write to stdout/stderr themselves: their output is the program's
output, not library logging (see ``launch/cli.py`` and ``doctor/cli.py``).

``$IPCSYNC_LOG_LEVEL`` (``ipcsync-run --log-level`` sets it for every stage) is applied by
``apply_env_level()``, which the endpoints call once per process, and only where the
program has not configured logging itself: if the root logger or the ``ipcsync`` logger
has a handler, or the ``ipcsync`` logger has a level, nothing is changed. Otherwise the
``ipcsync`` logger gets that level and a handler writing ``LEVEL logger[pid]: message``
lines to stderr; that handler stands aside (writes nothing) once the program configures
the root logger later, so no line is written twice. Without the variable nothing is
configured: Python's default shows warnings and errors only.

Imports neither torch nor zmq (the launcher uses it).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Mapping

from .envopts import LOG_LEVEL
from .errors import ConfigError

__all__ = ["LOG_LEVEL_ENV", "LEVELS", "parse_level", "apply_env_level", "CliLogging"]

LOG_LEVEL_ENV = LOG_LEVEL.name
LEVELS = ("debug", "info", "warning", "error", "critical")
FORMAT = "%(levelname)s %(name)s[%(process)d]: %(message)s"

log = logging.getLogger(__name__)

_applied = False  # apply_env_level ran in this process (once is enough)


def parse_level(text: str, source: str = LOG_LEVEL_ENV) -> int:
    """The ``logging`` level named ``text`` (one of ``LEVELS``, any case); ConfigError
    naming ``source`` otherwise."""
    name = text.strip().lower()
    if name not in LEVELS:
        raise ConfigError(f"{source}: unknown log level {text!r}; use one of {', '.join(LEVELS)}")
    return int(getattr(logging, name.upper()))


class _EnvHandler(logging.StreamHandler):  # type: ignore[type-arg]  # (subscriptable only on 3.11+)
    """The handler ``apply_env_level`` installs: stands aside once the root logger has a
    handler (the program configured logging after all: its handlers get the records)."""

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return
        super().emit(record)


def user_configured() -> bool:
    """Whether the program configured logging for ipcsync's records: a handler on the root
    or the ``ipcsync`` logger, or a level on the ``ipcsync`` logger."""
    pkg = logging.getLogger("ipcsync")
    return bool(logging.getLogger().handlers or pkg.handlers or pkg.level != logging.NOTSET)


def apply_env_level(environ: Mapping[str, str] | None = None) -> bool:
    """Apply ``$IPCSYNC_LOG_LEVEL`` to the ``ipcsync`` logger (see the module docstring);
    True if it did. Once per process: later calls return False at once. A value that is
    not a level is reported (a warning) and ignored."""
    global _applied
    if _applied:
        return False
    _applied = True
    text = LOG_LEVEL.get(environ)
    if not text or user_configured():
        return False
    try:
        level = parse_level(text)
    except ConfigError as exc:
        log.warning("%s; ignored", exc)
        return False
    handler = _EnvHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT))
    pkg = logging.getLogger("ipcsync")
    pkg.addHandler(handler)
    pkg.setLevel(level)
    return True


class CliLogging:
    """A command line's own logging of ipcsync records (``ipcsync-run``, ``ipcsync
    doctor``): a handler on the ``ipcsync`` logger at ``level`` writing ``prefix: LEVEL
    logger: message`` to stderr while the command runs. ``close()`` takes it off again and
    restores the logger's level (the command may run inside another program: tests)."""

    def __init__(self, level: int, prefix: str) -> None:
        self.logger = logging.getLogger("ipcsync")
        self.old_level = self.logger.level
        self.handler = logging.StreamHandler(sys.stderr)
        self.handler.setFormatter(logging.Formatter(f"{prefix}: %(levelname)s %(name)s: %(message)s"))
        self.logger.addHandler(self.handler)
        self.logger.setLevel(level)

    def close(self) -> None:
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.old_level)
