"""A conformance check every ipcsync backend must pass (in the style of trio's
``trio.testing.check_one_way_stream``).

``check_backend(make_backend, run_in_peer)`` runs five steps against a backend; the first
property that breaks raises ``BackendCheckFailed`` whose message names the step and the
property:

1. handle round trip: an arena exported here and opened in the peer shares its bytes
   both ways; an event handle opens in the peer, and a peer's event handle opens here;
2. record/query/wait: an event recorded after a write orders a waiter in the other
   process after that write (on a GPU the write is queued behind a GPU spin, so a wait
   that orders nothing reads the old value); ``query()`` is True once the work is done;
3. imports: a borrowed import (``open_borrowed_arena``) of a handle the peer already
   imported maps the same memory, and closing it leaves the owner's memory to the other
   import and to new imports;
4. close: ``Arena.close()`` and ``Backend.close()`` are idempotent; after the owner's
   close an import opened before stays readable and its memory is not handed to a new
   arena; the handle cannot be opened anew (in the owner's process; for host memory, in
   any process: the segment is unlinked);
5. bad handles raise ``BackendError`` and nothing else, here and in the peer.

No backend promises to cache imports (``open_arena`` maps anew each call on the CPU;
on CUDA the caching is torch's), so step 3 checks what the interface promises: shared
memory, and no effect of a borrowed import's close on the owner.

``make_backend()`` returns a fresh backend of this process's device; ``run_in_peer(fn,
**kwargs)`` runs command ``fn`` of tests/integration/backend_peers.py in another process with the same
device and returns its result (``PeerRunner`` is one, on the ``procs`` fixture).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
from pathlib import Path
from typing import Any, Callable, Iterator

import msgpack
import torch

from backend_peers import pack, read_span, settle, spin_cycles, unpack, warm_up, write_span
from ipcsync.backends.base import Arena, Backend, Event
from ipcsync.errors import BackendError, IpcTimeoutError

__all__ = ["BackendCheckFailed", "PeerError", "PeerRunner", "check_backend"]

RunInPeer = Callable[..., dict[str, Any]]
N = 1 << 16  # bytes per arena
NO_SUCH_PID = 2**22 + 12345  # above the largest pid_max Linux allows
SPIN_SECONDS = 1.0
FLOOD = 64  # arenas of N bytes allocated after an owner's close (4 MiB)


class BackendCheckFailed(AssertionError):
    """A backend broke a property of ``check_backend``: the message says which step and
    which property."""


class PeerError(Exception):
    """A command raised in the peer (its type and message are in the text)."""


# --------------------------------------------------------------------------- peer
class PeerRunner:
    """``run_in_peer`` on the ``procs`` fixture: one child (tests/integration/backend_peers.py ``serve``)
    started at the first call, fed through a FIFO, answering on stdout."""

    def __init__(self, procs: Any, backend: str, device: str, fifo_dir: Path, timeout: float = 60.0) -> None:
        self.procs = procs
        self.backend = backend
        self.device = device
        self.fifo = Path(fifo_dir) / "backend-peer.fifo"
        self.timeout = timeout
        self._peer: Any = None
        self._fd = -1
        self._seq = 0

    def _start(self) -> None:
        os.mkfifo(self.fifo, 0o600)
        # O_RDWR never blocks on a FIFO, and writes of short lines never block either.
        self._fd = os.open(self.fifo, os.O_RDWR)
        self._peer = self.procs.start("serve", module="backend_peers", commands=str(self.fifo),
                                      backend=self.backend, device=self.device)
        self._peer.read_until(lambda l: l.get("event") == "ready", timeout=self.timeout)

    def __call__(self, fn_name: str, **kwargs: Any) -> dict[str, Any]:
        if self._peer is None:
            self._start()
        self._seq += 1
        seq = self._seq
        os.write(self._fd, (json.dumps({"seq": seq, "fn": fn_name, "kwargs": kwargs}) + "\n").encode())
        line = self._peer.read_until(lambda l: l.get("event") == "reply" and l.get("seq") == seq,
                                     timeout=self.timeout)
        if not line["ok"]:
            raise PeerError(f"{fn_name}() in the peer raised {line['raised']}: {line['message']}")
        return line["result"]

    @property
    def pid(self) -> int | None:
        return None if self._peer is None else self._peer.pid

    def close(self) -> None:
        """Ask the peer to exit and check it did so cleanly (the procs fixture kills it
        otherwise)."""
        if self._peer is None:
            return
        try:
            os.write(self._fd, (json.dumps({"seq": 0, "fn": "exit", "kwargs": {}}) + "\n").encode())
            self._peer.result(timeout=self.timeout)
        finally:
            os.close(self._fd)
            self._peer = None


# --------------------------------------------------------------------------- helpers
class _Step:
    def __init__(self, name: str) -> None:
        self.name = name

    def require(self, ok: bool, what: str) -> None:
        if not ok:
            raise BackendCheckFailed(f"backend check failed at step {self.name!r}: {what}")


@contextlib.contextmanager
def _step(name: str) -> Iterator[_Step]:
    """Any unexpected exception inside a step is reported as that step's failure."""
    s = _Step(name)
    try:
        yield s
    except BackendCheckFailed:
        raise
    except Exception as exc:
        raise BackendCheckFailed(
            f"backend check failed at step {name!r}: unexpected {type(exc).__module__}."
            f"{type(exc).__qualname__}: {exc}"
        ) from exc


