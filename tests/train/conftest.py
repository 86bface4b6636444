import logging

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """Tiny models on a shared 2-core machine run an order of magnitude faster on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _quiet_checkpoint_logs(caplog):
    caplog.set_level(logging.INFO, logger="forge")
