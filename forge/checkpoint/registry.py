"""Named checkpoint components with scopes: what a checkpoint holds and who writes it.

A trainer registers components (objects with ``state_dict()`` / ``load_state_dict()``), each
with a scope (DESIGN.md, "Checkpoint state"):

======= ======================================= =================================
scope   written by                              file
======= ======================================= =================================
shared  rank 0                                  ``NAME.pt``
stage   data-parallel rank 0 of each stage      ``NAME.pt`` (one stage) or ``NAME-stage-K-of-N.pt``
sharded every rank, its own shard (FSDP2)       ``NAME-shard-RRRRR-of-WWWWW.pt``
rank    every rank                              ``NAME-rank-RRRRR.pt``
======= ======================================= =================================

Model weights are the one component written as Hugging Face safetensors
(``model.safetensors``, ``model-stage-K-of-N.safetensors`` with an index, or one
``model-shard-RRRRR-of-WWWWW.safetensors`` per rank when sharded).

Saving has two phases. ``snapshot``: every rank calls every component's ``state_dict()`` in
registration order (so collective state-dict calls under FSDP / DeepSpeed / Accelerate line up
across ranks) and copies what it owns to host memory, writing nothing. ``CheckpointSnapshot.
write`` (inside a ``CheckpointWriter``, the commit): each owner writes its files from the copy. Each torch file carries a header naming the component, scope, step, rank and
stage that wrote it, checked on load, so a file from another rank, stage or step is reported by
name instead of being restored silently. The manifest records the job's topology and every
component with its scope and files.

Loading runs in registration order, components marked ``restore_last`` (random generators) at
the end. A stage-scoped component saved with another number of stages is resharded (its shards
are keyed by parameter name and merged). A rank-scoped one follows the data-parallel replica:
it maps when the saved job had the same data-parallel size, whatever its pipeline split (see
``saved_rank_for``); saved by another data-parallel size it goes to the component's
``reshape`` handler (with every saved rank's state) or ``on_reshape`` handler, or fails naming
the component and what to do.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from forge.checkpoint.io import HEADER_KEY, CheckpointError, load_torch_state
from forge.checkpoint.layout import (
    FORMAT_VERSION,
    CheckpointManifest,
    component_file,
    component_file_names,
    read_manifest,
    shard_weights_name,
    stage_weights_name,
)
from forge.checkpoint.sharded import merge_sharded
from forge.checkpoint.snapshot import HostCopier, host_copy

logger = logging.getLogger(__name__)


class Scope(str, Enum):
    SHARED = "shared"
    STAGE = "stage"
    SHARDED = "sharded"
    RANK = "rank"


#: scopes whose state is keyed by parameter name, so either loads what the other saved
_BY_NAME = {"stage", "sharded"}


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


class WeightsStateful(Stateful, Protocol):
    """A model-weights component: written as safetensors, loaded from a checkpoint directory."""

    def write(self, writer: Any, state: Any, stage_file: str | None) -> None:
        """Write ``state`` (the host copy ``snapshot`` took of ``state_dict()``) on the owning
        rank: the whole model (``stage_file`` None) or one stage's safetensors shard."""

    def load_checkpoint(self, checkpoint: Path, manifest: CheckpointManifest) -> None: ...


class TopologyView(Protocol):
    """What the registry reads of ``forge.train.topology.Topology``."""

    rank: int
    world_size: int
    num_stages: int

    @property
    def stage(self) -> int: ...

    @property
    def dp_rank(self) -> int: ...

    @property
    def dp_size(self) -> int: ...

    def to_dict(self) -> dict[str, Any]: ...


def merge_shards(shards: list[Any]) -> Any:
    """Default resharding of a stage-scoped dict keyed by parameter name: the union."""
    merged: dict[str, Any] = {}
    for shard in shards:
        merged.update(shard)
    return merged


