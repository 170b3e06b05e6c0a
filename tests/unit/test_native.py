"""The compiled copy (ipcsync._native, wrapped by ipcsync.backends.native): it builds
here, copies exactly what torch copies, refuses bad arguments with an exception (never a
crash), is what a steady one-tensor send uses, and IPCSYNC_NATIVE turns it off.

The tests that need the module skip, with the reason, where it is not built; the
conformance and fast-path suites run both copy paths (the ``copy_path`` fixture).
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings, strategies as st

from ipcsync.backends import native

ROOT = Path(__file__).resolve().parents[2]

needs_module = pytest.mark.skipif(not native.BUILT, reason=f"{native.reason()}")


def _can_compile() -> str | None:
    """Why this machine cannot build a C extension, or None."""
    if importlib.util.find_spec("setuptools") is None:
        return "no setuptools in this Python (pip install -e . brings its own)"
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None:
        return f"no C compiler ({cc}) here"
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        return "no Python headers (Python.h) here"
    return None


def test_the_extension_builds_and_imports_here(tmp_path: Path) -> None:
    why = _can_compile()
    if why is not None:
        pytest.skip(f"{why}: ipcsync runs on torch's copy (the fallback)")
    build = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(tmp_path / "lib"),
         "--build-temp", str(tmp_path / "tmp")],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-2000:]
    (so,) = (tmp_path / "lib" / "ipcsync").glob("_native*.so")
    probe = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('ipcsync._native', sys.argv[1]); "
             "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
             "print(sorted(n for n in dir(m) if not n.startswith('_')))")
    out = subprocess.run([sys.executable, "-c", probe, str(so)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "['copy', 'cuda_available', 'cuda_copy_record', 'cuda_reason']"


@needs_module
@settings(max_examples=200, deadline=None)
@given(size=st.integers(0, 70_000), src_off=st.integers(0, 300), dst_off=st.integers(0, 300),
       seed=st.integers(0, 2**31 - 1))
def test_native_copy_and_torch_copy_give_the_same_bytes(size: int, src_off: int, dst_off: int, seed: int) -> None:
    copy = native.host_copy()
    assert copy is not None
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(0, 256, (src_off + size,), dtype=torch.uint8, generator=gen)[src_off:]
    by_torch = torch.randint(0, 256, (dst_off + size + 64,), dtype=torch.uint8, generator=gen)
    by_native = by_torch.clone()
    by_torch[dst_off:dst_off + size].copy_(src)
    copy(by_native[dst_off:].data_ptr(), src.data_ptr(), size)
    assert torch.equal(by_native, by_torch)  # (the bytes around it untouched too)


@needs_module
def test_a_large_copy_without_the_gil_is_exact() -> None:
    copy = native.host_copy()
    assert copy is not None
    src = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    copy(dst.data_ptr(), src.data_ptr(), src.numel())
    assert torch.equal(dst, src)


@needs_module
@pytest.mark.parametrize(("args", "error", "match"), [
    ((1, 2), TypeError, "takes 3 arguments"),
    ((1, 2, 3, 4), TypeError, "takes 3 arguments"),
    ((1, 2, "3"), TypeError, "argument 3 must be an int"),
    ((1.0, 2, 3), TypeError, "argument 1 must be an int"),
    ((1, True, 3), TypeError, "argument 2 must be an int"),
    ((-1, 2, 3), ValueError, "non-negative"),
    ((1, 2, 1 << 64), ValueError, "non-negative int below"),
    ((1, 2, 1 << 63), ValueError, "larger than any buffer"),
    ((0, 2, 3), ValueError, "null pointer"),
    ((1, 0, 3), ValueError, "null pointer"),
])
def test_bad_arguments_to_copy_raise(args: tuple[Any, ...], error: type[Exception], match: str) -> None:
    from ipcsync import _native

    with pytest.raises(error, match=match):
        _native.copy(*args)
    _native.copy(0, 0, 0)  # (nothing to copy: no pointer is touched)


@needs_module
@pytest.mark.parametrize(("args", "error", "match"), [
    ((1, 2, 3, 0), TypeError, "takes 5 or 6 arguments"),
    ((1, 2, 3, 0, 5, 0, 7), TypeError, "takes 5 or 6 arguments"),
    ((1, 2, 3, None, 5), TypeError, "argument 4 must be an int"),
    ((1, 2, 3, 0, 0), ValueError, "event must be a CUDA event handle"),
    ((1, 2, 3, 0, 5, "0"), TypeError, "argument 6 must be an int"),
    ((1, 2, 3, 0, 5, -2), ValueError, "device must be a device index"),
    ((0, 2, 3, 0, 5), ValueError, "null pointer"),
])
def test_bad_arguments_to_cuda_copy_record_raise(args: tuple[Any, ...], error: type[Exception], match: str) -> None:
    from ipcsync import _native

    with pytest.raises(error, match=match):
        _native.cuda_copy_record(*args)


@needs_module
def test_without_the_cuda_runtime_cuda_copy_record_raises_naming_why() -> None:
    from ipcsync import _native

    if _native.cuda_available():
        pytest.skip("the CUDA runtime is loaded here (tests/integration/test_native_cuda.py covers it)")
    assert native.cuda_copy_record() is None
    reason = native.cuda_reason()
    assert reason and "libcudart" in reason
    with pytest.raises(RuntimeError, match="CUDA runtime not available"):
        _native.cuda_copy_record(1, 2, 3, 0, 5, 0)


def test_ipcsync_native_0_turns_it_off_and_a_bad_value_is_refused(procs: Any) -> None:
    """Read at import, in a process of its own for each value."""
    def state(value: str) -> Any:
        return procs.start("native_state", module="peers.basic", env={"IPCSYNC_NATIVE": value})

    assert state("0").result() == {"event": "done", "enabled": False, "host_copy": False}
    assert state("1").result() == {"event": "done", "enabled": True, "host_copy": native.BUILT}
    bad = state("yes")
    assert bad.proc.wait(timeout=120) != 0
    err = bad.stderr()
    assert "IPCSYNC_NATIVE='yes'" in err and "set it to 0" in err, err[-2000:]


@needs_module
def test_a_steady_one_tensor_send_copies_natively_and_others_with_torch(
        endpoints: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    real = native.host_copy()
    assert real is not None
    calls: list[int] = []

    def counted(dst: int, src: int, nbytes: int) -> None:
        calls.append(nbytes)
        real(dst, src, nbytes)

    monkeypatch.setattr(native, "host_copy", lambda: counted)
    # (the CPU backend's route: on a machine with a GPU too, where a device would default to it)
    out = endpoints.producer("native-route", slots=2, slot_bytes=1 << 16, heartbeat=None, timeout=10, device="cpu")
    inp = endpoints.consumer("native-route", heartbeat=None, timeout=10, device="cpu")
    out.wait_for_consumers(1, timeout=10)
    plain = torch.arange(1000, dtype=torch.float32)
    sent = [
        ({"x": plain}, True),
        ({"x": plain.reshape(10, 100).t()}, True),  # dense, other strides: its bytes as they are
        ({"x": plain[::2]}, False),  # gapped
        ({"x": plain, "y": plain}, False),  # several tensors: torch's batched copy
        ({"x": torch.complex(plain, plain + 1).conj()}, False),  # a conj bit to resolve
        ({"x": torch.complex(plain, plain + 1).conj().imag}, False),  # a neg bit
        ({"x": torch.ones(3, requires_grad=True)}, False),
        ({"x": torch.zeros(0)}, True),
    ]
    for msg, natively in sent:
        before = len(calls)
        out.send(msg)
        item = inp.get(timeout=10)
        assert item is not None
        for k, v in msg.items():
            assert torch.equal(item[k].detach(), v.detach().resolve_conj()), k
        item.release()
        assert (len(calls) > before) is natively, msg
