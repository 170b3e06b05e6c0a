"""Why a process died writing into memory ipcsync maps read-only.

Consumers map received items read-only (the CPU backend's arenas: ``backends.cpu``), so an
in-place op on a received tensor, or on a view kept from one, is a SIGSEGV in the process
that did it: no other reader sees the change. Python's own report of it is "Fatal Python
error: Segmentation fault" and a traceback (``faulthandler``, which consumers enable). So
that every such process also says why, launched by ``ipcsync-run`` or not, ipcsync
registers each read-only range it maps (``watch``: an arena, and each slot with the seq
of the item last received there) and installs a SIGSEGV handler the first time: a fault
inside a watched range writes one paragraph to stderr naming the item, the producer and
the fix (``clone()`` first), then the signal goes on to the handler that was there before
(faulthandler's traceback, then the default action: the process dies of SIGSEGV as
before). A fault anywhere else goes on untouched.

The handler is the compiled ``ipcsync._fault`` (ipcsync/_fault.c, built by setup.py;
``write(2)`` only, async-signal-safe). Where it is not built (or ``IPCSYNC_NATIVE=0``) a
stand-in does the same through ``ctypes``: a Python callback installed with libc's
``sigaction``, which looks the address up, writes the paragraph, puts the previous
handler back and returns, so the write faults again into that one. (It runs Python inside
a signal handler: acceptable for a process that is about to die of a fault in a plain
memory write, and only where the compiled one is missing.)

``handler()`` says which one is in use (``"compiled"``, ``"ctypes"``) or None.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
from typing import Any

from .envopts import NATIVE

__all__ = ["watch", "unwatch", "handler", "compiled", "MESSAGE"]

log = logging.getLogger(__name__)

# (The compiled handler writes the same words.)
MESSAGE = ("received tensors are zero-copy views of the producer's shared memory, mapped read-only so that no "
           "other reader sees a change, and an in-place op on one (x.add_(...), x[i] = v, out=x, ...) or on a "
           "view kept from it faults. clone() a received tensor before changing it in place: "
           "x = item[\"x\"].clone(). (The traceback below, where faulthandler is on, shows the line.)")

try:
    from . import _fault as _compiled
except ImportError:  # not built: the ctypes stand-in
    _compiled = None  # type: ignore[assignment]

_lock = threading.RLock()  # (unwatch may run from a finalizer inside watch: a collection)
_which: str | None = None  # the handler installed: "compiled", "ctypes", or None (not yet / cannot)
_tried = False


def compiled() -> bool:
    """Whether the compiled handler (``ipcsync._fault``) is built here."""
    return _compiled is not None


def handler() -> str | None:
    """Which handler explains write faults in this process: ``"compiled"``, ``"ctypes"``,
    or None (none installed yet, or none can be)."""
    return _which


def watch(start: int, nbytes: int, label: str, seq_address: int = 0) -> int | None:
    """Explain a write fault in ``[start, start + nbytes)``: ``label`` says whose memory it
    is; the int64 at ``seq_address`` (0: none) holds the seq of the item last received
    there (negative: none yet). Installs the handler the first time. Returns a token for
    ``unwatch`` (None: no handler can be installed here; nothing is explained)."""
    global _which, _tried
    if nbytes <= 0:
        return None
    with _lock:
        if not _tried or (_which == "compiled" and not _compiled.installed()):
            _which = _install()  # (ConfigError for a bad $IPCSYNC_NATIVE: said at each call)
            _tried = True
        if _which == "compiled":
            try:
                token: int = _compiled.watch(start, nbytes, label.encode("utf-8", "replace"), seq_address)
            except (OverflowError, ValueError) as exc:
                log.debug("ipcsync: read-only range not watched: %s", exc)
                return None
            return token
        if _which == "ctypes":
            return _stand_in.watch(start, nbytes, label, seq_address)
        return None


def unwatch(token: int | None) -> None:
    """Forget a range ``watch`` registered (a None token: nothing)."""
    if token is None:
        return
    with _lock:
        if _which == "compiled":
            _compiled.unwatch(token)
        elif _which == "ctypes":
            _stand_in.unwatch(token)


def _install() -> str | None:
    if not sys.platform.startswith("linux"):
        return None
    if _compiled is not None and NATIVE.get():
        try:
            _compiled.install()
            return "compiled"
        except OSError as exc:
            log.debug("ipcsync: no SIGSEGV handler: %s", exc)
            return None
    try:
        _stand_in.install()
        return "ctypes"
    except (OSError, AttributeError, TypeError) as exc:
        log.debug("ipcsync: no SIGSEGV handler: %s", exc)
        return None


# --------------------------------------------------------------------------- the ctypes stand-in
class _Sigaction(ctypes.Structure):
    """glibc's ``struct sigaction`` (Linux, every architecture but mips and alpha)."""

    _fields_ = [("handler", ctypes.c_void_p), ("mask", ctypes.c_ulong * (128 // ctypes.sizeof(ctypes.c_ulong))),
                ("flags", ctypes.c_int), ("restorer", ctypes.c_void_p)]


_SA_SIGINFO = 4
_SA_ONSTACK = 0x08000000
_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)


class _StandIn:
    """The handler as a ``ctypes`` callback (see the module docstring)."""

    def __init__(self) -> None:
        self.ranges: dict[int, tuple[int, int, str, int]] = {}
        self.next_token = 0
        self.previous = _Sigaction()
        self.callback: Any = None
        self.libc: Any = None

    def install(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.sigaction.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        self.callback = _CALLBACK(self.on_fault)
        ours = _Sigaction()
        ours.handler = ctypes.cast(self.callback, ctypes.c_void_p).value
        ours.flags = _SA_SIGINFO | _SA_ONSTACK
        if libc.sigaction(signal.SIGSEGV, ctypes.byref(ours), ctypes.byref(self.previous)) != 0:
            raise OSError(ctypes.get_errno(), "sigaction(SIGSEGV)")
        self.libc = libc

    def watch(self, start: int, nbytes: int, label: str, seq_address: int) -> int:
        token = self.next_token
        self.next_token += 1
        self.ranges[token] = (start, start + nbytes, label, seq_address)
        return token

    def unwatch(self, token: int) -> None:
        self.ranges.pop(token, None)

    def on_fault(self, sig: int, info: int | None, ctx: int | None) -> None:
        try:
            if info and ctypes.c_int.from_address(info + 8).value > 0:  # si_code: a real fault
                addr = ctypes.c_void_p.from_address(info + 16).value or 0  # si_addr
                best = None
                for start, end, label, seq_address in list(self.ranges.values()):
                    if start <= addr < end and (best is None or end - start < best[1] - best[0]):
                        best = (start, end, label, seq_address)
                if best is not None:
                    seq = ctypes.c_int64.from_address(best[3]).value if best[3] else -1
                    item = f"item {seq}, " if seq >= 0 else ""
                    os.write(2, f"\nipcsync: this process wrote into memory it received read-only ({item}{best[2]}): "
                                f"{MESSAGE}\n".encode("utf-8", "replace"))
        finally:
            # The handler that was there before takes the fault, which happens again on return.
            self.libc.sigaction(sig, ctypes.byref(self.previous), None)


_stand_in = _StandIn()
