"""Programs that catch Ctrl-C and go on (a notebook, a REPL, a loop that checkpoints on
KeyboardInterrupt), for tests/integration/test_ctrl_c.py: the test sends them SIGINT again
and again while they stream, each once the last one was caught (``{"event": "caught"}``),
so no interrupt lands in the program's own ``except`` clause (a Python program cannot
catch one there). Each ignores SIGINT once its own part is over (so a late signal cannot
end its last calls), and says "done".

Item ``i`` is ``{"x": 16 floats equal to i}`` with meta ``i``."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import torch

import ipcsync

from .common import say


class Caught:
    """The interrupts a program caught (``n``), said as they come by a daemon thread (the
    main thread only counts: saying it there would open a window for the next one)."""

    def __init__(self) -> None:
        self.n = 0
        threading.Thread(target=self._say, daemon=True).start()

    def _say(self) -> None:
        said = 0
        while True:
            if self.n != said:
                said = self.n
                say(event="caught", n=said)
            time.sleep(0.001)


def stream(a: dict[str, Any]) -> None:
    """A producer sending items 0, 1, ... once a consumer is there, until the file
    ``stop`` exists, going on after each KeyboardInterrupt. What went out is what
    ``stats()`` counts (a Ctrl-C after a send returned, before the program noted it, must
    not send an item twice)."""
    caught = Caught()
    device = a.get("device", "cpu")
    with ipcsync.Producer(a["endpoint"], slots=a.get("slots", 4), slot_bytes=4096, timeout=30,
                          heartbeat=1.0, device=device) as out:
        say(event="bound")
        out.wait_for_consumers(1, timeout=30)
        said = False
        while True:
            try:
                if not said:  # (in the try: the test's interrupts may come at once)
                    say(event="streaming")
                    said = True
                while not os.path.exists(a["stop"]):
                    i = out.stats()["handoffs"]
                    out.send({"x": torch.full((16,), float(i), device=device)}, meta=i)
                break
            except KeyboardInterrupt:
                caught.n += 1
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        out.flush(timeout=30)  # every slot came back: nothing was lost on the way
        sent = out.stats()["handoffs"]
    say(event="done", sent=sent, interrupted=caught.n)


def take(a: dict[str, Any]) -> None:
    """A consumer iterating until the stream ends, going on after each KeyboardInterrupt:
    it notes every item's meta first, then checks its data and releases it."""
    caught = Caught()
    got: list[int] = []
    bad: list[str] = []
    with ipcsync.Consumer(a["endpoint"], timeout=30, heartbeat=1.0, device=a.get("device", "cpu")) as inp:
        said = False
        while True:
            try:
                if not said:
                    say(event="connected")
                    said = True
                for item in inp:
                    got.append(item.meta)  # (the first call in the body: a Ctrl-C lands after it)
                    # No name for the item's tensor: a Ctrl-C before a `del` would leave it
                    # viewing the slot, which then (the reference rule) never goes back.
                    if not bool((item["x"] == float(item.meta)).all()):
                        bad.append(f"item {item.meta} holds {item['x'].tolist()}")
                    item.release()  # (else the next iteration does: the producer's flush waits for it)
                break
            except KeyboardInterrupt:
                caught.n += 1
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    say(event="done", got=got, bad=bad[:5], interrupted=caught.n)


def astream(a: dict[str, Any]) -> None:
    """``stream`` under asyncio: ``asend`` in ``asyncio.run``, which a Ctrl-C ends (a
    KeyboardInterrupt, its tasks cancelled: a cancelled ``asend`` sent nothing); the
    program catches it and runs the coroutine again."""
    import asyncio

    caught = Caught()
    with ipcsync.Producer(a["endpoint"], slots=a.get("slots", 4), slot_bytes=4096, timeout=30,
                          heartbeat=1.0, device="cpu") as out:
        say(event="bound")
        out.wait_for_consumers(1, timeout=30)

        async def main() -> None:
            while not os.path.exists(a["stop"]):
                i = out.stats()["handoffs"]
                await out.asend({"x": torch.full((16,), float(i))}, meta=i)

        said = False
        while True:
            try:
                if not said:
                    say(event="streaming")
                    said = True
                asyncio.run(main())
                break
            except KeyboardInterrupt:
                caught.n += 1
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        out.flush(timeout=30)  # every slot came back, the items of left loops included
        sent = out.stats()["handoffs"]
    say(event="done", sent=sent, interrupted=caught.n)


def atake(a: dict[str, Any]) -> None:
    """``take`` under asyncio: ``async for`` in ``asyncio.run``, run again after each
    Ctrl-C; the items are auto-released (the loop a Ctrl-C left holds its current one
    until it is collected: then the next take gives it back)."""
    import asyncio

    caught = Caught()
    got: list[int] = []
    bad: list[str] = []
    with ipcsync.Consumer(a["endpoint"], timeout=30, heartbeat=1.0, device="cpu") as inp:

        async def main() -> None:
            async for item in inp:
                got.append(item.meta)  # (the first call in the body: a Ctrl-C lands after it)
                if not bool((item["x"] == float(item.meta)).all()):
                    bad.append(f"item {item.meta} holds {item['x'].tolist()}")

        said = False
        while True:
            try:
                if not said:
                    say(event="connected")
                    said = True
                asyncio.run(main())
                break
            except KeyboardInterrupt:
                caught.n += 1
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    say(event="done", got=got, bad=bad[:5], interrupted=caught.n)
