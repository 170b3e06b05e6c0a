"""Rules that depend on the backend are asked of the backend (no name compared elsewhere):
whether an arena a producer exports can be its own."""

from __future__ import annotations

from ipcsync.backends import Backend, CpuBackend
from ipcsync.backends.cuda import CudaBackend

SEGMENT_OF_123 = "ipcsync-123-456-789-0123456789abcdef"  # a segment name records its creator's pid


def test_a_cpu_producer_may_export_only_its_own_segments() -> None:
    cpu = CpuBackend()
    assert cpu.arena_owner_problem(SEGMENT_OF_123, 123) is None
    why = cpu.arena_owner_problem(SEGMENT_OF_123, 124)
    assert why == f"names shared memory {SEGMENT_OF_123} of pid 123"
    # A name that is no ipcsync segment is refused when it is opened, not here.
    assert cpu.arena_owner_problem("not-a-segment", 124) is None
    assert cpu.arena_owner_problem(b"\x00" * 64, 124) is None


def test_a_backend_whose_handles_name_no_process_has_no_owner_rule() -> None:
    # (CUDA: an IPC handle names no process; the base class's answer is the CUDA backend's.)
    assert "arena_owner_problem" not in vars(CudaBackend)
    assert Backend.arena_owner_problem(CpuBackend(), SEGMENT_OF_123, 124) is None
