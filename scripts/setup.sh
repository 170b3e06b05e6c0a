#!/usr/bin/env bash
# Set up this checkout: a Python environment with torch, ipcsync (editable, with the
# `ipcsync-run` command) and its runtime dependencies; `--test` adds the test dependencies
# (pytest, pytest-xdist, hypothesis, mypy: tests/unit/test_types.py type-checks the package)
# and the bench extra (matplotlib, for
# `scripts/bench.py --plot` and its tests). Safe to run again: it installs only what is missing,
# and when nothing is (torch is there, every requirement of ipcsync's installed metadata is
# installed at a version it accepts, that metadata is not older than pyproject.toml, ipcsync
# resolves to this checkout, imports, its commands exist, and its compiled copy
# ipcsync._native is built and not older than ipcsync/_native.c wherever a C compiler and the
# Python headers are there; setup.py builds it, optionally) it starts the environment's
# Python once, without importing torch, and calls no pip: about a second.
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
# torch: reused when the environment has it (found with its installed version). Otherwise, on a machine without an
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
# One start of it: "ok" (3.10 or newer) or "old", then its prefix when it is a virtual environment.
sys_info=$("$SYS_PY" -c 'import sys; print("ok" if sys.version_info >= (3, 10) else "old"); print(sys.prefix if sys.prefix != sys.base_prefix else "")') \
    || die "$SYS_PY does not run"
[ "$(sed -n 1p <<<"$sys_info")" = ok ] || die "ipcsync needs Python 3.10 or newer; $SYS_PY is $("$SYS_PY" --version 2>&1)"

# ------------------------------------------------------------------ the environment
active=""
if [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then
    active=$VIRTUAL_ENV
else
    active=$(sed -n 2p <<<"$sys_info")
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
extras=""
[ "$TEST" = 1 ] && extras="test bench"

# What the environment has, in one start of its Python, from / (so that the checkout itself
# is not on sys.path): "torch=VERSION" (empty when there is none), "at=DIR" (where ipcsync
# resolves from), then one "missing=..." line per requirement of ipcsync's metadata (with
# the extras asked for) that is absent or too old, per module of ipcsync, zmq and msgpack
# that does not import, and when that metadata is older than pyproject.toml. Imports
# ipcsync, zmq and msgpack; finds torch and the others by their installed metadata (an
# import of torch takes seconds).
probe() {
    (cd / && "$PY" - "$ROOT" "$extras" 2>/dev/null <<'PYEOF'
import importlib.metadata as md, importlib.util, os, re, sys
root, extras = sys.argv[1], set(sys.argv[2].split())
try:  # found, with its installed version, without paying for its import (seconds)
    torch = importlib.util.find_spec("torch") is not None and md.version("torch")
except Exception:  # no metadata (a source build on the path): import it
    try:
        import torch
        torch = torch.__version__
    except Exception:
        torch = ""
print(f"torch={torch or ''}")
try:
    spec = importlib.util.find_spec("ipcsync")
    at = os.path.dirname(os.path.dirname(spec.origin)) if spec is not None and spec.origin else ""
except Exception:
    at = ""
at = os.path.realpath(at) if at else ""
print("at=" + at)
if at != os.path.realpath(root):
    sys.exit(0)

def vt(v):  # "2.13.0+cpu" -> (2, 13, 0)
    out = []
    for part in v.split("."):
        m = re.match(r"\d+", part)
        if not m:
            break
        out.append(int(m.group()))
        if m.end() != len(part):
            break
    return tuple(out)

def applies(marker):  # the markers ipcsync's metadata uses: extra == "x", python_version <op> "x.y"
    for clause in marker.split(" and "):
        m = re.fullmatch(r'\s*\(?\s*(extra|python_version)\s*(==|!=|<=|>=|<|>)\s*"([^"]*)"\s*\)?\s*', clause)
        if m is None:
            continue  # another marker: check the requirement
        key, op, value = m.groups()
        if key == "extra":
            if (value in extras) != (op == "=="):
                return False
        else:
            a, b = sys.version_info[:2], vt(value)
            if not {"==": a == b, "!=": a != b, "<=": a <= b, ">=": a >= b, "<": a < b, ">": a > b}[op]:
                return False
    return True

try:
    dist = md.distribution("ipcsync")
    meta = dist.locate_file(f"ipcsync-{dist.version}.dist-info/METADATA")
    stale = os.path.getmtime(meta) < os.path.getmtime(os.path.join(root, "pyproject.toml"))
    requires = dist.requires or []
except Exception:
    stale, requires = True, []
if stale:
    print("missing=ipcsync's installed metadata (older than pyproject.toml)")
broken = set()
for module, name in (("ipcsync", "ipcsync"), ("zmq", "pyzmq"), ("msgpack", "msgpack")):
    try:
        __import__(module)
    except Exception as exc:
        broken.add(name)
        print(f"missing={name} (import {module}: {type(exc).__name__})")
# The compiled copy (ipcsync._native, optional): "native=ok", "native=missing" (not built,
# or older than its source, where a C compiler and the Python headers are there: the
# editable install builds it) or "native=cannot: why" (ipcsync then copies with torch).
import sysconfig
cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
import shutil
why = ("no C compiler (" + cc + ")" if shutil.which(cc) is None else
       "no Python headers (Python.h)" if not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))
       else "")
try:
    import ipcsync._native as native
    fresh = os.path.getmtime(native.__file__) >= os.path.getmtime(os.path.join(root, "ipcsync", "_native.c"))
    print("native=" + ("ok" if fresh or why else "missing"))
except ImportError:
    print("native=" + (f"cannot: {why}" if why else "missing"))
for req in requires:
    m = re.fullmatch(r"\s*([A-Za-z0-9._-]+)\s*(?:\[[^\]]*\])?\s*\(?([^;()]*)\)?\s*(?:;(.*))?", req)
    if m is None or m.group(1) in broken or not applies(m.group(3) or ""):
        continue
    name, specifiers = m.group(1), m.group(2)
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        print(f"missing={name}")
        continue
    for sp in specifiers.split(","):
        sp = sp.strip()
        if sp.startswith(">=") and vt(have) < vt(sp[2:]):
            print(f"missing={name}{sp} (have {have})")
PYEOF
    )
}
field() { sed -n "s/^$1=//p" <<<"$state"; }
state=$(probe) || die "$PY does not run; remove .venv and run this again"

