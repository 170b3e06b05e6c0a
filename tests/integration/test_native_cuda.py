"""The compiled copy-and-record on a CUDA slot (ipcsync.backends.native), each test with
the copy made natively and with torch (the ``copy_path`` fixture): the same bytes arrive;
the copy is enqueued on the current stream, after what was queued there, and the ready
event is recorded after it (a consumer that waits on the event sees the final values, one
that skips the wait does not). A send under another current stream copies and records on
that one: test_cuda.py's ``test_a_call_under_another_current_stream_records_on_that_stream``,
run with both copy paths. GPU only (the ``cuda`` marker).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from ipcsync.backends import native

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(240), pytest.mark.usefixtures("copy_path")]

N = 1 << 20  # floats in the race's item


def test_the_cuda_runtime_is_found_where_the_module_is_built(copy_path: str) -> None:
    torch.zeros(1, device="cuda")  # (CUDA initialized: torch's libcudart loaded)
    if copy_path == "native":
        assert native.cuda_copy_record() is not None, native.cuda_reason()


def test_every_dtype_and_size_arrives_the_same_either_way(endpoints: Any, copy_path: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    copies: list[int] = []
    real = native.cuda_copy_record()
    if real is not None:
        def counted(*args: int) -> None:
            copies.append(args[2])
            real(*args)

        monkeypatch.setattr(native, "cuda_copy_record", lambda: counted)
    name = f"native-cuda-{copy_path}-{os.getpid()}"
    out = endpoints.producer(name, slots=2, slot_bytes=1 << 22, device="cuda", heartbeat=None, timeout=60)
    inp = endpoints.consumer(name, device="cuda", heartbeat=None, timeout=60)
    out.wait_for_consumers(1, timeout=60)
    gen = torch.Generator(device="cuda").manual_seed(0)
    sent = []
    for dtype in (torch.uint8, torch.float16, torch.bfloat16, torch.float32, torch.int64, torch.complex64):
        for shape in ((0,), (1,), (7, 3), (4096,), (1 << 18,)):
            x = torch.randn(shape, generator=gen, device="cuda").to(dtype) if dtype != torch.uint8 else \
                torch.randint(0, 256, shape, generator=gen, device="cuda", dtype=dtype)
            for msg in ({"x": x}, {"x": x.t() if x.dim() == 2 else x}):
                out.send(msg)
                item = inp.get(timeout=60)
                assert item is not None
                assert torch.equal(item["x"], msg["x"]), (dtype, shape)
                item.release()
                sent.append(msg["x"].numel() * msg["x"].element_size())
    if copy_path == "native":
        # Every send after each slot's ready event existed (the first record creates it).
        assert len(copies) >= len(sent) - 2 and set(copies) <= set(sent)
    else:
        assert not copies


@pytest.mark.parametrize("skip_wait", [False, True], ids=["waits", "no-wait"])
def test_ready_race_of_a_send_consumer_sees_final_values_only_with_the_wait(procs: Any, copy_path: str,
                                                                            skip_wait: bool) -> None:
    """The producer fills its tensor after ~1 s of GPU work and sends it at once: the copy
    runs after the fill on the same stream, the ready event after the copy."""
    ep = f"nrace-{copy_path}"
    prod = procs.start("race_produce", module="peers.gpu", endpoint=ep, sleep=1.0, values=[1.0, 42.0],
                       elems=N, via="send", slots=2, sleep_all=True)
    cons = procs.start("race_consume", module="peers.gpu", endpoint=ep, skip_wait=skip_wait)
    c = cons.result(timeout=120)
    p = prod.result(timeout=120)
    assert all(p["pending"]), "send waited for the GPU work (a host sync)"
    # The first send of each slot records through torch (its event is created then).
    assert (p["native_copies"] > 0) is (copy_path == "native"), p
    final = [item["min"] == item["max"] == item["expected"] for item in c["items"]]
    assert len(final) == 2
    assert all(final) if not skip_wait else not all(final), c["items"]


def test_a_cuda_error_raises_naming_it_and_never_crashes(copy_path: str) -> None:
    if copy_path == "torch":
        pytest.skip("the compiled call only")
    from ipcsync import _native

    torch.zeros(1, device="cuda")
    if not _native.cuda_available():
        pytest.skip(f"no CUDA runtime found: {_native.cuda_reason()}")
    ev = torch.cuda.Event()
    ev.record()
    # A device that does not exist: the call fails before any copy, with the error's name.
    with pytest.raises(RuntimeError, match=r"cudaSetDevice failed: cudaErrorInvalidDevice \(CUDA error \d+\)"):
        _native.cuda_copy_record(0, 0, 0, 0, ev.cuda_event, 4096)
