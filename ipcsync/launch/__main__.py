"""``python3 -m ipcsync.launch`` is ``ipcsync-run``."""

import sys

from .cli import main

sys.exit(main())
