"""The steady write step's copy in one C call, where the optional compiled piece
``ipcsync._native`` (ipcsync/_native.c, built by setup.py) is there; torch's copy otherwise.

What it replaces, for a message that is one dense tensor on the slot's device with nothing
to resolve (no conj/neg bit, no grad; ``core.layout.Plan.flat``):

- CPU backend: ``copy_`` (a torch dispatch around a memcpy) by ``host_copy`` (a memcpy;
  the GIL is released above 256 KiB).
- CUDA backend: ``copy_`` and the ready event's record (a torch kernel launch, 9-11 us of
  host time on an H200 host, and the record) by ``cuda_copy_record``: ``cudaMemcpyAsync``
  then ``cudaEventRecord`` on the same stream, in one call, through the CUDA runtime torch
  loaded (found at first use; not found: torch's copy, and ``cuda_reason()`` says why).

Everything else (several tensors, other strides, dtypes converted, another device, an
explicit ``stream=``) stays on torch. The bytes are the same either way.

``IPCSYNC_NATIVE=0`` turns it off (read once, at import; unset or ``1``: on where built;
any other value is a ConfigError). Loaded by the runtime only: it imports nothing of
ipcsync but ``ipcsync.errors``.

Build and fallback: ``setup.py`` declares the extension ``optional`` (no CUDA headers: the
few runtime prototypes are declared in ``_native.c`` and resolved at first use from the
libcudart torch loaded, never a second copy of the runtime). ``scripts/setup.sh`` builds it
in place where there is a compiler and the Python headers, and goes on without it where
not; ``scripts/gpu-tests.sh`` builds it in place and says which copy the run uses. The
suites that exercise the copy run both ways (the ``copy_path`` fixture).
"""

from __future__ import annotations

from typing import Callable

from ..envopts import NATIVE

__all__ = ["ENABLED", "BUILT", "reason", "host_copy", "cuda_copy_record"]

_BUILD_HINT = ("build it with `pip install -e .` or `python setup.py build_ext --inplace` "
               "in the checkout (needs a C compiler and the Python headers)")

try:
    from .. import _native
    _why_not_built: str | None = None
except ImportError as exc:  # no compiler or headers where it was installed: torch's copy
    _native = None  # type: ignore[assignment]
    _why_not_built = f"ipcsync._native is not built ({exc}); {_BUILD_HINT}"


ENABLED = NATIVE.get()  # (read once: the choice holds for the process)
BUILT = _native is not None


def reason() -> str | None:
    """Why the compiled copy is not in use at all, or None when it is (for a CPU slot; a
    CUDA slot also needs the runtime: ``cuda_copy_record``)."""
    if not ENABLED:
        return "IPCSYNC_NATIVE=0"
    return _why_not_built


def host_copy() -> Callable[[int, int, int], None] | None:
    """``copy(dst_ptr, src_ptr, nbytes)``, a memcpy between host addresses, or None where
    the compiled copy is off or not built."""
    return _native.copy if ENABLED and _native is not None else None


def cuda_copy_record() -> Callable[[int, int, int, int, int, int], None] | None:
    """``cuda_copy_record(dst_ptr, src_ptr, nbytes, stream_handle, event_handle, device)``
    (the copy enqueued on the stream, then the event recorded on it; RuntimeError naming a
    CUDA error), or None where the compiled copy is off, not built, or the CUDA runtime
    torch loaded was not found (``cuda_reason``). Call after CUDA is initialized."""
    if not ENABLED or _native is None or not _native.cuda_available():
        return None
    return _native.cuda_copy_record


def cuda_reason() -> str | None:
    """Why ``cuda_copy_record`` is None, or None when it is not."""
    why = reason()
    if why is not None:
        return why
    return _native.cuda_reason()
