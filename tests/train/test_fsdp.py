"""FSDP2 in the plain trainer with real processes (torchrun, gloo on CPU): it trains as DDP
does, every rank saves its own shard, and the sharded checkpoint resumes exactly or into
another layout."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from forge.checkpoint import read_manifest, validate_checkpoint
from forge.checkpoint.io import load_torch_state
from forge.checkpoint.registry import read_component_states
from forge.checkpoint.sharded import merge_sharded
from forge.checkpoint.weights import read_weights
from tests.faults import fault_env
from tests.train.common import assert_same_tensors, checkpoint_dir, component_state
from tests.train.fsdp_script import STEPS

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("fsdp_script.py")


def launch(
    output_dir: Path,
    mode: str,
    nproc: int = 2,
    stop: int | None = None,
    record: Path | None = None,
    script: Path = SCRIPT,
    extra: tuple[str, ...] = (),
):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    if record is not None:  # every rank records the checkpoint files it writes
        record.mkdir(parents=True, exist_ok=True)
        recording = fault_env(record=record)
        env.update(recording, PYTHONPATH=f"{recording['PYTHONPATH']}{os.pathsep}{REPO}")
    command = [sys.executable, str(script), str(output_dir), mode, *extra]
    if nproc > 1:
        command[1:1] = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    if stop is not None:
        command.append(str(stop))
    # a session of its own: the kill takes torchrun and its workers, as a user's would
    return subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip


def finish(proc, killed: bool = False) -> str:
    try:
        output, _ = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise AssertionError(f"timed out:\n{output}") from None
    if killed:  # torchrun reports its killed workers
        assert proc.returncode != 0, output
    else:
        assert proc.returncode == 0, output
    return output


def losses(output_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r and "step" in r}


def optimizer_state(checkpoint: Path) -> dict:
    """The whole optimizer state of a checkpoint, sharded or not, keyed by parameter name."""
    manifest = read_manifest(checkpoint)
    files = manifest.components["optimizer"]["files"]
    states = [load_torch_state(checkpoint / name)["state"] for name in files]
    if manifest.components["optimizer"]["scope"] == "sharded":
        return merge_sharded(states)
    return states[0]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp")
    runs = {
        "fsdp": launch(root / "fsdp", "fsdp", record=root / "writes"),
        "ddp": launch(root / "ddp", "ddp"),
    }
    for proc in runs.values():
        finish(proc)
    return root


def test_fsdp_trains_as_ddp_and_each_rank_saves_its_own_shard(straight):
    fsdp, ddp = losses(straight / "fsdp"), losses(straight / "ddp")
    assert sorted(fsdp) == list(range(1, STEPS + 1))
    # accumulation over 2 micro-batches, clipping (the norm is above 0.5 at every step) and
    # unevenly split evaluations: only the order of float additions differs
    assert [fsdp[s] for s in sorted(fsdp)] == pytest.approx(
        [ddp[s] for s in sorted(fsdp)], rel=1e-5
    )
    assert len(set(fsdp.values())) == STEPS

    checkpoint = checkpoint_dir(straight / "fsdp", STEPS)
    assert validate_checkpoint(checkpoint) == []
    manifest = read_manifest(checkpoint)
    assert manifest.topology["world_size"] == 2
    entry = manifest.components["model"]
    assert entry["scope"] == "sharded"
    shards = [f"model-shard-{r:05d}-of-00002.safetensors" for r in range(2)]
    assert entry["files"] == shards
    assert not (checkpoint / "model.safetensors").exists()
    # no rank gathers the model to save it: each writes about half of the weights and moments
    plain = checkpoint_dir(straight / "ddp", STEPS)
    whole = (plain / "model.safetensors").stat().st_size
    for name in shards:
        assert 0.4 * whole < manifest.files[name]["size"] < 0.6 * whole, name
    whole_optimizer = (plain / "optimizer.pt").stat().st_size
    for rank in range(2):
        size = manifest.files[f"optimizer-shard-{rank:05d}-of-00002.pt"]["size"]
        assert 0.4 * whole_optimizer < size < 0.65 * whole_optimizer

    # the shards put back together are the DDP run's weights and moments, up to float noise
    ours, theirs = read_weights(checkpoint), read_weights(plain)
    assert sorted(ours) == sorted(theirs)
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-4, atol=1e-5)
    ours, theirs = optimizer_state(checkpoint), optimizer_state(plain)
    assert sorted(ours) == sorted(theirs)


@pytest.mark.slow
def test_shard_grad_op_with_activation_checkpointing_trains_as_ddp(straight, tmp_path):
    finish(launch(tmp_path / "zero2", "zero2"))
    found, ddp = losses(tmp_path / "zero2"), losses(straight / "ddp")
    assert [found[s] for s in sorted(ddp)] == pytest.approx([ddp[s] for s in sorted(ddp)], rel=1e-5)


@pytest.mark.slow
def test_sigkill_after_a_sharded_checkpoint_then_resume_is_bit_identical(straight, tmp_path):
    finish(launch(tmp_path / "run", "fsdp", stop=6), killed=True)
    assert checkpoint_dir(tmp_path / "run", 6).exists()
    assert not checkpoint_dir(tmp_path / "run", 9).exists()
    finish(launch(tmp_path / "run", "fsdp-resume"))
    done, expected = checkpoint_dir(tmp_path / "run", STEPS), checkpoint_dir(straight / "fsdp", 9)
    assert_same_tensors(read_weights(expected), read_weights(done), "weights")
    assert_same_tensors(optimizer_state(expected), optimizer_state(done), "optimizer")


def _continue_from(source: Path, target: Path, step: int) -> None:
    """``target``: a copy of the run in ``source`` with its checkpoints after ``step`` gone."""
    shutil.copytree(source, target)
    for later in range(step + 1, STEPS + 1):
        shutil.rmtree(checkpoint_dir(target, later), ignore_errors=True)
    (target / "metrics.jsonl").write_text("")


@pytest.mark.slow
def test_a_sharded_checkpoint_reshards_to_one_process_back_and_to_a_pipeline(straight, tmp_path):
    # FSDP on 2 ranks -> plain, 1 process (optimizer moments merged from both shards)
    _continue_from(straight / "fsdp", tmp_path / "to_plain", 6)
    finish(launch(tmp_path / "to_plain", "plain-resume", nproc=1))
    # one process -> FSDP on 2 ranks (each takes its rows of the whole weights and moments)
    finish(launch(tmp_path / "plain", "plain", nproc=1))
    _continue_from(tmp_path / "plain", tmp_path / "to_fsdp", 6)
    finish(launch(tmp_path / "to_fsdp", "fsdp-resume"))
    # FSDP on 2 ranks -> the pipeline trainer, 2 stages: each stage reads its own weights
    _continue_from(straight / "fsdp", tmp_path / "to_pipeline", 6)
    finish(launch(tmp_path / "to_pipeline", "pipeline-resume"))
    # each goes on with the rest of the epoch of the run it continues, dealt to its own ranks:
    # FSDP's 2 ranks after 6 steps of 4 items on 1 process take items 24.. of the epoch, the
    # batches the straight FSDP run took at its steps 4, 5, 6 (losses close to those: other
    # weights, the same items); the others go on from the straight FSDP run's step 6
    reference = losses(straight / "fsdp")
    same_items = {"to_plain": 0, "to_fsdp": 3, "to_pipeline": 0}  # steps back in the reference
    for run, back in same_items.items():
        found = losses(tmp_path / run)
        assert sorted(found) == [7, 8, 9], run
        for step in found:
            assert found[step] == pytest.approx(reference[step - back], rel=0.03), (run, step)
    assert (
        read_manifest(checkpoint_dir(tmp_path / "to_fsdp", 9)).components["model"]["scope"]
        == "sharded"
    )


def component_bytes(checkpoint: Path) -> dict[str, list[int]]:
    """Each component of a checkpoint: the sizes of its files (a sharded one's: one per rank)."""
    manifest = read_manifest(checkpoint)
    return {
        name: [manifest.files[file]["size"] for file in entry["files"]]
        for name, entry in manifest.components.items()
    }


def assert_each_rank_writes_its_share(sharded: Path, whole: Path, names: tuple[str, ...]) -> None:
    """The files of each sharded component of ``sharded`` sum to its one-process checkpoint's
    (``whole``, the same state unsharded) within 5 %, and each rank's is its share. A file
    costs about 300 B per tensor besides its data: the model must be wide enough for that to
    be noise."""
    ours, theirs = component_bytes(sharded), component_bytes(whole)
    for name in names:
        assert read_manifest(sharded).components[name]["scope"] == "sharded", name
        share = sum(theirs[name]) / len(ours[name])
        assert sum(ours[name]) == pytest.approx(sum(theirs[name]), rel=0.05), (name, ours, theirs)
        for size in ours[name]:
            assert size == pytest.approx(share, rel=0.1), (name, ours[name], share)


@pytest.mark.slow
def test_after_a_plain_checkpoint_is_continued_under_fsdp_each_rank_writes_its_share(tmp_path):
    """A one-process checkpoint continued under FSDP: each rank keeps its rows of the moments
    it loaded whole, and writes those alone (each rank wrote the whole optimizer, a view's
    storage, at every later save)."""
    finish(launch(tmp_path / "plain", "plain-wide", nproc=1))
    _continue_from(tmp_path / "plain", tmp_path / "to_fsdp", 6)
    finish(launch(tmp_path / "to_fsdp", "fsdp-wide-resume"))
    assert_each_rank_writes_its_share(
        checkpoint_dir(tmp_path / "to_fsdp", STEPS),
        checkpoint_dir(tmp_path / "plain", STEPS),
        ("model", "optimizer"),
    )


#: the trainers a checkpoint moves between, each with the process count it runs on here
TRAINERS = {"plain": 1, "accel": 2, "pipeline": 2, "fsdp": 2}


@pytest.fixture(scope="module")
def tied_runs(tmp_path_factory):
    """``kind`` -> a straight run of that trainer on the tiny Llama with its output head tied
    to its token embedding (as tiny_lm, GPT-2 and small Llamas have it), made when first asked."""
    root = tmp_path_factory.mktemp("tied")
    made: dict[str, Path] = {}

    def run(kind: str) -> Path:
        if kind not in made:
            finish(launch(root / kind, f"{kind}-tied", nproc=TRAINERS[kind]))
            made[kind] = root / kind
        return made[kind]

    return run


@pytest.mark.slow
@pytest.mark.parametrize(
    ("source", "target"), [(s, t) for s in TRAINERS for t in TRAINERS if s != t]
)
def test_a_tied_embedding_reshards_between_every_pair_of_trainers(
    tied_runs, tmp_path, source, target
):
    """Every direction between plain, Accelerate, pipeline and FSDP: the checkpoint stores the
    tied tensor once (save_pretrained's layout), and each trainer's ranks load exactly the
    checkpoint's tensors, the tied head included (a plain checkpoint under FSDP failed:
    missing keys: lm_head.weight)."""
    straight = tied_runs(source)
    saved = read_weights(checkpoint_dir(straight, 6))
    assert "lm_head.weight" not in saved
    saved["lm_head.weight"] = saved["model.embed_tokens.weight"]
    _continue_from(straight, tmp_path / "run", 6)
    finish(launch(tmp_path / "run", f"{target}-tied-resume", nproc=TRAINERS[target]))
    held: dict[str, torch.Tensor] = {}
    for rank in range(TRAINERS[target]):  # a pipeline stage holds its part, the others all
        held.update(torch.load(tmp_path / "run" / f"loaded-rank-{rank:05d}.pt"))
    assert sorted(held) == sorted(saved)
    assert_same_tensors(saved, held, "loaded")
    assert sorted(losses(tmp_path / "run")) == [7, 8, 9]  # and it trains on from there
    assert "lm_head.weight" not in read_weights(checkpoint_dir(tmp_path / "run", STEPS))


#: written by rank 0 beside the storage seam (transformers' save_pretrained; the stages'
#: weight index, at commit)
OUTSIDE_SEAM = {"config.json", "generation_config.json", "model.safetensors.index.json"}


def writes(record: Path) -> list[dict]:
    return [
        json.loads(line)
        for file in sorted(record.glob("writes-rank-*.jsonl"))
        for line in file.read_text().splitlines()
    ]


def owners(record: Path, step: int) -> dict[str, list[int]]:
    """Each file of the checkpoint of ``step``: the ranks that wrote it."""
    found: dict[str, list[int]] = {}
    for line in writes(record):
        if line["step"] == step:
            found.setdefault(line["file"], []).append(line["rank"])
    return found


def test_every_file_of_a_sharded_checkpoint_is_written_once_by_its_owner(straight):
    checkpoint = checkpoint_dir(straight / "fsdp", 6)
    written = owners(straight / "writes", 6)
    assert sorted(written) == sorted(set(read_manifest(checkpoint).files) - OUTSIDE_SEAM)
    for name, ranks in written.items():
        assert len(ranks) == 1, (name, ranks)
        own = re.search(r"-(?:shard|rank)-(\d+)", name)  # a rank's own: its number in the name
        if own:
            assert ranks == [int(own.group(1))], name
        else:
            assert ranks == [0], name
    # each rank writes about half of the state (no gather), rank 0 also what is whole on every
    # rank (a step count per parameter, the settings): the bytes of the shard files
    per_rank = [0, 0]
    for line in writes(straight / "writes"):
        if line["step"] == 6 and "-shard-" in line["file"]:
            per_rank[line["rank"]] += line["bytes"]
    assert per_rank[1] == pytest.approx(per_rank[0], rel=0.15)
    whole = sum(
        component_bytes(checkpoint_dir(straight / "ddp", 6))[name][-1]
        for name in ("model", "optimizer")
    )
    # a small model's file costs about 300 B per tensor besides its data
    assert sum(per_rank) == pytest.approx(whole, rel=0.08)


@pytest.mark.slow
def test_a_pipeline_checkpoint_of_two_replicas_is_written_once_by_each_stage_owner(tmp_path):
    """2 stages x 2 data-parallel replicas: only replica 0's rank of each stage writes the
    stage's weights and optimizer state (ranks 0 and 1; 2 and 3 hold the same state)."""
    pipeline = {
        "pipeline_parallel_size": 2,
        "max_steps": 2,
        "save_strategy": "steps",
        "save_steps": 2,
    }
    finish(
        launch(
            tmp_path / "run",
            "pipeline",
            nproc=4,
            record=tmp_path / "writes",
            script=Path(__file__).with_name("pipeline_script.py"),
            extra=(json.dumps(pipeline),),
        )
    )
    checkpoint = checkpoint_dir(tmp_path / "run", 2)
    assert validate_checkpoint(checkpoint) == []
    written = owners(tmp_path / "writes", 2)
    assert sorted(written) == sorted(set(read_manifest(checkpoint).files) - OUTSIDE_SEAM)
    for name, ranks in written.items():
        assert len(ranks) == 1, (name, ranks)
    for stage in range(2):
        assert written[f"model-stage-{stage:05d}-of-00002.safetensors"] == [stage]
        assert written[f"optimizer-stage-{stage:05d}-of-00002.pt"] == [stage]
    for rank in range(4):
        assert written[f"rng-rank-{rank:05d}.pt"] == [rank]


def test_export_of_a_sharded_checkpoint_gives_the_models_logits(straight, tmp_path):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from forge.read.reader import export_model
    from tests.train.common import tiny_llama_config

    checkpoint = checkpoint_dir(straight / "fsdp", STEPS)
    export_model(checkpoint, tmp_path / "hf")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    plain = LlamaForCausalLM(tiny_llama_config()).eval()
    plain.load_state_dict(read_weights(checkpoint))  # the shards put back together
    inputs = torch.arange(1, 17).reshape(2, 8)
    with torch.no_grad():
        assert torch.equal(exported(inputs).logits, plain(inputs).logits)


def test_t5_shards_the_blocks_of_both_stacks_and_trains_without_a_view_warning(tmp_path):
    """T5's encoder and decoder blocks are both T5Block lists: each block of each is sharded.
    Its first block returns a view (the position bias the later blocks reuse); FSDP2's warning
    about views returned by a sharded module is not raised."""
    output = finish(launch(tmp_path, "t5", script=SCRIPT.with_name("fsdp_t5_script.py")))
    found = json.loads((tmp_path / "sharded.json").read_text())
    blocks = [f"{stack}.block.{i}" for stack in ("encoder", "decoder") for i in range(2)]
    assert found["sharded"] == ["", *blocks]
    assert "returned a view tensor" not in output
    assert not [w for w in found["warnings"] if "view tensor" in w], found["warnings"]
    assert sorted(losses(tmp_path)) == [1, 2, 3]


@pytest.mark.slow
def test_hybrid_sharding_trains_as_ddp_writes_one_copy_and_resumes_bit_identical(tmp_path):
    """HSDP on 4 processes, 2 replicas x 2 shards: the losses are DDP's on 4 up to float
    noise; the first replica's ranks write the rows (the shards sum to DDP's files), the
    second's nearly nothing; killed after the checkpoint of step 6 and resumed, it ends bit for
    bit where the straight run ends."""
    runs = {"hsdp": launch(tmp_path / "hsdp", "hsdp", nproc=4)}
    runs["ddp"] = launch(tmp_path / "ddp", "ddp", nproc=4)
    for proc in runs.values():
        finish(proc)
    hybrid, ddp = losses(tmp_path / "hsdp"), losses(tmp_path / "ddp")
    assert [hybrid[s] for s in sorted(ddp)] == pytest.approx(
        [ddp[s] for s in sorted(ddp)], rel=1e-5
    )
    checkpoint = checkpoint_dir(tmp_path / "hsdp", STEPS)
    ours, theirs = (
        component_bytes(checkpoint),
        component_bytes(checkpoint_dir(tmp_path / "ddp", STEPS)),
    )
    for name in ("model", "optimizer"):
        first, second = ours[name][:2], ours[name][2:]
        assert max(second) < 0.02 * min(first), (name, ours[name])
        assert sum(ours[name]) == pytest.approx(theirs[name][-1], rel=0.1), (name, ours, theirs)
    ours_w, theirs_w = (
        read_weights(checkpoint),
        read_weights(checkpoint_dir(tmp_path / "ddp", STEPS)),
    )
    for name in theirs_w:
        torch.testing.assert_close(ours_w[name], theirs_w[name], rtol=1e-4, atol=1e-5)

    finish(launch(tmp_path / "run", "hsdp", nproc=4, stop=6), killed=True)
    assert not checkpoint_dir(tmp_path / "run", 9).exists()
    finish(launch(tmp_path / "run", "hsdp-resume", nproc=4))
    done = checkpoint_dir(tmp_path / "run", STEPS)
    assert_same_tensors(read_weights(checkpoint), read_weights(done), "weights")
    assert_same_tensors(optimizer_state(checkpoint), optimizer_state(done), "optimizer")


@pytest.mark.slow
def test_hybrid_sharding_with_an_average_and_checkpointed_activations_trains_as_ddp(tmp_path):
    """HSDP on 4 processes (2 replicas x 2 shards) with a moving average and activation
    checkpointing: the losses are DDP's (without checkpointing) up to float noise, and the
    average, kept as each rank's rows, merges to DDP's."""
    runs = {"hsdp": launch(tmp_path / "hsdp", "hsdp-ema-ckpt", nproc=4)}
    runs["ddp"] = launch(tmp_path / "ddp", "ddp-ema", nproc=4)
    for proc in runs.values():
        finish(proc)
    hybrid, ddp = losses(tmp_path / "hsdp"), losses(tmp_path / "ddp")
    assert [hybrid[s] for s in sorted(ddp)] == pytest.approx(
        [ddp[s] for s in sorted(ddp)], rel=1e-5
    )
    checkpoint = checkpoint_dir(tmp_path / "hsdp", STEPS)
    assert read_manifest(checkpoint).components["ema"]["scope"] == "sharded"
    states = merge_sharded(read_component_states(checkpoint, "ema"))
    average = {k.removeprefix("weights."): v for k, v in states.items() if "." in k}
    with_ddp = component_state(checkpoint_dir(tmp_path / "ddp", STEPS), "ema")["weights"]
    assert sorted(average) == sorted(with_ddp)
    for name, tensor in with_ddp.items():
        torch.testing.assert_close(average[name], tensor, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fsdp", "hsdp"])
def test_compiled_under_sharding_trains_as_uncompiled_and_keeps_the_models_names(tmp_path, kind):
    """torch.compile before the sharding wrap (FSDP2 on 2 processes; HSDP, 2 replicas x 2
    shards, on 4): the losses are the uncompiled run's up to float noise, and the sharded
    checkpoint holds the model's own names (no compiled wrapper's prefix) and the same rows."""
    nproc = 4 if kind == "hsdp" else 2
    modes = (kind, f"{kind}-compile")
    for proc in [launch(tmp_path / mode, mode, nproc=nproc) for mode in modes]:
        finish(proc)
    eager, compiled = (losses(tmp_path / mode) for mode in modes)
    assert sorted(compiled) == list(range(1, STEPS + 1))
    assert [compiled[s] for s in sorted(eager)] == pytest.approx(
        [eager[s] for s in sorted(eager)], rel=1e-5
    )
    expected, found = (checkpoint_dir(tmp_path / mode, STEPS) for mode in modes)
    assert read_manifest(found).components["model"]["scope"] == "sharded"
    ours, theirs = read_weights(found), read_weights(expected)
    assert sorted(ours) == sorted(theirs)
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-4, atol=1e-5)
    assert sorted(optimizer_state(found)) == sorted(optimizer_state(expected))
