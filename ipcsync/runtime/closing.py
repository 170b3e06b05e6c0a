"""What bounds a producer's ``close()`` when nobody can end its wait.

``close()`` waits for consumers: to take what is queued, to release what they hold. Two
waits have nobody to end them, and neither is waited out:

- **Items queued while no consumer is attached** wait ``linger`` seconds for one to
  attach (``Linger``), then are dropped with a warning naming how many
  (``dropped_words``). Default: ``FIRST_LINGER_S`` when no consumer ever attached
  (either side may start first, so a consumer still starting up gets them), and
  ``LEFT_LINGER_S`` once every consumer that attached has left. A consumer attached and
  alive is waited for as before (its items are its own to release, the liveness rule).
- **A ``Producer.slot()`` tensor kept past its block** (``SlotKeptError``): nothing was
  sent from that slot, and only the program can drop the tensor; close() does not wait
  for it, it names it (``kept_words``: the field, its shape and dtype, the fix). The
  tensor stays valid: it keeps its own reference to the memory, which the producer's
  close does not take away (a CPU arena's name is unlinked, its mapping lives on with the
  tensor).

And what an ``abort`` (a failed end of the stream) tells consumers: ``failure_text``.

Pure: no clock, no I/O, no torch.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, NamedTuple, Sequence

from ..errors import ConfigError

__all__ = ["FIRST_LINGER_S", "LEFT_LINGER_S", "Linger", "DEFAULT_LINGER", "kept_words", "dropped_words", "failure_text"]

# close(): how long items queued for nobody wait for a consumer to attach.
FIRST_LINGER_S = 10.0  # no consumer ever attached
LEFT_LINGER_S = 2.0  # every consumer that attached has left


class Linger(NamedTuple):
    """``close(linger=...)`` resolved: seconds queued items wait for a consumer when none
    ever attached (``first``) and once all that attached left (``left``); None: up to
    close()'s timeout."""

    first: float | None
    left: float | None

    @classmethod
    def of(cls, linger: float | None) -> "Linger":
        """``close(linger=...)`` given: the same for both (ConfigError if not seconds)."""
        if linger is not None and (not isinstance(linger, (int, float)) or isinstance(linger, bool)
                                   or math.isnan(linger) or linger < 0):
            raise ConfigError(f"linger must be a number of seconds >= 0, or None (up to timeout), got {linger!r}")
        value = None if linger is None or math.isinf(linger) else float(linger)
        return cls(value, value)

    def after(self, attached_ever: int) -> float | None:
        return self.left if attached_ever else self.first


DEFAULT_LINGER = Linger(FIRST_LINGER_S, LEFT_LINGER_S)


def kept_words(producer: str, fields: Mapping[str, tuple[Sequence[int], Any]], held: Sequence[str]) -> str:
    """Which tensor of a ``Producer.slot()`` block of ``producer`` outlived it, and the
    fix. ``fields``: the block's ``name -> (shape, dtype)``; ``held``: the names whose
    very tensor the program still references (empty: a view or storage made from one)."""
    def one(name: str) -> str:
        shape, dtype = fields[name]
        return f"s[{name!r}] (shape {tuple(shape)}, {dtype})"

    if held:
        which = f"the tensor{'s' if len(held) > 1 else ''} " + " and ".join(one(n) for n in held)
    else:
        which = "a view or storage made from " + (" or ".join(one(n) for n in fields) or "its tensors")
    return (f"producer {producer!r}: {which} taken from a Producer.slot() block is still referenced "
            "after the block ended, so its item was not sent (a write through it would change an item "
            "already sent); del it before the block ends, or clone() it if you need its values later")


def dropped_words(n: int, attached_ever: int, linger: float | None) -> str:
    """The warning's text for ``n`` queued items dropped at close."""
    if linger is None:
        why = "no consumer was attached when close()'s timeout ran out"
    elif attached_ever:
        why = (f"every consumer that attached ({attached_ever}) had left and none attached within "
               f"{linger:g} s")
    else:
        why = f"no consumer attached within {linger:g} s"
    return (f"closed with {n} queued item(s) that no consumer took: dropped ({why}); to deliver them, "
            "keep a consumer attached until close() returns, call wait_for_consumers() before "
            "close(), or pass close(linger=...)")

def failure_text(error: BaseException | str | None) -> str:
    """What an ERROR ``failed`` says of ``error``: an exception's type and message, or a text."""
    if isinstance(error, BaseException):
        return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    return error or "aborted"