def _quietly(fn: Callable[[], Any]) -> Callable[[], None]:
    """A cleanup that never hides the failure that made it run."""
    def run() -> None:
        with contextlib.suppress(Exception):
            fn()
    return run


def _pattern(seed: int, n: int = 256) -> bytes:
    return bytes((i * 31 + seed * 17 + 1) % 256 for i in range(n))


def _local_read(arena: Arena, offset: int, length: int) -> bytes:
    return bytes(arena.tensor[offset:offset + length].cpu().tolist())


def _local_write(backend: Backend, arena: Arena, offset: int, data: bytes) -> None:
    write_span(arena.tensor[offset:offset + len(data)], data)
    settle(backend)


def _other_type(h: bytes | str) -> bytes | str:
    """The same handle content in the type it is not."""
    return h.encode() if isinstance(h, str) else h.decode("latin-1")


def _lookalike(h: bytes | str) -> bytes | str:
    """A handle of this backend's format that names nothing: the owner's pid replaced by
    one no process has and every id zeroed."""
    if isinstance(h, str):
        parts = h.split("-")
        if len(parts) >= 3:
            return "-".join([parts[0], str(NO_SUCH_PID)] + parts[2:-1] + ["0" * len(parts[-1])])
        return h + "-0"
    try:
        fields = msgpack.unpackb(h, raw=False)
    except Exception:
        return bytes(len(h))
    if not isinstance(fields, list):
        return bytes(len(h))
    out = []
    for i, f in enumerate(fields):
        if isinstance(f, bytes):
            out.append(bytes(len(f)))
        elif isinstance(f, int) and not isinstance(f, bool) and i == 1:
            out.append(NO_SUCH_PID)
        else:
            out.append(f)
    return msgpack.packb(out, use_bin_type=True)


def _foreign_arena_handles(backend: Backend, stack: contextlib.ExitStack) -> list[tuple[str, Any]]:
    """Arena handles of the other backend."""
    out: list[tuple[str, Any]] = []
    if backend.device.type != "cpu":
        from ipcsync.backends.cpu import CpuBackend

        cpu = CpuBackend().create_arena(4096)
        stack.callback(_quietly(cpu.close))
        out.append(("the name of a live CPU shared-memory arena", cpu.handle))
    else:
        # The CUDA backend's format (ipcsync.backends.cuda.CudaArena.export).
        out.append(("a CUDA arena handle", msgpack.packb(
            ["ipcsync-cuda-arena", os.getpid(), bytes(64), N, 0, b"/torch_0_0_0", 0, bytes(64), False],
            use_bin_type=True)))
    return out


def _foreign_event_handle(backend: Backend) -> bytes:
    if backend.device.type != "cpu":
        return b"ipcsync-cpu-event"  # ipcsync.backends.cpu's event handle
    return bytes(range(64))  # the size of a cudaIpcEventHandle_t


