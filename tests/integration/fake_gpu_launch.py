"""``ipcsync-run`` as if this machine had one CUDA GPU (``cli.visible_gpus`` answers 1):
for tests of what the launcher does for CUDA stages (MPS) on a machine without a GPU.
The stages it runs must not use CUDA. ``python fake_gpu_launch.py ARGS`` takes
ipcsync-run's arguments."""

import sys

from ipcsync.launch import cli

cli.visible_gpus = lambda: 1
sys.exit(cli.main())
