"""The CLI through its real entry point: stdout vs stderr, exit codes, help text."""

from __future__ import annotations

import shutil

import pytest
import yaml

from tests.helpers import TINY_LM, run_forge


class TagIgnoringLoader(yaml.SafeLoader):
    """Reads forge's tagged YAML as plain data (tags dropped)."""


def _untagged(loader, _suffix, node):
    if isinstance(node, yaml.MappingNode):
        return loader.construct_mapping(node)
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node)
    return loader.construct_scalar(node)


TagIgnoringLoader.add_multi_constructor("!", _untagged)

COMMANDS = (
    "ls",
    "render",
    "build",
    "train",
    "resume",
    "runs",
    "checkpoints",
    "generate",
    "new",
    "new-config",
    "code",
    "plot",
    "tb",
    "env",
)


def test_help_lists_every_command_with_examples():
    result = run_forge("--help")
    assert result.returncode == 0
    for command in COMMANDS:
        assert command in result.stdout
    assert "quick start" in result.stdout


def test_each_command_help_has_worked_examples():
    for command in COMMANDS:
        result = run_forge(command, "--help")
        assert result.returncode == 0, result.stderr
        assert "examples:" in result.stdout, command
        assert f"forge {command}" in result.stdout, command


def test_no_command_is_a_usage_error():
    result = run_forge()
    assert result.returncode == 2
    assert result.stdout == ""


def test_unknown_option_is_a_usage_error():
    result = run_forge("render", "--no-such-flag")
    assert result.returncode == 2
    assert "--no-such-flag" in result.stderr


def test_render_prints_yaml_on_stdout_only():
    result = run_forge("render", "-p", str(TINY_LM))
    assert result.returncode == 0, result.stderr
    data = yaml.load(result.stdout, Loader=TagIgnoringLoader)
    assert "trainer" in data and "meta" in data
    assert "Traceback" not in result.stderr


def test_render_define_and_set_reach_the_output():
    result = run_forge(
        "render",
        "train",
        "-p",
        str(TINY_LM),
        "-D",
        "max_steps=7",
        "--set",
        "trainer.args.save_steps=3",
    )
    assert result.returncode == 0, result.stderr
    assert "max_steps: 7" in result.stdout
    assert "save_steps: 3" in result.stdout


def test_render_chain_lists_templates_in_order():
    result = run_forge("render", "train", "-p", str(TINY_LM), "--chain")
    assert result.returncode == 0, result.stderr
    names = [line.split()[1] for line in result.stdout.splitlines()]
    assert names[0] == "configs/train.yaml"
    for expected in (
        "projects/causal_lm.yaml",
        "base.yaml",
        "models/llama.yaml",
        "datasets/stdlib.yaml",
    ):
        assert expected in names
    assert names.index("projects/causal_lm.yaml") < names.index("base.yaml")


def test_render_graph_resolves_callables():
    result = run_forge("render", "train", "-p", str(TINY_LM), "--graph")
    assert result.returncode == 0, result.stderr
    assert "forge.train" in result.stdout and "Trainer" in result.stdout
    assert "LlamaForCausalLM" in result.stdout


def test_unknown_config_exits_2_with_suggestion(tmp_path):
    result = run_forge("render", "trian", "-p", str(TINY_LM))
    assert result.returncode == 2
    assert "train.yaml" in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


def test_bad_set_path_exits_2_and_suggests():
    result = run_forge("render", "train", "-p", str(TINY_LM), "--set", "trainer.args.max_stepz=3")
    assert result.returncode == 2
    assert "max_steps" in result.stderr
    assert "Traceback" not in result.stderr


def test_verbose_shows_the_traceback():
    result = run_forge("render", "trian", "-p", str(TINY_LM), "-v")
    assert result.returncode != 0
    assert "Traceback" in result.stderr


def test_ls_checks_every_config_and_renders_only_with_no_check():
    result = run_forge("ls", "-p", str(TINY_LM), "--no-check")
    assert result.returncode == 0, result.stderr
    assert "train.yaml*" in result.stdout and "renders" in result.stdout
    assert "--no-check" in result.stderr
    result = run_forge("ls", "-p", str(TINY_LM))
    assert result.returncode == 0, result.stderr
    assert "train.yaml*" in result.stdout
    assert "ok" in result.stdout.split("train.yaml*")[1]


