"""How a trainer sets up what its loop runs: the model-transform stage, the loaders, the
checkpoint state and the resume.

``TrainerSetup`` is the part of the trainer (forge/train/loop.py) that ``train()`` calls
before its first step:

- the model-transform stage (``transform_model``): build (``model_init`` after seeding; a
  pipeline stage builds only its part) -> the model's settings -> the adapter step (peft LoRA:
  forge/train/lora.py) -> placement on the device -> activation checkpointing ->
  ``torch.compile`` -> the strategy's parallel wrap (``parallelize``); each step is a method a
  subclass may override, and forge/train/transforms.py has the steps themselves;
- what the model brings (``trainer_parts``: forge/train/model_parts.py): its own optimizer and
  schedule where the trainer is given neither, and callbacks for this ``train()``;
- the optimizer (through the strategy) and the learning-rate schedule;
- this rank's loaders (forge/data/trainer_loaders.py);
- the checkpoint manager and what a checkpoint holds (``register_components``): model,
  optimizer, scheduler, scaler, the loop's counters, the callbacks' state, what the transform
  stage and the callbacks register (``on_register``), data position and random generators;
- the resume: the checkpoint found and validated on rank 0, every component restored;
- after a failure between two steps, the last completed step saved (``_keep_trained_steps``).
"""

from __future__ import annotations

import functools
import gc
import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from forge.checkpoint import (
    Checkpoint,
    CheckpointError,
    Component,
    RngState,
    Scope,
    resume_checkpoint,
    unwrap_model,
)
from forge.checkpoint.manager import BestRule, CheckpointManager
from forge.data import trainer_loaders
from forge.data.collator import ItemsBatch
from forge.data.columns import ModelInputs
from forge.data.length_grouping import LengthError, item_lengths
from forge.data.streams import is_stream
from forge.train import dist
from forge.train.args import TrainingArgumentsError
from forge.train.callbacks import TrainerControl, TrainerState
from forge.train.data_position import DataPosition, StepBatch
from forge.train.loop_state import Batch, StopVote, Tally
from forge.train.loss import resolve_label_names
from forge.train.model_parts import ModelParts, TrainingPlan, offered_parts
from forge.train.optim import build_optimizer, build_scheduler, set_seed
from forge.train.packing import packing_refusal, packs_sequences
from forge.train.plain_models import not_a_dict_batch
from forge.train.precision import device_problems
from forge.train.rollback import rollback_anchor_before
from forge.train.runtime import Intervals, apply_runtime_settings
from forge.train.stream_position import StreamPosition
from forge.train.transforms import apply_activation_checkpointing, apply_model_settings
from forge.wrappers import class_label

logger = logging.getLogger(__name__)


