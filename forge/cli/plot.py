"""``forge plot`` and ``forge tb``: a run's metric curves as a PNG, and TensorBoard on the runs.

The curves come from the run's ``metrics.jsonl`` (one JSON object per logged step and per
evaluation); the steps where ``forge resume`` continued the run, recorded in ``run.json``,
are marked. matplotlib is optional (``pip install 'forge[plot]'``) and used headless (Agg).
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from forge.cli.exits import UsageError
from forge.extras import install_command
from forge.runs import RunError, RunRecord

logger = logging.getLogger(__name__)

DEFAULT_METRICS = ("loss", "eval_loss")
NOT_METRICS = frozenset({"step", "epoch"})


def read_metrics(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Metric name -> [(step, value)] sorted by step; a step logged twice keeps its last value."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise RunError(f"{path}: missing; the run has logged no metrics yet")
    series: dict[str, dict[int, float]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line torn by a crash
        step = record.get("step") if isinstance(record, dict) else None
        if not isinstance(step, int):
            continue
        for key, value in record.items():
            if key in NOT_METRICS or isinstance(value, bool):
                continue
            if isinstance(value, int | float):
                series.setdefault(key, {})[step] = float(value)
    return {key: sorted(values.items()) for key, values in series.items()}


def resume_steps(run_dir: Path) -> list[int]:
    """The steps at which the run was resumed (from the checkpoint names in run.json)."""
    from forge.checkpoint.layout import parse_checkpoint_step

    steps = []
    for resume in RunRecord.load(run_dir).data.get("resumes", []):
        step = parse_checkpoint_step(Path(str(resume.get("from", ""))).name)
        if step is not None:
            steps.append(step)
    return steps


def choose_metrics(
    available: Sequence[str], requested: Sequence[str] | None, run_dir: Path
) -> list[str]:
    """``requested`` if all exist, else a UsageError listing what exists; by default the
    defaults that exist."""
    listing = ", ".join(sorted(available)) or "none"
    if requested:
        missing = [m for m in requested if m not in available]
        if missing:
            raise UsageError(
                f"{run_dir} has no metric {', '.join(repr(m) for m in missing)}; metrics: {listing}"
            )
        return list(requested)
    chosen = [m for m in DEFAULT_METRICS if m in available]
    if not chosen:
        raise UsageError(
            f"{run_dir} has none of the default metrics ({', '.join(DEFAULT_METRICS)}); "
            f"pass --metric NAME[,NAME...] (metrics: {listing})"
        )
    return chosen


def plot_run(run_dir: Path, metrics: Sequence[str] | None = None) -> Any:
    """A matplotlib Figure: one line per metric against the step, resumes marked."""
    run_dir = Path(run_dir)
    series = read_metrics(run_dir)
    chosen = choose_metrics(list(series), metrics, run_dir)
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(8, 4.5), layout="constrained")
    for name in chosen:
        steps, values = zip(*series[name], strict=True)
        sparse = len(steps) <= 30  # evaluations: show each point, a lone one included
        axes.plot(steps, values, label=name, marker="o" if sparse else None, markersize=3)
    for index, step in enumerate(resume_steps(run_dir)):
        axes.axvline(
            step,
            color="0.5",
            linestyle="--",
            linewidth=1,
            label="resumed" if index == 0 else "_resumed",
        )
    record = RunRecord.load(run_dir).data
    axes.set_title(f"{record.get('config', '?')} {run_dir.name} ({record.get('status', '?')})")
    axes.set_xlabel("step")
    axes.grid(alpha=0.3)
    axes.legend()
    return figure


def save_plot(run_dir: Path, metrics: Sequence[str] | None, output: Path) -> Path:
    figure = plot_run(run_dir, metrics)
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=120)
    _pyplot().close(figure)
    return output


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise UsageError(
            "forge plot needs matplotlib, which is not installed; "
            f"install it with: {install_command('matplotlib')} (or pip install matplotlib)"
        ) from None
    matplotlib.use("Agg")  # files only: no display needed, none opened
    import matplotlib.pyplot as plt

    return plt


def tensorboard_command(
    logdir: Path, *, port: int | None = None, host: str | None = None
) -> list[str]:
    """The argv that serves ``logdir`` (every run's ``tb/`` below it) with TensorBoard."""
    command = [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir)]
    if port is not None:
        command += ["--port", str(port)]
    if host is not None:
        command += ["--host", host]
    return command


def require_tensorboard() -> None:
    import importlib.util

    if importlib.util.find_spec("tensorboard") is None:
        raise UsageError(
            f"forge tb needs TensorBoard, which is not installed; {install_command('tensorboard')}"
        )
