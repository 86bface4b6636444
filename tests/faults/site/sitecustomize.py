"""Run at the start of every Python process whose PYTHONPATH holds this directory
(``tests.faults.fault_env``): installs the fault-injecting checkpoint storage that
``FORGE_TEST_KILL_AT`` / ``FORGE_TEST_FAIL_AT`` ask for, and the pause before the training loop
that ``FORGE_TEST_PAUSE_BEFORE_LOOP`` asks for, and the hold inside a save that
``FORGE_TEST_HOLD_AFTER`` asks for. Nothing happens without them."""

import os
import sys
from pathlib import Path

if any(
    os.environ.get(name)
    for name in (
        "FORGE_TEST_KILL_AT",
        "FORGE_TEST_FAIL_AT",
        "FORGE_TEST_RECORD_WRITES",
        "FORGE_TEST_PAUSE_BEFORE_LOOP",
        "FORGE_TEST_HOLD_AFTER",
    )
):
    repo = str(Path(__file__).resolve().parents[3])
    if repo not in sys.path:
        sys.path.append(repo)
    from tests.faults import install_from_env

    install_from_env()