@dataclass
class Component:
    """One named part of a checkpoint.

    ``required``: a checkpoint without it cannot resume this job (else a warning, and the
    component starts fresh). ``fix`` completes the error message when it cannot be restored
    (e.g. "set trainer.args.restore_optimizer_state: false to start it fresh").
    ``on_reshape`` (rank scope): called with a description instead of loading when the
    checkpoint was written by another number of ranks; without it that is an error.
    ``reshape`` (rank scope): as ``on_reshape``, but given every saved rank's state too (in
    saved rank order), for state that can be dealt to another number of ranks (the data
    position); it takes the place of ``on_reshape``.
    ``reshard`` (stage scope): merges the shards of another split (default: dict union).
    ``on_absent``: called, at the component's place in the load order, when a checkpoint
    without it is restored (after the warning that it starts fresh).
    ``save`` / ``restore`` False leave the component out of checkpoints / out of a resume.
    """

    name: str
    obj: Stateful
    scope: Scope = Scope.SHARED
    weights: bool = False
    save: bool = True
    restore: bool = True
    required: bool = True
    restore_last: bool = False
    fix: str = ""
    on_reshape: Callable[[str], None] | None = None
    reshape: Callable[[str, list[Any]], None] | None = None
    reshard: Callable[[list[Any]], Any] | None = merge_shards
    on_absent: Callable[[], None] | None = None

    def __post_init__(self) -> None:
        self.scope = Scope(self.scope)
        if not self.name.replace("_", "").isalnum():
            raise ValueError(f"component name {self.name!r} must be letters, digits and _")
        if self.weights and self.scope is Scope.RANK:
            raise ValueError(f"component {self.name!r}: weights are shared or stage-scoped")


def owns(component: Component, topology: TopologyView) -> bool:
    """Whether this rank writes the component's file."""
    if component.scope is Scope.SHARED:
        return topology.rank == 0
    if component.scope is Scope.STAGE:
        return topology.dp_rank == 0
    return True  # sharded, rank: every rank writes its own


def own_file(component: Component, topology: TopologyView) -> str:
    """The torch file this rank writes / reads for a component."""
    return component_file(
        component.name,
        component.scope.value,
        rank=topology.rank,
        stage=topology.stage,
        num_stages=topology.num_stages,
        world_size=topology.world_size,
    )


