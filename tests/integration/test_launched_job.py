"""`forge train` on every rank of a job another launcher started (here a user's torchrun).

The slow test in test_accel.py starts the same path through `accelerate launch`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers import REPO
from tests.integration.conftest import SMALL

pytestmark = pytest.mark.integration

# Loaded by every rank (not by torchrun's agent, which has no RANK): notes each start of a
# process group, and has rank 0 come late to every group after its first, as a busy machine
# may. A second default group on the launcher's store then meets the first one's keys: rank 1
# reads rank 0's old address before rank 0 has written the new one, and gloo's connectFullMesh
# fails with "Connection refused".
SITECUSTOMIZE = """
import os
if os.environ.get("RANK") is not None:
    import time
    import torch.distributed as dist

    _init = dist.init_process_group
    _starts = []

    def init_process_group(*args, **kwargs):
        _starts.append(time.time())
        with open(os.environ["GROUP_STARTS"], "a") as out:
            out.write(f"{os.environ['RANK']} {os.getpid()}\\n")
        if os.environ["RANK"] == "0" and len(_starts) > 1:
            time.sleep(3)
        return _init(*args, **kwargs)

    dist.init_process_group = init_process_group
"""


def test_a_launched_job_starts_one_process_group_per_rank(project, tmp_path):
    """The checks before training run the trainer's paths, which need the group: they share the
    job's one group with training instead of starting and ending one of their own."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent(SITECUSTOMIZE))
    starts = tmp_path / "group_starts.txt"
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(site), str(REPO)]),
        GROUP_STARTS=str(starts),
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
    )
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [str(torchrun), "--nproc_per_node=2", "-m", "forge.cli", "train"]
    command += ["-p", str(project), *SMALL, "-D", "max_steps=4", "-D", "save_steps=2"]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split() for line in starts.read_text().splitlines()]
    assert sorted(rank for rank, _ in rows) == ["0", "1"], rows  # one start on each rank
    runs = sorted((project / "output" / "train").iterdir())
    assert [r.name for r in runs] == ["run_001"]
    record = json.loads((runs[0] / "run.json").read_text())
    assert record["status"] == "completed"
    manifest = json.loads(
        (runs[0] / "checkpoints" / "checkpoint-000004" / "manifest.json").read_text()
    )
    assert manifest["topology"]["world_size"] == 2
