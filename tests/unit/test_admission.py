"""runtime.producer.admission: which HELLOs a producer refuses before any session exists."""

from __future__ import annotations

import dataclasses

from ipcsync.backends import CpuBackend
from ipcsync.backends.cuda import CudaBackend
from ipcsync.core import protocol as P
from ipcsync.core.protocol import ErrorCode
from ipcsync.system import host
from ipcsync.runtime.producer.admission import hello_problem, is_remote

CPU = CpuBackend()


def _hello(version: int, boot_id: str) -> P.Hello:
    return P.Hello(version=version, pid=4242, start_time=1, boot_id=boot_id, pid_ns=host.pid_namespace(),
                   backend="cpu", device="cpu", credits=4, heartbeat_ms=1000)


def test_a_remote_consumer_of_a_version_without_sent_is_refused_for_its_version() -> None:
    # Its items would be served before their sends were confirmed (or never, waiting for a SENT).
    h = _hello(P.OLDEST_VERSION, "another-host")
    assert is_remote(h)
    problem = hello_problem(h, CPU, "cpu", remote_ok=True)
    assert problem is not None
    code, text = problem
    assert code == ErrorCode.VERSION.value
    assert f"version {P.SENT_VERSION}" in text and "same ipcsync version" in text


def test_a_same_host_consumer_of_the_oldest_version_is_still_served() -> None:
    h = _hello(P.OLDEST_VERSION, host.host_identity())
    assert hello_problem(h, CPU, "cpu", remote_ok=True) is None
    assert hello_problem(dataclasses.replace(h, version=P.PROTOCOL_VERSION), CPU, "cpu") is None


def test_a_remote_consumer_of_this_version_is_admitted_on_a_tcp_producer_only() -> None:
    h = _hello(P.PROTOCOL_VERSION, "another-host")
    assert hello_problem(h, CPU, "cpu", remote_ok=True) is None
    problem = hello_problem(h, CPU, "cpu", remote_ok=False)
    assert problem is not None and problem[0] == ErrorCode.HOST.value


def test_a_remote_consumer_on_another_kind_of_device_is_admitted_a_local_one_is_not() -> None:
    # A remote edge copies by its transfer, so a CPU loader host can feed a GPU trainer.
    remote = dataclasses.replace(_hello(P.PROTOCOL_VERSION, "another-host"), backend="cuda")
    assert hello_problem(remote, CPU, "cpu", remote_ok=True) is None
    local = dataclasses.replace(_hello(P.PROTOCOL_VERSION, host.host_identity()), backend="cuda")
    problem = hello_problem(local, CPU, "cpu", remote_ok=True)
    assert problem is not None and problem[0] == ErrorCode.BACKEND.value and "same kind of device" in problem[1]
    odd = dataclasses.replace(remote, backend="tpu")
    problem = hello_problem(odd, CPU, "cpu", remote_ok=True)
    assert problem is not None and problem[0] == ErrorCode.BACKEND.value


class _IpcBackend(CpuBackend):
    """A CPU backend with CUDA's PID-namespace rule: admission takes the rule from the
    backend it is given, not from a backend name."""

    pid_namespace_rule = CudaBackend.pid_namespace_rule


def test_a_local_consumer_in_another_pid_namespace_is_refused_only_by_a_backend_with_that_rule() -> None:
    elsewhere = dataclasses.replace(_hello(P.PROTOCOL_VERSION, host.host_identity()), pid_ns="pid:[1]")
    assert hello_problem(elsewhere, CPU, "cpu") is None  # shared memory names no process
    problem = hello_problem(elsewhere, _IpcBackend(), "cpu")
    assert problem == (ErrorCode.HOST.value, "CUDA IPC needs both processes in one PID namespace")
    # A remote consumer has no PID namespace in common with us to need.
    remote = dataclasses.replace(elsewhere, boot_id="another-host")
    assert hello_problem(remote, _IpcBackend(), "cpu", remote_ok=True) is None
