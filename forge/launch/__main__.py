"""``python -m forge.launch``: torchrun's agent as forge starts it (forge.launch.torchrun)."""

import sys

from forge.launch.torchrun import main
from forge.lifetime import prepare_a_quick_exit

try:
    code = main()
finally:
    prepare_a_quick_exit()
sys.exit(code)
