"""The pipeline trainer through `forge train pipeline.yaml --nproc N` on the default project:
its checkpoints, exact and resharded resume, `forge export`, and errors that end the job
before it trains."""

from __future__ import annotations

import json
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.faults import fault_env
from tests.helpers import REPO, run_forge
from tests.integration.conftest import SMALL
from tests.integration.test_train_resume import start_held
from tests.reliability.procs import alive, kill_tree
from tests.train.common import assert_same_tensors

pytestmark = pytest.mark.integration

# tiny_lm's SMALL settings with 4 layers, so that 4 stages fit (later -D values win)
PIPE = [*SMALL, "-D", "num_layers=4"]


def train(project: Path, config: str, *extra: str) -> Path:
    result = run_forge("train", config, "-p", str(project), *PIPE, *extra)
    assert result.returncode == 0, result.stderr
    return Path(result.stdout.splitlines()[0])


def checkpoint(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"checkpoint-{step:06d}"


def weights(ckpt: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint's weight files (each name in exactly one file)."""
    index = ckpt / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.exists()
        else ["model.safetensors"]
    )
    merged: dict[str, torch.Tensor] = {}
    for name in files:
        tensors = load_file(ckpt / name)
        assert not set(tensors) & set(merged), f"{name} repeats a tensor"
        merged.update(tensors)
    return merged


def optimizer_state(ckpt: Path) -> dict:
    """The optimizer state of every stage, merged (it is keyed by parameter name)."""
    merged: dict = {}
    files = json.loads((ckpt / "manifest.json").read_text())["components"]["optimizer"]["files"]
    for name in files:
        merged.update(torch.load(ckpt / name, weights_only=True)["state"])
    return merged


def final_eval_loss(run_dir: Path) -> float:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["eval_loss"] for r in records if "eval_loss" in r][-1]


@pytest.fixture(scope="module")
def two_stages(warm_project, tmp_path_factory):
    """A short 2-stage run of pipeline.yaml (the fast representative), shared read-only."""
    dest = tmp_path_factory.mktemp("pipeline") / "tiny_lm"
    shutil.copytree(warm_project, dest)
    run_dir = train(dest, "pipeline", "--nproc", "2", "-D", "max_steps=10", "-D", "save_steps=5")
    return dest, run_dir


def test_each_stage_writes_its_own_shard_and_the_index_joins_them(two_stages):
    _, run_dir = two_stages
    ckpt = checkpoint(run_dir, 10)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["trainer"] == "pipeline"
    assert manifest["topology"] == {"world_size": 2, "num_stages": 2, "dp_size": 1}
    stage_files = [f"model-stage-{k:05d}-of-00002.safetensors" for k in range(2)]
    assert manifest["components"]["model"]["files"] == [
        *stage_files,
        "model.safetensors.index.json",
    ]
    assert manifest["components"]["optimizer"]["files"] == [
        f"optimizer-stage-{k:05d}-of-00002.pt" for k in range(2)
    ]
    first, last = (set(load_file(ckpt / f)) for f in stage_files)
    assert "model.embed_tokens.weight" in first and "model.layers.1.mlp.up_proj.weight" in first
    assert "model.layers.2.mlp.up_proj.weight" in last and "model.norm.weight" in last
    assert not first & last  # the tied embedding is written once, by the first stage
    first_optim = torch.load(ckpt / "optimizer-stage-00000-of-00002.pt", weights_only=True)
    names = {k.split(".exp_avg")[0] for k in first_optim["state"] if k.endswith(".exp_avg")}
    assert names == {f"state.{n}" for n in first}  # keyed by the stage's own parameter names

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt)  # the index reads both stages
    assert torch.equal(
        model.model.layers[3].mlp.up_proj.weight, weights(ckpt)["model.layers.3.mlp.up_proj.weight"]
    )


