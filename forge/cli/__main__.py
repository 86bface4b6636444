"""``python -m forge.cli``: the same entry point as the ``forge`` console script."""

import sys

from forge.cli import main

sys.exit(main())
