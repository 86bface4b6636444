"""Hostile and malformed input: a pipeline stage's state file carrying code is refused unrun,
and `hypothesis`-generated damage to a run directory (run.json, config.yaml, a checkpoint's
manifest and files) ends `forge runs`, `forge checkpoints` and `forge resume` with exit 0, 1
or 2 and a message naming the file, never a traceback.

The commands run in-process (`forge.cli.main`) on a copy of one small finished run; the
default suite tries a few derandomized examples, `-m slow` (make reliability) many more.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import re
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from forge.checkpoint import CheckpointError, validate_checkpoint
from forge.cli import main
from forge.train.topology import Topology
from tests.checkpoint.test_registry import load, rehash, save
from tests.helpers import run_forge
from tests.integration.test_resume_refuses_code import CreatesMarker

FAST = settings(
    max_examples=20,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
SLOW = settings(
    max_examples=300,
    deadline=None,
    database=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
)


def test_a_pipeline_stage_file_carrying_code_is_refused_unrun(tmp_path):
    path = save(tmp_path / "checkpoints", world_size=2, num_stages=2)
    marker = tmp_path / "code-ran"
    shard = path / "moments-stage-00001-of-00002.pt"
    payload = torch.load(shard, weights_only=True)
    torch.save({**payload, "hook": CreatesMarker(str(marker))}, shard)
    rehash(path)
    problems = validate_checkpoint(path)
    assert len(problems) == 1, problems
    assert problems[0].startswith(
        "moments-stage-00001-of-00002.pt: refusing to load: it holds Python objects other than "
        "tensors and plain data (unsupported global io.open)"
    )
    with pytest.raises(CheckpointError, match="refusing to load"):
        load(path, Topology(1, 2, 1, 2))  # loading without validating first refuses it too
    assert not marker.exists()


# --------------------------------------------------------------------------- run directories


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A small project with one finished run: checkpoints at steps 2 and 4."""
    root = tmp_path_factory.mktemp("hostile")
    assert run_forge("new", "demo", "--from", "classifier", cwd=root).returncode == 0
    made = run_forge(
        "train",
        "-p",
        "demo",
        "-D",
        "max_steps=4",
        "-D",
        "save_steps=2",
        "-D",
        "eval_steps=2",
        cwd=root,
    )
    assert made.returncode == 0, made.stderr
    return root / "demo"


json_value = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-3, 10**12)
    | st.floats(allow_nan=True)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
RECORD_KEYS = [
    "run", "config", "status", "step", "world_size", "created", "created_ns", "checkpoints",
    "best", "resumes", "restarts", "signal", "project", "variables", "overrides",
]  # fmt: skip
MANIFEST_KEYS = [
    "format_version", "step", "epoch", "trainer", "created", "metrics", "topology",
    "components", "files", "world",
]  # fmt: skip
YAML_BITS = [
    "trainer:", "  args:", "!singleton:os:system", "!call:builtins:eval ['1']", "!var run_dir",
    "*missing", "&a", "{", "[", "- ", ": ", "\t", "!!python/object:os.system", "max_grad_norm: x",
    "!partial:./model.py:Nope", "\x00", "é", "'", "!singleton:./../../escape.py:f",
]  # fmt: skip
text = st.one_of(
    st.text(max_size=40),
    json_value.map(json.dumps),
    st.lists(st.sampled_from(YAML_BITS), max_size=6).map("\n".join),
)
blob = st.one_of(st.binary(max_size=64), text.map(str.encode))

mutation = st.one_of(
    st.tuples(st.just("run.json"), text),
    st.tuples(st.just("run.json field"), st.sampled_from(RECORD_KEYS), json_value),
    st.tuples(st.just("config.yaml"), text),
    st.tuples(st.just("config.yaml line"), st.integers(0, 60), text),
    st.tuples(st.just("manifest.json"), text),
    st.tuples(st.just("manifest field"), st.sampled_from(MANIFEST_KEYS), json_value),
    st.tuples(st.just("manifest file entry"), st.integers(0, 20), json_value),
    st.tuples(st.just("file contents"), st.integers(0, 20), blob, st.booleans()),
    st.tuples(st.just("file removed"), st.integers(0, 20)),
    st.tuples(st.just("file added"), st.text(min_size=1, max_size=8), blob),
    st.tuples(st.just("checkpoint is a file"), blob),
)


