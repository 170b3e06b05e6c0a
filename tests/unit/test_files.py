"""Files the library and the launcher write (``ipcsync.system.files``): never through a
name another user planted (a symbolic link at the temporary's name or at an appended
file's name), whole or not at all, and a failed write (a full disk) leaves the previous
file and no temporary behind. Files the launcher reads: regular files only, never a wait
(a FIFO at the name), size-capped, and a document nested too deeply is a ValueError."""

from __future__ import annotations

import errno
import itertools
import json
import os
import stat
import threading
from pathlib import Path
from typing import Any, Callable

import pytest

from ipcsync.launch.monitor import Observer, merge_trace
from ipcsync.system import files


def victim(tmp_path: Path) -> Path:
    """A file another user's link points at: it must never change."""
    v = tmp_path / "victim"
    v.write_text("precious\n")
    return v


def leftovers(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.endswith(".tmp"))


def test_write_atomic_writes_whole_files_private_by_default(tmp_path: Path) -> None:
    path = tmp_path / "out.json"
    files.write_atomic(str(path), '{"a": 1}')
    assert path.read_text() == '{"a": 1}' and stat.S_IMODE(path.stat().st_mode) == 0o600
    files.write_atomic(str(path), iter(["[", "1, ", "2]"]))  # in pieces
    assert json.loads(path.read_text()) == [1, 2]
    files.write_atomic(str(path), b"x" * (3 << 20))  # more than one write
    assert path.stat().st_size == 3 << 20
    assert leftovers(tmp_path) == []


