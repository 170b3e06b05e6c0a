#!/usr/bin/env python3
"""A stage standing for a CUDA process under ipcsync-run's MPS daemon, on a machine
without a GPU (the launcher is tests/integration/fake_gpu_launch.py, the daemon
tests/fakemps.py; nothing here touches CUDA).

Unless ``detached``, it first tells the daemon ``attach <its pid>``, as the CUDA driver
connects a process to the daemon at its first CUDA call; then it runs the attachment
check (``ipcsync.mps_attach.check_attached``, which the CUDA backend runs), writes an
``mps`` marker with its MPS variables and pid, and does what its argument says: ``ok``
(exit 0), ``fail`` (exit 3), ``sleep`` (a ``ready`` marker, then sleep until stopped),
``detached`` (no attach: the check fails, and so does the stage).
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import stagelib  # noqa: E402

stagelib.record_pid()

from ipcsync.mps_attach import CONTROL, ENV_CONTROL, ENV_PIPE, LOG_ENV, PIPE_ENV, ask, check_attached  # noqa: E402

mode = sys.argv[1]
pipe = os.environ.get(PIPE_ENV)
if mode != "detached" and pipe:
    ask(pipe, f"attach {os.getpid()}", os.environ.get(ENV_CONTROL, CONTROL))
check_attached(timeout=1.0)
stagelib.mark("mps", pid=os.getpid(), **{k: os.environ.get(k) for k in (PIPE_ENV, LOG_ENV, ENV_PIPE, ENV_CONTROL)})
if mode == "fail":
    sys.exit(3)
if mode == "sleep":
    stagelib.mark("ready")
    while True:
        time.sleep(1)
stagelib.say(event="done")
