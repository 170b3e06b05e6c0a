"""Roles for the reference-rule tests (tests/integration/test_reference_rule.py): a
consumer that changes the items it receives in place (the bug the read-only mapping and
``verify=True`` catch)."""

from __future__ import annotations

import os
from typing import Any

import ipcsync

from .common import say


def inplace_consume(a: dict[str, Any]) -> None:
    """Receive from ``endpoint`` and do ``item["a"].mul_(0)`` on each item: on the CPU
    backend the first one faults (a read-only mapping); with ``verify`` (CUDA) a later call
    raises ItemWrittenError."""
    device = a.get("device", "cpu")
    n = 0
    options = {"verify": True} if a.get("verify") else {}
    with ipcsync.Consumer(a["endpoint"], device=device, timeout=30, heartbeat=1.0, **options) as inp:
        say(event="connected", pid=os.getpid())
        try:
            for item in inp:
                item["a"].mul_(0)  # the bug under test: an in-place op on a received tensor
                n += 1
                say(event="wrote", n=n)
        except ipcsync.ItemWrittenError as exc:
            say(event="caught", message=str(exc), n=n)
    say(event="done", wrote=n)


def write_one(a: dict[str, Any]) -> None:
    """Receive one item from ``endpoint`` and write into it: ``how="item"``:
    ``item["a"].add_(1)``; ``how="kept"``: a view kept from it, after ``release()``. On the
    CPU backend the write faults; the process must say why before it dies."""
    with ipcsync.Consumer(a["endpoint"], timeout=30, heartbeat=1.0) as inp:
        item = inp.get(timeout=30)
        say(event="got", seq=item.seq)
        if a["how"] == "item":
            item["a"].add_(1)  # the bug under test
        else:
            view = item["a"][1:]
            item.release()
            view.add_(1)  # the bug under test, after release()
        say(event="wrote")
