"""A run on a stream killed with SIGKILL mid-epoch and continued with `forge resume` ends with
the weights and optimizer state of the same run trained straight: a sharded jsonl corpus read
through `datasets` and a user IterableDataset with no sharding of its own, shuffled, on 1 and
2 processes, with 0 and 2 loader workers; and tiny_lm's packed stream under FSDP, HSDP, the
Accelerate trainer, the pipeline and pipeline x FSDP (slow: real processes)."""

from __future__ import annotations

import signal
import textwrap
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.helpers import run_forge
from tests.integration.test_train_resume import start_held
from tests.train.common import assert_same_tensors, component_state

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DATA = '''

import json
from pathlib import Path


class StreamClassification(torch.utils.data.IterableDataset):
    """SyntheticClassification's items as a stream: no length, no shards, no state."""

    def __init__(self, **kwargs):
        self.data = SyntheticClassification(**kwargs)

    def __iter__(self):
        for index in range(len(self.data)):
            yield self.data[index]


def jsonl_stream(directory, shards=5, **kwargs):
    """The same items written as `shards` jsonl files, read back as a datasets stream."""
    import datasets

    data = SyntheticClassification(**kwargs)
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    files = []
    for shard in range(shards):
        path = folder / f"part-{shard:03d}.jsonl"
        rows = range(shard, len(data), shards)
        path.write_text("".join(
            json.dumps({"features": data[i]["features"].tolist(), "labels": int(data[i]["labels"])})
            + "\\n" for i in rows
        ))
        files.append(str(path))
    return datasets.load_dataset("json", data_files=files, split="train", streaming=True)


def collate(items):
    return {
        "features": torch.stack([torch.as_tensor(i["features"], dtype=torch.float32) for i in items]),
        "labels": torch.tensor([int(i["labels"]) for i in items]),
    }
'''

CONFIG = """\
-- extends 'configs/train.yaml'
-- block datasets
-- if source == "jsonl"
train_dataset: &train_dataset !singleton:./data.py:jsonl_stream
    directory: {{ shard_dir }}
-- else
train_dataset: &train_dataset !singleton:./data.py:StreamClassification
-- endif
    num_samples: 200
    num_features: 16
    num_classes: 4
eval_dataset: &eval_dataset null
-- endblock
-- block collator
data_collator: &data_collator !partial:./data.py:collate
-- endblock
-- block trainer_args
    == super()
    max_steps: 24
    per_device_train_batch_size: 8
    save_steps: 6
    logging_steps: 6
    eval_strategy: "no"
    metric_for_best_model: null
    report_to: none
    stream_shuffle_buffer: 16
    dataloader_num_workers: {{ workers }}
-- endblock
"""


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("streams")
    created = run_forge("new", "streams", "--from", "classifier", cwd=root)
    assert created.returncode == 0, created.stderr
    project = root / "streams"
    with open(project / "data.py", "a") as file:
        file.write(textwrap.dedent(DATA))
    (project / "templates" / "configs" / "stream.yaml").write_text(CONFIG)
    return project


def start_and_kill_after_step_12(extra: list[str], project: Path) -> Path:
    """``forge train EXTRA`` SIGKILLed (the launcher: its ranks and loader workers die with it)
    once the checkpoint of step 12 is committed and before any later one is written. Its run
    directory."""
    proc, run_dir = start_held("train", *extra, cwd=project, saved=12)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=300)
    checkpoints = sorted(path.name for path in (run_dir / "checkpoints").glob("checkpoint-*"))
    assert checkpoints[-1] == "checkpoint-000012", checkpoints
    return run_dir


@pytest.mark.parametrize(
    ("source", "nproc", "workers"),
    [("jsonl", "1", "0"), ("jsonl", "2", "2"), ("plain", "1", "2"), ("plain", "2", "0")],
)
def test_a_stream_run_killed_with_sigkill_resumes_bit_identical(
    project, tmp_path, source, nproc, workers
):
    extra = [
        "stream", "-p", str(project), "-D", f"source={source}", "-D", f"workers={workers}",
        "-D", f"shard_dir={tmp_path / 'shards'}", "--nproc", nproc,
    ]  # fmt: skip
    straight = run_forge("train", *extra, timeout=600)
    assert straight.returncode == 0, straight.stderr[-3000:]
    run_dir = start_and_kill_after_step_12(extra, project)
    resumed = run_forge("resume", "-p", str(project), "--run-dir", str(run_dir), timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed in epoch" in resumed.stderr
    ends = [
        Path(straight.stdout.splitlines()[0]) / "checkpoints" / "checkpoint-000024",
        run_dir / "checkpoints" / "checkpoint-000024",
    ]
    weights = [load_file(end / "model.safetensors") for end in ends]
    assert_same_tensors(*weights, "weights")
    assert_same_tensors(*(component_state(end, "optimizer") for end in ends), "optimizer")


def test_a_stream_run_of_one_process_continues_on_two(project, tmp_path):
    """Killed on 1 process, resumed on 2: the shards of the epoch the one reader had not
    finished, and its shuffle buffer, are dealt to the 2 ranks, which train to max_steps."""
    extra = [
        "stream", "-p", str(project), "-D", "source=jsonl", "-D", "workers=0",
        "-D", f"shard_dir={tmp_path / 'shards'}", "--nproc", "1",
    ]  # fmt: skip
    run_dir = start_and_kill_after_step_12(extra, project)
    resumed = run_forge(
        "resume", "-p", str(project), "--run-dir", str(run_dir), "--nproc", "2", timeout=600
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "saved reader(s)" in resumed.stderr and "dealt to 2 reader(s)" in resumed.stderr
    assert (run_dir / "checkpoints" / "checkpoint-000024" / "model.safetensors").exists()


# the strategies beyond one process and DDP, on tiny_lm's stream (a Llama the pipeline splits)
@pytest.mark.parametrize("strategy", ["fsdp", "hsdp", "accelerate", "pipeline", "ppfsdp"])
def test_a_tiny_lm_stream_run_killed_with_sigkill_resumes_bit_identical(tmp_path, strategy):
    """tiny_lm's sharded stream of the standard library's files, tokenized, packed and
    shuffled on the fly, under FSDP (2 processes), HSDP (2 replicas x 2 shards), the
    Accelerate trainer (2), the pipeline (2 stages) and pipeline x FSDP (2 stages x 2
    shards): killed after the checkpoint of step 4 and resumed, every rank's file of the
    weights and optimizer state ends as the straight run's."""
    import shutil

    from forge.checkpoint import read_manifest
    from tests.cli.small_lm import SMALL_LM, defines
    from tests.helpers import TINY_LM
    from tests.integration.strategies import STRATEGIES, assert_same_end, sigkill_and_resume

    project = shutil.copytree(
        TINY_LM, tmp_path / "tiny_lm", ignore=shutil.ignore_patterns("output")
    )
    arguments = [
        "stream", "-p", str(project), *defines(SMALL_LM), "-D", "max_steps=12",
        "-D", "save_steps=4", "-D", "eval_steps=12", "-D", "logging_steps=4",
        "--set", "trainer.args.stream_shuffle_buffer=16", *STRATEGIES[strategy],
    ]  # fmt: skip
    straight, resumed, stderr = sigkill_and_resume(arguments, project, saved=4, last=12)
    assert "resumed in epoch" in stderr
    assert_same_end(straight, resumed)
    manifest = read_manifest(resumed)
    assert manifest.topology["world_size"] == int(STRATEGIES[strategy][1])
    data_ranks = [f for f in manifest.files if f.startswith("data-rank-")]
    assert len(data_ranks) == manifest.topology["world_size"]  # each rank's stream position
