#!/usr/bin/env bash
# Set up this checkout: a Python environment with torch, ipcsync (editable, with the
# `ipcsync-run` command) and its runtime dependencies; `--test` adds the test dependencies
# (pytest, pytest-xdist, hypothesis) and the bench extra (matplotlib, for
# `scripts/bench.py --plot` and its tests). Safe to run again: it installs only what is missing.
#
# The environment is the active virtual environment if there is one (VIRTUAL_ENV, or a
# python3 whose sys.prefix is not its base prefix); otherwise .venv in the checkout, made
# with `python3 -m venv --system-site-packages` so that an installed torch is reused. Either
# way .venv is that environment afterwards (a link to the active one), so
# `. .venv/bin/activate` and .venv/bin/python are right in both cases. Nothing is installed
# into the system Python (PEP 668). Where venv cannot install pip (Debian/Ubuntu without
# python3-venv), .venv is made without pip and the system's pip installs into it
# (`python3 -m pip --python .venv/bin/python`); with no pip at all it says which package to
# install.
#
# torch: reused when the environment can import it. Otherwise, on a machine without an
# NVIDIA GPU, the CPU build of torch 2.13.0 (`torch==2.13.0+cpu`: the configured package
# sources first, then download.pytorch.org/whl/cpu; never the CUDA wheels), and on a
# machine with one, `torch` (the CUDA build).
#
# PYTHON=/path/to/python3 picks the interpreter that makes .venv (default: python3).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd -P)
TORCH_CPU="torch==2.13.0+cpu"
TORCH_CPU_INDEX="https://download.pytorch.org/whl/cpu"

say() { echo "setup: $*"; }
die() { echo "setup: error: $*" >&2; exit 1; }

TEST=0
for arg in "$@"; do
    case "$arg" in
        --test) TEST=1 ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "setup: unknown argument '$arg' (usage: scripts/setup.sh [--test])" >&2; exit 2 ;;
    esac
done

SYS_PY=${PYTHON:-python3}
command -v "$SYS_PY" >/dev/null 2>&1 || die "$SYS_PY not found: install Python 3.10 or newer (Debian/Ubuntu: apt-get install python3 python3-venv)"
"$SYS_PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
    || die "ipcsync needs Python 3.10 or newer; $SYS_PY is $("$SYS_PY" --version 2>&1)"

# ------------------------------------------------------------------ the environment
active=""
if [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then
    active=$VIRTUAL_ENV
elif "$SYS_PY" -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)'; then
    active=$("$SYS_PY" -c 'import sys; print(sys.prefix)')
fi
if [ -n "$active" ]; then
    active=$(cd "$active" && pwd -P)
    if [ "$active" = "$ROOT/.venv" ]; then
        say "using the active environment .venv"
    elif [ -L .venv ] || [ ! -e .venv ]; then
        ln -sfn "$active" .venv
        say "using the active environment $active (.venv links to it)"
    elif [ "$(cd .venv && pwd -P)" = "$active" ]; then
        say "using the active environment $active"
    else
        say "note: .venv is an environment of its own, so setting up .venv, not the active $active (remove .venv to use the active one)"
        active=""
    fi
fi
if [ -z "$active" ] && [ ! -e .venv ]; then
    say "creating .venv ($("$SYS_PY" --version 2>&1), --system-site-packages)"
    if ! venv_log=$("$SYS_PY" -m venv --system-site-packages .venv 2>&1); then
        rm -rf .venv  # made by the failed attempt just now
        if "$SYS_PY" -m venv --without-pip --system-site-packages .venv >/dev/null 2>&1; then
            say "venv could not install pip (no ensurepip; on Debian/Ubuntu it comes with: apt-get install python3-venv); made .venv without pip"
        else
            rm -rf .venv
            echo "$venv_log" >&2
            die "cannot create a virtual environment with $SYS_PY; on Debian/Ubuntu: apt-get install python3-venv (or activate a virtual environment of your own), then run this again"
        fi
    fi
fi
PY=$ROOT/.venv/bin/python
[ -n "$active" ] && PY=$active/bin/python
"$PY" -c '' 2>/dev/null || die "$PY does not run; remove .venv and run this again"

# pip for that environment: its own, else the system's pip pointed at it (pip >= 22.3).
if "$PY" -m pip --version >/dev/null 2>&1; then
    PIP=("$PY" -m pip)
elif "$PY" -m ensurepip --default-pip >/dev/null 2>&1 && "$PY" -m pip --version >/dev/null 2>&1; then
    PIP=("$PY" -m pip)
elif "$SYS_PY" -m pip --python "$PY" --version >/dev/null 2>&1; then
    say "installing with the system's pip: $SYS_PY -m pip --python $PY"
    PIP=("$SYS_PY" -m pip --python "$PY")
else
    die "no pip to install into $PY; on Debian/Ubuntu: apt-get install python3-venv, then run this again"
fi
pip_install() {
    "${PIP[@]}" install --quiet --disable-pip-version-check "$@" 2>&1 \
        | { grep -v -e "is ignored: it is neither" -e "Running pip as the 'root' user" || true; }
}
has() { (cd / && "$PY" -c "import $1" >/dev/null 2>&1); }
torch_version() { (cd / && "$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null); }

# ------------------------------------------------------------------ torch
if has torch; then
    say "reusing torch $(torch_version)"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    say "installing torch (CUDA build)"
    pip_install torch || die "installing torch failed (see above); install it as https://pytorch.org/get-started/locally/ says, then run this again"
else
    say "no NVIDIA GPU found; installing $TORCH_CPU (CPU build)"
    log=$(mktemp)
    trap 'rm -f "$log"' EXIT
    # The pin names the CPU build, so no candidate can be a CUDA wheel: first the configured
    # sources (a local copy, if any), then PyTorch's CPU index.
    if ! pip_install "$TORCH_CPU" >"$log" 2>&1; then
        if ! pip_install "$TORCH_CPU" --extra-index-url "$TORCH_CPU_INDEX" >>"$log" 2>&1; then
            cat "$log" >&2
            die "could not install $TORCH_CPU; install a CPU build of torch (https://pytorch.org/get-started/locally/) into $PY, then run this again"
        fi
    fi
fi
has torch || die "torch still does not import in $PY"

# ------------------------------------------------------------------ ipcsync
# Checked from / so that the checkout itself is not on sys.path.
needs="ipcsync, zmq, msgpack, numpy"
extra=""
if [ "$TEST" = 1 ]; then
    needs="$needs, pytest, xdist, hypothesis, matplotlib"
    extra="[test,bench]"
fi
installed_at=$(cd / && "$PY" -c "import $needs, os; print(os.path.dirname(os.path.dirname(ipcsync.__file__)))" 2>/dev/null || true)
if [ "$installed_at" != "$ROOT" ] || [ ! -x "$(dirname "$PY")/ipcsync-run" ]; then
    say "installing ipcsync (editable) with its ${extra:+test and bench }dependencies"
    pip_install -e ".$extra" || die "installing ipcsync failed (see above)"
fi
installed_at=$(cd / && "$PY" -c "import $needs, os; print(os.path.dirname(os.path.dirname(ipcsync.__file__)))" 2>/dev/null || true)
[ "$installed_at" = "$ROOT" ] || die "ipcsync from $ROOT does not import in $PY (got '$installed_at')"

say "ok: ${PY#"$ROOT"/} ($("$PY" --version 2>&1), torch $(torch_version)); run things with the environment active: . .venv/bin/activate"
