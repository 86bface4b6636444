"""``report_to`` integrations: the callback of each (TensorBoard's is in callbacks.py), and
Weights & Biases and MLflow, offline by default.

Both run on rank 0 and keep their files under the run directory unless the environment says
otherwise: wandb in ``WANDB_MODE=offline`` (set ``WANDB_MODE=online`` to sync as you train, or
``wandb sync <output_dir>/wandb/offline-run-*`` later), MLflow with a local store in the run
directory (``mlflow.db``, or the ``mlruns/`` file store where SQLAlchemy is missing, as with
mlflow-skinny; set ``MLFLOW_TRACKING_URI`` for a server). A resumed run continues
the same wandb / MLflow run. The packages are imported only when training starts; the config
check already refused a ``report_to`` whose package is missing.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any

from forge.train.callbacks import TensorBoardCallback, TrainerCallback

logger = logging.getLogger(__name__)

__all__ = ["CALLBACKS", "MLflowCallback", "WandbCallback", "integration_callback"]


def _numbers(values: dict[str, Any]) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in values.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def _run_id(output_dir: str) -> str:
    """A stable id per run directory, so a resumed run logs into the same run."""
    return hashlib.sha256(str(Path(output_dir).resolve()).encode()).hexdigest()[:16]


class WandbCallback(TrainerCallback):
    """Logs ``train/*`` and ``eval/*`` scalars and the arguments to Weights & Biases.

    The project is ``WANDB_PROJECT`` (else ``args.project``), the name ``args.run_name``
    (else the run directory's name); the mode is ``WANDB_MODE`` (else offline).
    """

    def __init__(self) -> None:
        self.run: Any = None

    def on_train_begin(self, args, state, control, **kwargs):
        import wandb

        directory = Path(args.output_dir)
        directory.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", args.project),
            name=args.run_name or directory.name,
            id=_run_id(args.output_dir),
            resume="allow",
            dir=str(directory),
            mode=os.environ.get("WANDB_MODE", "offline"),
            config=args.to_dict(),
        )

    def _log(self, prefix: str, values: dict[str, Any], step: int) -> None:
        if self.run is not None:
            scalars = {
                f"{prefix}/{k.removeprefix('eval_')}": v for k, v in _numbers(values).items()
            }
            self.run.log(scalars, step=step)

    def on_log(self, args, state, control, logs, **kwargs):
        self._log("train", logs, state.global_step)

    def on_evaluate(self, args, state, control, metrics, **kwargs):
        self._log("eval", metrics, state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        if self.run is not None:
            self.run.finish()
            self.run = None


def local_tracking_uri(directory: Path) -> str:
    """MLflow's local store in ``directory``: SQLite where SQLAlchemy is installed (MLflow's
    recommended local backend), else the ``mlruns/`` file store (which MLflow 3 keeps only
    on request: ``MLFLOW_ALLOW_FILE_STORE``)."""
    import importlib.util

    if importlib.util.find_spec("sqlalchemy") is not None:
        return f"sqlite:///{(directory / 'mlflow.db').resolve()}"
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return (directory / "mlruns").resolve().as_uri()


class MLflowCallback(TrainerCallback):
    """Logs the metrics (by step) and the arguments (as parameters) to MLflow.

    The tracking URI is ``MLFLOW_TRACKING_URI`` (else a local store in ``output_dir``),
    the experiment ``MLFLOW_EXPERIMENT_NAME`` (else ``args.project``), the run name
    ``args.run_name`` (else the run directory's name).
    """

    RUN_ID_FILE = "mlflow_run_id"

    def __init__(self) -> None:
        self.mlflow: Any = None

    def on_train_begin(self, args, state, control, **kwargs):
        import mlflow

        directory = Path(args.output_dir)
        directory.mkdir(parents=True, exist_ok=True)
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            mlflow.set_tracking_uri(local_tracking_uri(directory))
        mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", args.project))
        id_file = directory / self.RUN_ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else None
        run = mlflow.start_run(
            run_id=run_id, run_name=None if run_id else args.run_name or directory.name
        )
        id_file.write_text(run.info.run_id)
        if run_id is None:
            params = {k: str(v)[:500] for k, v in args.to_dict().items()}
            mlflow.log_params(params)
        self.mlflow = mlflow

    def _log(self, values: dict[str, Any], step: int) -> None:
        if self.mlflow is not None:
            self.mlflow.log_metrics(_numbers(values), step=step)

    def on_log(self, args, state, control, logs, **kwargs):
        self._log(logs, state.global_step)

    def on_evaluate(self, args, state, control, metrics, **kwargs):
        self._log(metrics, state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        if self.mlflow is not None:
            self.mlflow.end_run()
            self.mlflow = None


#: the callback of each ``report_to`` integration
CALLBACKS: dict[str, type[TrainerCallback]] = {
    "tensorboard": TensorBoardCallback,
    "wandb": WandbCallback,
    "mlflow": MLflowCallback,
}


def integration_callback(name: str) -> TrainerCallback:
    """The callback of one ``report_to`` integration (``args.report_to`` is checked)."""
    return CALLBACKS[name]()
