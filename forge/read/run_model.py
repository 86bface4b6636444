"""The model of a run, built as its training built it, before any weights are loaded: the one
place the read side (the reader, ``forge evaluate``/``predict``/``generate``/``export``) turns a
run's ``config.yaml`` into its module."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forge.checkpoint.io import CheckpointError
from forge.wrappers import class_label

if TYPE_CHECKING:
    from torch import nn

    from forge.config import Config, Project

__all__ = ["build_run_model"]


def build_run_model(
    run_dir: Path, cfg: Config, project: Project | None, record: dict[str, Any]
) -> nn.Module:
    """The model of the run in ``run_dir`` (its checked ``cfg``, ``project`` and ``run.json``
    ``record``) as its training built it, before any weights are loaded: the config's
    ``model`` target when the trainer takes it, else the trainer's model."""
    from torch import nn

    from forge.config.graph import CallNode
    from forge.launch.worker import TRAINER_TARGET, build_variables

    trainer = cfg.targets.get(TRAINER_TARGET)
    given = trainer.kwargs.get("model") if isinstance(trainer, CallNode) else None
    alone = given is not None and cfg.targets.get("model") is given
    # the objects' own files (a trainer's logs) go to a scratch directory, not to the run
    with tempfile.TemporaryDirectory(prefix="forge-read-") as scratch:
        variables = build_variables(Path(scratch), project, record.get("config", "config"))
        if alone:  # only the model and what it needs
            built = cfg.build("model", variables)
        else:  # the model is written inside the trainer: build the trainer, as training did
            built = cfg.build(TRAINER_TARGET, variables)
            built = built.model if built.model is not None else built.model_init
        model = built if isinstance(built, nn.Module) else built()
    if not isinstance(model, nn.Module):
        raise CheckpointError(
            f"{run_dir}/config.yaml: the trainer's model built a {class_label(model)}, "
            "not a torch.nn.Module"
        )
    return model
