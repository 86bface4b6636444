"""The strategies of docs/trainers.md's table of features by strategy as `forge train`
arguments (for any config that extends base.yaml), and one SIGKILL-then-resume harness, so a
feature's resume test is parametrized over strategies instead of repeating itself."""

from __future__ import annotations

import signal
from pathlib import Path

from forge.checkpoint.registry import read_component_states
from forge.checkpoint.weights import read_weights
from tests.helpers import run_forge
from tests.integration.test_train_resume import start_held
from tests.train.common import assert_same_tensors, checkpoint_dir


def trainer(kind: str, cls: str) -> list[str]:
    """The ``-D`` variables base.yaml reads to build ``forge.train:<cls>Trainer``."""
    return [
        "-D", f"trainer_class=forge.train:{cls}Trainer",
        "-D", f"trainer_args_class=forge.train:{cls}TrainingArguments",
        "-D", f"trainer_kind={kind}",
    ]  # fmt: skip


_FSDP = ["--set", "trainer.args.fsdp=full_shard"]
_PIPELINE = trainer("pipeline", "Pipeline")

#: the strategies beyond one process and DDP; HSDP is 2 replicas x 2 shards on 4 processes,
#: pipeline x FSDP 2 stages each sharded over 2 replicas
STRATEGIES: dict[str, list[str]] = {
    "fsdp": ["--nproc", "2", *_FSDP],
    "hsdp": [
        "--nproc", "4", "--set", "trainer.args.fsdp=hybrid_shard",
        "--set", "trainer.args.fsdp_config={replicate_size: 2}",
    ],
    "accelerate": ["--nproc", "2", *trainer("accelerate", "Accel")],
    "pipeline": ["--nproc", "2", *_PIPELINE],
    "ppfsdp": [
        "--nproc", "4", *_PIPELINE, *_FSDP, "--set", "trainer.args.pipeline_parallel_size=2",
    ],
}  # fmt: skip


def sigkill_and_resume(
    arguments: list[str], cwd: Path, saved: int, last: int, timeout: int = 900
) -> tuple[Path, Path, str]:
    """``forge train ARGUMENTS`` straight to step ``last``; the same run SIGKILLed (forge's
    launcher: its ranks and loader workers die with it) once the checkpoint of step ``saved``
    exists, then continued with `forge resume`. The two last checkpoints and the resume's
    stderr."""
    straight = run_forge("train", *arguments, cwd=cwd, timeout=timeout)
    assert straight.returncode == 0, straight.stderr[-3000:]
    proc, run_dir = start_held("train", *arguments, cwd=cwd, saved=saved, timeout=timeout)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=300)
    assert not checkpoint_dir(run_dir, last).exists()
    project = arguments[arguments.index("-p") + 1]
    resumed = run_forge(
        "resume", "-p", project, "--run-dir", str(run_dir), cwd=cwd, timeout=timeout
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    ran = Path(straight.stdout.splitlines()[0])
    return checkpoint_dir(ran, last), checkpoint_dir(run_dir, last), resumed.stderr


def assert_same_end(expected: Path, found: Path) -> None:
    """Two checkpoints of the same layout hold bit-identical weights and optimizer state, file
    by file (a rank's shard, a stage's part, or the whole)."""
    assert_same_tensors(read_weights(expected), read_weights(found), "weights")
    assert_same_tensors(
        read_component_states(expected, "optimizer"),
        read_component_states(found, "optimizer"),
        "optimizer",
    )