def test_a_link_planted_at_the_temporary_name_is_not_followed(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    v = victim(tmp_path)
    path = tmp_path / "trace.json"
    planted = tmp_path / "planted.tmp"
    planted.symlink_to(v)
    names = itertools.chain([str(planted)], (str(tmp_path / f"fresh{i}.tmp") for i in itertools.count()))
    monkeypatch.setattr(files, "temp_name", lambda p: next(names))
    files.write_atomic(str(path), "trace data")
    assert path.read_text() == "trace data"
    assert v.read_text() == "precious\n" and planted.is_symlink()


def test_every_temporary_name_taken_fails_clearly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    v = victim(tmp_path)
    planted = tmp_path / "planted.tmp"
    planted.symlink_to(v)
    monkeypatch.setattr(files, "temp_name", lambda p: str(planted))
    with pytest.raises(FileExistsError, match="cannot create a temporary file beside .*planting"):
        files.write_atomic(str(tmp_path / "out.json"), "data")
    assert v.read_text() == "precious\n" and not (tmp_path / "out.json").exists()


def test_a_link_at_the_target_is_replaced_not_followed(tmp_path: Path) -> None:
    v = victim(tmp_path)
    path = tmp_path / "out.json"
    path.symlink_to(v)
    files.write_atomic(str(path), "new")
    assert not path.is_symlink() and path.read_text() == "new" and v.read_text() == "precious\n"


def test_append_never_follows_a_link(tmp_path: Path) -> None:
    v = victim(tmp_path)
    path = tmp_path / "stats.jsonl"
    path.symlink_to(v)
    with pytest.raises(OSError) as err:
        files.append(str(path), b"line\n")
    assert err.value.errno == errno.ELOOP and v.read_text() == "precious\n"
    with pytest.raises(OSError) as err:
        Observer(stats_file=str(path))  # --stats-file: the launcher says so (ConfigError)
    assert err.value.errno == errno.ELOOP and v.read_text() == "precious\n"


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "out.json"
    files.write_atomic(str(path), "old")

    def full(fd: int, data: bytes) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(files, "write_all", full)
    with pytest.raises(OSError) as err:
        files.write_atomic(str(path), "new")
    assert err.value.errno == errno.ENOSPC
    assert path.read_text() == "old" and leftovers(tmp_path) == []


def test_merge_trace_ignores_a_link_at_the_name_it_used_to_write(tmp_path: Path) -> None:
    """``--trace PATH`` used to write ``PATH.<pid>.tmp`` through whatever was there."""
    v = victim(tmp_path)
    path = tmp_path / "trace.json"
    (tmp_path / f"trace.json.{os.getpid()}.tmp").symlink_to(v)
    merge_trace([], str(path))
    assert "traceEvents" in json.loads(path.read_text())
    assert v.read_text() == "precious\n"


def test_a_full_runtime_directory_before_any_stage_is_a_clear_error(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from ipcsync.errors import ConfigError
    from ipcsync.launch.supervisor import Supervisor

    def full(fd: int, data: bytes) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(files, "write_all", full)

    def no_plan(*args: object) -> None:
        raise AssertionError("no stage may start when the run cannot be recorded")

    with pytest.raises(ConfigError, match="cannot write to the runtime directory .*No space left on device.*"
                                          "IPCSYNC_RUNTIME_DIR"):
        Supervisor(no_plan, runtime_base=str(tmp_path)).run()  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []  # its run directory removed


# ---------------------------------------------------------------------------- reading
def at_once(fn: Callable[[], Any], fifo: Path, reading: bool = True) -> BaseException | None:
    """What ``fn()`` raised (None if it returned), within 10 s; a call still blocked on
    ``fifo`` then is released (its other end opened) and the test fails."""
    out: list[BaseException | None] = []

    def run() -> None:
        try:
            fn()
            out.append(None)
        except BaseException as exc:  # noqa: BLE001 (handed to the test)
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(10)
    if t.is_alive():
        fd = os.open(fifo, (os.O_WRONLY if reading else os.O_RDONLY) | os.O_NONBLOCK)
        t.join(10)
        os.close(fd)
        raise AssertionError(f"blocked on the FIFO {fifo}")
    return out[0]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("read", [
    lambda p: files.read_regular(p, 100), lambda p: files.read_json(p, 100), lambda p: files.open_regular(p),
    lambda p: files.read_lines(p, 100),
])
def test_reading_a_fifo_is_refused_at_once(tmp_path: Path, read: Callable[[str], Any]) -> None:
    fifo = tmp_path / "report.json"
    os.mkfifo(fifo, 0o600)
    err = at_once(lambda: read(str(fifo)), fifo)
    assert isinstance(err, OSError) and err.strerror == "not a regular file (a FIFO)", err


@pytest.mark.timeout(60)
def test_appending_to_a_fifo_is_refused_at_once(tmp_path: Path) -> None:
    # Before: an open for appending waited for a reader (--stats-file at a FIFO: for ever).
    fifo = tmp_path / "stats.jsonl"
    os.mkfifo(fifo, 0o600)
    err = at_once(lambda: files.open_append(str(fifo)), fifo, reading=False)
    assert isinstance(err, OSError) and err.strerror == "not a regular file (a FIFO)", err
    # With a reader there, the open succeeds in the kernel; the file is still refused.
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        err = at_once(lambda: files.open_append(str(fifo)), fifo, reading=False)
        assert isinstance(err, OSError) and err.strerror == "not a regular file (a FIFO)", err
    finally:
        os.close(reader)


def test_reading_what_is_not_a_regular_file_says_what_it_is(tmp_path: Path) -> None:
    (tmp_path / "dir.json").mkdir()
    (tmp_path / "link.json").symlink_to(victim(tmp_path))
    for name, what in (("dir.json", "a directory"), ("link.json", "a symbolic link")):
        with pytest.raises(OSError) as err:
            files.read_json(str(tmp_path / name), 100)
        assert err.value.strerror == f"not a regular file ({what})"
    with pytest.raises(FileNotFoundError):
        files.read_json(str(tmp_path / "missing.json"), 100)


def test_reads_are_capped_and_nesting_is_a_value_error(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    path.write_text('{"a": [1, 2]}')
    assert files.read_json(str(path), 13) == {"a": [1, 2]}
    with pytest.raises(OSError) as err:
        files.read_json(str(path), 12)
    assert err.value.errno == errno.EFBIG and files.why(err.value) == "larger than 12 bytes"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError) as verr:  # before: RecursionError, which readers did not catch
        files.read_json(str(path), 1 << 20)
    assert files.why(verr.value) == "JSON nested too deeply"
    path.write_bytes(b"a\nbb\n" + b"c" * 10)
    assert list(files.read_lines(str(path), 100, line_limit=4)) == [b"a\n", b"bb\n", b"cccc", b"cccc", b"cc"]
    assert list(files.read_lines(str(path), 4)) == [b"a\n", b"bb"]


def test_a_check_sees_the_file_that_is_read(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text("x" * 20)
    seen: list[os.stat_result] = []
    assert files.read_regular(str(path), 100, seen.append) == b"x" * 20
    assert seen[0].st_ino == path.stat().st_ino

    def refuse(st: os.stat_result) -> None:
        raise PermissionError("no")

    with pytest.raises(PermissionError):
        files.read_regular(str(path), 100, refuse)
