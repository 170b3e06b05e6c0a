"""Stage output relayed to the launcher's stdout.

Every line a stage writes is written as ``[stage/replica] line``; of a partial line, the
part up to its last ``\\r`` is written at once (progress bars stay live) and the rest
waits for more; a partial line longer than ``_MAX_PARTIAL`` is written in pieces, and
what is left when a pipe reaches EOF is written as a line. When nobody reads the
launcher's output any more (``| head`` exited), the relay writes nothing more and says
so once (``on_broken``): the supervisor stops as if by SIGPIPE.

An attempt's selector holds every stage's pipe (its data: the ``StageProc``) and the read
end of the launcher's signal wakeup pipe (its data: None), which ``pump`` drains: a
signal ends the wait at once.
"""

from __future__ import annotations

import os
import selectors
from typing import IO, Callable

from .stageproc import StageProc

__all__ = ["OutputRelay"]

_READ_CHUNK = 65536
_MAX_PARTIAL = 1 << 16  # a line longer than this is printed in pieces


class OutputRelay:
    """Writes the stages' output to ``out``, each line prefixed with its stage's label."""

    def __init__(self, out: IO[bytes], on_broken: Callable[[], None]) -> None:
        self._out = out
        self._on_broken = on_broken
        self.broken = False  # our stdout's reader is gone

    def pump(self, sel: selectors.BaseSelector, timeout: float) -> None:
        """Relay output (and notice signals) for up to ``timeout`` seconds."""
        for key, _ in sel.select(timeout):
            if key.data is None:  # the signal wakeup pipe
                try:
                    os.read(key.fd, 512)
                except BlockingIOError:
                    pass
                continue
            proc: StageProc = key.data
            try:
                chunk = os.read(key.fd, _READ_CHUNK)
            except BlockingIOError:
                continue
            except OSError:
                chunk = b""
            if not chunk:
                sel.unregister(key.fileobj)
                proc.pipe_open = False
                self.emit(proc, final=True)
            else:
                proc.partial += chunk
                self.emit(proc)

    def emit(self, proc: StageProc, final: bool = False) -> None:
        """Write the complete lines of ``proc.partial``, each prefixed; of the rest, a part
        up to its last ``\\r`` (a progress bar's update) is written at once, without a
        newline; the rest waits for more (all of it if ``final`` or too long)."""
        lines = proc.partial.split(b"\n")
        rest = lines.pop()
        prefix = f"[{proc.inst.label}] ".encode()
        pieces = [prefix + line + b"\n" for line in lines]
        if len(rest) > _MAX_PARTIAL or (final and rest):
            pieces.append(prefix + rest + b"\n")
            rest = b""
        else:
            cr = rest.rfind(b"\r")
            if cr >= 0:
                pieces.append(prefix + rest[: cr + 1])
                rest = rest[cr + 1 :]
        proc.partial = rest
        if pieces and not self.broken:
            try:
                self._out.write(b"".join(pieces))
                self._out.flush()
            except (BrokenPipeError, ValueError, OSError):
                # Nobody reads our output (``| head`` exited): stop as if by SIGPIPE.
                self.broken = True
                self._on_broken()
