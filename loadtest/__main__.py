"""``python -m loadtest``: see :mod:`loadtest.cli`."""

import sys

from loadtest.cli import main

sys.exit(main())
