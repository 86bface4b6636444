"""The moving average of the weights through the real entry point: tiny_lm trained with
``ema_decay`` and ``eval_with_ema``, killed with SIGKILL after its step-20 checkpoint and
continued with `forge resume`, ends with the average a straight run ends with, bit for bit;
`forge evaluate --ema` reports the loss the run reported, and `forge export --ema` writes a
directory `from_pretrained` loads with the average's weights."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, run_forge
from tests.integration.conftest import SMALL
from tests.integration.test_train_resume import start_held
from tests.train.common import assert_same_tensors, component_state

pytestmark = pytest.mark.integration

EMA = ["--set", "trainer.args.ema_decay=0.9", "--set", "trainer.args.eval_with_ema=true"]


def final_checkpoint(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / "checkpoint-000040"


@pytest.mark.slow  # ~60 s; tests/train/test_ema.py resumes the average exactly in process
def test_the_average_survives_sigkill_and_resume_and_exports(project, tmp_path):
    straight = run_forge("train", "-p", str(project), *SMALL, *EMA)
    assert straight.returncode == 0, straight.stderr
    straight_dir = Path(straight.stdout.splitlines()[0])

    proc, run_dir = start_held("train", "-p", str(project), *SMALL, *EMA, cwd=REPO, saved=20)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=300)
    assert proc.returncode == -signal.SIGKILL
    assert not final_checkpoint(run_dir).exists()
    resumed = run_forge("resume", "-p", str(project), "--run-dir", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr

    a, b = final_checkpoint(straight_dir), final_checkpoint(run_dir)
    assert_same_tensors(component_state(a, "ema"), component_state(b, "ema"), "ema")
    assert_same_tensors(component_state(a, "optimizer"), component_state(b, "optimizer"), "opt")

    # forge evaluate --ema gives the loss the run reported at step 40 (evaluated with the
    # average); without --ema, the trained weights' other loss
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    reported = [r["eval_loss"] for r in records if "eval_loss" in r and r.get("step") == 40]
    averaged = run_forge("evaluate", str(b), "--ema", "--json")
    assert averaged.returncode == 0, averaged.stderr
    raw = run_forge("evaluate", str(b), "--json")
    assert raw.returncode == 0, raw.stderr
    ema_loss, raw_loss = (json.loads(r.stdout)["eval_loss"] for r in (averaged, raw))
    assert ema_loss == pytest.approx(reported[-1], rel=1e-6)
    assert ema_loss != raw_loss

    # forge export --ema: the average, in a directory from_pretrained loads
    out = tmp_path / "exported"
    exported = run_forge("export", str(b), str(out), "--ema")
    assert exported.returncode == 0, exported.stderr
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    average = component_state(b, "ema")["weights"]
    for name, param in model.named_parameters():
        assert torch.equal(param, average[name].to(param.dtype)), name


def test_ema_flags_refuse_a_checkpoint_without_an_average(trained_once, tmp_path):
    _, run_dir, _ = trained_once  # trained without ema_decay
    checkpoint = final_checkpoint(run_dir)
    for command in (
        ("export", str(checkpoint), str(tmp_path / "out"), "--ema"),
        ("evaluate", str(checkpoint), "--ema"),
    ):
        result = run_forge(*command)
        assert result.returncode == 2, result.stderr
        assert "holds no moving average of the weights" in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


def stage_states(checkpoint: Path) -> list:
    """The average each pipeline stage wrote (its own file, named by the manifest)."""
    files = json.loads((checkpoint / "manifest.json").read_text())["components"]["ema"]["files"]
    return [torch.load(checkpoint / name, weights_only=True)["state"] for name in files]


@pytest.mark.slow
def test_the_average_of_two_pipeline_stages_survives_sigkill_and_resume(project):
    """pipeline.yaml on 2 processes: each stage keeps the average of its own parameters in
    its own file; the launcher killed with SIGKILL after the step-20 checkpoint (its job dies
    with it) and `forge resume` end with the straight run's averages, bit for bit."""
    two = ["pipeline", "-p", str(project), *SMALL, "-D", "num_layers=4", "--nproc", "2", *EMA]
    straight = run_forge("train", *two)
    assert straight.returncode == 0, straight.stderr
    straight_dir = Path(straight.stdout.splitlines()[0])

    proc, run_dir = start_held("train", *two, cwd=REPO, saved=20)
    proc.send_signal(signal.SIGKILL)  # as a user would; the job stops with its launcher
    proc.wait(timeout=300)
    assert not final_checkpoint(run_dir).exists()
    resumed = run_forge("resume", "-p", str(project), "--run-dir", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr

    a, b = stage_states(final_checkpoint(straight_dir)), stage_states(final_checkpoint(run_dir))
    assert len(a) == len(b) == 2
    first, last = (set(state["weights"]) for state in a)
    assert "model.embed_tokens.weight" in first and "model.norm.weight" in last
    assert "model.norm.weight" not in first  # each stage averages its own parameters
    for index, (x, y) in enumerate(zip(a, b, strict=True)):
        assert_same_tensors(x, y, f"ema stage {index}")


def merged(checkpoint: Path, name: str) -> dict:
    """A component's state put back whole from every rank's shard (keyed by name)."""
    from forge.checkpoint.registry import read_component_states
    from forge.checkpoint.sharded import merge_sharded

    return merge_sharded(read_component_states(checkpoint, name))


@pytest.mark.slow
def test_the_average_under_fsdp_survives_sigkill_resume_exports_and_reshards(project, tmp_path):
    """tiny_lm with fsdp on 2 processes and an average: each rank keeps and writes its rows
    of it (no gather); killed with SIGKILL after step 20 and resumed, the weights and the
    average end bit for bit where a straight run's do, and the average is DDP's within float
    noise. `forge export --ema` and `forge evaluate --ema` read the shards, and the plain
    trainer on one process continues the checkpoint with its average."""
    from forge.checkpoint.weights import read_weights

    fsdp = ["--nproc", "2", "--set", "trainer.args.fsdp=full_shard"]
    common = ["train", "-p", str(project), *SMALL, *EMA]
    straight = run_forge(*common, *fsdp)
    assert straight.returncode == 0, straight.stderr
    straight_dir = Path(straight.stdout.splitlines()[0])
    ddp = run_forge(*common, "--nproc", "2")
    assert ddp.returncode == 0, ddp.stderr

    proc, run_dir = start_held(*common, *fsdp, cwd=REPO, saved=20)
    proc.send_signal(signal.SIGKILL)  # the job dies with its launcher
    proc.wait(timeout=300)
    assert not final_checkpoint(run_dir).exists()
    resumed = run_forge("resume", "-p", str(project), "--run-dir", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr

    a, b = final_checkpoint(straight_dir), final_checkpoint(run_dir)
    entry = json.loads((b / "manifest.json").read_text())["components"]["ema"]
    assert entry["scope"] == "sharded"
    assert entry["files"] == [f"ema-shard-{r:05d}-of-00002.pt" for r in range(2)]
    assert_same_tensors(merged(a, "ema"), merged(b, "ema"), "ema")
    assert_same_tensors(read_weights(a), read_weights(b), "weights")
    # the same run under DDP keeps the same average, up to the order of float additions
    average = {k.removeprefix("weights."): v for k, v in merged(b, "ema").items() if "." in k}
    with_ddp = component_state(final_checkpoint(Path(ddp.stdout.splitlines()[0])), "ema")
    assert sorted(average) == sorted(with_ddp["weights"])
    for name, tensor in with_ddp["weights"].items():
        torch.testing.assert_close(average[name], tensor, rtol=1e-4, atol=1e-5)
    # each rank wrote about half of it: the shards sum to DDP's one file
    sizes = [(b / name).stat().st_size for name in entry["files"]]
    whole = (final_checkpoint(Path(ddp.stdout.splitlines()[0])) / "ema.pt").stat().st_size
    assert sum(sizes) == pytest.approx(whole, rel=0.1)

    out = tmp_path / "exported"
    exported = run_forge("export", str(b), str(out), "--ema")
    assert exported.returncode == 0, exported.stderr
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    for name, param in model.named_parameters():
        assert torch.equal(param, average[name].to(param.dtype)), name
    averaged = run_forge("evaluate", str(b), "--ema", "--json")
    raw = run_forge("evaluate", str(b), "--json")
    assert averaged.returncode == 0 and raw.returncode == 0, averaged.stderr + raw.stderr
    assert json.loads(averaged.stdout)["eval_loss"] != json.loads(raw.stdout)["eval_loss"]

    # the plain trainer on one process continues it: the average is read whole from the shards
    more = ["--set", "trainer.args.max_steps=45", "--set", "trainer.args.fsdp=null"]
    plain = run_forge(
        "resume", "-p", str(project), "--run-dir", str(run_dir), "--nproc", "1", *more
    )
    assert plain.returncode == 0, plain.stderr
    after = component_state(run_dir / "checkpoints" / "checkpoint-000045", "ema")
    assert after["steps"] == 45 and sorted(after["weights"]) == sorted(average)