def _is_host(backend: Backend) -> bool:
    return backend.device.type == "cpu"


# --------------------------------------------------------------------------- the check
class _Ctx:
    def __init__(self, backend: Backend, peer: RunInPeer, stack: contextlib.ExitStack) -> None:
        self.backend = backend
        self.peer = peer
        self.stack = stack
        self.arena: Arena | None = None  # step 1's arena, imported in the peer as "rt"
        self.handle: bytes | str = ""  # its export
        self.event: Event | None = None  # recorded here, opened in the peer as "ev"
        self.peer_event: Event | None = None  # recorded in the peer ("pev"), opened here
        self.closed_handle: bytes | str = ""  # step 4's arena, closed, its imports closed
        self.readonly = False  # the peer's import is read-only (a write through it faults)

    def arena_for_test(self, nbytes: int = N) -> Arena:
        a = self.backend.create_arena(nbytes)
        self.stack.callback(_quietly(a.close))
        return a


def check_backend(make_backend: Callable[[], Backend], run_in_peer: RunInPeer, *,
                  spin_seconds: float = SPIN_SECONDS) -> None:
    """Raise ``BackendCheckFailed`` naming the first property the backend breaks."""
    with contextlib.ExitStack() as stack:
        with _step("0. setup") as s:
            backend = make_backend()
            stack.callback(_quietly(backend.close))
            hello = run_in_peer("hello")
            s.require(hello["pid"] != os.getpid(), "run_in_peer ran in this process")
            warm_up(backend)
        ctx = _Ctx(backend, run_in_peer, stack)
        _check_round_trip(ctx)
        _check_record_query_wait(ctx, spin_seconds)
        arena, handle = _check_imports(ctx)
        _check_close(ctx, make_backend, arena, handle)
        _check_bad_handles(ctx)
        with _step("6. teardown") as s:
            run_in_peer("close_backend", times=2)
            backend.close()
            backend.close()


def _check_round_trip(ctx: _Ctx) -> None:
    with _step("1. handle round trip") as s:
        a = ctx.arena = ctx.arena_for_test()
        s.require(a.nbytes == N and a.tensor.numel() == N and a.tensor.dtype == torch.uint8,
                  f"create_arena({N}) gave nbytes={a.nbytes}, a {a.tensor.dtype} tensor of "
                  f"{a.tensor.numel()} elements; expected a uint8 view of all {N} bytes")
        _local_write(ctx.backend, a, 4096, _pattern(1))
        h = ctx.handle = a.export()
        s.require(isinstance(h, (bytes, str)) and len(h) > 0, f"export() returned {h!r:.60}, not bytes/str")
        got = ctx.peer("open_arena", key="rt", handle=pack(h), nbytes=N)
        s.require(got["numel"] == N and got["dtype"] == "torch.uint8",
                  f"the peer's open_arena(handle, {N}) gave a {got['dtype']} tensor of {got['numel']} elements")
        seen = ctx.peer("read", key="rt", offset=4096, length=256)
        s.require(seen["hex"] == _pattern(1).hex(),
                  "bytes written into the arena here are not what the peer reads through the exported handle")
        ctx.readonly = got["readonly"]
        if not ctx.readonly:  # (a read-only import, the CPU backend's, faults on a write)
            ctx.peer("write", key="rt", offset=N - 256, data=_pattern(2).hex())
            s.require(_local_read(a, N - 256, 256) == _pattern(2),
                      "bytes the peer wrote through its import are not seen in the owner's arena")

        ev = ctx.event = ctx.backend.create_event()
        eh = ev.handle()
        s.require(isinstance(eh, bytes) and len(eh) > 0, f"Event.handle() returned {eh!r:.60}, not non-empty bytes")
        s.require(ev.handle() == eh, "Event.handle() returned different bytes on a second call")
        ctx.peer("open_event", key="ev", handle=pack(eh))
        peh = unpack(ctx.peer("create_event", key="pev")["handle"])
        s.require(isinstance(peh, bytes) and len(peh) > 0, f"the peer's Event.handle() returned {peh!r:.60}")
        ctx.peer_event = ctx.backend.open_event(peh)


