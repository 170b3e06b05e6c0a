"""Why a process that maps received CUDA items read-only got a GPU fault.

A consumer maps the memory it receives by descriptor read-only (``backends.cuda_vmm``), so
an in-place op on a received tensor faults the GPU in the process that ran it instead of
changing what other readers see. CUDA reports that as a bare "an illegal memory access was
encountered", at the next call that syncs, wherever it is. Once this process maps such
memory (``watching``), an exception escaping the program with that text (or a driver
error of that code inside ipcsync, ``explain``) is followed by one paragraph naming the
likely cause and the fix. Never raises, never changes the exception.

Imports nothing of ipcsync.
"""

from __future__ import annotations

import sys
import threading
from types import TracebackType
from typing import Any

__all__ = ["watching", "explain", "HINT", "ILLEGAL_ADDRESS"]

ILLEGAL_ADDRESS = 700  # CUDA_ERROR_ILLEGAL_ADDRESS
_TEXT = "illegal memory access"
HINT = ("ipcsync: this process maps the CUDA items it receives read-only, and a write into one faults the GPU "
        "(CUDA then says 'an illegal memory access was encountered', at the next call that waits for the GPU, "
        "wherever that is): an in-place op on a received tensor (x.add_(...), x.copy_(...), out=x, an "
        "optimizer step on it) is the usual cause. clone() a received tensor before changing it in place: "
        "x = item[\"x\"].clone(). The CUDA context of this process is unusable now; under MPS every process "
        "on this GPU ends with it.")

_lock = threading.Lock()
_installed = False


def explain(text: str) -> str:
    """``text`` with the hint appended, when this process maps received items read-only."""
    return f"{text}\n{HINT}" if _installed else text


def _mentions(exc: BaseException | None) -> bool:
    seen = 0
    while exc is not None and seen < 8:
        if _TEXT in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


def _say() -> None:
    try:
        sys.stderr.write(HINT + "\n")
        sys.stderr.flush()
    except Exception:  # noqa: BLE001 (stderr closed: nothing more to say)
        pass


def watching() -> None:
    """This process now maps received CUDA memory read-only: chain the excepthooks (the
    main thread's and threads') once, so a GPU fault is explained after its traceback."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
        previous = sys.excepthook
        previous_thread = threading.excepthook

        def hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
            previous(kind, exc, tb)
            if _mentions(exc):
                _say()

        def thread_hook(args: Any) -> None:
            previous_thread(args)
            if _mentions(args.exc_value):
                _say()

        sys.excepthook = hook
        threading.excepthook = thread_hook
