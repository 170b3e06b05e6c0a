"""Child-process programs for the multi-process tests, one module per subject:

- ``peers.common``: ``say`` (JSON lines on stdout, a final {"event": "done", ...}) and the
  deterministic item ``expected(i)`` that ``check`` verifies (order, meta, every tensor);
- ``peers.basic``: producer/consumer roles, a tagged producer for FanIn, stage roles;
- ``peers.gpu``: CUDA races and profiles (need a GPU);
- ``peers.faults``: the fault matrix's dying endpoints and hand-made wire peers.

A test starts a role with ``procs.start("consume", module="peers.basic", ...)``; by hand,
``python3 -m peers ROLE JSON-ARGS`` from tests/integration. This package also
re-exports every role and helper, so ``procs.start(role)`` (module ``peers``) and
``import peers; peers.expected(...)`` keep working.
"""

from __future__ import annotations

from .basic import consume, produce, stage_sink, stage_src, tagged_produce
from .common import check, expected, plain, say
from .faults import fault_check, fault_consume, fault_msg, fault_produce, raw_hello, raw_peer, raw_producer
from .gpu import cuda_consume_and_die, cuda_profile, cuda_serve, race_consume, race_produce

__all__ = [
    "say", "expected", "check", "plain",
    "produce", "consume", "tagged_produce", "stage_src", "stage_sink",
    "race_produce", "race_consume", "cuda_profile", "cuda_serve", "cuda_consume_and_die",
    "fault_msg", "fault_check", "fault_consume", "fault_produce", "raw_hello", "raw_peer", "raw_producer",
]
