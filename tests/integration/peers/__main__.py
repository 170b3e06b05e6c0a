"""By hand, from tests/integration: ``python3 -m peers MODULE ROLE JSON-ARGS``, e.g.
``python3 -m peers basic consume '{"endpoint": "x"}'`` (tests use conftest's Procs)."""

import importlib
import json
import sys

getattr(importlib.import_module(f"peers.{sys.argv[1]}"), sys.argv[2])(json.loads(sys.argv[3]))
