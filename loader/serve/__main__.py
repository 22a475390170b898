"""`python -m kernels.serve DIR [--host H] [--port N] [--no-lfs-redirect]`."""

import sys

from .cli import main

sys.exit(main())
