"""``python -m forge.launch``: torchrun's agent as forge starts it (forge.launch.torchrun)."""

import sys

from forge.launch.torchrun import main

sys.exit(main())
