"""What a checkpoint holds besides weights, and the order it is restored in.

Shared by every trainer through ``CheckpointingMixin``:

* ``training_state.pt`` (rank 0): step, epoch, data position, optimizer, scheduler, grad
  scaler, trainer state (best metric and checkpoint, skipped steps, tokens), callback states,
  the running log tally;
* ``rank_state_XXXXX.pt`` (every rank): its data loader position and random generators.

Restore order: weights, optimizer, scheduler, scaler, trainer and callback state, then the
data position (whose ``iter()`` draws a seed) and the random generators last, so nothing
draws from them between the restore and the first resumed step.
"""

from __future__ import annotations

import logging
import math
import os
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from forge.checkpoint import (
    MANIFEST_NAME,
    TRAINING_STATE_NAME,
    CheckpointError,
    CheckpointWriter,
    capture_rng_state,
    find_latest_checkpoint,
    load_model_weights,
    load_torch_state,
    parse_checkpoint_step,
    rank_state_name,
    read_manifest,
    restore_rng_state,
    rotate_checkpoints,
    validate_checkpoint,
)
from forge.train import dist
from forge.train.args import TrainingArguments
from forge.train.callbacks import CallbackHandler, TrainerState
from forge.train.loop_state import Position

logger = logging.getLogger(__name__)

TRAINING_STATE_FORMAT = 1
_RUN_DIR_RE = re.compile(r"run_(\d+)")


def resume_search_dirs(output_dir: str | os.PathLike) -> list[Path]:
    """Where ``resume_from_checkpoint: true`` looks: sibling ``run_*`` directories'
    checkpoints, oldest run first, then this run's own (which wins when it has a valid one)."""
    out = Path(output_dir)
    own = out / "checkpoints"
    if not _RUN_DIR_RE.fullmatch(out.name) or not out.parent.is_dir():
        return [own]
    runs = sorted(
        (p for p in out.parent.iterdir() if p.is_dir() and _RUN_DIR_RE.fullmatch(p.name)),
        key=lambda p: int(_RUN_DIR_RE.fullmatch(p.name).group(1)),
    )
    return [run / "checkpoints" for run in runs if run.name != out.name] + [own]


def find_resume_checkpoint(
    resume: bool | str | os.PathLike, output_dir: str | os.PathLike
) -> Path | None:
    """The checkpoint ``resume`` names: True, a checkpoint, or a run / checkpoints directory.

    True with nothing found warns and returns None (train from scratch); a path that is not
    a valid checkpoint raises CheckpointError listing its problems.
    """
    if resume is True:
        dirs = resume_search_dirs(output_dir)
        found = find_latest_checkpoint(dirs)
        if found is None:
            logger.warning(
                "resume_from_checkpoint is set but there is no valid checkpoint in %s; "
                "training from scratch",
                ", ".join(str(d) for d in dirs),
            )
        return found
    path = Path(resume)
    if path.is_dir() and not (path / MANIFEST_NAME).exists():
        if parse_checkpoint_step(path) is None:  # a run or checkpoints directory
            found = find_latest_checkpoint(path)
            if found is None:
                raise CheckpointError(f"{path}: no valid checkpoint to resume from")
            return found
    problems = validate_checkpoint(path)
    if problems:
        listed = "\n".join(f"  - {p}" for p in problems)
        raise CheckpointError(f"cannot resume from {path}:\n{listed}")
    return path