def _check_record_query_wait(ctx: _Ctx, spin: float) -> None:
    with _step("2. record/query/wait") as s:
        a, ev, pev = ctx.arena, ctx.event, ctx.peer_event
        assert a is not None and ev is not None and pev is not None
        off, length = 8192, 16384
        gpu = ctx.backend.device.type == "cuda"
        write_span(a.tensor[off:off + length], bytes([1]) * length)
        settle(ctx.backend)

        # This process writes (behind a GPU spin on a GPU), records; the peer waits, reads.
        if gpu:
            torch.cuda._sleep(spin_cycles(spin, ctx.backend.device))
        a.tensor[off:off + length].fill_(2)
        ev.record(ctx.backend.current_stream())
        pending = not ev.query()
        if _is_host(ctx.backend):
            s.require(not pending, "query() returned False right after record() on a host backend, "
                                   "whose work is complete when it is recorded")
        if gpu:
            s.require(pending, f"query() returned True right after record() behind a {spin} s GPU "
                               "spin: it does not report pending work")
            try:
                ev.synchronize(timeout=0)
            except IpcTimeoutError:
                pass
            else:
                s.require(False, "synchronize(timeout=0) returned while query() said the recorded work "
                                 "was pending (expected IpcTimeoutError)")
        control = ctx.peer("read", key="rt", offset=off, length=length) if gpu else {}
        waited = ctx.peer("read", key="rt", offset=off, length=length, wait="ev")
        s.require(waited["min"] == waited["max"] == 2,
                  f"the peer waited on the event recorded after the write and read values "
                  f"{waited['min']}..{waited['max']}, not the final 2: the event does not order a "
                  "waiter in another process after the recorded work")
        s.require(waited["query_after"] is True, "the peer's query() of the event is False after its "
                                                 "wait and a host read behind it")
        if gpu:
            s.require((control["min"], control["max"]) != (2, 2),
                      f"inconclusive: the peer read the final value without waiting, so the {spin} s "
                      "GPU spin was over before it read; raise spin_seconds")
        ev.synchronize(timeout=60)
        s.require(ev.query() is True, "query() is False after synchronize() returned")
        ev.wait()  # waiting on completed work is a no-op, never an error

        # The peer writes (behind a GPU spin), records its event; this process waits, reads.
        # (Through a read-only import the peer only records: this process writes.)
        off2 = off + length
        write_span(a.tensor[off2:off2 + length], bytes([1]) * length)
        settle(ctx.backend)
        if ctx.readonly:
            a.tensor[off2:off2 + length].fill_(3)
        ctx.peer("fill_recorded", key="rt", offset=off2, length=0 if ctx.readonly else length, value=3,
                 event="pev", spin=spin)
        control = read_span(a.tensor[off2:off2 + length]) if gpu else {}
        pev.wait(ctx.backend.current_stream())
        waited = read_span(a.tensor[off2:off2 + length])
        s.require(waited["min"] == waited["max"] == 3,
                  f"after waiting on the peer's event this process read {waited['min']}..{waited['max']}, "
                  "not the final 3 the peer wrote before recording it")
        pev.synchronize(timeout=60)
        s.require(pev.query() is True, "query() of the peer's event is False after synchronize()")
        if gpu:
            s.require((control["min"], control["max"]) != (3, 3),
                      f"inconclusive: the final value was read here without waiting, so the peer's {spin} s "
                      "GPU spin was over first; raise spin_seconds")