class TrainerSetup:
    """What ``train()`` builds before its first step; see the module docstring."""

    # ------------------------------------------------------------------ setup
    def _resolve_device(self) -> torch.device:
        """This rank's device, checked against the launcher's LOCAL_RANK and against the
        precision ``args`` ask for, so a mismatch fails here rather than at the first step."""
        args, topology = self.args, self.topology
        try:
            device = dist.resolve_device(args.device, topology.local_rank, topology.world_size)
        except ValueError as exc:
            raise TrainingArgumentsError([f"{args.config_key}.device {exc}"]) from None
        problems = device_problems(args, device)
        if problems:
            raise TrainingArgumentsError(problems)
        return device

    def _setup_training(self) -> None:
        args = self.args
        apply_runtime_settings(args, self.topology.is_main)
        set_seed(args.seed)
        self.checkpoints, self._pending_components = None, []
        self.wrapped_model = self.transform_model()
        self._check_packing()
        if self.topology.distributed:
            set_seed(args.seed + self.topology.rank)  # same weights, each rank its own dropout
        self.setup_optimization()
        self.state = TrainerState(
            max_steps=self.max_steps,
            num_train_epochs=self.num_epochs,
            is_world_process_zero=self.is_main_process,
        )
        self.control = TrainerControl()
        if getattr(self.train_loader, "is_stream", False):
            self.data_position = StreamPosition(
                self.train_loader,
                is_main=self.is_main_process,
                fix=f"set {args.config_key}.ignore_data_skip: true to start the stream again",
                on_saved=functools.partial(setattr, self.state, "stream_position"),
            )
        else:
            per_device = None if args.max_tokens_per_batch else self.train_loader.batch_size
            self.data_position = DataPosition(
                self.train_loader,
                is_main=self.is_main_process,
                step_batch=StepBatch(
                    per_device, args.gradient_accumulation_steps, self.topology.dp_size
                ),
                key=args.config_key,
            )
        self._tally = Tally()
        self._last_eval = (None, {})
        self._stop_vote, self._stop_agreed = StopVote(), 0
        self._step_open, self._start_step = False, 0
        self._run_tally, self._loss_before = None, (0.0, 0)  # the run's loss (_run_loss)
        self.build_checkpoint_manager()

    def setup_optimization(self) -> None:
        """The training loader, the run's length in steps and epochs, and the optimizer and
        learning-rate schedule over them (the model's own, e.g. ``configure_optimizers``)."""
        args = self.args
        self.train_loader = self.build_train_loader()
        streams = getattr(self.train_loader, "is_stream", False)
        if streams:  # no length: max_steps ends training (build_train_loader checked it is set)
            self.max_steps, self.num_epochs = args.max_steps, math.ceil(args.num_train_epochs)
        elif args.max_steps > 0:
            steps_per_epoch = math.ceil(len(self.train_loader) / args.gradient_accumulation_steps)
            self.max_steps = args.max_steps
            self.num_epochs = math.ceil(args.max_steps / steps_per_epoch)
        else:
            steps_per_epoch = math.ceil(len(self.train_loader) / args.gradient_accumulation_steps)
            self.max_steps = math.ceil(args.num_train_epochs * steps_per_epoch)
            self.num_epochs = math.ceil(args.num_train_epochs)
        self._every = Intervals.of(args, self.max_steps)
        self.model_parts = self.adopt_model_parts()
        self.setup_optimizer()
        self.lr_scheduler = build_scheduler(
            self.model_parts.lr_scheduler, self.optimizer, args, self.max_steps
        )

    def _check_packing(self) -> None:
        """A collator known to pack sequences (forge/train/packing.py) with a model or trainer
        that would let them attend to each other: refused before the first step. (Other
        collators' packed batches are checked by the sanity pass, on the first batch.)"""
        if not packs_sequences(self.data_collator):
            return
        refusal = packing_refusal(
            self.wrapped_model,
            use_cache=self.args.use_cache,
            trainer_reason=getattr(self, "refuses_packed_batches", None),
        )
        if refusal:
            message, fix = refusal
            raise ValueError(f"trainer.data_collator packs sequences, and {message}; {fix}")

    def adopt_model_parts(self) -> ModelParts:
        """What the model offers (``trainer_parts``, forge/train/model_parts.py), as this
        ``train()`` uses it: the model's optimizer and schedule unless the trainer was given
        either of its own (then the trainer's, and a warning), the model's callbacks in place of
        those a previous ``train()`` added."""
        stream = getattr(self.train_loader, "is_stream", False)
        plan = TrainingPlan(
            max_steps=self.max_steps,
            num_epochs=self.num_epochs,
            batches_per_epoch=0 if stream else len(self.train_loader),  # 0: not known
            gradient_accumulation_steps=self.args.gradient_accumulation_steps,
            topology=self.topology,
        )
        parts = offered_parts(self.model, plan)
        offers = parts.optimizer is not None or parts.lr_scheduler is not None
        given = self.optimizer_factory is not None or self.lr_scheduler_factory is not None
        if offers and given:
            self._warn(
                "the trainer's optimizer / lr_scheduler are given, so those of %s are not used",
                parts.source,
            )
        elif offers:
            self._info(
                "optimizer and learning-rate schedule from %s (%s.learning_rate, "
                "lr_scheduler_type and warmup are not used)",
                parts.source,
                self.args.config_key,
            )
        if given or not offers:
            parts.optimizer, parts.lr_scheduler = self.optimizer_factory, self.lr_scheduler_factory
        for callback in self.model_parts.callbacks:  # a previous train()'s model
            self.callback_handler.remove(callback)
        for callback in parts.callbacks:
            self.callback_handler.add(callback)
        return parts

    def setup_optimizer(self) -> None:
        """The optimizer over the model's parameters (through the strategy), and its grad
        scaler; the learning-rate schedule is built by the loop afterwards, on ``optimizer``."""
        optimizer = build_optimizer(self.model_parts.optimizer, self.model, self.args)
        self.optimizer = self.strategy.prepare_optimizer(optimizer)
        self.scaler = self.strategy.scaler

    # ------------------------------------------------------------------ the model-transform stage
    def transform_model(self) -> nn.Module:
        """Everything that happens to the model between "built" and "trained", in this order
        (forge/train/transforms.py): build (``build_model``, just after seeding) -> the model's
        settings (``use_cache``, loss type) -> adapters (``apply_adapters``) -> placement on the
        device -> activation checkpointing -> ``torch.compile`` -> the strategy's parallel wrap
        (``parallelize``).

        Sets ``model`` (the module checkpoints hold and the optimizer steps) and returns what
        the training step calls.
        """
        args = self.args
        model = self.build_model()
        apply_model_settings(model, args)
        model = self.apply_adapters(model)
        model.to(self.device)
        self.model = model
        scope = self.strategy.activation_checkpointing_scope()
        done = apply_activation_checkpointing(model, args, **scope)
        if done:
            self._info("%s", done)
        compiled = self.compile_model(model) if args.torch_compile else None
        self._eval_model = compiled
        return self.parallelize(model if compiled is None else compiled)

    def build_model(self) -> nn.Module:
        """This rank's model: ``model_init()``, called just after seeding, or the module the
        trainer was given (a pipeline stage builds only its own part), with its generation
        settings (``generation_config``)."""
        model = self.strategy.build_model(self.model, self._call_model_init)
        self.prepare_generation(model)
        return model

    def _call_model_init(self) -> nn.Module:
        model = self.model_init()
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"trainer.model built a {class_label(model)}, not an nn.Module; pass a module "
                "or a callable (e.g. !partial) that returns one"
            )
        return model

    def apply_adapters(self, model: nn.Module) -> nn.Module:
        """The adapter step (``peft_config``: the model wrapped by peft, its base frozen,
        forge/train/lora.py), else the model as built. In ``train()`` the run records its
        frozen base first (once; a resume checks it is unchanged)."""
        if self.adapter is None:
            return model
        record_in = self.args.output_dir if self._in_train else None
        return self.adapter.apply(model, record_in=record_in, topology=self.topology)

    def compile_model(self, model: nn.Module) -> nn.Module:
        """``torch.compile`` with ``torch_compile_backend`` / ``torch_compile_mode``."""
        args = self.args
        return torch.compile(
            model, backend=args.torch_compile_backend or "inductor", mode=args.torch_compile_mode
        )

    def parallelize(self, model: nn.Module) -> nn.Module:
        """The strategy's parallel wrap, the transform stage's last step: what the training step
        calls (``model``, compiled when ``torch_compile`` is on)."""
        compiled = model if model is not self.model else None
        return self.strategy.parallelize(self.model, compiled)

    def evaluation_model(self) -> nn.Module:
        """What evaluation calls: the model, compiled when ``torch_compile`` is on.

        Not the parallel wrapper: evaluation needs no gradient synchronisation. In ``train()``
        it is the module the transform stage compiled (the one the wrapper calls).
        """
        if not self.args.torch_compile:
            return self.model
        if self._eval_model is None:  # outside train()
            self._eval_model = self.compile_model(self.model)
        return self._eval_model

    def release_wrappers(self) -> None:
        """Drop the training wrappers at the end of ``train()``.

        A DDP wrapper holds the process group; freed later (at interpreter exit) the group's
        destructor can deadlock with its worker thread, so it goes while the group is alive.
        """
        self.strategy.release()
        self.wrapped_model = self._eval_model = None
        if self.topology.distributed:
            gc.collect()  # wrappers sit in reference cycles (hooks)

    # ------------------------------------------------------------------ data
    def build_train_loader(self) -> Any:
        """This data-parallel rank's resumable loader over the training dataset (batches
        grouped by length or by a token budget where the arguments ask for it)."""
        args = self.args
        batch = self.strategy.per_rank_batch_size("per_device_train_batch_size")
        option = "max_tokens_per_batch" if args.max_tokens_per_batch else "train_sampling_strategy"
        if is_stream(self.train_dataset):
            self._check_stream_arguments()
        try:
            loader = trainer_loaders.build_train_loader(
                self.train_dataset,
                self.data_collator,
                batch_size=batch,
                seed=args.seed if args.data_seed is None else args.data_seed,
                rank=self.topology.dp_rank,
                world_size=self.topology.dp_size,
                shuffle=args.train_sampling_strategy == "random",
                drop_last=args.dataloader_drop_last,
                workers=self._worker_settings(),
                inputs=self._model_inputs(),
                lengths=self._train_lengths(),
                group_size=batch * args.gradient_accumulation_steps * self.topology.dp_size,
                max_tokens=args.max_tokens_per_batch,
                stream_shuffle_buffer=args.stream_shuffle_buffer,
                # auto_find_batch_size: its pieces are collated anew from a batch's items
                keep_items=bool(args.auto_find_batch_size),
            )
        except LengthError as exc:
            raise TrainingArgumentsError([f"{args.config_key}.{option}: {exc}"]) from None
        if args.auto_find_batch_size and not getattr(loader, "is_stream", False):
            # a piece of a batch is collated from its items (a stream's batches are cut)
            collate = loader.collate_fn.collate
            self.micro_batches.collate = lambda items: self._to_device(collate(items))
        return loader

    def _check_stream_arguments(self) -> None:
        """A training stream has no length: ``max_steps`` says when training ends (as in HF's
        Trainer), and batches cannot be grouped by the lengths of items not yet read."""
        args, key = self.args, self.args.config_key
        problems = []
        if args.max_steps <= 0:
            problems.append(
                f"{key}.max_steps must be set when the training dataset is a stream "
                f"({type(self.train_dataset).__name__} has no length, so num_train_epochs "
                "cannot say how many steps an epoch is); set max_steps: N"
            )
        if args.train_sampling_strategy == "group_by_length" or args.max_tokens_per_batch:
            option = (
                "max_tokens_per_batch" if args.max_tokens_per_batch else "train_sampling_strategy"
            )
            problems.append(
                f"{key}.{option} groups batches by the lengths of all items, which a stream "
                'does not know in advance; use train_sampling_strategy: "random" (the stream is '
                "shuffled through stream_shuffle_buffer)"
            )
        if problems:
            raise TrainingArgumentsError(problems)

    def _train_lengths(self) -> list[int] | None:
        """Each training item's length where batches are grouped by it (else None)."""
        args = self.args
        if args.train_sampling_strategy != "group_by_length" and not args.max_tokens_per_batch:
            return None
        return item_lengths(self.train_dataset, args.length_column_name)

    def build_eval_loader(self, dataset: Dataset | None = None, description: str = "eval") -> Any:
        """This rank's share of ``dataset`` (default: the eval dataset), in order: items
        ``rank, rank + world_size, ...``, each item once."""
        batch = self.strategy.per_rank_batch_size("per_device_eval_batch_size")
        limit = self.args.max_eval_batches
        return trainer_loaders.build_eval_loader(
            self.eval_dataset if dataset is None else dataset,
            self.data_collator,
            # auto_find_batch_size's, after out of memory; the limit counts configured batches
            batch_size=self.eval_batch_size or batch,
            max_items=None if limit is None else limit * batch * self.topology.dp_size,
            rank=self.topology.dp_rank,
            world_size=self.topology.dp_size,
            workers=self._worker_settings(),
            inputs=self._model_inputs(),
            description=description,
            seed=self.args.seed if self.args.data_seed is None else self.args.data_seed,
        )

    def _worker_settings(self) -> dict[str, Any]:
        args = self.args
        return trainer_loaders.worker_settings(
            num_workers=args.dataloader_num_workers,
            pin_memory=args.dataloader_pin_memory and self.device.type == "cuda",
            persistent_workers=args.dataloader_persistent_workers,
            prefetch_factor=args.dataloader_prefetch_factor,
            multiprocessing_context=args.dataloader_multiprocessing_context,
        )

    def _model_inputs(self) -> ModelInputs | None:
        """What ``remove_unused_columns`` keeps (None: keep every column, also for a model
        that hands its step the batch whole: ``takes_whole_batch``, as LightningAdapter)."""
        if not self.args.remove_unused_columns or getattr(self.model, "takes_whole_batch", False):
            return None
        return ModelInputs.of(unwrap_model(self.model, through_adapters=True), self.label_names)

    @property
    def label_names(self) -> list[str]:
        """``args.label_names``, else the model's ``forward`` parameters named like labels;
        with ``compute_loss_func`` and none of those, ``labels`` (what the function gets)."""
        return resolve_label_names(
            self.args.label_names, self.model, self.compute_loss_func is not None
        )

    def _to_device(self, batch: Batch) -> Batch:
        if not isinstance(batch, Mapping):
            raise TypeError(not_a_dict_batch(batch, self.model))
        moved = {
            k: v.to(self.device, non_blocking=True) if isinstance(v, torch.Tensor) else v
            for k, v in batch.items()
        }
        return ItemsBatch(moved, batch.source_items) if isinstance(batch, ItemsBatch) else moved

    # ------------------------------------------------------------------ checkpoints
    def register(self, component: Component) -> None:
        """Add a checkpoint component: the one way trainers (``register_components``),
        callbacks (``on_register``) and model transforms add state to every checkpoint. It is
        saved and restored in registration order, random generators last.

        The model-transform stage runs before the optimizer exists: what it registers joins
        the checkpoints when ``train()`` builds them, after the model and optimizer."""
        if self.checkpoints is None:
            self._pending_components.append(component)
        else:
            self.checkpoints.register(component)

    def build_checkpoint_manager(self) -> CheckpointManager:
        """This run's checkpoint manager with this trainer's components (``train()`` builds it
        once, after the model, optimizer and scheduler, before a checkpoint is loaded)."""
        args = self.args
        self.checkpoints = CheckpointManager(
            self.checkpoints_dir,
            self.topology,
            self.state,
            kind=self.trainer_kind,
            hash_algorithm=args.checkpoint_hash,
            async_save=args.async_save,
            save_total_limit=args.save_total_limit,
            best=BestRule(args.metric_for_best_model, args.greater_is_better, args.save_top_k),
            device=self.device,
            optimizer=self.optimizer,
            on_commit=self._on_saved,
            anchor_before=rollback_anchor_before(self.callback_handler.callbacks),
        )
        self.register_components()
        registered = [c.obj for c in self.checkpoints.components.values()]
        self.callback_handler.keep_apart(registered)
        listeners = [
            obj.on_optimizer_step
            for obj in registered
            if callable(getattr(obj, "on_optimizer_step", None))
            and not any(obj is cb for cb in self.callback_handler.callbacks)  # called as one
        ]
        if self.callback_handler.listens("on_optimizer_step"):
            listeners.append(functools.partial(self._call, "on_optimizer_step"))
        self._step_listeners = listeners
        return self.checkpoints

    def register_components(self) -> None:
        """Register what a checkpoint of this trainer holds: model, optimizer, scheduler,
        scaler, the loop's counters, the callbacks' shared state, what the model-transform
        stage and the callbacks (``on_register``) register, data position and random
        generators.

        Override ``model_component`` / ``optimizer_component`` to change how the weights or
        the optimizer are saved; override this (call super(), then ``self.register``) to add a
        part.
        """
        args, key = self.args, self.args.config_key
        self.register(self.model_component())
        self.register(self.optimizer_component())
        self.register(
            Component(
                "lr_scheduler",
                self.lr_scheduler,
                save=args.save_scheduler_state,
                restore=args.restore_scheduler_state,
                fix=_start_fresh(key, "restore_scheduler_state"),
            )
        )
        if self.scaler is not None:
            self.register(Component("scaler", self.scaler, required=False))
        self.register(Component("trainer", self))
        self.register(Component("callbacks", self.callback_handler))
        early, self._pending_components = self._pending_components, []
        for component in early:  # the model-transform stage's
            self.register(component)
        self._call("on_register", register=self.register, topology=self.topology)
        data = self.data_position
        self.register(
            Component(
                "data",
                data,
                Scope.RANK,
                save=args.save_dataloader_state,
                restore=args.restore_dataloader_state,
                fix=f"set {key}.restore_dataloader_state: false to restart the epoch",
                # a position (map-style or a stream's) deals the rest of its epoch to the new
                # ranks, or refuses where that cannot be exact
                reshape=getattr(data, "reshape", None),
                on_reshape=getattr(data, "on_reshape", None),
            )
        )
        self.register(
            Component(
                "rng",
                RngState(self.device),
                Scope.RANK,
                save=args.save_rng_state,
                restore=args.restore_rng_state,
                restore_last=True,
                fix=_start_fresh(key, "restore_rng_state"),
                on_reshape=lambda _: None,  # each rank's generators as a new job seeds them
            )
        )

    def model_component(self) -> Component:
        """The model's weights (stage-scoped, written as safetensors), as the strategy saves
        them; of an adapted model only the adapter (forge/checkpoint/adapter.py)."""
        base = self.adapter.base if self.adapter is not None else None
        return self.strategy.model_component(self.model, self.tokenizer, base)

    def optimizer_component(self) -> Component:
        """The optimizer's state, keyed by parameter name (stage-scoped or sharded)."""
        return self.strategy.optimizer_component(self.model, self.optimizer)

    def load_weights(self, checkpoint: str | os.PathLike) -> None:
        """Load a checkpoint's model weights, building the model first (``model_init``,
        seeded) if need be: the model ``evaluate()`` / ``predict()`` then use, or the best one
        at the end of training. A pipeline stage builds and loads only its own part."""
        if self.model is None:
            set_seed(self.args.seed)
            self.model = self.build_model()
        if self.adapter is not None and not self.adapter.applied_to(self.model):
            self.model = self.apply_adapters(self.model)  # its checkpoints hold the adapter
        self.strategy.load_weights(self.model, Path(checkpoint))

    def _resolve_checkpoint(
        self, resume: bool | str | os.PathLike | Checkpoint | None
    ) -> Checkpoint | None:
        """The checkpoint to resume from, found (and validated, once) on rank 0 and shared
        with every rank."""
        if resume is False or resume is None:
            return None
        found, error = None, None
        if self.is_main_process:
            try:
                found = resume_checkpoint(resume, self.args.output_dir)
            except CheckpointError as exc:
                error = str(exc)
        found, error = dist.broadcast_object((found, error))
        if error is not None:
            raise CheckpointError(error)
        return found

    def _load_checkpoint(self, path: Path) -> None:
        """Restore every component; the random generators go last, so nothing draws from
        them between the restore and the first resumed step."""
        manifest = self.checkpoints.load(path)
        state = self.state
        state.resumed_from = str(path)
        if manifest.metrics:
            self._last_eval = (state.global_step, dict(manifest.metrics))
        self.data_position.restart_epoch_unless_restored()

    def _keep_trained_steps(self) -> None:
        """After a failure, as Lightning's ``OnExceptionCheckpoint``: when it came between two
        optimizer steps (an evaluation, the metrics, a callback, logging), the last step is
        complete, so it is saved (unless a checkpoint holds it) and ``forge resume`` continues
        from it. A failure inside a step (forward, backward, the optimizer step, a callback of
        ``on_optimizer_step``) may have left the weights half-updated: nothing is saved. Every
        rank of a job takes part in the save, or none does."""
        step, manager = self.state.global_step, self.checkpoints
        if manager is None or step <= self._start_step or manager.last_step == step:
            return  # nothing trained since the newest checkpoint
        if self._step_open:
            why = f"step {step + 1} failed inside its forward, backward or optimizer step"
        elif not manager.every_rank_agrees():
            why = f"another rank did not stop after step {step} with this one"
        else:
            try:
                path = self.save_checkpoint()
                manager.wait()
            except Exception as exc:  # the run's own failure is the one reported
                self._info("saving step %d after the failure failed: %s", step, exc)
                return
            self._info(
                "the run failed after step %d, which completed: %s holds it; `forge resume` "
                "continues from there",
                step,
                path,
                level=logging.WARNING,
            )
            return
        rank = f"rank {self.topology.rank}: " if self.topology.distributed else ""
        newest = f"step {manager.last_step}" if manager.last_step is not None else "none"
        logger.warning("%s%s: no checkpoint was saved for it (newest: %s)", rank, why, newest)

    def _log_start(self) -> None:
        args, state = self.args, self.state
        batch = self.strategy.per_rank_batch_size("per_device_train_batch_size")
        if args.skip_nonfinite and self._device_skippable_optimizer() is None:
            # the host waits for the device only where the device runs ahead of it: on the
            # CPU the wait costs nothing, so the line is for whoever debugs the loop
            self._info(
                "skip_nonfinite with %s%s: each step waits for its gradients on the host to "
                "decide the skip; a fused optimizer (the default AdamW, or fused=True) decides "
                "on the device",
                type(self.strategy.inner_optimizer(self.optimizer)).__name__,
                " and a grad scaler" if self.scaler is not None else "",
                level=logging.DEBUG if self.device.type == "cpu" else logging.INFO,
            )
        position = self.data_position
        if isinstance(position, StreamPosition):
            self._info(
                "training for %d steps on a stream (%s); batch %d x accumulation %d x "
                "data-parallel %d = %d items per step",
                self.max_steps,
                position.describe(),
                batch,
                args.gradient_accumulation_steps,
                self.topology.dp_size,
                batch * args.gradient_accumulation_steps * self.topology.dp_size,
            )
        elif args.max_tokens_per_batch:
            self._info(
                "training for %d steps (%d epochs of %d batches per rank); batches of at most "
                "%d padded tokens x accumulation %d x data-parallel %d per step",
                self.max_steps,
                self.num_epochs,
                len(self.train_loader),
                args.max_tokens_per_batch,
                args.gradient_accumulation_steps,
                self.topology.dp_size,
            )
        else:
            self._info(
                "training for %d steps (%d epochs of %d batches per rank); batch %d x "
                "accumulation %d x data-parallel %d = %d sequences per step",
                self.max_steps,
                self.num_epochs,
                len(self.train_loader),
                batch,
                args.gradient_accumulation_steps,
                self.topology.dp_size,
                batch * args.gradient_accumulation_steps * self.topology.dp_size,
            )
        if state.resumed_from:
            self._info("resumed from %s at step %d", state.resumed_from, state.global_step)


def _start_fresh(key: str, flag: str) -> str:
    return f"set {key}.{flag}: false to start it fresh"
