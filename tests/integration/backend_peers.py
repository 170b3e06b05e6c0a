"""The peer side of tests/integration/backend_checker.py: one long-lived child process that opens
another process's arenas and events on a backend and answers commands.

``serve`` reads one JSON command per line from a FIFO (``{"seq", "fn", "kwargs"}``), runs
``COMMANDS[fn](state, **kwargs)`` and prints ``{"event": "reply", "seq", "ok", ...}`` on
stdout (the JSON-lines protocol of tests/conftest.py's ``Peer``). Arenas and events it
opens stay open between commands, under the keys the commands name, so a check can open
something, let the owner act, and look again.

Handles travel as tagged JSON values (``pack``/``unpack``): bytes as hex, and the wrong
types the bad-handle checks send keep their type.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import sys
import time
from typing import Any, Callable

import torch

from ipcsync.backends.base import Arena, Backend, Event
from ipcsync.errors import BackendError

Packed = list[Any]


def say(**kw: Any) -> None:
    print(json.dumps(kw), flush=True)


# --------------------------------------------------------------------------- values
def pack(v: Any) -> Packed:
    """A JSON-safe, type-preserving form of a handle (or of a wrong-typed stand-in)."""
    if v is None:
        return ["none"]
    if isinstance(v, bool):
        return ["bool", v]
    if isinstance(v, int):
        return ["int", v]
    if isinstance(v, float):
        return ["float", v]
    if isinstance(v, (bytes, bytearray)):
        return ["bytes", bytes(v).hex()]
    if isinstance(v, str):
        return ["str", v]
    if isinstance(v, (list, tuple)):
        return ["list", [pack(x) for x in v]]
    if isinstance(v, dict):
        return ["dict", [[pack(k), pack(x)] for k, x in v.items()]]
    raise TypeError(f"cannot pass a {type(v).__name__} to the peer")


def unpack(p: Packed) -> Any:
    """Inverse of ``pack``."""
    tag = p[0]
    if tag == "none":
        return None
    if tag in ("bool", "int", "float", "str"):
        return p[1]
    if tag == "bytes":
        return bytes.fromhex(p[1])
    if tag == "list":
        return [unpack(x) for x in p[1]]
    if tag == "dict":
        return {unpack(k): unpack(x) for k, x in p[1]}
    raise ValueError(f"unknown packed tag {tag!r}")


def load_backend(spec: str, device: str) -> Backend:
    """``module:Class`` built for ``device``."""
    mod, _, name = spec.partition(":")
    cls = getattr(importlib.import_module(mod), name)
    return cls(torch.device(device))


def settle(backend: Backend) -> None:
    """Make this process's queued writes visible to other processes (host work is
    already done; device work is waited for)."""
    if backend.device.type == "cuda":
        torch.cuda.synchronize(backend.device)


def spin_cycles(seconds: float, device: torch.device) -> int:
    """GPU clock cycles that ``torch.cuda._sleep`` spins for about ``seconds``."""
    props = torch.cuda.get_device_properties(device)
    rate = getattr(props, "clock_rate", 0) or 1_980_000  # kHz
    return int(seconds * rate * 1000)


def warm_up(backend: Backend) -> None:
    """Launch the kernels the checks use once: with CUDA lazy loading the first launch of a
    kernel loads its module, which waits for the device to go idle."""
    if backend.device.type != "cuda":
        return
    with torch.cuda.device(backend.device):
        x = torch.zeros(1 << 10, dtype=torch.uint8, device=backend.device)
        x.fill_(1)
        torch.cuda._sleep(1)
        x.cpu()
        torch.cuda.synchronize()


def read_span(t: torch.Tensor) -> dict[str, Any]:
    """What a span of uint8 holds: min, max and (when short) its bytes."""
    host = t.cpu()  # on the current stream, after whatever it was told to wait for
    out: dict[str, Any] = {"min": int(host.min()) if host.numel() else None,
                           "max": int(host.max()) if host.numel() else None}
    if host.numel() <= 4096:
        out["hex"] = bytes(host.tolist()).hex()
    return out


def write_span(t: torch.Tensor, data: bytes) -> None:
    t.copy_(torch.tensor(list(data), dtype=torch.uint8))


# --------------------------------------------------------------------------- commands
class State:
    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.arenas: dict[str, Arena] = {}
        self.events: dict[str, Event] = {}


def _refusal(exc: BaseException) -> dict[str, Any]:
    return {"raised": f"{type(exc).__module__}.{type(exc).__qualname__}",
            "backend_error": isinstance(exc, BackendError), "message": str(exc)[:500]}


def c_hello(s: State) -> dict[str, Any]:
    return {"pid": os.getpid(), "backend": s.backend.name, "device": str(s.backend.device)}


def c_open_arena(s: State, key: str, handle: Packed, nbytes: int, borrowed: bool = False) -> dict[str, Any]:
    h = unpack(handle)
    a = s.backend.open_borrowed_arena(h, nbytes) if borrowed else s.backend.open_arena(h, nbytes)
    s.arenas[key] = a
    return {"nbytes": a.nbytes, "numel": a.tensor.numel(), "dtype": str(a.tensor.dtype),
            "data_ptr": a.tensor.data_ptr(), "readonly": bool(getattr(a, "readonly", False))}


def c_try_open_arena(s: State, handle: Packed, nbytes: int, borrowed: bool = False) -> dict[str, Any]:
    """Open and close at once; report whether and how it was refused."""
    h = unpack(handle)
    try:
        a = s.backend.open_borrowed_arena(h, nbytes) if borrowed else s.backend.open_arena(h, nbytes)
    except BaseException as exc:  # any type: reporting the wrong type is the point
        return _refusal(exc)
    a.close()
    return {"raised": None}


def c_read(s: State, key: str, offset: int, length: int, wait: str | None = None) -> dict[str, Any]:
    """Read a span of arena ``key``; with ``wait``, the current stream first waits on
    event ``wait`` (the read is queued after it)."""
    t = s.arenas[key].tensor[offset:offset + length]
    if wait is not None:
        s.events[wait].wait()
    out = read_span(t)
    if wait is not None:
        out["query_after"] = s.events[wait].query()
    return out


def c_write(s: State, key: str, offset: int, data: str) -> dict[str, Any]:
    """Write bytes (hex) into arena ``key``; visible to the owner when this returns."""
    raw = bytes.fromhex(data)
    write_span(s.arenas[key].tensor[offset:offset + len(raw)], raw)
    settle(s.backend)
    return {}


def c_fill_recorded(s: State, key: str, offset: int, length: int, value: int, event: str,
                    spin: float = 0.0) -> dict[str, Any]:
    """Fill a span with ``value`` behind ``spin`` s of GPU work, record event ``event``
    after it and return at once (no host sync)."""
    t = s.arenas[key].tensor[offset:offset + length]
    if spin and s.backend.device.type == "cuda":
        torch.cuda._sleep(spin_cycles(spin, s.backend.device))
    t.fill_(value)
    s.events[event].record()
    return {}


def c_close_arena(s: State, key: str, times: int = 2) -> dict[str, Any]:
    a = s.arenas.pop(key)
    for _ in range(times):
        a.close()
    del a
    gc.collect()
    s.backend.collect()
    return {}


def c_create_event(s: State, key: str) -> dict[str, Any]:
    ev = s.backend.create_event()
    s.events[key] = ev
    return {"handle": pack(ev.handle())}


def c_open_event(s: State, key: str, handle: Packed) -> dict[str, Any]:
    s.events[key] = s.backend.open_event(unpack(handle))
    return {"query": s.events[key].query()}


def c_try_open_event(s: State, handle: Packed) -> dict[str, Any]:
    try:
        s.backend.open_event(unpack(handle))
    except BaseException as exc:
        return _refusal(exc)
    return {"raised": None}


def c_synchronize(s: State, key: str, timeout: float = 60.0) -> dict[str, Any]:
    s.events[key].synchronize(timeout)
    return {"query": s.events[key].query()}


def c_close_backend(s: State, times: int = 2) -> dict[str, Any]:
    for key in list(s.arenas):
        c_close_arena(s, key)
    s.events.clear()
    for _ in range(times):
        s.backend.close()
    return {}


COMMANDS: dict[str, Callable[..., dict[str, Any]]] = {
    "hello": c_hello,
    "open_arena": c_open_arena,
    "try_open_arena": c_try_open_arena,
    "read": c_read,
    "write": c_write,
    "fill_recorded": c_fill_recorded,
    "close_arena": c_close_arena,
    "create_event": c_create_event,
    "open_event": c_open_event,
    "try_open_event": c_try_open_event,
    "synchronize": c_synchronize,
    "close_backend": c_close_backend,
}


def serve(a: dict[str, Any]) -> None:
    """Answer commands from FIFO ``a["commands"]`` until it closes or says exit."""
    backend = load_backend(a["backend"], a["device"])
    if backend.device.type == "cuda":
        torch.cuda.set_device(backend.device)
    warm_up(backend)
    state = State(backend)
    say(event="ready", pid=os.getpid())
    with open(a["commands"], "r", encoding="utf-8") as cmds:
        for line in cmds:
            cmd = json.loads(line)
            seq, fn = cmd["seq"], cmd["fn"]
            if fn == "exit":
                break
            t0 = time.monotonic()
            try:
                result = COMMANDS[fn](state, **cmd["kwargs"])
            except BaseException as exc:
                say(event="reply", seq=seq, ok=False, fn=fn, **_refusal(exc))
                continue
            say(event="reply", seq=seq, ok=True, fn=fn, result=result, took=time.monotonic() - t0)
    state.arenas.clear()
    state.events.clear()
    gc.collect()
    settle(backend)
    say(event="done")
    sys.stdout.flush()