def damage(run_dir: Path, change: tuple) -> None:
    """Apply one generated change to a copy of the finished run."""
    kind, *args = change
    checkpoint = run_dir / "checkpoints" / "checkpoint-000004"
    manifest_path = checkpoint / "manifest.json"
    files = sorted(p.name for p in checkpoint.iterdir() if p.name != "manifest.json")
    if kind == "run.json":
        (run_dir / "run.json").write_text(args[0])
    elif kind == "run.json field":
        record = json.loads((run_dir / "run.json").read_text())
        record[args[0]] = args[1]
        (run_dir / "run.json").write_text(json.dumps(record))
    elif kind == "config.yaml":
        (run_dir / "config.yaml").write_text(args[0])
    elif kind == "config.yaml line":
        lines = (run_dir / "config.yaml").read_text().splitlines()
        lines[args[0] % len(lines)] = args[1]
        (run_dir / "config.yaml").write_text("\n".join(lines))
    elif kind == "manifest.json":
        manifest_path.write_text(args[0])
    elif kind == "manifest field":
        manifest = json.loads(manifest_path.read_text())
        manifest[args[0]] = args[1]
        manifest_path.write_text(json.dumps(manifest))
    elif kind == "manifest file entry":
        manifest = json.loads(manifest_path.read_text())
        name = sorted(manifest["files"])[args[0] % len(manifest["files"])]
        manifest["files"][name] = args[1]
        manifest_path.write_text(json.dumps(manifest))
    elif kind == "file contents":
        index, data, consistent = args
        name = files[index % len(files)]
        (checkpoint / name).write_bytes(data)
        if consistent:  # the manifest made to agree: only the contents can tell
            manifest = json.loads(manifest_path.read_text())
            manifest["files"][name] = {
                "size": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
            }
            manifest_path.write_text(json.dumps(manifest))
    elif kind == "file removed":
        (checkpoint / files[args[0] % len(files)]).unlink()
    elif kind == "file added":
        name = re.sub(r"[^\w.-]", "_", args[0]).lstrip(".") or "x"
        (checkpoint / name).write_bytes(args[1])
    elif kind == "checkpoint is a file":
        shutil.rmtree(checkpoint)
        checkpoint.write_bytes(args[0])


# A failure names where it is: a file of the run or checkpoint, or a template line.
LOCATED = re.compile(
    r"run\.json|config\.yaml|manifest\.json|checkpoint-\d+|\.pt\b|\.safetensors|"
    r"\.ya?ml:\d+|rendered line \d+"
)


def run_cli(args: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(args)
        except SystemExit as exit_:
            code = exit_.code
    return code, out.getvalue(), err.getvalue()


LONGER = "trainer.args.max_steps=5"


def check_run_directory(base: Path, change: tuple) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        project = Path(tmp) / "demo"
        shutil.copytree(base, project)
        run_dir = project / "output" / "train" / "run_001"
        damage(run_dir, change)
        for args in (
            ["runs", "-p", str(project)],
            ["checkpoints", "-p", str(project), "--verify"],
            # one step further, so the checkpoint is loaded, not only found complete
            ["resume", "-p", str(project), "--run-dir", str(run_dir), "--set", LONGER],
        ):
            code, out, err = run_cli(args)
            assert code in (0, 1, 2), (args, change, code, err)
            assert "Traceback" not in err and "(run again with -v" not in err, (args, change, err)
            if code:
                assert LOCATED.search(out + err), (args, change, out, err)


@FAST
@given(change=mutation)
@example(change=("file contents", 3, b"", True))  # an empty safetensors file, hash updated
@example(change=("config.yaml", ""))  # nothing for --set to set
@example(change=("config.yaml line", 7, ""))  # the model partial loses an argument
def test_damaged_run_directories_end_with_a_located_message(finished_run, change):
    check_run_directory(finished_run, change)


@pytest.mark.slow
@SLOW
@given(change=mutation)
def test_damaged_run_directories_end_with_a_located_message_many(finished_run, change):
    check_run_directory(finished_run, change)
