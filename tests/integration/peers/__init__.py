"""Child-process programs for the multi-process tests, one module per subject:

- ``peers.common``: ``say`` (JSON lines on stdout, a final {"event": "done", ...}) and the
  deterministic item ``expected(i)`` that ``check`` verifies (order, meta, every tensor);
- ``peers.basic``: producer/consumer roles, a tagged producer for FanIn, stage roles;
- ``peers.gpu``: CUDA races and profiles (need a GPU);
- ``peers.faults``: the fault matrix's dying endpoints and hand-made wire peers.

A test starts a role with ``procs.start("consume", module="peers.basic", ...)`` and imports
helpers from the module that defines them (``from peers.common import expected``); by hand,
``python3 -m peers basic consume JSON-ARGS`` from tests/integration.
"""
