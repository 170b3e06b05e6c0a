"""Ctrl-C lands where the endpoints' state is whole (KeyboardInterrupt protection).

Python raises KeyboardInterrupt at the main thread's next bytecode boundary, wherever that
is. Inside ipcsync that can be between two steps of one transition: RELEASE frames read off
a lane and not yet applied to the ring, an item handed to a consumer by the ring and its
READY not yet sent. A program that catches the interrupt and goes on (a notebook, a REPL,
a training loop that checkpoints on Ctrl-C) is then left with a slot held for ever or an
item never delivered, and the producer wedges once the ring runs dry (seen: a producer
streaming to a consumer, Ctrl-C'd and going on, wedged in 6 runs out of 6 within 150
interrupts).

So, as trio does, ipcsync installs a SIGINT handler that decides where the interrupt
lands, by the frame it interrupted:

- in the program's own code, or where ipcsync waits (a ``select``, a sleep, a condition
  wait: the functions marked ``wait_point``), it raises KeyboardInterrupt at once, as
  Python's default handler does;
- anywhere else in ipcsync (its *protected* code: every module of the package except the
  command lines ``launch/``, ``doctor/`` and ``__main__.py``), it defers it: a helper
  thread (``ipcsync-ctrl-c``) signals the main thread again (``_thread.interrupt_main``),
  and again, until the handler finds it outside protected code: in practice within a few
  milliseconds, once the call in progress has finished its transition or reached a wait.
  (The handler cannot ask again itself: the call would run it again inside itself, at
  once.)

Frames of the standard library and of ipcsync's dependencies (torch, zmq, msgpack, numpy)
are looked through: what decides is the first frame, from the innermost out, that is the
program's or ipcsync's. So a callback of the program's that ipcsync runs (a dataset that
``ipcsync.data.serve`` iterates) is interrupted at once, and a torch call made by ipcsync is
protected.

An interrupt deferred for ``ESCALATE_S`` seconds is raised at the next chance wherever it
lands: a second Ctrl-C then gets out of a call stuck in protected code (a lock that is never
released), at the price of the state that protection keeps.

Installed from the main thread when an endpoint is made (``protect``), and only over
Python's default handler: a program (or framework) that installed a SIGINT handler of its
own keeps it, unprotected. Installed again at a main-thread tick where the default came
back (IPython's kernel puts it back at each cell). Python's default is put back when the
last endpoint closes in the main thread (``unprotect``). While it is installed,
``signal.getsignal(SIGINT)`` is not ``signal.default_int_handler``: ``asyncio.run`` then
leaves SIGINT to it (KeyboardInterrupt, as on Python 3.10) instead of cancelling its main
task.

SIGTERM (``kill``, a supervisor's or ``ipcsync-run``'s stop) still ends the process at
once, by the signal, as Python's default does: no exception, none of the program's code
runs, a parent sees it killed by SIGTERM. Only what ipcsync made on the file system goes
first (the endpoints' ``.sock``, ``.lane`` and ``.lock`` files, the CPU arenas' names in
/dev/shm: the functions registered with ``at_terminate``, unlinks only, no lock taken),
as a close would remove them. Installed with the SIGINT handler, only over the default
(a program's own SIGTERM handler, or SIG_IGN, is kept: its exit runs the endpoints'
closes), and put back with it. Like any Python signal handler it runs in the main thread
between bytecodes: a main thread inside a long C call ends once that call returns. It does
not raise an exception instead (so that ``with`` blocks unwind): that would change what
SIGTERM means to every program that makes an endpoint (its ``except BaseException`` and
``finally`` clauses would run, and could keep it alive past a supervisor's stop), where
removing files changes nothing it can see.

Imports nothing of ipcsync (the backends mark their waits with it).
"""

from __future__ import annotations

import _thread
import os
import queue
import signal
import sys
import sysconfig
import threading
import time
from types import CodeType, FrameType
from typing import Any, Callable, TypeVar

__all__ = ["ESCALATE_S", "wait_point", "protect", "unprotect", "installed", "in_protected_code", "at_terminate"]

# A deferred interrupt older than this is raised wherever it lands next.
ESCALATE_S = 3.0

_F = TypeVar("_F", bound=Callable[..., Any])

_PKG = os.path.dirname(os.path.abspath(__file__)) + os.sep
# Parts of the package that are command lines, not endpoints: looked through.
_NOT_PROTECTED = (_PKG + "launch" + os.sep, _PKG + "doctor" + os.sep, _PKG + "__main__.py")
_DEPENDENCIES = ("torch", "zmq", "msgpack", "numpy")

_OURS, _THROUGH, _PROGRAM = 0, 1, 2
_kinds: dict[str, int] = {}  # co_filename -> _OURS / _THROUGH / _PROGRAM (filled as met)
_through_dirs: tuple[str, ...] | None = None
_wait_codes: set[CodeType] = set()
_deferred_since: float | None = None  # when the interrupt being deferred first came


def wait_point(fn: _F) -> _F:
    """Mark ``fn`` (and the functions and lambdas defined in it) as a place where ipcsync
    waits, so where a Ctrl-C may land at once. Returns ``fn`` unchanged."""
    todo = [fn.__code__]
    while todo:
        code = todo.pop()
        _wait_codes.add(code)
        todo.extend(c for c in code.co_consts if isinstance(c, CodeType))
    return fn


