"""core/seal.py (names, signed records, sealed values) and the launcher's secret
(``launch.nodes.load_secret``): what an outsider without the secret can and cannot do."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ipcsync.core import seal
from ipcsync.errors import ConfigError
from ipcsync.launch.nodes import SECRET_ENV, load_secret

S = b"a" * 64
NONCE = bytes(range(seal.NONCE_BYTES))


def test_names_are_opaque_and_differ_per_key_and_secret() -> None:
    a, b = seal.name(S, "a0/node/0"), seal.name(S, "a0/node/1")
    assert len(a) == 32 and int(a, 16) >= 0 and a != b
    assert seal.name(b"b" * 64, "a0/node/0") != a
    assert "node" not in a


def test_a_record_verifies_only_under_its_key_and_secret() -> None:
    raw = seal.sign(S, "a0/node/0", {"addr": "10.0.0.1", "port": 5})
    assert seal.verify(S, "a0/node/0", raw) == {"addr": "10.0.0.1", "port": 5}
    assert seal.verify(S, "a0/node/1", raw) is None  # copied to another key
    assert seal.verify(b"b" * 64, "a0/node/0", raw) is None  # another secret
    forged = raw.replace(b"10.0.0.1", b"10.6.6.6")
    assert seal.verify(S, "a0/node/0", forged) is None
    for junk in (b"", b"{}", b"[1]", b'{"body": 1, "mac": "x"}', b"\xff" * 10):
        assert seal.verify(S, "k", junk) is None


def test_a_sealed_value_hides_its_bytes_and_refuses_tampering() -> None:
    value = b"127.0.0.1:4242 gloo address"
    blob = seal.seal(S, "0/0", value, NONCE)
    assert value not in blob and b"127.0.0.1" not in blob
    assert seal.unseal(S, "0/0", blob) == value
    assert seal.unseal(S, "0/1", blob) is None
    assert seal.unseal(b"b" * 64, "0/0", blob) is None
    flipped = blob[:20] + bytes([blob[20] ^ 1]) + blob[21:]
    assert seal.unseal(S, "0/0", flipped) is None
    assert seal.unseal(S, "0/0", b"short") is None
    assert seal.unseal(S, "0/0", seal.seal(S, "0/0", b"", NONCE)) == b""
    with pytest.raises(ValueError):
        seal.seal(S, "0/0", value, b"123")


def test_node_0_writes_a_private_secret_file_and_the_others_read_it(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    lines: list[str] = []
    path = tmp_path / "run.secret"
    secret, written = load_secret(0, str(path), False, 1.0, lines.append, str(tmp_path))
    assert written is None and path.stat().st_mode & 0o777 == 0o600
    assert secret is not None and len(secret) == 64 and "wrote this run's rendezvous secret" in lines[0]
    assert load_secret(1, str(path), False, 1.0, lines.append, str(tmp_path)) == (secret, None)
    assert load_secret(0, str(path), False, 1.0, lines.append, str(tmp_path)) == (secret, None)  # reused


def test_node_0_without_a_file_writes_one_in_the_runtime_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    lines: list[str] = []
    secret, written = load_secret(0, None, False, 1.0, lines.append, str(tmp_path))
    assert written is not None and Path(written).read_text().strip().encode() == secret
    assert os.stat(written).st_mode & 0o777 == 0o600 and written in lines[0]


def test_secrets_that_are_missing_short_or_readable_by_others_are_refused(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(ConfigError, match="node 1: no rendezvous secret"):
        load_secret(1, None, False, 1.0, print, str(tmp_path))
    assert load_secret(1, None, True, 1.0, print, str(tmp_path)) == (None, None)  # --insecure
    assert load_secret(0, None, True, 1.0, print, str(tmp_path)) == (None, None)
    with pytest.raises(ConfigError, match="cannot read it"):
        load_secret(1, str(tmp_path / "absent"), False, 0.2, print, str(tmp_path))
    open_file = tmp_path / "open.secret"
    open_file.write_text("x" * 64)
    open_file.chmod(0o644)
    with pytest.raises(ConfigError, match="can be read by other users"):
        load_secret(1, str(open_file), False, 1.0, print, str(tmp_path))
    monkeypatch.setenv(SECRET_ENV, "short")
    with pytest.raises(ConfigError, match="fewer than 16"):
        load_secret(1, None, False, 1.0, print, str(tmp_path))
    monkeypatch.setenv(SECRET_ENV, "y" * 40)
    assert load_secret(1, None, False, 1.0, print, str(tmp_path)) == (b"y" * 40, None)
