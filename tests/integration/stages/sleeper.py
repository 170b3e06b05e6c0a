#!/usr/bin/env python3
"""A stage that sleeps until it is stopped (no ipcsync endpoints).

On SIGTERM/SIGINT it writes a ``sig-<NAME>`` marker and exits with 128+N, or with
``--ignore-term`` keeps sleeping (only SIGKILL stops it; ``--ignore-term-on-restart R``:
only on attempt R). ``--exit-when FILE --code C``:
exit with code C once FILE exists. ``--chatty``: print a line every 10 ms.
``--watch-run-dir``: write a ``run-dir-gone`` marker if its run directory disappears
while it runs. Writes a ``ready`` marker once its handlers are set; an ``exit`` or
``died`` marker when it ends by itself, a ``sig-<NAME>`` marker for any other signal
that ends it (so a test that finds it gone can say why; SIGKILL leaves none).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import stagelib  # noqa: E402

stagelib.record_pid()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ignore-term", action="store_true")
    ap.add_argument("--ignore-term-on-restart", type=int, default=None, metavar="R",
                    help="ignore SIGTERM/SIGINT only on attempt R (ipcsync.stage.info().restart)")
    ap.add_argument("--exit-when", default=None, metavar="FILE")
    ap.add_argument("--code", type=int, default=0)
    ap.add_argument("--chatty", action="store_true", help="print a line every 10 ms")
    ap.add_argument("--watch-run-dir", action="store_true",
                    help="mark run-dir-gone if the run directory is removed while this process lives")
    args = ap.parse_args()
    run_dir = None
    if args.watch_run_dir:
        import json

        stats_path = json.loads(os.environ["IPCSYNC_WIRING"])["stats_path"]
        run_dir = os.path.dirname(os.path.dirname(stats_path))
    if args.ignore_term_on_restart is not None and args.ignore_term_on_restart == stagelib.ident()[2]:
        args.ignore_term = True

    def on_signal(signum: int, frame: object) -> None:
        stagelib.mark(f"sig-{signal.Signals(signum).name}")
        if not args.ignore_term:
            os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    def on_fatal(signum: int, frame: object) -> None:  # (a test that finds it dead says why)
        stagelib.mark(f"sig-{signal.Signals(signum).name}")
        os._exit(128 + signum)

    for fatal in (signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM):
        signal.signal(fatal, on_fatal)
    stagelib.mark("ready")
    stagelib.say(event="sleeping", pid=os.getpid())
    n = 0
    while True:
        if args.chatty:
            print(f"chatter {n}", flush=True)
            n += 1
            time.sleep(0.01)
            continue
        if run_dir is not None and not os.path.isdir(run_dir):
            stagelib.mark("run-dir-gone")
            run_dir = None
        if args.exit_when and os.path.exists(args.exit_when):
            stagelib.say(event="exiting", code=args.code)
            return args.code
        time.sleep(0.05)


if __name__ == "__main__":
    try:
        code = main()
    except BaseException as exc:  # (a test that finds it dead says why)
        stagelib.mark("died", error=repr(exc))
        raise
    stagelib.mark("exit", code=code)
    sys.exit(code)
