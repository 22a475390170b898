"""`python -m kernels ...`: the same command line as the `kernels` script."""

import sys

from .cli.main import main

sys.exit(main())
