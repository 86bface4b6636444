"""Real processes: SIGKILL in the middle of saving, and several ranks writing one checkpoint."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from forge.checkpoint import (
    CheckpointWriter,
    find_checkpoints,
    find_latest_checkpoint,
    load_model_weights,
    load_torch_state,
    read_manifest,
    validate_checkpoint,
)

HERE = Path(__file__).parent
pytestmark = pytest.mark.integration


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _worker(checkpoints_dir: Path, first_step: int, *mode: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(HERE / "ckpt_kill_worker.py"), str(checkpoints_dir), str(first_step)]
        + list(mode),
        stdout=subprocess.PIPE,
        text=True,
        env=_env(),
    )


def _save_then_kill(checkpoints_dir: Path, first_step: int, saves: int, rng: random.Random) -> int:
    """Run the saving loop, SIGKILL it at a random moment after ``saves`` saves; last step seen."""
    proc = _worker(checkpoints_dir, first_step)
    try:
        steps = [int(proc.stdout.readline()) for _ in range(saves)]
        # land somewhere inside the next save or two (each takes about 15 ms)
        for _ in range(rng.randrange(200_000)):
            pass
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    return steps[-1]


def _latest_step(checkpoints_dir: Path) -> int:
    latest = find_latest_checkpoint(checkpoints_dir)
    assert latest is not None
    return read_manifest(latest).step


def _assert_all_valid(checkpoints_dir: Path) -> None:
    infos = find_checkpoints(checkpoints_dir)
    assert infos, "no checkpoint survived"
    for info in infos:
        assert info.valid, (info.path, info.problems)


def _assert_loadable(path: Path) -> None:
    step = read_manifest(path).step
    model = nn.Linear(512, 512)
    load_model_weights(model, path)
    expected = nn.Linear(512, 512)
    torch.manual_seed(step)
    with torch.no_grad():
        for p in expected.parameters():
            p.normal_()
    assert torch.equal(model.weight, expected.weight) and torch.equal(model.bias, expected.bias)
    assert load_torch_state(path / "training.pt")["step"] == step
    assert load_torch_state(path / "data-rank-00000.pt")["step"] == step


def test_sigkill_mid_save_leaves_only_valid_checkpoints(tmp_path: Path) -> None:
    checkpoints_dir = tmp_path / "checkpoints"
    rng = random.Random(0)
    seen = _save_then_kill(checkpoints_dir, 0, 3, rng)
    _assert_all_valid(checkpoints_dir)
    latest = _latest_step(checkpoints_dir)
    assert latest >= seen
    _assert_loadable(checkpoints_dir / f"checkpoint-{latest:06d}")

    # killed with the new checkpoint complete but not yet renamed: the old latest stays latest
    assert _worker(checkpoints_dir, latest + 1, "die-before-rename").wait() == -signal.SIGKILL
    assert (checkpoints_dir / f".tmp-checkpoint-{latest + 1:06d}").is_dir()
    assert _latest_step(checkpoints_dir) == latest
    _assert_all_valid(checkpoints_dir)

    # killed while replacing a step: the moved-aside old one is still found and loadable
    assert _worker(checkpoints_dir, latest, "die-between-renames").wait() == -signal.SIGKILL
    assert not (checkpoints_dir / f"checkpoint-{latest:06d}").exists()
    found = find_latest_checkpoint(checkpoints_dir)
    assert found.name == f".tmp-old-checkpoint-{latest:06d}"
    _assert_loadable(found)

    # the next save sweeps the leftovers and gives the moved-aside checkpoint its name back
    with CheckpointWriter(checkpoints_dir, latest + 1) as writer:
        writer.save_json("state.json", {})
    names = sorted(p.name for p in checkpoints_dir.iterdir())
    assert f"checkpoint-{latest:06d}" in names
    assert not [n for n in names if n.startswith(".tmp-")]
    _assert_all_valid(checkpoints_dir)
    _assert_loadable(checkpoints_dir / f"checkpoint-{latest:06d}")


def test_two_ranks_write_one_checkpoint_with_torchrun(tmp_path: Path) -> None:
    checkpoints_dir = tmp_path / "checkpoints"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(HERE / "ckpt_dist_worker.py"),
        str(checkpoints_dir),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]

    [info] = find_checkpoints(checkpoints_dir)
    assert info.valid, info.problems
    assert info.path.name == "checkpoint-000012"
    manifest = info.manifest
    assert manifest.topology == {"world_size": 2, "num_stages": 2, "dp_size": 1, "backend": "gloo"}
    assert manifest.epoch == 1
    assert {
        "rng-rank-00000.pt",
        "rng-rank-00001.pt",
        "progress.pt",
        "model-stage-00000-of-00002.safetensors",
        "model-stage-00001-of-00002.safetensors",
        "model.safetensors.index.json",
    } == set(manifest.files)
    assert {name: e["scope"] for name, e in manifest.components.items()} == {
        "model": "stage",
        "progress": "shared",
        "rng": "rank",
    }
    assert [p.name for p in checkpoints_dir.iterdir()] == ["checkpoint-000012"]
    for rank in (0, 1):
        header = load_torch_state(info.path / f"rng-rank-{rank:05d}.pt")["forge_component"]
        assert (header["rank"], header["name"], header["step"]) == (rank, "rng", 12)

    torch.manual_seed(0)
    expected = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    load_model_weights(model, info.path)
    for key, value in expected.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    assert validate_checkpoint(info.path) == []
