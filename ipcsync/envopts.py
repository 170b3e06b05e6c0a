"""Options read from the environment, each checked the same way: a clear ConfigError
naming the variable and what it got. Loads nothing but ``ipcsync.errors`` (the launcher
uses it before any pipeline runs)."""

from __future__ import annotations

import os

from .errors import ConfigError

__all__ = ["env_seconds"]


def env_seconds(name: str, default: float, most: float = 1e6) -> float:
    """``$name`` as a number of seconds, more than 0 and less than ``most``; ``default``
    when it is unset or empty. ConfigError for anything else."""
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"${name}={raw!r} is not a number of seconds") from None
    if not 0 < value < most:
        raise ConfigError(f"${name} must be a positive number of seconds (less than {most:g}), got {raw!r}")
    return value
