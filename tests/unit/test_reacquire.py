"""An endpoint takes its lock back after a wait however a Ctrl-C lands
(``runtime.endpoint.reacquire``, what ``EndpointBase._unlocked`` does after every wait).

The bug this guards: the wait's end re-took the lock with ``lock.acquire()`` retried on
any exception. A Ctrl-C handled as that acquire returned (the lock taken, the handler run
at the call's end) was retried, and the retry waited for ever on a lock its own thread
held: the producer wedged, silent, its consumers never told (seen once in a fresh-clone
run: a streaming producer Ctrl-C'd went silent instead of failing its consumer).

Each case runs in a child interpreter (a wedged main thread cannot hang the test worker;
the child's own watchdog ends it) where a helper thread holds the lock while the main
thread waits for it, and interrupts the main thread at a chosen moment."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_CHILD = textwrap.dedent(r"""
    import _thread, os, signal, sys, threading, time
    from ipcsync.runtime.endpoint import EndpointBase, reacquire

    how = sys.argv[1]
    main = threading.get_ident()

    def watchdog():
        time.sleep(20)
        print("WEDGED", flush=True)
        os._exit(3)

    threading.Thread(target=watchdog, daemon=True).start()
    lock = threading.Lock()
    holding = threading.Event()

    def helper():
        with lock:
            holding.set()
            time.sleep(0.3)  # the main thread waits for the lock meanwhile
            if how in ("after", "both"):
                _thread.interrupt_main()  # handled once the acquire has returned
            if how in ("while", "both"):
                signal.pthread_kill(main, signal.SIGINT)  # interrupts the wait itself
                time.sleep(0.2)

    def wait_then_take_back(take_back):
        threading.Thread(target=helper, daemon=True).start()
        holding.wait()
        return take_back()

    if sys.argv[2] == "reacquire":
        got = wait_then_take_back(lambda: reacquire(lock))
    else:  # the endpoint's own wait: _unlocked, lock held on entry
        ep = EndpointBase.__new__(EndpointBase)
        ep._lock, ep.blocked_calls, ep._closer = lock, 0, None
        lock.acquire()
        try:
            ep._unlocked(lambda: wait_then_take_back(lambda: None))
            got = None
        except KeyboardInterrupt as exc:
            got = exc
    print(type(got).__name__, lock.locked(), lock.acquire(blocking=False), flush=True)
""")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["after", "while", "both", "none"])
@pytest.mark.parametrize("entry", ["reacquire", "unlocked"])
def test_the_lock_is_taken_back_and_the_interrupt_kept(how: str, entry: str) -> None:
    """``after``: a Ctrl-C handled as the acquire returns (the lock taken); ``while``: one
    that interrupts the wait (not taken: it waits again); ``both``; ``none``. Every time
    the call returns with the lock held by its thread (a second acquire fails) and the
    KeyboardInterrupt handed back (``_unlocked``: raised), never wedged."""
    out = subprocess.run([sys.executable, "-c", _CHILD, how, entry], cwd=ROOT, capture_output=True,
                         text=True, timeout=40)
    assert "WEDGED" not in out.stdout, "the thread waited for ever on the lock it held"
    expected = "NoneType" if how == "none" else "KeyboardInterrupt"
    assert out.returncode == 0 and out.stdout.split() == [expected, "True", "False"], (out.stdout, out.stderr)
