"""The rendezvous secret file (``ipcsync.launch.secretfile``, ``--rdzv-secret-file``): a
file another user made or can swap never gives them the run, and nothing at the path
makes a launcher wait.

Read: a regular file only (never a link, a FIFO, a directory), owned by this user or
root, one name, no access for group or others, at most 4 KiB. Written (node 0): a new
file, mode 600, in a directory only this user can write, or a sticky one (/tmp).
"""

from __future__ import annotations

import os
import stat
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from ipcsync.errors import ConfigError
from ipcsync.launch import secretfile
from ipcsync.launch.plan import SECRET_ENV

NOBODY = 65534


@pytest.fixture(autouse=True)
def no_env_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)


def load(rank: int, path: Path, wait: float = 0.0, said: list[str] | None = None) -> bytes | None:
    secret, _ = secretfile.load_secret(rank, str(path), False, wait, (said if said is not None else []).append,
                                       str(path.parent))
    return secret


def secret_file(tmp_path: Path, text: str = "ab" * 32, mode: int = 0o600) -> Path:
    path = tmp_path / "run.secret"
    path.write_text(text + "\n")
    os.chmod(path, mode)
    return path


def others(path: Path, monkeypatch: pytest.MonkeyPatch) -> int:
    """Make ``path`` another user's (as root: chown to nobody; else: this process passes
    for another user). Returns the owner the launcher sees."""
    if os.geteuid() == 0:
        os.chown(path, NOBODY, NOBODY)
        return NOBODY
    me = os.geteuid()
    monkeypatch.setattr(os, "geteuid", lambda: me + 1)
    return me


def at_once(fn: Callable[[], Any], fifo: Path) -> BaseException | None:
    """What ``fn()`` raised, within 10 s; a call still blocked in open() on ``fifo`` then
    is released (a writer opened) and the test fails."""
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
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        t.join(10)
        raise AssertionError(f"blocked on the FIFO {fifo}")
    return out[0]


# ---------------------------------------------------------------------------- read
@pytest.mark.parametrize("rank", [0, 1])
def test_a_secret_file_of_another_user_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  rank: int) -> None:
    # Before: a root launcher used a file uid 65534 had made at the path (mode 600): the
    # planter held the run's secret, joined as node 1 and received the items.
    path = secret_file(tmp_path)
    owner = others(path, monkeypatch)
    with pytest.raises(ConfigError) as err:
        load(rank, path)
    assert str(err.value).startswith(f"--rdzv-secret-file {path} is owned by another user (uid {owner})"), err.value
    assert "use a file you made" in str(err.value)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("rank", [0, 1])
def test_a_fifo_at_the_secret_file_is_refused_at_once(tmp_path: Path, rank: int) -> None:
    # Before: open() of the FIFO waited for a writer, for ever (node 1 past --rdzv-timeout).
    fifo = tmp_path / "run.secret"
    os.mkfifo(fifo, 0o600)
    err = at_once(lambda: load(rank, fifo, wait=5.0), fifo)
    assert isinstance(err, ConfigError), err
    assert str(err) == (f"--rdzv-secret-file {fifo}: cannot read it (not a regular file (a FIFO)); give a regular "
                        "file of your own, mode 600 (node 0's ipcsync-run writes one)")


def test_what_is_not_a_private_regular_file_of_ones_own_is_refused(tmp_path: Path) -> None:
    target = secret_file(tmp_path)
    link = tmp_path / "link.secret"
    link.symlink_to(target)
    with pytest.raises(ConfigError, match=r"cannot read it \(not a regular file \(a symbolic link\)\)"):
        load(1, link)
    d = tmp_path / "dir.secret"
    d.mkdir(mode=0o700)
    with pytest.raises(ConfigError, match=r"cannot read it \(not a regular file \(a directory\)\)"):
        load(0, d)
    hard = tmp_path / "hard.secret"
    os.link(target, hard)  # before: accepted (another name can be another user's way to it)
    with pytest.raises(ConfigError, match=r"has 2 names \(hard links\)"):
        load(1, hard)
    os.unlink(hard)
    os.chmod(target, 0o640)
    with pytest.raises(ConfigError, match=r"can be read by other users \(mode 640\); chmod 600"):
        load(1, target)
    os.chmod(target, 0o602)
    with pytest.raises(ConfigError, match=r"can be written by other users \(mode 602\); chmod 600"):
        load(1, target)
    os.chmod(target, 0o600)
    big = secret_file(tmp_path, "a" * 5000)
    with pytest.raises(ConfigError, match="larger than 4096 bytes"):
        load(1, big)


def test_a_good_file_is_read_and_node_0_reuses_it(tmp_path: Path) -> None:
    path = secret_file(tmp_path)
    assert load(1, path) == ("ab" * 32).encode()
    assert load(0, path) == ("ab" * 32).encode()


@pytest.mark.timeout(60)
def test_another_node_waits_for_the_file_to_be_written(tmp_path: Path) -> None:
    path = tmp_path / "run.secret"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # created, not yet written
    said: list[str] = []

    def write_later() -> None:
        time.sleep(0.5)
        os.write(fd, b"cd" * 32 + b"\n")
        os.close(fd)

    t = threading.Thread(target=write_later)
    t.start()
    try:
        assert load(1, path, wait=30.0, said=said) == ("cd" * 32).encode()
    finally:
        t.join()
    assert said == [f"waiting for the rendezvous secret file {path} (node 0's ipcsync-run writes it; copy it here)"]


def test_a_file_that_never_appears_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"--rdzv-secret-file .*: cannot read it \(it did not appear within 0.3 s, "
                                          r"--rdzv-timeout\)"):
        load(1, tmp_path / "never.secret", wait=0.3)


# ---------------------------------------------------------------------------- written
def test_node_0_writes_a_new_private_file(tmp_path: Path) -> None:
    d = tmp_path / "private"
    d.mkdir(mode=0o700)
    path = d / "run.secret"
    said: list[str] = []
    secret = load(0, path, said=said)
    assert secret is not None and len(secret) == 64
    st = path.lstat()
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_nlink == 1
    assert path.read_text().strip().encode() == secret
    assert said[0].startswith(f"wrote this run's rendezvous secret to {path} (mode 600)")


def test_node_0_writes_in_a_sticky_shared_directory(tmp_path: Path) -> None:
    d = tmp_path / "shared"
    d.mkdir()
    os.chmod(d, 0o1777)  # as /tmp: nobody else can remove or rename the file
    assert load(0, d / "run.secret") is not None


def test_node_0_refuses_to_write_where_others_could_swap_the_file(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: node 0 wrote the secret into any directory it could write.
    d = tmp_path / "open"
    d.mkdir()
    os.chmod(d, 0o777)  # not sticky: anyone can replace the file
    with pytest.raises(ConfigError) as err:
        load(0, d / "run.secret")
    assert str(err.value) == (f"--rdzv-secret-file {d / 'run.secret'}: its directory {d} can be written by other "
                              "users (mode 777, not sticky), who could replace the file; create it in a directory "
                              "only you can write, e.g. secret=$(mktemp -d)/run.secret")
    assert not (d / "run.secret").exists()
    os.chmod(d, 0o700)
    owner = others(d, monkeypatch)
    with pytest.raises(ConfigError, match=rf"its directory {d} is owned by another user \(uid {owner}\)"):
        load(0, d / "run.secret")
    assert not (d / "run.secret").exists()
