"""``LaunchConfig``: everything one ``ipcsync-run`` needs, checked once (pure).

``cli.parse_args -> cli.config_from_args -> LaunchConfig -> cli.run(config)``, as torchrun
does: the spec (``spec.py``) and every launcher option travel in one frozen value, and an
option that does not fit is a ConfigError when the config is built, before anything is
resolved or started. Checks that need the machine (GPU count, paths of the stages'
commands, opening ``--stats-file``) are ``run``'s. Imports neither torch nor zmq.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from .spec import PipelineSpec

__all__ = ["LaunchConfig", "parse_endpoint", "check_rdzv_timeout", "MAX_NODES", "MIN_MONITOR_INTERVAL", "MAX_MONITOR_INTERVAL"]

MAX_NODES = 1024
MIN_MONITOR_INTERVAL = 0.05  # seconds
MAX_MONITOR_INTERVAL = 3600.0
MAX_RDZV_TIMEOUT = 1e6  # seconds


def parse_endpoint(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) -> (host, port); ConfigError otherwise."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--rdzv-endpoint {text!r}: expected HOST:PORT, e.g. node0.example:29400")
    return host, int(port)


def check_rdzv_timeout(seconds: float) -> None:
    """ConfigError unless ``seconds`` is a usable ``--rdzv-timeout``."""
    if not 0 < seconds < MAX_RDZV_TIMEOUT:
        raise ConfigError(f"--rdzv-timeout must be a positive number of seconds, got {seconds}")


@dataclass(frozen=True)
class LaunchConfig:
    """The spec and every option of one launch; validated when built (ConfigError).

    ``dry_run``: print the resolved plan, check the stages' commands, start nothing.
    ``summary``: print the per-edge summary at the end. ``monitor``, ``stats_file``,
    ``trace``, ``monitor_interval``: the observer (``monitor.Observer``), only built when
    one of the first three is set (``observed``). ``nnodes`` > 1: one launcher per node;
    ``node_rank``, ``rdzv_endpoint`` (both needed unless ``dry_run``), ``rdzv_timeout``,
    ``node_addr``, ``insecure`` and ``rdzv_secret_file`` only go with it.
    """

    spec: PipelineSpec
    dry_run: bool = False
    summary: bool = True
    monitor: bool = False
    monitor_interval: float = 1.0
    stats_file: str | None = None
    trace: str | None = None
    nnodes: int = 1
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_timeout: float = 300.0
    node_addr: str | None = None
    insecure: bool = False
    rdzv_secret_file: str | None = None

    def __post_init__(self) -> None:
        self._check_nodes()
        if self.observed and not MIN_MONITOR_INTERVAL <= self.monitor_interval <= MAX_MONITOR_INTERVAL:
            raise ConfigError(f"--monitor-interval must be from {MIN_MONITOR_INTERVAL:g} to "
                              f"{MAX_MONITOR_INTERVAL:g} seconds, got {self.monitor_interval}")

    @property
    def many(self) -> bool:
        """Whether this is a run over several nodes."""
        return self.nnodes > 1

    @property
    def rank(self) -> int:
        """This node's index (0 for a dry run of every node)."""
        return self.node_rank or 0

    @property
    def observed(self) -> bool:
        """Whether the run has an observer (``--monitor``, ``--stats-file`` or ``--trace``)."""
        return bool(self.monitor or self.stats_file or self.trace)

    def _check_nodes(self) -> None:
        if not 1 <= self.nnodes <= MAX_NODES:
            raise ConfigError(f"--nnodes must be from 1 to {MAX_NODES}, got {self.nnodes}")
        if not self.many:
            extra = [flag for flag, given in (
                ("--node-rank", self.node_rank not in (None, 0)), ("--rdzv-endpoint", self.rdzv_endpoint),
                ("--insecure", self.insecure), ("--node-addr", self.node_addr),
                ("--rdzv-secret-file", self.rdzv_secret_file),
            ) if given]
            if extra:
                raise ConfigError(f"{', '.join(extra)} only go with --nnodes N (N > 1)")
            return
        n = self.nnodes
        if self.node_rank is not None and not 0 <= self.node_rank < n:
            raise ConfigError(f"--node-rank must be from 0 to {n - 1} (--nnodes {n}), got {self.node_rank}")
        check_rdzv_timeout(self.rdzv_timeout)
        if self.dry_run:
            return
        if self.node_rank is None:
            raise ConfigError(f"--nnodes {n} needs --node-rank R (0 on the node serving the rendezvous)")
        if self.rdzv_endpoint is None:
            raise ConfigError(f"--nnodes {n} needs --rdzv-endpoint HOST:PORT (node 0's address and a free port)")
        parse_endpoint(self.rdzv_endpoint)