def _check_imports(ctx: _Ctx) -> tuple[Arena, bytes | str]:
    """Leaves the arena open, imported in the peer as "main", for step 4."""
    with _step("3. imports: borrowed and repeated") as s:
        a = ctx.arena_for_test()
        _local_write(ctx.backend, a, 0, _pattern(3))
        h = a.export()  # one export for one connection: the peer's "main" import
        ctx.peer("open_arena", key="main", handle=pack(h), nbytes=N)
        b = ctx.peer("open_arena", key="borrowed", handle=pack(h), nbytes=N, borrowed=True)
        s.require(b["numel"] == N, f"open_borrowed_arena(handle, {N}) gave {b['numel']} bytes")
        s.require(ctx.peer("read", key="borrowed", offset=0, length=256)["hex"] == _pattern(3).hex(),
                  "a borrowed import of a handle does not see the owner's bytes")
        if b["readonly"]:
            _local_write(ctx.backend, a, 1024, _pattern(4))
        else:
            ctx.peer("write", key="borrowed", offset=1024, data=_pattern(4).hex())
            s.require(_local_read(a, 1024, 256) == _pattern(4),
                      "bytes written through a borrowed import are not seen by the owner")
        s.require(ctx.peer("read", key="main", offset=1024, length=256)["hex"] == _pattern(4).hex(),
                  "two imports of one handle in one process (open_arena, open_borrowed_arena) do not "
                  "share memory")
        ctx.peer("close_arena", key="borrowed", times=2)
        _local_write(ctx.backend, a, 2048, _pattern(5))
        s.require(ctx.peer("read", key="main", offset=2048, length=256)["hex"] == _pattern(5).hex(),
                  "after a borrowed import was closed, the process's other import of the same handle "
                  "no longer sees the owner's writes")
        ctx.peer("open_arena", key="fresh", handle=pack(a.export()), nbytes=N)
        s.require(ctx.peer("read", key="fresh", offset=2048, length=256)["hex"] == _pattern(5).hex(),
                  "after a borrowed import was closed, a new import of the owner's arena does not see "
                  "the owner's bytes")
        ctx.peer("close_arena", key="fresh", times=1)
        ctx.stack.callback(_quietly(lambda: ctx.peer("close_arena", key="main")))
        return a, h


def _check_close(ctx: _Ctx, make_backend: Callable[[], Backend], a: Arena, h: bytes | str) -> None:
    """On step 3's arena, which the peer still imports as "main"."""
    with _step("4. close") as s:
        for k in range(2):
            try:
                a.close()
            except Exception as exc:
                s.require(False, f"the owner's Arena.close() raised {type(exc).__name__}: {exc} on call "
                                 f"{k + 1} (close must be idempotent)")
        gc.collect()
        s.require(ctx.peer("read", key="main", offset=2048, length=256)["hex"] == _pattern(5).hex(),
                  "an import opened before the owner's close() no longer reads the arena's bytes")
        ctx.backend.collect()
        # Enough new arenas to take any freed memory a caching allocator holds (its free
        # blocks are handed out before it asks the device for more).
        others = [ctx.arena_for_test() for _ in range(FLOOD)]
        for o in others:
            write_span(o.tensor, bytes([0xEE]) * N)
        settle(ctx.backend)
        s.require(ctx.peer("read", key="main", offset=2048, length=256)["hex"] == _pattern(5).hex(),
                  "after the owner closed its arena while an import was open, a new arena got its "
                  "memory: the import now reads the new arena's bytes (a closed borrowed import, or "
                  "the owner's close, gave the memory back too early)")
        for o in others:
            o.close()
        ctx.closed_handle = h
        try:
            again = ctx.backend.open_arena(h, N)
        except BackendError:
            pass
        except Exception as exc:
            s.require(False, f"open_arena() of a closed arena's handle in the owner's process raised "
                             f"{type(exc).__name__}: {exc}, not BackendError")
        else:
            again.close()
            s.require(False, "the handle of an arena its owner closed can still be opened in the owner's process")
        if _is_host(ctx.backend):
            got = ctx.peer("try_open_arena", handle=pack(h), nbytes=N)
            s.require(got["raised"] is not None,
                      "the name of an arena its owner closed can still be opened by another process: "
                      "close() did not unlink the segment")
            s.require(got["backend_error"], f"opening a closed arena's name in the peer raised {got['raised']}: "
                                            f"{got['message']}, not BackendError")
        ctx.peer("close_arena", key="main", times=2)

        b = make_backend()
        x = b.create_arena(4096)
        for what, fn in [("Arena.close()", x.close), ("second Arena.close()", x.close),
                         ("Backend.close()", b.close), ("second Backend.close()", b.close)]:
            try:
                fn()
            except Exception as exc:
                s.require(False, f"{what} raised {type(exc).__name__}: {exc} (close must be idempotent)")


