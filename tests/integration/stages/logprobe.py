#!/usr/bin/env python3
"""Logging probe stage: a Producer and a Consumer of its own (so the library applies
``$IPCSYNC_LOG_LEVEL`` and logs a real debug line, a consumer attaching), then one line
at each level on an ``ipcsync.*`` logger: "probe debug", "probe info", "probe warning".

``--configure``: call ``logging.basicConfig`` first (format "USER LEVEL name: message",
level INFO), as a program that configures logging itself.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import stagelib  # noqa: E402

stagelib.record_pid()

import torch  # noqa: E402

import ipcsync  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configure", action="store_true")
    args = ap.parse_args()
    if args.configure:
        logging.basicConfig(level=logging.INFO, format="USER %(levelname)s %(name)s: %(message)s")
    name = f"logprobe-{os.getpid()}"
    with ipcsync.Producer(name, slots=1, slot_bytes=4096, device="cpu", timeout=30) as out, \
            ipcsync.Consumer(name, device="cpu", timeout=30) as inp:
        out.send({"x": torch.zeros(2)})
        inp.get().release()
    probe = logging.getLogger("ipcsync.probe")
    probe.debug("probe debug")
    probe.info("probe info")
    probe.warning("probe warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
