"""Rules that depend on the backend are asked of the backend (no name compared elsewhere):
whether an arena a producer exports can be its own, whether a consumer on this host must
share our PID namespace, which backends a remote consumer may name."""

from __future__ import annotations

import ast
from pathlib import Path

from ipcsync.backends import BACKEND_NAMES, Backend, CpuBackend
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


def test_only_cuda_ipc_needs_one_pid_namespace() -> None:
    assert CpuBackend.pid_namespace_rule is None
    assert CudaBackend.pid_namespace_rule == "CUDA IPC needs both processes in one PID namespace"


def test_the_backend_names_are_those_of_the_backends() -> None:
    assert BACKEND_NAMES == (CpuBackend.name, CudaBackend.name)


def test_runtime_compares_no_backend_name_with_a_literal() -> None:
    # A rule that depends on the backend is an attribute or method of Backend; the runtime
    # compares names only with each other (a peer's backend with ours), never with "cpu"
    # or "cuda" (the remote edge's transport included: backends.NATIVE_TRANSPORT).
    runtime = Path(__file__).resolve().parents[2] / "ipcsync" / "runtime"
    found = []
    for path in sorted(runtime.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                names = [o for o in operands if isinstance(o, ast.Attribute) and o.attr in ("name", "backend")
                         or isinstance(o, ast.Name) and (o.id.endswith("backend") or o.id == "backend_name")]
                literals = [o for o in operands if isinstance(o, ast.Constant) and o.value in BACKEND_NAMES
                            or isinstance(o, ast.Tuple) and any(isinstance(e, ast.Constant) and e.value in BACKEND_NAMES
                                                                for e in o.elts)]
                if names and literals:
                    found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "backend names compared in the runtime:\n" + "\n".join(found)


def test_every_backend_names_the_transport_its_memory_travels_by() -> None:
    from ipcsync.backends import NATIVE_TRANSPORT

    assert set(NATIVE_TRANSPORT) == set(BACKEND_NAMES)
    assert set(NATIVE_TRANSPORT.values()) <= {"gloo", "nccl"}


def test_the_current_stream_is_looked_up_again_only_when_its_key_changes() -> None:
    from typing import Any, Callable

    import torch

    from ipcsync.backends.base import CurrentStream

    class Keyed(CpuBackend):
        key = "a"
        lookups = 0

        def current_stream_key(self) -> Callable[[], Any] | None:
            return lambda: self.key

        def current_stream(self) -> Any:
            self.lookups += 1
            return f"stream {self.key}"

    b = Keyed(torch.device("cpu"), run_id=None)
    cs = CurrentStream(b)
    got = [cs.now if cs.key() == cs.seen else cs.resolve() for _ in range(3)]
    b.key = "b"
    got += [cs.now if cs.key() == cs.seen else cs.resolve() for _ in range(2)]
    assert got == ["stream a"] * 3 + ["stream b"] * 2
    assert b.lookups == 2