def _check_bad_handles(ctx: _Ctx) -> None:
    with _step("5. bad handles") as s:
        h = ctx.handle
        arena_cases: list[tuple[str, Any, int]] = [
            ("None", None, N), ("an int", 12345, N), ("a float", 1.5, N), ("a list", [h], N),
            ("the handle as " + ("bytes" if isinstance(h, str) else "str"), _other_type(h), N),
            ("garbage bytes", b"\xc1garbage" + bytes(range(64)), N),
            ("a garbage string", "not-a-handle/../../etc/passwd", N),
            ("an empty handle", h[:0], N),
            ("a truncated handle (half)", h[: len(h) // 2], N),
            ("a truncated handle (last byte cut)", h[:-1], N),
            ("a well-formed handle that names nothing", _lookalike(h), N),
            (f"nbytes {2 * N} on an arena of {N}", h, 2 * N),
        ]
        arena_cases += [(label, fh, N) for label, fh in _foreign_arena_handles(ctx.backend, ctx.stack)]
        # A closed arena's handle: refused in the owner's process by every backend, and in
        # any process where closing unlinks a name (host memory). (A peer of a GPU backend
        # cannot know the owner closed; importing would also take the export's reference.)
        closed_case = ("the handle of a closed arena", ctx.closed_handle, N)
        arena_cases.append(closed_case)
        ev = ctx.event
        assert ev is not None
        eh = ev.handle()
        event_cases: list[tuple[str, Any]] = [
            ("None", None), ("an int", 12345), ("the handle as str", eh.decode("latin-1")),
            ("a list", [eh]), ("garbage bytes", b"\xc1" * len(eh)), ("an empty handle", b""),
            ("a truncated handle (half)", eh[: len(eh) // 2]),
            ("a truncated handle (last byte cut)", eh[:-1]),
            ("an oversized handle", eh + bytes(4096)),
            ("the other backend's event handle", _foreign_event_handle(ctx.backend)),
        ]
        for case in arena_cases:
            label, bad, nbytes = case
            for borrowed in (False, True):
                fn = "open_borrowed_arena" if borrowed else "open_arena"
                opener = ctx.backend.open_borrowed_arena if borrowed else ctx.backend.open_arena
                try:
                    got = opener(bad, nbytes)
                except BackendError:
                    pass
                except Exception as exc:
                    s.require(False, f"{fn}({label}: {bad!r:.60}, {nbytes}) here raised "
                                     f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}, not BackendError")
                else:
                    got.close()
                    s.require(False, f"{fn}({label}: {bad!r:.60}, {nbytes}) here was accepted, not BackendError")
                if case is closed_case and not _is_host(ctx.backend):
                    continue
                r = ctx.peer("try_open_arena", handle=pack(bad), nbytes=nbytes, borrowed=borrowed)
                s.require(r["raised"] is not None,
                          f"{fn}({label}: {bad!r:.60}, {nbytes}) in the peer was accepted, not BackendError")
                s.require(r["backend_error"], f"{fn}({label}: {bad!r:.60}, {nbytes}) in the peer raised "
                                              f"{r['raised']}: {r['message']}, not BackendError")
        for label, bad in event_cases:
            try:
                ctx.backend.open_event(bad)
            except BackendError:
                pass
            except Exception as exc:
                s.require(False, f"open_event({label}: {bad!r:.60}) here raised "
                                 f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}, not BackendError")
            else:
                s.require(False, f"open_event({label}: {bad!r:.60}) here was accepted, not BackendError")
            r = ctx.peer("try_open_event", handle=pack(bad))
            s.require(r["raised"] is not None, f"open_event({label}: {bad!r:.60}) in the peer was accepted")
            s.require(r["backend_error"], f"open_event({label}: {bad!r:.60}) in the peer raised "
                                          f"{r['raised']}: {r['message']}, not BackendError")