@pytest.mark.slow
def test_export_holds_exactly_the_checkpoints_tensors_and_gives_the_same_logits(
    two_stages, tmp_path
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from forge.checkpoint import load_model_weights

    _, run_dir = two_stages
    ckpt = checkpoint(run_dir, 10)
    out = tmp_path / "exported"
    result = run_forge("export", str(ckpt), str(out))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(out)
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert_same_tensors(load_file(out / "model.safetensors"), weights(ckpt), "export")

    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    config = exported.config
    plain = type(exported)(config).eval()  # what the plain trainer builds, then loads into
    load_model_weights(plain, ckpt)
    ids = AutoTokenizer.from_pretrained(out)("def main():\n    return 1", return_tensors="pt")
    with torch.no_grad():
        assert torch.equal(exported(**ids).logits, plain(**ids).logits)

    again = run_forge("export", str(run_dir), str(out))  # a run directory: its newest
    assert again.returncode == 2
    assert "exists and is not empty" in again.stderr and "--force" in again.stderr
    forced = run_forge("export", str(run_dir), str(out), "--force")
    assert forced.returncode == 0, forced.stderr


def test_a_split_name_that_does_not_exist_ends_the_job_before_training(project):
    result = run_forge(
        "train", "pipeline", "-p", str(project), *PIPE, "--nproc", "2",
        "-D", "pipeline_split=[model.layers.9]",
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "trainer.args.pipeline_split: 'model.layers.9' is not a layer" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (project / "output" / "pipeline" / "run_001").exists()  # removed, never started


def test_dry_run_prints_the_plan_the_readme_shows(project):
    """The `forge train pipeline ... --dry-run` output docs/trainers.md shows, line for line
    (the run directory line names the project's own path)."""
    from tests import docs

    shown = docs.find(r"\$ (forge train pipeline [^\n]*--dry-run)\n(.*?)```", "the pipeline plan")
    command = shown.group(1).replace("projects/tiny_lm", str(project)).split()[1:]
    result = run_forge(*command, *PIPE)
    assert result.returncode == 0, result.stderr
    expected = shown.group(2).replace("projects/tiny_lm", str(project)).splitlines()
    assert result.stdout.splitlines() == expected
    assert not (project / "output" / "pipeline").exists()


@pytest.mark.slow
def test_dry_run_prints_the_pipeline_plan_for_the_jobs_process_count(project):
    result = run_forge(
        "train", "pipeline", "-p", str(project), *PIPE, "--nproc", "4",
        "-D", "pipeline_parallel_size=2", "--dry-run",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert (
        "pipeline: 2 stage(s) on 2 process(es) per replica x 2 replica(s); schedule 1f1b, "
        "2 microbatch(es) per batch"
    ) in lines
    assert "  stage 0 (process 0): model.embed_tokens + model.layers.0-1" in lines
    assert "  stage 1 (process 1): model.layers.2-3 + model.norm + lm_head" in lines
    # the sanity pass ran its batches in one process, the model as one stage: the job's split
    # of 2 stages is the plan's to check (it failed the dry run, pipeline_parallel_size 2 not
    # dividing its one process)
    assert "sanity pass: one training batch" in result.stderr
    assert not (project / "output" / "pipeline").exists()


@pytest.mark.parametrize(
    ("extra", "where", "expected"),
    [
        (
            ["--nproc", "2", "-D", "pipeline_split=[model.layers.9]"],
            "pipeline_trainer.yaml:",
            "trainer.args.pipeline_split: 'model.layers.9' is not a layer where a stage can begin",
        ),
        pytest.param(
            ["--nproc", "2", "--set", "trainer.args.pipeline_layers=model.blocks"],
            "--set trainer.args.pipeline_layers=model.blocks",
            "trainer.args.pipeline_layers: LlamaForCausalLM has no module 'model.blocks'",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            ["--nproc", "8"],
            "pipeline_trainer.yaml:",
            "trainer.args.pipeline_parallel_size: 8 pipeline stages but the model has only 4",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            ["--nproc", "3"],  # batch_size 4, one microbatch per stage
            "train.yaml:",
            "per_device_train_batch_size 4 is not a multiple of the 3 microbatches",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            ["--nproc", "3", "-D", "pipeline_parallel_size=2"],
            "pipeline_trainer.yaml:",
            "trainer.args.pipeline_parallel_size 2 does not divide the 3 processes",
            marks=pytest.mark.slow,
        ),
    ],
    ids=["split-name", "missing-part", "stages-over-layers", "microbatches", "replicas"],
)
@pytest.mark.parametrize("dry_run", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_a_split_that_cannot_run_is_reported_before_torchrun_starts(
    project, extra, where, expected, dry_run
):
    """Planned on the meta device with the job's process count, in the `forge` process: the
    error is located at the training argument (the line that sets it), and no run directory
    is ever made (the workers would need one)."""
    result = run_forge(
        "train", "pipeline", "-p", str(project), *PIPE, *extra, *(["--dry-run"] * dry_run)
    )
    assert result.returncode == 2, result.stderr
    assert expected in result.stderr and where in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert not (project / "output" / "pipeline").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("nproc", "define", "expected"),
    [
        ("2", "pipeline_microbatches=3", "per_device_train_batch_size 4 is not a multiple of"),
        ("4", "num_layers=2", "4 pipeline stages but the model has only 2 layers"),
    ],
)
def test_a_split_that_cannot_run_ends_the_job_before_training(project, nproc, define, expected):
    result = run_forge(
        "train", "pipeline", "-p", str(project), *PIPE, "--nproc", nproc, "-D", define
    )
    assert result.returncode == 2, result.stderr
    assert expected in result.stderr and "Traceback" not in result.stderr


# ------------------------------------------------------------------------------- resume (slow)


@pytest.fixture(scope="module")
def straight(warm_project, tmp_path_factory):
    """40 steps of pipeline.yaml on 2 stages, straight through."""
    dest = tmp_path_factory.mktemp("straight") / "tiny_lm"
    shutil.copytree(warm_project, dest)
    return train(dest, "pipeline", "--nproc", "2")


def kill_job(proc, run_dir: Path) -> None:
    """SIGKILL every process of a `forge train --nproc N` job at once, as a lost machine would:
    torchrun and the workers run in a session of their own, the launcher's child; the workers'
    command lines name the run directory. Returns once they are gone (their run lock with
    them)."""
    victims = kill_tree(proc.pid)  # found by descent from forge, before any of them dies
    proc.wait(timeout=120)
    deadline = time.monotonic() + 60
    while any(alive(pid) for pid in victims):
        assert time.monotonic() < deadline, "the job's processes did not die"
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_stop_and_resume_is_bit_identical_for_two_stages(straight, project, sig):
    """SIGKILL: the whole job dies after the step-20 checkpoint; SIGTERM: every stage saves
    at the next step boundary and the job exits 143."""
    proc, run_dir = start_held(
        "train", "pipeline", "-p", str(project), *PIPE, "--nproc", "2", cwd=REPO, saved=20
    )
    if sig == signal.SIGKILL:
        kill_job(proc, run_dir)
    else:
        proc.send_signal(sig)  # forge forwards it to torchrun, which passes it to each rank
        assert proc.wait(timeout=300) == 143, proc.stderr.read()
        assert json.loads((run_dir / "run.json").read_text())["status"] == "interrupted"
    assert not checkpoint(run_dir, 40).exists()
    resumed = run_forge("resume", "-p", str(project), "--run-dir", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stderr
    assert_same_tensors(weights(checkpoint(straight, 40)), weights(checkpoint(run_dir, 40)), "w")
    assert_same_tensors(
        optimizer_state(checkpoint(straight, 40)), optimizer_state(checkpoint(run_dir, 40)), "opt"
    )


@pytest.mark.slow
def test_a_stage_killed_during_a_save_leaves_the_previous_checkpoint_to_resume(project):
    # stage 1 (rank 1) dies in the step-20 save right after writing its weight shard (its
    # other files are written beside it, on other writer threads)
    died = run_forge(
        "train", "pipeline", "-p", str(project), *PIPE, "--nproc", "2",
        env=fault_env(kill="after:model-stage-00001-of-00002.safetensors@20:1"),
    )  # fmt: skip
    assert died.returncode != 0
    run_dir = Path(died.stdout.splitlines()[0])
    partial = run_dir / "checkpoints" / ".tmp-checkpoint-000020"
    assert (partial / "model-stage-00001-of-00002.safetensors").exists()  # it died after writing
    assert not (partial / "manifest.json").exists() and not checkpoint(run_dir, 20).exists()
    resumed = run_forge("resume", "-p", str(project), "--run-dir", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {checkpoint(run_dir, 10)} at step 10" in resumed.stderr
    assert json.loads((run_dir / "run.json").read_text())["step"] == 40


def resume_in(project: Path, config: str, nproc: str, source: Path) -> Path:
    """A new run of ``config`` on ``nproc`` processes, starting from ``source``."""
    result = run_forge(
        "train", config, "-p", str(project), *PIPE, "--nproc", nproc,
        "--set", f"trainer.args.resume_from_checkpoint={source}",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert f"resumed from {source} at step {int(source.name.split('-')[1])}" in result.stderr
    return Path(result.stdout.splitlines()[0])


@pytest.mark.slow
def test_two_stages_reshard_to_four_and_back_to_two(straight, project):
    """Weights and optimizer state reshard by name; the data position is kept (one
    data-parallel replica throughout), and the curve continues close to, not exactly on, the
    straight run's (another split adds in another order)."""
    four = resume_in(project, "pipeline", "4", checkpoint(straight, 20))
    assert final_eval_loss(four) == pytest.approx(final_eval_loss(straight), rel=0.03)
    two = resume_in(project, "pipeline", "2", checkpoint(four, 30))
    assert final_eval_loss(two) == pytest.approx(final_eval_loss(straight), rel=0.03)


@pytest.mark.slow
def test_a_two_stage_checkpoint_resumes_with_the_plain_trainer(straight, project):
    plain = resume_in(project, "train", "1", checkpoint(straight, 20))
    assert final_eval_loss(plain) == pytest.approx(final_eval_loss(straight), rel=0.03)


@pytest.mark.slow
def test_a_plain_checkpoint_resumes_on_two_stages(project):
    plain = train(project, "train")
    two = resume_in(project, "pipeline", "2", checkpoint(plain, 20))
    assert final_eval_loss(two) == pytest.approx(final_eval_loss(plain), rel=0.03)


@pytest.mark.slow
def test_the_readmes_pipeline_examples_run(project, tmp_path):
    """The pipeline commands of docs/trainers.md and the export of docs/checkpoints.md as
    written, on a copy of tiny_lm shrunk by PIPE's variables."""
    from tests.docs import commands as readme_commands

    def runnable(command: list[str]) -> list[str]:
        return [str(project) if word == "projects/tiny_lm" else word for word in command]

    for command in readme_commands("forge train pipeline -p projects/tiny_lm --nproc 2"):
        result = run_forge(*runnable(command), *PIPE, cwd=tmp_path)
        assert result.returncode == 0, (command, result.stderr)
    (export,) = readme_commands("forge export projects/tiny_lm/output/pipeline/run_001")
    export = [w.replace("projects/tiny_lm", str(project)) for w in export]
    result = run_forge(*export, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "tiny_lm_hf")


# ------------------------------------------------------------------------------- GPT-2 (slow)

GPT2_CONFIG = """\
## tiny_lm's pipeline config with GPT-2 in place of the Llama: its parts come from the
## GPT-2 preset (three embedding modules, no rotary); its embeddings are tied (the default).
-- extends 'configs/pipeline.yaml'
-- block model
.model_config: &model_config !singleton:transformers:GPT2Config
    vocab_size: !call:forge.data.vocab:vocab_size [*tokenizer]
    n_positions: {{ block_size | default(128) }}
    n_embd: {{ hidden_size | default(128) }}
    n_layer: {{ num_layers | default(4) }}
    n_head: {{ num_heads | default(4) }}
    bos_token_id: 0
    eos_token_id: 0
model: &model !partial:transformers:GPT2LMHeadModel
    - *model_config
-- endblock
"""


@pytest.mark.slow
def test_gpt2_trains_on_two_stages_resumes_exactly_and_exports_with_its_tied_head(
    project, tmp_path
):
    """GPT-2 with nothing named: split by its preset, its tied embedding written once (by the
    first stage), a run resumed from its step-10 checkpoint reaching step 20 bit for bit as
    the straight run, and the export loading with from_pretrained, head tied again."""
    from transformers import GPT2LMHeadModel

    from forge.checkpoint import load_model_weights

    (project / "templates" / "configs" / "gpt2.yaml").write_text(GPT2_CONFIG)
    short = ["--nproc", "2", "-D", "max_steps=20", "-D", "save_steps=10"]
    dry = run_forge("train", "gpt2", "-p", str(project), *PIPE, *short, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert (
        "  stage 0 (process 0): transformer.wte + transformer.wpe + transformer.drop + "
        "transformer.h.0-1"
    ) in dry.stdout.splitlines()
    straight = train(project, "gpt2", *short)
    ckpt = checkpoint(straight, 20)
    first, last = (
        set(load_file(ckpt / f"model-stage-{k:05d}-of-00002.safetensors")) for k in range(2)
    )
    assert "transformer.wte.weight" in first and "transformer.wpe.weight" in first
    assert "transformer.ln_f.weight" in last and "transformer.wte.weight" not in last
    assert "lm_head.weight" not in first | last  # the tied head is the embedding

    source = checkpoint(straight, 10)
    result = run_forge(
        "train", "gpt2", "-p", str(project), *PIPE, *short,
        "--set", f"trainer.args.resume_from_checkpoint={source}",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert f"resumed from {source} at step 10" in result.stderr
    resumed = Path(result.stdout.splitlines()[0])
    assert_same_tensors(weights(ckpt), weights(checkpoint(resumed, 20)), "weights")
    assert_same_tensors(
        optimizer_state(ckpt), optimizer_state(checkpoint(resumed, 20)), "optimizer"
    )

    out = tmp_path / "exported"
    result = run_forge("export", str(ckpt), str(out))
    assert result.returncode == 0, result.stderr
    exported = GPT2LMHeadModel.from_pretrained(out).eval()
    assert exported.lm_head.weight is exported.transformer.wte.weight
    assert_same_tensors(load_file(out / "model.safetensors"), weights(ckpt), "export")
    plain = GPT2LMHeadModel(exported.config).eval()
    load_model_weights(plain, ckpt)
    ids = torch.randint(0, exported.config.vocab_size, (2, 16))
    with torch.no_grad():
        assert torch.equal(exported(input_ids=ids).logits, plain(input_ids=ids).logits)


# ------------------------------------------------------------------- pipeline x FSDP (slow)

#: 2 stages x 2 shards on 4 processes, each stage sharded over its 2 replicas
SHARDED = [
    "--nproc",
    "4",
    "-D",
    "pipeline_parallel_size=2",
    "--set",
    "trainer.args.fsdp=full_shard",
]


@pytest.mark.slow
def test_pipeline_x_fsdp_survives_sigkill_and_forge_resume_bit_identical(warm_project, tmp_path):
    """The whole job SIGKILLed after its step-20 checkpoint, then `forge resume`: the step-40
    checkpoint's weights and optimizer state (each rank's rows, put back together) are the
    straight run's bit for bit; `forge evaluate` reads the sharded checkpoint."""
    from forge.checkpoint.weights import read_weights
    from tests.train.test_fsdp import optimizer_state as merged_optimizer

    shutil.copytree(warm_project, tmp_path / "tiny_lm")
    project = tmp_path / "tiny_lm"
    straight = train(project, "pipeline", *SHARDED)
    proc, run_dir = start_held(
        "train", "pipeline", "-p", str(project), *PIPE, *SHARDED, cwd=REPO, saved=20
    )
    kill_job(proc, run_dir)
    assert not checkpoint(run_dir, 40).exists()
    resumed = run_forge("resume", "-p", str(project), "--run-dir", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stderr
    done, expected = checkpoint(run_dir, 40), checkpoint(straight, 40)
    assert json.loads((done / "manifest.json").read_text())["components"]["model"]["files"] == [
        f"model-shard-{r:05d}-of-00004.safetensors" for r in range(4)
    ]
    assert_same_tensors(read_weights(expected), read_weights(done), "weights")
    assert_same_tensors(merged_optimizer(expected), merged_optimizer(done), "optimizer")
    # one process evaluates the checkpoint (tiny_lm's max_eval_batches: half the batches the
    # run's 2 replicas took); the two runs' identical checkpoints evaluate identically
    found = []
    for ckpt in (done, expected):
        evaluated = run_forge("evaluate", str(ckpt), "--json")
        assert evaluated.returncode == 0, evaluated.stderr
        found.append(json.loads(evaluated.stdout)["eval_loss"])
    assert found[0] == found[1]
    assert found[0] == pytest.approx(final_eval_loss(run_dir), rel=0.03)
