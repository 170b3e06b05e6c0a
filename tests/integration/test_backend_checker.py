"""Every backend passes tests/integration/backend_checker.py's ``check_backend``; and the checker fails
a backend that breaks a property, saying which."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch

from backend_checker import BackendCheckFailed, PeerRunner, check_backend
from ipcsync.backends.base import Backend
from ipcsync.backends.cpu import CpuArena, CpuBackend, CpuEvent

CPU = "ipcsync.backends.cpu:CpuBackend"


@pytest.fixture
def run_in_peer(procs: Any, runtime_dir: Path) -> Iterator[Callable[[str, str], PeerRunner]]:
    """``run_in_peer(backend_spec, device)``: a PeerRunner on the procs fixture, closed
    cleanly at the end of a passing test (procs kills it in any case)."""
    made: list[PeerRunner] = []

    def make(backend: str, device: str) -> PeerRunner:
        r = PeerRunner(procs, backend, device, runtime_dir)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


@pytest.mark.timeout(90)
def test_cpu_backend_conforms(run_in_peer: Callable[[str, str], PeerRunner]) -> None:
    check_backend(CpuBackend, run_in_peer(CPU, "cpu"))


@pytest.mark.cuda
@pytest.mark.timeout(240)
def test_cuda_backend_conforms(run_in_peer: Callable[[str, str], PeerRunner]) -> None:
    from ipcsync.backends.cuda import CudaBackend

    dev = torch.device("cuda", torch.cuda.current_device())
    check_backend(lambda: CudaBackend(dev), run_in_peer("ipcsync.backends.cuda:CudaBackend", str(dev)))


# --------------------------------------------------------------------------- the checker can fail
class ValueErrorOnBadEvent(CpuBackend):
    """open_event lets a ValueError escape for a handle it does not know."""

    def open_event(self, handle: bytes | str) -> CpuEvent:
        if handle != CpuEvent().handle():
            raise ValueError("unknown event handle")
        return CpuEvent()


class LyingEvent(CpuEvent):
    def query(self) -> bool:
        return False


class LyingQuery(CpuBackend):
    """Events whose query() says the recorded work is never done."""

    def create_event(self) -> CpuEvent:
        return LyingEvent()


class LeakyArena(CpuArena):
    """An owner whose close() leaves its segment linked (the test unlinks it)."""

    left: list[str] = []

    def close(self) -> None:
        if self.owner:
            LeakyArena.left.append(self.path)
            self.owner = False
        super().close()


class CloseKeepsSegment(CpuBackend):
    def create_arena(self, nbytes: int) -> CpuArena:
        a = super().create_arena(nbytes)
        a.__class__ = LeakyArena
        return a


class CloseTwiceFails(CpuBackend):
    """Arena.close() raises the second time."""

    def create_arena(self, nbytes: int) -> CpuArena:
        a = super().create_arena(nbytes)
        first = a.close
        calls = []

        def close() -> None:
            calls.append(1)
            if len(calls) > 1:
                raise RuntimeError("already closed")
            first()

        a.close = close  # type: ignore[method-assign]
        return a


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("fake", "message"), [
    (ValueErrorOnBadEvent, r"step '5\. bad handles': open_event\(.*here raised builtins\.ValueError"),
    (LyingQuery, r"step '2\. record/query/wait': query\(\) returned False right after record\(\)"),
    (CloseKeepsSegment, r"step '4\. close': the handle of an arena its owner closed can still be opened"),
    (CloseTwiceFails, r"step '4\. close': the owner's Arena\.close\(\) raised RuntimeError.*idempotent"),
], ids=lambda v: v.__name__ if isinstance(v, type) else "")
def test_checker_fails_a_broken_backend(run_in_peer: Callable[[str, str], PeerRunner],
                                        fake: type[Backend], message: str) -> None:
    LeakyArena.left.clear()
    try:
        with pytest.raises(BackendCheckFailed, match=message):
            check_backend(fake, run_in_peer(CPU, "cpu"))
    finally:
        for path in LeakyArena.left:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


# --------------------------------------------------------------------------- ... on a GPU too
try:
    from ipcsync.backends.cuda import CudaBackend, IpcEvent
except ImportError:  # pragma: no cover - torch without CUDA support
    CudaBackend = None  # type: ignore[assignment,misc]

if CudaBackend is not None:

    class CudaBorrowTakesReference(CudaBackend):
        """A peer whose borrowed imports take (and on close drop) the export's reference,
        which belongs to the process the handle was exported to."""

        def open_borrowed_arena(self, handle: bytes | str, nbytes: int, where: Any = None) -> Any:
            return self.open_arena(handle, nbytes, where)

    class NoWaitEvent(IpcEvent):
        __slots__ = ()

        def wait(self, stream: Any = None) -> None:
            pass

    class CudaWaitIsANoOp(CudaBackend):
        """A peer whose event waits order nothing."""

        def open_event(self, handle: bytes | str) -> IpcEvent:
            return NoWaitEvent(self.index, _event=super().open_event(handle).event)


@pytest.mark.cuda
@pytest.mark.timeout(240)
@pytest.mark.parametrize(("peer_backend", "message"), [
    ("CudaWaitIsANoOp", r"step '2\. record/query/wait': the peer waited on the event .* not the final 2"),
    ("CudaBorrowTakesReference", r"step '4\. close': after the owner closed its arena while an import was open"),
])
def test_checker_fails_a_broken_cuda_peer(run_in_peer: Callable[[str, str], PeerRunner],
                                          peer_backend: str, message: str) -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    with pytest.raises(BackendCheckFailed, match=message):
        check_backend(lambda: CudaBackend(dev), run_in_peer(f"test_backend_checker:{peer_backend}", str(dev)))
