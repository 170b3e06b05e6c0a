#!/usr/bin/env bash
# Install ipcsync (editable) and its test dependencies into the current python3 environment.
# Reuses a torch that is already installed; otherwise installs torch==2.13.0 on a machine
# without an NVIDIA GPU (the CPU build where one is provided locally) and torch with CUDA on
# a machine with one. Safe to run again: it installs nothing that is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
pip_install() { "$PY" -m pip install --quiet --disable-pip-version-check "$@" 2> >(grep -v -e "is ignored: it is neither" -e "Running pip as the 'root' user" >&2); }

if "$PY" -c "import torch" 2>/dev/null; then
    echo "setup: reusing torch $("$PY" -c 'import torch; print(torch.__version__)')"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: installing torch (CUDA build)"
    pip_install torch
else
    echo "setup: no GPU found; installing torch==2.13.0 (CPU build)"
    pip_install "torch==2.13.0"
fi
# Checked from / so that the checkout itself is not on sys.path.
installed_at=$(cd / && "$PY" -c "import ipcsync, zmq, msgpack, pytest, xdist, hypothesis, os; print(os.path.dirname(os.path.dirname(ipcsync.__file__)))" 2>/dev/null || true)
if [ "$installed_at" != "$PWD" ]; then
    echo "setup: installing ipcsync (editable) with test dependencies"
    pip_install -e ".[test]"
fi
if ! command -v ipcsync-run >/dev/null 2>&1; then
    echo "setup: note: ipcsync-run is not on PATH here; use 'python3 -m ipcsync.launch' (same command)" >&2
fi
echo "setup: ok ($("$PY" --version), torch $("$PY" -c 'import torch; print(torch.__version__)'))"
