"""pyproject's ``torch>=`` floor is the oldest torch with every late API forge calls.

Each entry names an API forge uses that arrived in a recent torch, where forge uses it, and
the release that added it. The floor must equal the newest of those releases: a new use of a
late API goes into this table (and raises the floor); an API forge stops using leaves it.
"""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# (module, attribute path, optional keyword the call passes, where forge uses it, since)
LATE_APIS = [
    ("torch.nn.utils", "get_total_norm", None, "forge/train/strategies/base.py", (2, 6)),
    ("torch.nn.utils", "clip_grads_with_norm_", None, "forge/train/strategies/base.py", (2, 6)),
    (
        "torch.distributed.checkpoint.state_dict",
        "StateDictOptions",
        "flatten_optimizer_state_dict",
        "forge/checkpoint/components.py",
        (2, 3),
    ),
    ("torch.amp", "GradScaler", None, "forge/train/strategies/base.py", (2, 3)),
    ("torch.cuda", "is_bf16_supported", "including_emulation", "forge/train/precision.py", (2, 4)),
    ("torch.optim", "AdamW", "fused", "forge/train/optim.py", (2, 4)),  # fused on CPU
]


def pyproject_floor() -> tuple[int, int]:
    text = (REPO / "pyproject.toml").read_text()
    match = re.search(r'"torch>=(\d+)\.(\d+)', text)
    assert match, "pyproject.toml has no torch>= floor"
    return int(match.group(1)), int(match.group(2))


@pytest.mark.parametrize(("module", "name", "keyword", "where", "since"), LATE_APIS)
def test_each_late_api_exists_and_is_used_where_listed(module, name, keyword, where, since):
    api = importlib.import_module(module)
    for part in name.split("."):
        api = getattr(api, part)
    if keyword is not None:
        assert keyword in inspect.signature(api).parameters, f"{name} takes no {keyword}"
    source = (REPO / where).read_text()
    assert name.split(".")[-1] in source, f"{where} no longer uses {name}: drop it from the table"
    if keyword is not None:
        assert keyword in source, f"{where} no longer passes {keyword}: drop it from the table"


def test_the_floor_is_the_newest_late_api():
    newest = max(since for *_, since in LATE_APIS)
    assert pyproject_floor() == newest, (
        f"pyproject.toml says torch>={'.'.join(map(str, pyproject_floor()))} but forge calls "
        f"APIs of torch {'.'.join(map(str, newest))}"
    )
