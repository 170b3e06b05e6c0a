"""Files the library and the launcher write (``ipcsync.runtime.files``): never through a
name another user planted (a symbolic link at the temporary's name or at an appended
file's name), whole or not at all, and a failed write (a full disk) leaves the previous
file and no temporary behind."""

from __future__ import annotations

import errno
import itertools
import json
import os
import stat
from pathlib import Path

import pytest

from ipcsync.launch.monitor import Observer, merge_trace
from ipcsync.runtime import files


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