def saved_dp_size(saved: dict[str, Any]) -> int:
    """The data-parallel size of a manifest's topology (older manifests: world / stages)."""
    world, stages = int(saved.get("world_size", 1)), int(saved.get("num_stages", 1))
    return int(saved.get("dp_size", world // max(stages, 1)))


def saved_rank_for(topology: TopologyView, saved: dict[str, Any]) -> int | None:
    """The rank of a saved job whose per-rank state this rank takes over, or None when it
    does not map.

    Per-rank state (data position, random generators) follows the data-parallel replica, not
    the process: it maps when both jobs have the same data-parallel size, whatever their
    pipeline split. With the same split a rank takes its own file; with another, the file of
    its replica's rank at its own stage, or at stage 0 where the saved job had fewer stages
    (every stage of a replica reads the same batches).
    """
    if saved_dp_size(saved) != topology.dp_size:
        return None
    saved_stages = int(saved.get("num_stages", 1))
    stage = topology.stage if topology.stage < saved_stages else 0
    return topology.dp_rank * saved_stages + stage


@dataclass
class CheckpointSnapshot:
    """One rank's part of a checkpoint, in host memory: all that its commit writes.

    ``owned``: (component, host copy of its state) for every component this rank writes, in
    registration order; ``saved``: every component the checkpoint holds (rank 0 lists them in
    the manifest). ``epoch``, ``metrics`` and ``extra`` go into the manifest. ``write`` reads
    nothing of the live components' state, so training may go on while it runs.
    """

    step: int
    topology: TopologyView
    saved: list[Component]
    owned: list[tuple[Component, Any]]
    epoch: float | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)  # further manifest keys (its best)

    def write(self, writer: Any) -> None:
        """Second phase, inside the writer's context: this rank's files from the snapshot.

        Rank 0 records the topology and the components (scope, files) in the manifest.
        """
        topo = self.topology
        weights_files: dict[str, list[str]] = {}
        # state files first: they go to writer threads, while the weights (a model's
        # save_pretrained) are written in this thread at the same time
        for component, state in sorted(self.owned, key=lambda owned: owned[0].weights):
            if component.weights:
                weights_files[component.name] = self._write_weights(writer, component, state)
            else:
                header = {
                    "name": component.name,
                    "scope": component.scope.value,
                    "step": self.step,
                    "rank": topo.rank,
                    "stage": topo.stage,
                    "num_stages": topo.num_stages,
                    "world_size": topo.world_size,
                }
                writer.save_torch(own_file(component, topo), {HEADER_KEY: header, "state": state})
        if topo.rank == 0:
            writer.set_components(
                topology=topo.to_dict(),
                components={
                    c.name: {
                        "scope": c.scope.value,
                        "weights": c.weights,
                        "files": weights_files.get(c.name)
                        or component_file_names(c.name, c.scope.value, c.weights, topo.to_dict()),
                    }
                    for c in self.saved
                },
            )
        writer.set_meta(epoch=self.epoch, metrics=self.metrics, **self.extra)

    def _write_weights(self, writer: Any, component: Component, state: Any) -> list[str]:
        """Write a weights component; returns its files when rank 0 wrote all of them."""
        topo = self.topology
        if component.scope is Scope.SHARDED:
            component.obj.write(writer, state, shard_weights_name(topo.rank, topo.world_size))
            return []
        if topo.num_stages == 1 or component.scope is Scope.SHARED:
            # shared: gathered whole on rank 0 (a pipeline's adapter), written as one process
            mark = writer.mark()
            component.obj.write(writer, state, None)
            return writer.files_since(mark)
        component.obj.write(writer, state, stage_weights_name(topo.stage, topo.num_stages))
        if topo.rank == 0:
            writer.index_weights(
                [stage_weights_name(k, topo.num_stages) for k in range(topo.num_stages)]
            )
        return []


class CheckpointRegistry:
    """The components of one trainer's checkpoints; knows no trainer."""

    def __init__(self, topology: TopologyView) -> None:
        self.topology = topology
        self.components: dict[str, Component] = {}

    def register(self, component: Component) -> None:
        if component.name in self.components:
            raise ValueError(f"checkpoint component {component.name!r} is registered twice")
        self.components[component.name] = component

    def extend(self, components: Iterable[Component]) -> None:
        for component in components:
            self.register(component)

    def load_order(self) -> list[Component]:
        """Registration order, with ``restore_last`` components (random generators) at the end."""
        restored = [c for c in self.components.values() if c.restore]
        return [c for c in restored if not c.restore_last] + [c for c in restored if c.restore_last]

    # ------------------------------------------------------------------ saving
    def snapshot(self, step: int, copier: HostCopier | None = None) -> CheckpointSnapshot:
        """First phase of a save, on every rank in the training thread: every saved component's
        state, copied to host memory where this rank writes it (as ``copier`` says: kept,
        staged or deferred; forge/checkpoint/snapshot.py); nothing is written."""
        saved = [c for c in self.components.values() if c.save]
        owned: list[tuple[Component, Any]] = []
        for component in saved:
            state = component.obj.state_dict()  # on every rank: collective-safe
            if owns(component, self.topology):
                owned.append((component, host_copy(state, copier)))
        return CheckpointSnapshot(step, self.topology, saved, owned)

    def save(self, writer: Any) -> None:
        """Both phases at once, inside ``writer``'s context (for callers with nothing to do in
        between): snapshot, then write this rank's files."""
        self.snapshot(writer.step).write(writer)

    # ------------------------------------------------------------------ loading
    def load(self, path: str | os.PathLike) -> CheckpointManifest:
        """Restore every component from a validated checkpoint directory."""
        path = Path(path)
        manifest = read_manifest(path)
        if manifest.format_version < FORMAT_VERSION or not manifest.components:
            raise CheckpointError(
                f"{path}: written by an older forge (checkpoint format "
                f"{manifest.format_version}, this forge reads {FORMAT_VERSION}); its weights "
                "still load (load_model_weights, from_pretrained), but its training state "
                "cannot resume here: resume it with the forge that wrote it, or start a new run "
                "from its weights"
            )
        for component in self.load_order():
            entry = manifest.components.get(component.name)
            if entry is None:
                self._absent(path, component)
                continue
            scopes = {entry.get("scope"), component.scope.value}
            by_name = scopes <= _BY_NAME or component.weights  # weights load by their names
            if entry.get("scope") != component.scope.value and not by_name:
                raise CheckpointError(
                    f"{path}: component '{component.name}' was saved with scope "
                    f"{entry.get('scope')!r}, this trainer uses {component.scope.value!r}"
                    + (f"; {component.fix}" if component.fix else "")
                )
            if component.weights:
                component.obj.load_checkpoint(path, manifest)
                continue
            state = self._read_state(path, manifest, component, entry.get("scope"))
            if state is not _SKIPPED:
                component.obj.load_state_dict(state)
        return manifest

    def _absent(self, path: Path, component: Component) -> None:
        message = f"{path.name}: has no '{component.name}' component"
        if component.required:
            raise CheckpointError(
                f"{path}: has no '{component.name}' component, which this job restores"
                + (f"; {component.fix}" if component.fix else "")
            )
        logger.warning("%s; it starts fresh", message)
        if component.on_absent is not None:
            component.on_absent()

    def _read_state(
        self, path: Path, manifest: CheckpointManifest, component: Component, scope: str
    ) -> Any:
        topo, saved = self.topology, manifest.topology
        saved_stages = int(saved.get("num_stages", 1))
        if scope == Scope.SHARDED.value:
            # every rank's shard, merged whole: each loader keeps the part it holds
            names = component_file_names(component.name, scope, False, saved)
            shards = [
                self._read_file(path / name, manifest, component, {"rank": rank})
                for rank, name in enumerate(names)
            ]
            return merge_sharded(shards)
        if component.scope is Scope.SHARED:
            file = component_file(component.name, Scope.SHARED.value)
            return self._read_file(path / file, manifest, component, {})
        if scope == Scope.STAGE.value:
            if saved_stages == topo.num_stages and component.scope is Scope.STAGE:
                expect = {"stage": topo.stage, "num_stages": topo.num_stages}
                return self._read_file(
                    path / own_file(component, topo), manifest, component, expect
                )
            if component.reshard is None:
                raise CheckpointError(
                    f"{path}: component '{component.name}' was saved by {saved_stages} pipeline "
                    f"stage(s) and cannot be resharded to {topo.num_stages}; resume with "
                    f"{saved_stages} stage(s)" + (f", or {component.fix}" if component.fix else "")
                )
            shards = []
            for name in component_file_names(component.name, "stage", False, saved):
                shards.append(self._read_file(path / name, manifest, component, {}))
            return component.reshard(shards)
        # rank scope
        saved_rank = saved_rank_for(topo, saved)
        if saved_rank is None:
            saved_world, saved_dp = int(saved.get("world_size", 1)), saved_dp_size(saved)
            description = (
                f"{path.name} was written by {saved_world} rank(s), this job has {topo.world_size}"
            )
            resume = f"{saved_world} process(es)"
            if saved_stages > 1 or topo.num_stages > 1:
                description += f" ({saved_dp} and {topo.dp_size} data-parallel replica(s))"
                resume = f"{saved_dp} data-parallel replica(s)"
            if component.reshape is not None:
                names = component_file_names(component.name, Scope.RANK.value, False, saved)
                states = [
                    self._read_file(path / name, manifest, component, {"rank": rank})
                    for rank, name in enumerate(names)
                ]
                component.reshape(description, states)
                return _SKIPPED
            if component.on_reshape is None:
                raise CheckpointError(
                    f"{path}: component '{component.name}' is per rank and {description}; "
                    f"resume with {resume}" + (f", or {component.fix}" if component.fix else "")
                )
            component.on_reshape(description)
            return _SKIPPED
        file = path / component_file(component.name, Scope.RANK.value, rank=saved_rank)
        return self._read_file(file, manifest, component, {"rank": saved_rank})

    def _read_file(
        self,
        file: Path,
        manifest: CheckpointManifest,
        component: Component,
        expect: dict[str, int],
    ) -> Any:
        return read_component_file(file, manifest, component.name, expect)


def read_component_file(
    file: Path, manifest: CheckpointManifest, name: str, expect: dict[str, int]
) -> Any:
    """The state one component file holds, checked against the manifest (the file is listed)
    and against its header (written for component ``name``, at the manifest's step, by what
    ``expect`` says: a rank, a stage). The one reader of component files."""
    if file.name not in manifest.files:
        raise CheckpointError(
            f"{file}: component '{name}' has no such file in the manifest (missing shard)"
        )
    payload = load_torch_state(file)
    header = payload.get(HEADER_KEY) if isinstance(payload, dict) else None
    if not isinstance(header, dict) or "state" not in payload:
        raise CheckpointError(f"{file}: not a forge component file (no {HEADER_KEY} header)")
    wanted = {"name": name, "step": manifest.step, **expect}
    wrong = {k: (header.get(k), v) for k, v in wanted.items() if header.get(k) != v}
    if wrong:
        detail = ", ".join(f"{k} {got!r} (expected {want!r})" for k, (got, want) in wrong.items())
        raise CheckpointError(
            f"{file}: component '{name}' was written by another "
            f"{'/'.join(wrong)}: {detail}; the checkpoint is inconsistent"
        )
    return payload["state"]


def read_component_states(path: str | os.PathLike, name: str) -> list[Any] | None:
    """Every state a checkpoint holds of component ``name``, one per file it lists (each
    stage's, each rank's), read as a resume reads them; None when it has no such component."""
    path = Path(path)
    manifest = read_manifest(path)
    entry = (manifest.components or {}).get(name)
    if not entry:
        return None
    return [
        read_component_file(path / file, manifest, name, {}) for file in entry.get("files") or []
    ]


_SKIPPED = object()
