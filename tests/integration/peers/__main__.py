"""By hand, from tests/integration: ``python3 -m peers ROLE JSON-ARGS`` (tests use conftest's Procs)."""

import json
import sys

import peers

getattr(peers, sys.argv[1])(json.loads(sys.argv[2]))
