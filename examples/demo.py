#!/usr/bin/env python3
"""Runs the demo pipeline: one producer process and one consumer process.

Uses CUDA when a GPU is present, else the CPU backend. Each line of a process's output is
prefixed with its name; the demo exits with the first failing process's code.

    python3 examples/demo.py [--batches N]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading

HERE = os.path.dirname(os.path.abspath(__file__))


def pump(name: str, stream) -> None:
    for line in iter(stream.readline, b""):
        sys.stdout.write(f"[{name}] {line.decode(errors='replace')}")
        sys.stdout.flush()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batches", type=int, default=300)
    args = ap.parse_args()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # Like torchrun: one intra-op thread per process unless told otherwise, so processes
    # sharing a few cores do not spin against each other in OpenMP.
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("IPCSYNC_RUNTIME_DIR", tempfile.mkdtemp(prefix="ipcsync-demo-"))
    procs = {
        "producer": [sys.executable, os.path.join(HERE, "producer.py"), "--batches", str(args.batches)],
        "consumer": [sys.executable, os.path.join(HERE, "consumer.py")],
    }
    running = {}
    threads = []
    try:
        for name, cmd in procs.items():
            p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
            running[name] = p
            t = threading.Thread(target=pump, args=(name, p.stdout), daemon=True)
            t.start()
            threads.append(t)
        codes = {name: p.wait(timeout=600) for name, p in running.items()}
    finally:
        for p in running.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        for t in threads:
            t.join(timeout=5)
    failed = [(n, c) for n, c in codes.items() if c != 0]
    if failed:
        print(f"demo: {failed[0][0]} failed with exit code {failed[0][1]}")
        return failed[0][1]
    print("demo: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