def _through() -> tuple[str, ...]:
    """The directories whose frames are looked through: the standard library's and the
    dependencies' (those imported by now). Never raises."""
    global _through_dirs
    if _through_dirs is None:
        dirs = {os.path.dirname(os.path.abspath(threading.__file__))}
        try:
            paths = sysconfig.get_paths()
            dirs.update((paths["stdlib"], paths["platstdlib"]))
        except Exception:  # (seen: a process run as another user cannot import _sysconfigdata)
            pass
        for name in _DEPENDENCIES:
            mod = sys.modules.get(name)
            file = getattr(mod, "__file__", None)
            if file:
                dirs.add(os.path.dirname(os.path.abspath(file)))
        _through_dirs = tuple(os.path.join(d, "") for d in dirs if d)
    return _through_dirs


def _kind(filename: str) -> int:
    kind = _kinds.get(filename)
    if kind is None:
        if filename.startswith(_PKG) and not filename.startswith(_NOT_PROTECTED):
            kind = _OURS
        elif filename.startswith("<") or filename.startswith(_NOT_PROTECTED) or filename.startswith(_through()):
            kind = _THROUGH  # (frozen and generated code: "<frozen os>", "<string>" of dataclasses)
        else:
            kind = _PROGRAM
        _kinds[filename] = kind
    return kind


def in_protected_code(frame: FrameType | None) -> bool:
    """Whether an interrupt of ``frame`` (the innermost one) is deferred: the first frame,
    from it out, that is not the standard library's or a dependency's is ipcsync's own and
    not a wait point."""
    while frame is not None:
        code = frame.f_code
        if code in _wait_codes:
            return False
        kind = _kind(code.co_filename)
        if kind != _THROUGH:
            return kind == _OURS
        frame = frame.f_back
    return False


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    """The SIGINT handler: KeyboardInterrupt now, or once the main thread is outside
    ipcsync's protected code."""
    global _deferred_since, _rearmed
    rearm, _rearmed = _rearmed, False
    if rearm and _deferred_since is None:
        return  # (the helper's call for an interrupt raised since: not a Ctrl-C)
    try:
        protected = in_protected_code(frame)
    except Exception:  # (never: but a handler that fails must still be Ctrl-C)
        protected = False
    if protected:
        now = time.monotonic()
        if _deferred_since is None:
            _deferred_since = now
        if now - _deferred_since < ESCALATE_S:
            try:
                _ask_again()
                return
            except Exception:  # (no thread to be had: an interrupt now rather than none)
                pass
    _deferred_since = None
    raise KeyboardInterrupt


_rearmed = False  # the helper signalled the main thread (the handler's next run is its)
_requests: "queue.SimpleQueue[None]" = queue.SimpleQueue()  # (put is safe in a signal handler)
_helper_pid = 0


def _ask_again() -> None:
    """Have the helper thread signal the main thread again (started at first use, and
    again in a forked child, which has none)."""
    global _helper_pid, _requests
    if _helper_pid != os.getpid():
        _helper_pid = os.getpid()
        _requests = queue.SimpleQueue()
        threading.Thread(target=_helper, args=(_requests,), name="ipcsync-ctrl-c", daemon=True).start()
    _requests.put(None)


def _helper(requests: "queue.SimpleQueue[None]") -> None:
    global _rearmed
    while True:
        requests.get()
        _rearmed = True  # (set and signal with no bytecode boundary between: one step for the GIL)
        _thread.interrupt_main(signal.SIGINT)


_on_terminate: list[Callable[[], None]] = []  # what a SIGTERM removes first (at_terminate)


def at_terminate(fn: _F) -> _F:
    """Register ``fn`` to run when a SIGTERM ends this process, before it dies: it may
    only remove files (no lock, no I/O on sockets); an exception it raises is ignored.
    Returns ``fn`` unchanged (a decorator)."""
    _on_terminate.append(fn)
    return fn


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    """The SIGTERM handler: remove what ``at_terminate`` registered, then die by the
    signal, as the default action would have."""
    for fn in _on_terminate:
        try:
            fn()
        except BaseException:  # (dying anyway: the rest still runs)
            pass
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def installed() -> bool:
    """Whether ipcsync's SIGINT handler is the one in place."""
    return signal.getsignal(signal.SIGINT) is _on_sigint


def protect() -> None:
    """Install the handler, from the main thread, where Python's default is in place (an
    endpoint was made, or a main-thread tick found the default back). Elsewhere: nothing."""
    if threading.current_thread() is not threading.main_thread():  # (a forked child's is its own)
        return
    try:
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            _through()  # (worked out now, not in the handler: it may import)
            signal.signal(signal.SIGINT, _on_sigint)
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _on_sigterm)
    except Exception:  # (not the main interpreter, signals unavailable: unprotected, never failing)
        pass


def unprotect() -> None:
    """Put Python's default handler back, from the main thread, where ours is in place (the
    last endpoint closed)."""
    global _deferred_since
    if threading.current_thread() is not threading.main_thread():  # (a forked child's is its own)
        return
    try:
        if installed():
            signal.signal(signal.SIGINT, signal.default_int_handler)
            _deferred_since = None
        if signal.getsignal(signal.SIGTERM) is _on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
    except Exception:
        pass
