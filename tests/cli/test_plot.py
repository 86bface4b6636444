"""`forge plot` on a real (resumed) run, and the command `forge tb` would run."""

from __future__ import annotations

import shlex
import sys

import pytest

from tests.helpers import REPO, run_forge

pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory):
    """A classifier run trained to step 20, then resumed to step 30."""
    parent = tmp_path_factory.mktemp("plot")
    assert run_forge("new", "cls", "--from", "classifier", "-p", str(parent)).returncode == 0
    project = parent / "cls"
    steps = ["-D", "logging_steps=5", "-D", "eval_steps=10", "-D", "save_steps=10"]
    trained = run_forge("train", "-p", str(project), "-D", "max_steps=20", *steps)
    assert trained.returncode == 0, trained.stderr
    resumed = run_forge("resume", "-p", str(project), "--set", "trainer.args.max_steps=30")
    assert resumed.returncode == 0, resumed.stderr
    return project, project / "output" / "train" / "run_001"


def test_figure_has_one_line_per_metric_and_marks_the_resume(resumed_run):
    from forge.cli.plot import plot_run

    _, run_dir = resumed_run
    figure = plot_run(run_dir, ["loss", "eval_loss", "learning_rate"])
    lines = {line.get_label(): line for line in figure.axes[0].get_lines()}
    assert set(lines) == {"loss", "eval_loss", "learning_rate", "resumed"}
    assert list(lines["loss"].get_xdata()) == [5, 10, 15, 20, 25, 30]
    assert list(lines["eval_loss"].get_xdata()) == [10, 20, 30]
    assert list(lines["resumed"].get_xdata()) == [20, 20]
    legend = [text.get_text() for text in figure.axes[0].get_legend().get_texts()]
    assert legend == ["loss", "eval_loss", "learning_rate", "resumed"]


def test_plot_writes_a_png(resumed_run, tmp_path):
    project, run_dir = resumed_run
    result = run_forge("plot", "-p", str(project))  # the newest run, default metrics
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(run_dir / "metrics.png")
    output = tmp_path / "curves.png"
    result = run_forge("plot", "train/run_001", "-p", str(project), "-o", str(output))
    assert result.returncode == 0, result.stderr
    assert output.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_unknown_metric_exits_2_listing_the_metrics(resumed_run):
    project, _ = resumed_run
    result = run_forge("plot", "1", "-p", str(project), "--metric", "loss,eval_los")
    assert result.returncode == 2
    assert "'eval_los'" in result.stderr and "eval_loss, " in result.stderr
    assert "learning_rate" in result.stderr and "Traceback" not in result.stderr


def test_missing_matplotlib_exits_2_saying_how_to_install(resumed_run, tmp_path):
    project, _ = resumed_run
    blocker = tmp_path / "blocker" / "matplotlib"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('no matplotlib here')\n")
    env = {"PYTHONPATH": f"{blocker.parent}:{REPO}"}
    result = run_forge("plot", "-p", str(project), env=env)
    assert result.returncode == 2
    assert "pip install 'forge[plot]'" in result.stderr and "Traceback" not in result.stderr


def test_tb_command_serves_the_output_dir_or_one_run(resumed_run):
    project, run_dir = resumed_run
    result = run_forge("tb", "-p", str(project), "--print-command", "--port", "7007")
    assert result.returncode == 0, result.stderr
    argv = shlex.split(result.stdout)
    assert argv[:3] == [sys.executable, "-m", "tensorboard.main"]
    assert argv[argv.index("--logdir") + 1] == str(project / "output")
    assert argv[argv.index("--port") + 1] == "7007"
    one = run_forge("tb", "1", "-p", str(project), "--print-command")
    assert shlex.split(one.stdout)[4] == str(run_dir)


def test_tb_without_runs_exits_1(tmp_path):
    (tmp_path / "meta.yaml").write_text("name: p\n")
    result = run_forge("tb", "-p", str(tmp_path), "--print-command")
    assert result.returncode == 1
    assert "no runs" in result.stderr


def test_a_run_number_several_configs_have_is_refused_with_a_fix_each_command_takes(
    tmp_path, capsys
):
    """Run 1 of configs a and b: plot and tb (a RUN argument) and checkpoints (--run N) each
    say how to name one run with what that command accepts, and the named run is found."""
    from forge.cli import main
    from forge.runs import create_run

    (tmp_path / "meta.yaml").write_text("name: p\n")
    for config in ("a", "b"):
        run = create_run(
            tmp_path / "output" / config, config_name=f"{config}.yaml", config_text="x: 1\n",
            project_root=tmp_path, overrides=[], variables={}, nproc=1,
        )  # fmt: skip
        (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.0}\n')
    project = ["-p", str(tmp_path)]
    for command, fix in (
        (["plot", "1"], "name it by its path under output/: forge plot a/run_001"),
        (["tb", "1", "--print-command"], "name it by its path under output/: forge tb a/run_001"),
        (["checkpoints", "--run", "1"], f"use --run-dir {tmp_path / 'output' / 'a' / 'run_001'}"),
    ):
        assert main([*command, *project]) == 2, command
        err = capsys.readouterr().err
        assert "run number 1 exists for several configs (a/run_001, b/run_001)" in err
        assert fix in err and "--config" not in err, err
    assert main(["plot", "a/run_001", *project]) == 0
    assert capsys.readouterr().out.strip() == str(
        tmp_path / "output" / "a" / "run_001" / "metrics.png"
    )
    assert (
        main(["checkpoints", "--run-dir", str(tmp_path / "output" / "a" / "run_001"), *project])
        == 0
    )