# pip for that environment, found only when something is to be installed: its own, else
# the system's pip pointed at it (pip >= 22.3).
PIP=()
find_pip() {
    [ ${#PIP[@]} -gt 0 ] && return
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
}
pip_install() {
    find_pip
    "${PIP[@]}" install --quiet --disable-pip-version-check "$@" 2>&1 \
        | { grep -v -e "is ignored: it is neither" -e "Running pip as the 'root' user" || true; }
}

# ------------------------------------------------------------------ torch
if [ -n "$(field torch)" ]; then
    say "reusing torch $(field torch)"
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
[ -n "$(field torch)" ] || state=$(probe) || die "$PY does not run"

# ------------------------------------------------------------------ ipcsync
# The editable install must be this checkout's, with its commands, every requirement met
# and the compiled copy built where it can be (the install builds it in place).
if [ -z "$(field torch)" ] || [ "$(field at)" != "$ROOT" ] || [ -n "$(field missing)" ] \
        || [ "$(field native)" = missing ] \
        || [ ! -x "$(dirname "$PY")/ipcsync-run" ] || [ ! -x "$(dirname "$PY")/ipcsync" ]; then
    if [ -n "$(field missing)" ]; then
        say "to install: $(field missing | paste -sd, - | sed 's/,/, /g')"
    fi
    if [ "$(field native)" = missing ]; then
        say "to build: the compiled copy (ipcsync._native)"
    fi
    say "installing ipcsync (editable) with its ${extras:+test and bench }dependencies"
    pip_install -e ".${extras:+[${extras// /,}]}" || die "installing ipcsync failed (see above)"
    state=$(probe) || die "$PY does not run"
fi
[ -n "$(field torch)" ] || die "torch still does not import in $PY"
[ "$(field at)" = "$ROOT" ] || die "ipcsync from $ROOT does not import in $PY (got '$(field at)')"
[ -z "$(field missing)" ] || die "still missing in $PY: $(field missing | paste -sd, - | sed 's/,/, /g')"
case "$(field native)" in
    ok) ;;
    cannot*) say "note: the compiled copy (ipcsync._native) cannot be built here ($(field native | sed 's/^cannot: //')): ipcsync copies with torch (slower steady sends; everything else is the same)" ;;
    *) say "note: the compiled copy (ipcsync._native) did not build (pip install -e . -v shows why): ipcsync copies with torch" ;;
esac

say "ok: ${PY#"$ROOT"/} ($("$PY" --version 2>&1), torch $(field torch)); run things with the environment active: . .venv/bin/activate"