def test_ls_reports_a_bad_callable_that_ls_no_check_cannot_see(tmp_path):
    (tmp_path / "templates" / "configs").mkdir(parents=True)
    (tmp_path / "meta.yaml").write_text("name: p\n")
    bad = "optimizer: !partial:torch.optim:AdamWW {lr: 0.1}\n"
    (tmp_path / "templates" / "configs" / "bad.yaml").write_text(bad)
    (tmp_path / "templates" / "configs" / "tag.yaml").write_text("x: !nosuchtag 1\n")
    plain = run_forge("ls", "-p", str(tmp_path), "--no-check")
    assert plain.returncode == 2
    assert "bad.yaml" in plain.stdout and "tag.yaml" in plain.stderr
    assert "AdamWW" not in plain.stderr
    checked = run_forge("ls", "-p", str(tmp_path), "--check")
    assert checked.returncode == 2
    assert "AdamW" in checked.stderr and "bad.yaml" in checked.stderr
    assert "Traceback" not in checked.stderr


def test_project_found_from_nested_cwd():
    nested = TINY_LM / "templates" / "configs"
    result = run_forge("ls", cwd=nested)
    assert result.returncode == 0, result.stderr
    assert "tiny_lm" in result.stdout


def test_no_project_is_a_usage_error(tmp_path):
    result = run_forge("ls", cwd=tmp_path)
    assert result.returncode == 2
    assert "meta.yaml" in result.stderr
    assert "Traceback" not in result.stderr


def test_build_prints_the_target_repr():
    result = run_forge("build", "train", "-p", str(TINY_LM), "--target", "meta")
    assert result.returncode == 0, result.stderr
    assert "'project': 'tiny_lm'" in result.stdout


def test_build_unknown_target_exits_2():
    result = run_forge("build", "train", "-p", str(TINY_LM), "--target", "trainr")
    assert result.returncode == 2
    assert "trainer" in result.stderr


def test_env_reports_versions():
    result = run_forge("env")
    assert result.returncode == 0
    for key in ("python", "torch", "transformers", "distributed backends"):
        assert key in result.stdout


def test_train_dry_run_checks_without_creating_a_run(tmp_path):
    project = tmp_path / "tiny_lm"
    shutil.copytree(TINY_LM, project, ignore=shutil.ignore_patterns("output"))
    small = ["-D", "max_files=4", "-D", "vocab_size=512", "-D", "block_size=32"]
    result = run_forge("train", "-p", str(project), "--dry-run", *small)
    assert result.returncode == 0, result.stderr
    assert "run_NNN" in result.stdout
    assert not (project / "output" / "train").exists()


def test_resume_without_runs_exits_1_and_touches_nothing(tmp_path):
    project = tmp_path / "p"
    (project / "templates" / "configs").mkdir(parents=True)
    (project / "meta.yaml").write_text("name: p\n")
    result = run_forge("resume", "-p", str(project))
    assert result.returncode == 1
    assert "no runs" in result.stderr
    assert not (project / "output").exists()


def test_dash_p_naming_a_missing_directory_says_so(tmp_path):
    result = run_forge("ls", "-p", "no/such/project", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith("error: no such directory: no/such/project")


@pytest.mark.parametrize("command", ["runs", "predict", "export", "sweep", "new"])
def test_a_one_process_command_under_a_launcher_is_refused_by_rank_0_only(
    command, monkeypatch, capsys, tmp_path
):
    """Every rank of `accelerate launch -m forge.cli CMD` would write the same files or print
    the same rows: the commands that do not run on every rank are refused before anything is
    read or written, rank 0 saying why and the others exiting quietly."""
    from forge.cli import main

    monkeypatch.chdir(tmp_path)
    args = {
        "runs": ["runs"],
        "predict": ["predict", "run", "--input", "in.jsonl", "--output", "out.jsonl"],
        "export": ["export", "run", "out"],
        "sweep": ["sweep", "-p", "."],
        "new": ["new", "demo"],
    }[command]
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("WORLD_SIZE", "2")
        assert main(args) == 2
        said = capsys.readouterr()
        assert said.out == ""
        if rank == "0":
            assert f"`forge {command}` is a one-process command" in said.err
            assert "rank 0 of 2 started by a launcher" in said.err
        else:
            assert said.err == ""
    assert list(tmp_path.iterdir()) == []  # nothing written (`new` would create demo/)
    monkeypatch.delenv("RANK")  # one process: not a launched job
    monkeypatch.delenv("WORLD_SIZE")
    assert main(["new", "demo"]) == 0
    assert (tmp_path / "demo").is_dir()


@pytest.mark.parametrize("rank,world", [("1", "1"), ("x", "2")], ids=["beyond", "not-a-number"])
def test_rank_variables_that_do_not_agree_are_named_without_a_traceback(rank, world):
    """A RANK left over in the shell (or beyond WORLD_SIZE): one message naming the variables,
    exit 2, for any command (it was a ValueError traceback from the logging set-up)."""
    result = run_forge("runs", "-p", str(TINY_LM), env={"RANK": rank, "WORLD_SIZE": world})
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert "process variables do not agree" in result.stderr
    assert "RANK, WORLD_SIZE and LOCAL_RANK" in result.stderr