class CheckpointingMixin:
    """Saving and exact restoring for ``BaseTrainer`` (see the module docstring).

    Works on the trainer's attributes annotated here; ``write_checkpoint`` is the method a
    trainer overrides to change which rank writes which file.
    """

    args: TrainingArguments
    state: TrainerState
    env: dist.DistEnv
    trainer_kind: str
    model: nn.Module
    tokenizer: Any
    optimizer: Optimizer
    lr_scheduler: LRScheduler
    scaler: torch.amp.GradScaler | None
    train_loader: Any
    checkpoints_dir: Path
    callback_handler: CallbackHandler

    def save_checkpoint(self) -> Path:
        """Write a checkpoint of the current step (every rank calls this); rotate old ones."""
        args, state = self.args, self.state
        step = state.global_step
        if self._last_save_step == step and state.last_checkpoint:
            return Path(state.last_checkpoint)  # already saved at this step
        metrics = self._last_eval[1] if self._last_eval[0] == step else {}
        barrier = dist.barrier if self.env.world_size > 1 else None
        with CheckpointWriter(
            self.checkpoints_dir,
            step,
            rank=self.env.rank,
            world_size=self.env.world_size,
            barrier=barrier,
            trainer=self.trainer_kind,
        ) as ckpt:
            final = ckpt.final_path
            self._track_best(final, metrics)
            state.last_checkpoint = str(final)
            self.write_checkpoint(ckpt)
            ckpt.set_meta(
                epoch=state.epoch, metrics=metrics, world={"world_size": self.env.world_size}
            )
        self._last_save_step = step
        if self.is_main_process and args.save_total_limit:
            protect = [state.best_checkpoint] if state.best_checkpoint else []
            rotate_checkpoints(self.checkpoints_dir, args.save_total_limit, protect=protect)
        self._call("on_save", checkpoint_path=final, metrics=metrics)
        return final

    def write_checkpoint(self, ckpt: CheckpointWriter) -> None:
        """Which rank writes what: rank 0 the model, tokenizer and shared training state;
        every rank its own random and data state."""
        if self.is_main_process:
            ckpt.save_model(self.model, tokenizer=self.tokenizer)
            ckpt.save_torch(TRAINING_STATE_NAME, self.training_state_dict())
        ckpt.save_torch(rank_state_name(self.env.rank), self.rank_state_dict())

    def training_state_dict(self) -> dict[str, Any]:
        """State shared by all ranks; loads with ``torch.load(weights_only=True)``."""
        args, state = self.args, self.state
        training_state: dict[str, Any] = {
            "format": TRAINING_STATE_FORMAT,
            "trainer": self.trainer_kind,
            "global_step": state.global_step,
            "epoch": state.epoch,
            "position": {"epoch": self._position.epoch, "batch": self._position.batch},
            "world_size": self.env.world_size,
            "trainer_state": state.state_dict(),
            "callbacks": self.callback_handler.state_dict(),
            "log_tally": self._tally.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
        }
        if args.save_optimizer_state:
            training_state["optimizer"] = self.optimizer.state_dict()
        if args.save_scheduler_state:
            training_state["lr_scheduler"] = self.lr_scheduler.state_dict()
        return training_state

    def rank_state_dict(self) -> dict[str, Any]:
        """This rank's data position and random generators."""
        args = self.args
        # the loader state first: taking it may build an iterator, which draws a random seed
        loader_state = self.train_loader.state_dict() if args.save_dataloader_state else None
        return {
            "rank": self.env.rank,
            "world_size": self.env.world_size,
            "epoch": self._position.epoch,
            "batch": self._position.batch,
            "dataloader": loader_state,
            "rng": capture_rng_state() if args.save_rng_state else None,
        }

    def _track_best(self, checkpoint: Path, metrics: dict[str, float]) -> None:
        args, state = self.args, self.state
        value = metrics.get(args.metric_for_best_model or "")
        if value is None or not math.isfinite(value):
            return
        best = state.best_metric
        better = best is None or (value > best if args.greater_is_better else value < best)
        if better:
            state.best_metric, state.best_checkpoint = float(value), str(checkpoint)

    def _resolve_checkpoint(self, resume: bool | str | os.PathLike) -> Path | None:
        """The checkpoint to resume from, found on rank 0 and shared with every rank."""
        if resume is False or resume is None:
            return None
        found, error = None, None
        if self.is_main_process:
            try:
                found = find_resume_checkpoint(resume, self.args.output_dir)
            except CheckpointError as exc:
                error = str(exc)
        found, error = dist.broadcast_object((found, error))
        if error is not None:
            raise CheckpointError(error)
        return found

    def _load_checkpoint(self, path: Path) -> None:
        """Restore a checkpoint; the random generators go last, so nothing draws from them
        between the restore and the first resumed step."""
        args, state = self.args, self.state
        load_model_weights(self.model, path, strict=True)
        state_file = path / TRAINING_STATE_NAME
        if not state_file.exists():
            logger.warning(
                "%s has no %s: loaded its weights only, starting at step 0",
                path,
                TRAINING_STATE_NAME,
            )
            return
        saved = load_torch_state(state_file)
        if saved.get("format", 0) > TRAINING_STATE_FORMAT:
            raise CheckpointError(f"{state_file}: written by a newer forge; upgrade forge")
        if args.restore_optimizer_state and saved.get("optimizer") is not None:
            self._load_component("optimizer", self.optimizer, saved["optimizer"], state_file)
        if args.restore_scheduler_state and saved.get("lr_scheduler") is not None:
            self._load_component(
                "lr_scheduler", self.lr_scheduler, saved["lr_scheduler"], state_file
            )
        if self.scaler is not None and saved.get("scaler"):
            self.scaler.load_state_dict(saved["scaler"])
        state.global_step = int(saved["global_step"])
        state.epoch = float(saved["epoch"])
        state.load_state_dict(saved.get("trainer_state", {}))
        state.resumed_from = str(path)
        self.callback_handler.load_state_dict(saved.get("callbacks", {}))
        self._tally.load_state_dict(saved.get("log_tally", {}))
        metrics = read_manifest(path).metrics
        if metrics:
            self._last_eval = (state.global_step, dict(metrics))
        self._last_save_step = state.global_step
        self._restore_position(path, saved)

    def _load_component(self, name: str, target: Any, saved: Any, state_file: Path) -> None:
        try:
            target.load_state_dict(saved)
        except (ValueError, KeyError, RuntimeError, TypeError) as exc:
            raise CheckpointError(
                f"{state_file}: the saved {name} state does not fit this {name} ({exc}); "
                f"set {self.args.config_key}.restore_{name.removeprefix('lr_')}_state: false "
                "to start it fresh"
            ) from exc

    def _restore_position(self, path: Path, saved: dict[str, Any]) -> None:
        """Data position and random generators of this rank, the last things restored."""
        args = self.args
        position = saved.get("position") or {"epoch": int(saved["epoch"]), "batch": 0}
        self._position = Position(int(position["epoch"]), int(position["batch"]))
        rank_file = path / rank_state_name(self.env.rank)
        saved_world = int(saved.get("world_size", 1))
        if saved_world != self.env.world_size or not rank_file.exists():
            self._info(
                "%s was written by %d rank(s), this job has %d: per-rank random and data "
                "positions cannot be restored exactly; epoch %d restarts from its first batch",
                path.name,
                saved_world,
                self.env.world_size,
                self._position.epoch,
                level=logging.WARNING,
            )
            self._position.batch = 0
            return
        rank_state = load_torch_state(rank_file)
        if self._position.batch >= len(self.train_loader):
            # every batch of the epoch was taken (its loader may be finished, and a finished
            # loader's state would restart the epoch): the loop ends the epoch, then goes on
            self._resumed_batches = iter(())
        elif self._position.batch > 0 and args.restore_dataloader_state:
            if rank_state.get("dataloader") is None:
                raise CheckpointError(
                    f"{rank_file}: no data loader state (saved with save_dataloader_state: "
                    f"false); set {args.config_key}.restore_dataloader_state: false to restart "
                    "the epoch"
                )
            try:
                self.train_loader.load_state_dict(rank_state["dataloader"])
            except ValueError as exc:
                raise CheckpointError(f"{rank_file}: {exc}") from exc
            self.train_loader.set_epoch(self._position.epoch)
            # iter() draws a seed from the generators: do it before they are restored, as the
            # uninterrupted run did at the start of this epoch
            self._resumed_batches = iter(self.train_loader)
        else:
            self._position.batch = 0  # an epoch boundary: the loop starts the epoch afresh
        if args.restore_rng_state and rank_state.get("rng") is not None:
            restore_rng_state(rank_state["rng"])
