"""The checkpoint manager: everything a save involves, behind the few calls a training loop makes.

The loop calls ``save(step, ...)`` where it saves, ``poll(synced)`` at each step boundary,
``before_optimizer_step()`` before it changes the weights, ``wait()`` where it needs every save
in place (the end of training, a stop) and ``load(path)`` to resume. The manager owns the
rest: the registry of components, the snapshot (phase 1, every rank, in the training thread),
the commit (phase 2: files, hashes, fsync, manifest, rename; on a background thread with
``async_save``), the host staging and copy gate of an asynchronous save, the commit's own
process group, and what follows a commit (phase 3): the checkpoint becomes the last one (and
the best one when its metric improved), old checkpoints are rotated away (never the best), and
the owner is told (``on_commit``). A save that fails or is killed before its rename changes
none of these.

It knows no trainer: what it records of the best and last checkpoint goes into a ``record``
object (anything with ``last_checkpoint``, ``best_checkpoint`` and ``best_metric``
attributes, the trainer's state), and what the checkpoint being snapshotted records of itself
is ``recording``, which the owner's own component puts into its state.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from forge.checkpoint.background import BackgroundCommit
from forge.checkpoint.layout import (
    CheckpointManifest,
    best_checkpoints,
    checkpoint_name,
    rollback_anchors,
    rotate_checkpoints,
)
from forge.checkpoint.registry import CheckpointRegistry, CheckpointSnapshot, Component
from forge.checkpoint.snapshot import HostCopier, HostStaging, stepped_by
from forge.checkpoint.writer import DEFAULT_HASH, CheckpointWriter


class CheckpointRecord(Protocol):
    """What a run knows of its checkpoints (the trainer's state has these fields)."""

    last_checkpoint: str | None
    best_checkpoint: str | None
    best_metric: float | None


class BestRule:
    """Which metric makes a checkpoint the best, and in which direction (None: no best);
    ``keep``: how many of the best checkpoints rotation never deletes (``save_top_k``)."""

    def __init__(
        self, metric: str | None = None, greater_is_better: bool = False, keep: int = 1
    ) -> None:
        self.metric = metric
        self.greater_is_better = greater_is_better
        self.keep = keep

    def improves(self, value: float | None, best: float | None) -> bool:
        """Whether ``value`` beats ``best`` (a non-finite value never does)."""
        if value is None or not math.isfinite(value):
            return False
        return best is None or (value > best if self.greater_is_better else value < best)


class CheckpointManager:
    """Saves, finishes and restores one training job's checkpoints; see the module docstring.

    ``directory`` is the run's ``checkpoints/``; ``topology`` this rank's place in the job
    (rank, world size, stages). ``async_save``: commits run on a background thread, at most one
    in flight. ``device``: the training device (pinned staging buffers on CUDA, and the device
    the ranks agree on in a synchronous commit's meetings). ``optimizer``: what an asynchronous
    save's deferred copies wait for (the tensors its step changes in place).
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        topology: Any,
        record: CheckpointRecord,
        *,
        kind: str = "plain",
        hash_algorithm: str = DEFAULT_HASH,
        async_save: bool = False,
        save_total_limit: int | None = None,
        best: BestRule | None = None,
        device: Any = None,
        optimizer: Any = None,
        on_commit: Callable[[int, float | None, Path, dict[str, Any]], None] | None = None,
        anchor_before: int | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.topology = topology
        self.record = record
        self.kind = kind
        self.hash_algorithm = hash_algorithm
        self.async_save = async_save
        self.save_total_limit = save_total_limit
        self.best = best or BestRule()
        self.device = device
        self.optimizer = optimizer
        self.on_commit = on_commit
        #: a rollback may restore the newest checkpoint this many steps before the step it is
        #: asked at (forge/train/rollback.py): rotation keeps it (None: no rollbacks)
        self.anchor_before = anchor_before
        self.registry = CheckpointRegistry(topology)
        #: what the checkpoint being snapshotted records of itself (as the last checkpoint, and
        #: the best if it is); the live record takes it only once the checkpoint is committed
        self.recording: dict[str, Any] = {}
        self.last_step: int | None = None  # the step of the last checkpoint saved or loaded
        self._commits = BackgroundCommit()  # the commit in flight, if any
        self._copy_gate = HostCopier()  # the snapshot copies an async commit still has to make
        self._staging: HostStaging | None = None  # async on CUDA: reused pinned buffers
        # several ranks: a gloo group of the manager's own, for a background commit's meetings
        # and for agreeing to save after a failure (every rank creates it here, in one order)
        self._group: Any = None
        if async_save and getattr(device, "type", None) == "cuda":
            self._staging = HostStaging()
        if topology.distributed:
            import torch.distributed as dist

            if dist.is_initialized():
                self._group = dist.new_group(backend="gloo")

    # ------------------------------------------------------------------ components
    def register(self, component: Component) -> None:
        self.registry.register(component)

    @property
    def components(self) -> dict[str, Component]:
        return self.registry.components

    # ------------------------------------------------------------------ saving
    def save(self, step: int, *, epoch: float | None, metrics: dict[str, float]) -> Path:
        """Save ``step`` (every rank calls this): the snapshot now, the commit now or on the
        background thread, then what follows a commit. Returns where the checkpoint is, or will
        be once committed. A save first waits for the previous one, whose outcome (the last and
        best checkpoint) this one builds on; a second save of the same step returns the first."""
        self.wait()
        if self.last_step == step and self.record.last_checkpoint:
            return Path(self.record.last_checkpoint)  # already saved at this step
        final = self.directory / checkpoint_name(step)
        recorded = self._recorded_by(final, metrics)
        copier = self._host_copier()
        self.recording = recorded
        try:
            snapshot = self.registry.snapshot(step, copier)
        finally:
            self.recording = {}
        snapshot.epoch, snapshot.metrics = epoch, dict(metrics)
        snapshot.extra = self._best_entry(recorded)
        if not self.async_save:
            self.commit(snapshot)
            self._committed(snapshot, final, recorded)
            return final

        def commit() -> None:
            copier.copy_deferred()  # first, while the loop runs the next forward and backward
            self.commit(snapshot, any_failed=self._commit_any_failed)

        def then() -> None:  # back in the training thread (poll / wait)
            self._committed(snapshot, final, recorded)

        self._commits.submit(commit, checkpoint_name(step), then=then)
        self._copy_gate = copier  # the next optimizer step waits for the deferred copies
        return final

    def commit(
        self, snapshot: CheckpointSnapshot, any_failed: Callable[[bool], bool] | None = None
    ) -> Path:
        """Phase 2: write ``snapshot`` as a checkpoint (files, hashes, fsync, manifest, rename).

        It reads nothing of the live components but what a weights component writes beside
        the weights (the model's config, the tokenizer), so it may run outside the training
        thread. Its only collectives are the writer's three meetings (``any_failed``: after
        rank 0 creates the temporary directory, after every rank has written, after the
        rename); a background commit holds them over its own process group, so they never
        interleave with the training thread's collectives.
        """
        if any_failed is None and self.topology.distributed:
            any_failed = self._any_rank_failed
        with CheckpointWriter(
            self.directory,
            snapshot.step,
            rank=self.topology.rank,
            world_size=self.topology.world_size,
            any_failed=any_failed,
            trainer=self.kind,
            hash_algorithm=self.hash_algorithm,
        ) as writer:
            snapshot.write(writer)
        return writer.final_path

    def improves(self, value: float | None) -> bool:
        """Whether a metric ``value`` would make its checkpoint the best so far."""
        return self.best.improves(value, self.record.best_metric)

    def _recorded_by(self, checkpoint: Path, metrics: dict[str, float]) -> dict[str, Any]:
        """What saving ``checkpoint`` changes in the record: it becomes the last checkpoint,
        and the best one when ``metrics`` improve the best metric."""
        recorded: dict[str, Any] = {"last_checkpoint": str(checkpoint)}
        value = metrics.get(self.best.metric or "")
        if self.improves(value):
            recorded.update(best_metric=float(value), best_checkpoint=str(checkpoint))
        return recorded

    def _best_entry(self, recorded: dict[str, Any]) -> dict[str, Any]:
        """The manifest's ``best``: the run's best checkpoint once this one is committed (a
        sibling's name, the metric and its value), so that what reads a run can tell its best
        from the committed checkpoints alone, whatever the run's own record lags behind."""
        best = recorded.get("best_checkpoint", self.record.best_checkpoint)
        value = recorded.get("best_metric", self.record.best_metric)
        if not self.best.metric or best is None or value is None:
            return {}
        entry = {
            "checkpoint": Path(best).name,
            "metric": self.best.metric,
            "value": value,
            "greater_is_better": self.best.greater_is_better,
        }
        return {"best": entry}

    def _committed(
        self, snapshot: CheckpointSnapshot, final: Path, recorded: dict[str, Any]
    ) -> None:
        """Phase 3, every rank, after the rename: the record takes what the checkpoint
        recorded; rank 0 rotates old checkpoints (never the best ``keep`` ones); the owner is
        told."""
        for name, value in recorded.items():
            setattr(self.record, name, value)
        self.last_step = snapshot.step
        if self.topology.rank == 0 and self.save_total_limit:
            protect = self.kept_best() + self.kept_anchors(snapshot.step)
            rotate_checkpoints(self.directory, self.save_total_limit, protect=protect)
        if self.on_commit is not None:
            self.on_commit(snapshot.step, snapshot.epoch, final, snapshot.metrics)

    def kept_best(self) -> list[Path]:
        """The checkpoints rotation keeps for their metric: the best ``best.keep`` by the
        manifests' metrics, and the record's best checkpoint (one saved before metrics went
        into manifests)."""
        rule = self.best
        kept = best_checkpoints(self.directory, rule.metric, rule.greater_is_better, rule.keep)
        best = self.record.best_checkpoint
        return kept + ([Path(best)] if best else [])

    def kept_anchors(self, step: int) -> list[Path]:
        """The checkpoints a rollback asked at ``step`` or later may restore (the newest
        complete one at least ``anchor_before`` steps before ``step``, and every later one):
        rotation keeps each until a newer anchor is past the detection window."""
        if self.anchor_before is None:
            return []
        return rollback_anchors(self.directory, step, self.anchor_before)

    def _host_copier(self) -> HostCopier:
        """How a snapshot copies tensors (forge/checkpoint/snapshot.py). A synchronous commit
        ends before the next optimizer step: CPU state needs no copy. An asynchronous one must
        copy (the optimizer steps change parameters and moments in place before the commit
        ends), but those change only in the optimizer step: their copies run on the commit
        thread while the loop computes the next forward and backward, and the next optimizer
        step waits for them (``before_optimizer_step``)."""
        if not self.async_save:
            return HostCopier(copy_cpu=False)
        if self._staging is not None:
            self._staging.reuse()  # the previous commit is done: its buffers are free
        deferrable = stepped_by(self.optimizer) if self.optimizer is not None else None
        return HostCopier(staging=self._staging, deferrable=deferrable)

    # ------------------------------------------------------------------ the loop's boundaries
    def before_optimizer_step(self) -> None:
        """Wait for the copies a save still has to make of what the optimizer step changes."""
        self._copy_gate.wait_copied()

    def poll(self, synced: bool) -> None:
        """At a step boundary: finish a background commit that has ended (the last and best
        checkpoint, rotation, ``on_commit``), in the training thread. Every rank of a job does
        it at the same step, so the owner's callbacks act alike on all of them: at a step that
        has ``synced`` anyway, once all agree their commit ended (a collective, only while one
        is pending). A failed commit is raised at once, at any step."""
        commits = self._commits
        if not commits.pending:
            return
        if not self.topology.distributed:
            commits.poll()
            return
        commits.raise_if_failed()
        if synced and not self._agree_max(0.0 if commits.ended else 1.0):
            commits.wait()

    def raise_if_failed(self) -> None:
        """Raise the failure of a background commit that has ended (its success waits for
        ``poll``)."""
        self._commits.raise_if_failed()

    def wait(self) -> None:
        """Block until no commit is in flight; raise its failure, or finish it."""
        self._commits.wait()

    @property
    def in_flight(self) -> bool:
        return self._commits.in_flight

    def failure(self) -> BaseException | None:
        """Wait for the commit in flight and return its failure (once) instead of raising it:
        the cause to report when the training thread failed too."""
        return self._commits.failure()

    def finish_quietly(self) -> None:
        """On the way out of a failed run: let the commit in flight finish, logging its
        failure (the run's own error is the one reported)."""
        self._commits.wait_quietly()

    # ------------------------------------------------------------------ restoring
    def load(self, path: str | os.PathLike) -> CheckpointManifest:
        """Restore every component from a validated checkpoint, in registration order (random
        generators last)."""
        manifest = self.registry.load(path)
        self.last_step = manifest.step
        return manifest

    # ------------------------------------------------------------------ the ranks' meetings
    def _agree_max(self, value: float) -> float:
        """The largest ``value`` over the ranks, on the training device."""
        import torch
        import torch.distributed as dist

        if not self.topology.distributed or not dist.is_initialized():
            return value
        flag = torch.tensor([float(value)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return float(flag.item())

    def _any_rank_failed(self, failed: bool) -> bool:
        return bool(self._agree_max(1.0 if failed else 0.0))

    def _commit_any_failed(self, failed: bool) -> bool:
        """A background commit's meeting: over the manager's gloo group, on host tensors."""
        if self._group is None:
            return failed
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1.0 if failed else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return bool(flag.item())

    def every_rank_agrees(self, timeout_s: float = 60.0) -> bool:
        """Whether every rank of the job reaches this call within ``timeout_s`` (one process:
        at once): before a save after a failure, which every rank takes part in, or none."""
        if self._group is None:
            return True
        import datetime

        import torch
        import torch.distributed as dist

        # an all-reduce that gives up: a rank that went on training never joins it
        work = dist.all_reduce(torch.ones(1), group=self._group, async_op=True)
        try:
            work.wait(timeout=datetime.timedelta(seconds=timeout_s))
        except RuntimeError:
            return False
        return True
