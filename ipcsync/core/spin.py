"""When a blocking wait spins before it parks (pure: the time is passed in).

A wait that spins (polls its input, yielding the CPU with ``os.sched_yield()`` between
polls) sees an answer that comes within the spin without a sleep and a wake-up. Spinning
costs a core while it lasts, so it is done only where it is likely to pay:

- never longer than the budget (``IPCSYNC_SPIN_US``) per wait;
- only while the peer was recently active: the previous wait was answered during its
  spin, or after a park no longer than ``ACTIVE_WINDOW_S``. A wait whose park lasted
  longer, or that timed out, makes the next wait park at once: an idle endpoint spins at
  most once after its last activity, then never until the peer is active again;
- not while spinning keeps finding nothing: after ``MISSES_BEFORE_BACKOFF`` fruitless
  spins in a row, only every 2nd, 4th, ... (up to every ``MAX_SKIP + 1``-th) wait spins,
  until a spin finds its answer again. An oversubscribed host, where the peer cannot run
  while we spin, thus stops paying for spins within a few waits.

A wait that is answered before it would spin (its input was already there) changes
nothing.
"""

from __future__ import annotations

__all__ = ["ACTIVE_WINDOW_S", "MISSES_BEFORE_BACKOFF", "MAX_SKIP", "AdaptiveSpin"]

ACTIVE_WINDOW_S = 0.002  # a park answered within this long: the peer is active
MISSES_BEFORE_BACKOFF = 4  # fruitless spins in a row before spins are skipped
MAX_SKIP = 63  # at most this many waits in a row park without spinning


class AdaptiveSpin:
    """The spin decision of one endpoint's waits. ``plan(timeout)`` before a wait: how
    long to spin (0: park at once). Then exactly one of ``hit()`` (the spin found the
    answer), ``missed()`` (the spin ended without it; the wait goes on to park) and, after
    a park, ``parked(seconds, answered)``."""

    __slots__ = ("budget", "active", "misses", "skip", "to_skip")

    def __init__(self, budget_s: float) -> None:
        if budget_s < 0:
            raise ValueError(f"a spin budget is a non-negative number of seconds, got {budget_s}")
        self.budget = budget_s
        self.active = False  # the peer answered recently (no spin before the first answer)
        self.misses = 0  # fruitless spins in a row
        self.skip = 0  # waits left to park without spinning (backoff)
        self.to_skip = 0  # the backoff's current length

    def plan(self, timeout: float | None) -> float:
        """Seconds to spin in the wait about to start (``timeout``: the wait's own bound)."""
        if not self.budget or not self.active:
            return 0.0
        if self.skip:
            self.skip -= 1
            return 0.0
        return self.budget if timeout is None else max(0.0, min(self.budget, timeout))

    def hit(self) -> None:
        """The spin found the answer: the peer is active and spinning pays."""
        self.active = True
        self.misses = self.skip = self.to_skip = 0

    def missed(self) -> None:
        """The spin ended without the answer."""
        self.misses += 1
        if self.misses >= MISSES_BEFORE_BACKOFF:
            self.to_skip = min(MAX_SKIP, 2 * self.to_skip + 1)
            self.skip = self.to_skip

    def parked(self, seconds: float, answered: bool) -> None:
        """The wait parked ``seconds`` and then got its answer (``answered``) or ended
        without it (timeout, error)."""
        self.active = answered and seconds <= ACTIVE_WINDOW_S
