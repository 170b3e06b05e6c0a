"""Roles for tests/integration/test_forkserver.py: what a peer sees of its start and how
its end is reported, the same for a forked peer and a fresh interpreter."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from typing import Any


def say(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def describe(a: dict[str, Any]) -> None:
    """Print what this process was given: environment, directory, session, stdin, SIGINT."""
    say(event="done", env=os.environ.get(a["var"]), cwd=os.getcwd(), sid=os.getsid(0), pid=os.getpid(),
        stdin=sys.stdin.read(), sigint=signal.getsignal(signal.SIGINT) is signal.default_int_handler)


def end(a: dict[str, Any]) -> None:
    """End as ``a["how"]`` says."""
    how = a["how"]
    say(event="ready", pid=os.getpid())
    if how == "raise":
        raise RuntimeError("raised by the role")
    if how == "exit3":
        sys.exit(3)
    if how == "exit_text":
        sys.exit("a text exit")
    if how == "ctrl_c":
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(30)
    if how == "wait":
        time.sleep(60)
    if how == "thread":  # a non-daemon thread the exit waits for
        threading.Thread(target=lambda: (time.sleep(0.3), say(event="thread done"))).start()
    if how == "atexit":
        import atexit  # noqa: PLC0415

        atexit.register(lambda: say(event="atexit ran"))
