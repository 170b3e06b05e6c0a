"""``ipcsync doctor``'s CUDA IPC probe: two fresh processes, one exporting a tensor and an
interprocess event on every visible GPU, the other opening both (``cuda_ipc_probe``).
A probe process (``probe_child``) talks JSON lines over its stdin and stdout: its stdout is
that channel, not logging."""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Iterator

from .report import FAIL, PASS, Check

__all__ = ["DEFAULT_IPC_TIMEOUT", "PROBE_VALUE", "PROBE_NUMEL", "cuda_ipc_probe", "probe_child"]

log = logging.getLogger(__name__)

DEFAULT_IPC_TIMEOUT = 60.0  # seconds for the whole CUDA IPC probe (two CUDA inits)
PROBE_VALUE = 1000  # the exporter fills GPU i's tensor with PROBE_VALUE + i
PROBE_NUMEL = 1 << 16

_IPC_FIX = ("CUDA IPC needs both processes on one host in one IPC namespace (containers: one container for "
            "the pipeline, or --ipc=host for each), a driver that supports it (not WSL2, not a vGPU without "
            "IPC), GPUs in compute mode Default, and the same GPUs visible to both; until then run the "
            "stages on device = \"cpu\"")


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


class _Child:
    """A probe process: JSON lines in over stdin, out over stdout, stderr in a file."""

    def __init__(self, role: str) -> None:
        self.err = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", f"from ipcsync.doctor import probe_child; probe_child({role!r})"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, env=_child_env(),
            start_new_session=True,
        )
        self.role = role
        self.buf = b""

    def send(self, obj: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj).encode() + b"\n")
        self.proc.stdin.flush()

    def read(self, deadline: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the {self.role} process (pid {self.proc.pid}) did not answer in time")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise EOFError(f"the {self.role} process (pid {self.proc.pid}) exited "
                                   f"({self.proc.wait()}): {self.stderr_tail()}")
                self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        reply = json.loads(line)
        if not isinstance(reply, dict):
            raise ValueError(f"the {self.role} process sent {line[:200]!r}")
        if reply.get("error"):
            raise RuntimeError(f"{self.role} process: {reply['error']}")
        return reply

    def stderr_tail(self) -> str:
        self.err.seek(0)
        lines = self.err.read().decode(errors="replace").strip().splitlines()
        return " | ".join(lines[-3:]) or "(no output)"

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            log.warning("probe process %d did not exit after SIGKILL", self.proc.pid)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass
        self.err.close()


def cuda_ipc_probe(timeout: float = DEFAULT_IPC_TIMEOUT) -> Check:
    """CUDA IPC between two fresh processes, on every visible GPU: the exporter fills a
    tensor, records an interprocess event and prints both handles (hex in JSON; never
    pickle); the importer opens both (``import_tensor``, ``IpcEvent.from_handle``), waits
    on the event, checks the values and writes new ones, which the exporter then reads.
    Both processes are killed when ``timeout`` seconds run out."""
    name = "cuda ipc"
    start = time.monotonic()
    deadline = start + timeout
    children: list[_Child] = []
    try:
        exporter = _Child("export")
        children.append(exporter)
        offer = exporter.read(deadline)
        importer = _Child("import")
        children.append(importer)
        importer.send(offer)
        seen = importer.read(deadline)
        exporter.send({"verify": True})
        back = exporter.read(deadline)
        # The importer goes first: torch counts its references to the exporter's memory,
        # and an exporter that exits while they are held warns ("Producer process has been
        # terminated before all shared CUDA tensors released").
        for child in (importer, exporter):
            child.send({"exit": True})
            child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    except (OSError, ValueError, RuntimeError, TimeoutError, EOFError, subprocess.TimeoutExpired) as exc:
        log.debug("CUDA IPC probe failed", exc_info=True)
        tails = "; ".join(f"{c.role} stderr: {c.stderr_tail()}" for c in children if not isinstance(exc, EOFError))
        return Check(FAIL, name, f"{exc}" + (f" ({tails})" if tails else ""), _IPC_FIX)
    finally:
        for child in children:
            child.close()
    gpus = ", ".join(f"cuda:{g['device']}" for g in offer["gpus"])
    if not (seen.get("ok") and back.get("ok")):
        return Check(FAIL, name, f"the values did not cross: importer saw {seen.get('seen')}, exporter read back "
                     f"{back.get('seen')} (expected {[PROBE_VALUE + g['device'] for g in offer['gpus']]})", _IPC_FIX)
    return Check(PASS, name, (
        f"pid {offer['pid']} exported a tensor and an interprocess event on {gpus}; pid {seen['pid']} opened both, "
        f"waited on the event, read the values and wrote new ones, which pid {offer['pid']} read "
        f"({time.monotonic() - start:.1f} s)"))


def _lines_in() -> Iterator[dict[str, Any]]:
    for line in sys.stdin:
        obj = json.loads(line)
        if not isinstance(obj, dict) or obj.get("exit"):
            return
        yield obj


def _say(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def probe_child(role: str) -> None:
    """The body of a CUDA IPC probe process (``role`` "export" or "import"); run by
    ``cuda_ipc_probe`` in a fresh interpreter. Talks JSON lines over stdin/stdout."""
    try:
        import torch

        from ..backends.cuda import IpcEvent, export_tensor, import_tensor

        if role == "export":
            if torch.cuda.device_count() == 0:
                raise RuntimeError(
                    f"no CUDA GPU is visible (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')})")
            keep = []
            offer = []
            for i in range(torch.cuda.device_count()):
                with torch.cuda.device(i):
                    t = torch.zeros(PROBE_NUMEL, dtype=torch.int64, device=f"cuda:{i}")
                    t.fill_(PROBE_VALUE + i)
                    ev = IpcEvent(i)
                    ev.record()
                keep.append((t, ev))
                offer.append({"device": i, "tensor": export_tensor(t).hex(), "event": ev.handle().hex()})
            _say({"pid": os.getpid(), "gpus": offer})
            for _ in _lines_in():  # {"verify": true}: the importer has written value + 1
                torch.cuda.synchronize()
                seen = [int(t[0].item()) for t, _ in keep]
                ok = all(bool((t == PROBE_VALUE + i + 1).all().item()) for i, (t, _) in enumerate(keep))
                _say({"ok": ok, "seen": seen})
            keep.clear()  # the importer has exited: its references are gone
            torch.cuda.ipc_collect()
        elif role == "import":
            for offer_msg in _lines_in():
                seen, ok = [], True
                for g in offer_msg["gpus"]:
                    i = int(g["device"])
                    t = import_tensor(bytes.fromhex(g["tensor"]), i)
                    ev = IpcEvent.from_handle(bytes.fromhex(g["event"]), i)
                    ev.synchronize(timeout=10.0)  # the host sees the peer's event complete
                    with torch.cuda.device(i):
                        ev.wait()  # and a stream of ours waits on it
                        seen.append(int(t[0].item()))
                        ok = ok and bool((t == PROBE_VALUE + i).all().item())
                        t.add_(1)
                        torch.cuda.synchronize(i)
                    del t
                _say({"ok": ok, "seen": seen, "pid": os.getpid()})
        else:
            raise ValueError(f"unknown probe role {role!r}")
    except Exception as exc:
        _say({"error": f"{type(exc).__name__}: {exc}"})
        sys.exit(1)
