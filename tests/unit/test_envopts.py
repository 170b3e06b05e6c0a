"""Options read from the environment: one check, one message (ipcsync.envopts)."""

from __future__ import annotations

from typing import Callable

import pytest

from ipcsync.envopts import env_seconds
from ipcsync.errors import ConfigError
from ipcsync.launch.nodes import NODE_TIMEOUT_ENV, node_timeout
from ipcsync.runtime.remote.io import OP_TIMEOUT_ENV, op_timeout


@pytest.mark.parametrize("raw, want", [(None, 7.0), ("", 7.0), ("2.5", 2.5), ("1e3", 1000.0)])
def test_seconds_from_the_environment(monkeypatch: pytest.MonkeyPatch, raw: str | None, want: float) -> None:
    if raw is None:
        monkeypatch.delenv("IPCSYNC_TEST_SECONDS", raising=False)
    else:
        monkeypatch.setenv("IPCSYNC_TEST_SECONDS", raw)
    assert env_seconds("IPCSYNC_TEST_SECONDS", 7.0) == want


@pytest.mark.parametrize("raw, says", [("soon", "is not a number of seconds"), ("0", "positive"),
                                       ("-1", "positive"), ("nan", "positive"), ("inf", "positive"),
                                       ("1e7", "less than 1e+06")])
def test_bad_seconds_name_the_variable(monkeypatch: pytest.MonkeyPatch, raw: str, says: str) -> None:
    monkeypatch.setenv("IPCSYNC_TEST_SECONDS", raw)
    with pytest.raises(ConfigError, match=r"\$IPCSYNC_TEST_SECONDS") as info:
        env_seconds("IPCSYNC_TEST_SECONDS", 7.0)
    assert says in str(info.value) and repr(raw) in str(info.value)


@pytest.mark.parametrize("name, read", [(NODE_TIMEOUT_ENV, node_timeout), (OP_TIMEOUT_ENV, op_timeout)])
def test_the_launcher_and_the_remote_edge_read_their_timeouts_so(monkeypatch: pytest.MonkeyPatch, name: str,
                                                                 read: Callable[[], float]) -> None:
    monkeypatch.setenv(name, "3")
    assert read() == 3.0
    monkeypatch.setenv(name, "-3")
    with pytest.raises(ConfigError, match=rf"\${name} must be a positive number of seconds"):
        read()
