"""A TCP port that accepts connections and never answers: what a process paused (SIGSTOP)
looks like to a client, or another service on the port that speaks no c10d store."""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import Iterator


@contextlib.contextmanager
def silent_listener() -> Iterator[int]:
    """A port on 127.0.0.1 for the block; every connection made to it, and the listener,
    closed after it."""
    accepted: list[socket.socket] = []
    stop = threading.Event()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        listener.settimeout(0.1)

        def accept() -> None:
            while not stop.is_set():
                try:
                    accepted.append(listener.accept()[0])  # and never answer
                except OSError:
                    continue

        t = threading.Thread(target=accept, daemon=True, name="silent-listener")
        t.start()
        try:
            yield int(listener.getsockname()[1])
        finally:
            stop.set()
            t.join(5)
            for c in accepted:
                c.close()
