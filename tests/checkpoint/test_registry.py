"""The state registry: each scope's files, and every inconsistency reported by component name.

Several ranks are simulated in one process: each "rank" saves through its own registry into the
same temporary directory, and rank 0 (saving last) commits.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from forge.checkpoint import (
    CheckpointError,
    CheckpointRegistry,
    CheckpointWriter,
    Component,
    ModelWeights,
    OptimizerState,
    Scope,
    find_latest_checkpoint,
    read_manifest,
    validate_checkpoint,
)
from forge.checkpoint.io import DEFAULT_HASH, sync_and_hash
from forge.train.topology import Topology
from tests.checkpoint.conftest import Value


def components(topology: Topology, values: dict | None = None) -> list[Component]:
    """shared ``progress``, stage ``moments`` and rank ``position``, valued by coordinates."""
    values = values or {}
    return [
        Component("progress", values.get("progress", Value({"step": 7}))),
        Component(
            "moments",
            values.get(
                "moments", Value({f"layer{topology.stage}": torch.full((2,), topology.stage)})
            ),
            Scope.STAGE,
            reshard=values.get("reshard", None),
        ),
        Component(
            "position",
            values.get("position", Value({"rank": topology.rank})),
            Scope.RANK,
            on_reshape=values.get("on_reshape"),
            reshape=values.get("reshape"),
        ),
    ]


def save(checkpoints: Path, world_size: int, num_stages: int = 1, step: int = 7) -> Path:
    """Save one checkpoint as ``world_size`` ranks would (rank 0 last, as it commits)."""
    writers = [
        CheckpointWriter(checkpoints, step, rank=r, world_size=world_size, barrier=lambda: None)
        for r in range(world_size)
    ]
    writers[0].__enter__()
    for rank in reversed(range(world_size)):
        topology = Topology(rank, world_size, rank, num_stages)
        registry = CheckpointRegistry(topology)
        registry.extend(components(topology))
        if rank:
            writers[rank].__enter__()
        registry.save(writers[rank])
        writers[rank].__exit__(None, None, None)
    return writers[0].final_path


def load(path: Path, topology: Topology, **values) -> dict[str, Value]:
    made = {name: Value({}) for name in ("progress", "moments", "position")}
    made.update(values)
    registry = CheckpointRegistry(topology)
    registry.extend(components(topology, made))
    registry.load(path)
    return made


def rehash(path: Path) -> None:
    """Make the manifest match the files again (a consistent-looking, wrong checkpoint)."""
    raw = json.loads((path / "manifest.json").read_text())
    for name in raw["files"]:
        size, sha = sync_and_hash(path / name)
        raw["files"][name] = {"size": size, DEFAULT_HASH: sha}
    (path / "manifest.json").write_text(json.dumps(raw))


def swap(path: Path, a: str, b: str) -> None:
    tmp = path / "swap.tmp"
    (path / a).rename(tmp)
    (path / b).rename(path / a)
    tmp.rename(path / b)


# ---------------------------------------------------------------------------------------------
# files and restore


def test_each_scope_has_its_files_and_round_trips(tmp_path):
    path = save(tmp_path, world_size=4, num_stages=2)
    manifest = read_manifest(path)
    assert manifest.topology == {"world_size": 4, "num_stages": 2, "dp_size": 2}
    files = {name: sorted(e["files"]) for name, e in manifest.components.items()}
    assert files == {
        "progress": ["progress.pt"],
        "moments": ["moments-stage-00000-of-00002.pt", "moments-stage-00001-of-00002.pt"],
        "position": [f"position-rank-{r:05d}.pt" for r in range(4)],
    }
    assert validate_checkpoint(path) == []
    for rank in range(4):
        got = load(path, Topology(rank, 4, rank, 2))
        assert got["progress"].state == {"step": 7}
        assert got["position"].state == {"rank": rank}
        stage = rank % 2
        assert list(got["moments"].state) == [f"layer{stage}"]
        assert torch.equal(got["moments"].state[f"layer{stage}"], torch.full((2,), stage))


def test_restore_runs_in_registration_order_random_generators_last(tmp_path):
    calls = []

    class Recorder(Value):
        def __init__(self, name):
            super().__init__({"name": name})
            self.name = name

        def load_state_dict(self, state):
            calls.append(self.name)

    registry = CheckpointRegistry(Topology())
    names = ["rng", "model_like", "trainer", "data"]
    registry.extend(
        Component(
            n,
            Recorder(n),
            Scope.RANK if n in ("rng", "data") else Scope.SHARED,
            restore_last=n == "rng",
        )
        for n in names
    )
    with CheckpointWriter(tmp_path, 1) as writer:
        registry.save(writer)
    registry.load(writer.final_path)
    assert calls == ["model_like", "trainer", "data", "rng"]


def test_stage_state_reshards_to_another_stage_count(tmp_path):
    path = save(tmp_path, world_size=2, num_stages=2)
    got = load(
        path,
        Topology(),
        reshard=lambda shards: {k: v for s in shards for k, v in s.items()},
        on_reshape=lambda _: None,
    )
    assert sorted(got["moments"].state) == ["layer0", "layer1"]


# ---------------------------------------------------------------------------------------------
# every inconsistency named, per scope


def test_shared_component_from_another_component_or_step_is_named(tmp_path):
    path = save(tmp_path, world_size=1)
    torch.save(
        {"forge_component": {"name": "progress", "step": 3}, "state": {"step": 3}},
        path / "progress.pt",
    )
    rehash(path)
    # the manifest's sizes and hashes fit; the file's own header gives it away before loading
    assert validate_checkpoint(path) == [
        "progress.pt: written for another checkpoint, rank or stage: its header says "
        "step 3 (expected 7)"
    ]
    assert find_latest_checkpoint(tmp_path) is None
    with pytest.raises(
        CheckpointError, match=r"progress\.pt: component 'progress' was written by another step"
    ):
        load(path, Topology())  # and loading without validation names it too


def test_stage_shard_written_by_the_wrong_stage_is_named(tmp_path):
    path = save(tmp_path, world_size=2, num_stages=2)
    swap(path, "moments-stage-00000-of-00002.pt", "moments-stage-00001-of-00002.pt")
    rehash(path)
    assert (
        "moments-stage-00001-of-00002.pt: written for another checkpoint, rank or stage: "
        "its header says stage 0 (expected 1)"
    ) in validate_checkpoint(path)
    with pytest.raises(CheckpointError) as err:
        load(path, Topology(1, 2, 1, 2))
    message = str(err.value)
    assert "moments-stage-00001-of-00002.pt: component 'moments'" in message
    assert "stage 0 (expected 1)" in message


def test_rank_file_written_by_the_wrong_rank_is_named(tmp_path):
    path = save(tmp_path, world_size=2)
    swap(path, "position-rank-00000.pt", "position-rank-00001.pt")
    rehash(path)
    assert (
        "position-rank-00000.pt: written for another checkpoint, rank or stage: "
        "its header says rank 1 (expected 0)"
    ) in validate_checkpoint(path)
    with pytest.raises(
        CheckpointError,
        match=r"position-rank-00000\.pt: component 'position'.*rank 1 \(expected 0\)",
    ):
        load(path, Topology(0, 2, 0))


@pytest.mark.parametrize(
    "missing, component",
    [
        ("progress.pt", "progress"),
        ("moments-stage-00001-of-00002.pt", "moments"),
        ("position-rank-00002.pt", "position"),
    ],
)
def test_a_missing_file_is_named_by_validation_and_discovery_skips_it(tmp_path, missing, component):
    earlier = save(tmp_path, world_size=4, num_stages=2, step=6)
    path = save(tmp_path, world_size=4, num_stages=2, step=7)
    (path / missing).unlink()
    assert validate_checkpoint(path) == [f"{missing}: listed in manifest but missing"]
    assert find_latest_checkpoint(tmp_path) == earlier
    # dropped from the manifest too: the component's own file list no longer fits the topology
    raw = json.loads((path / "manifest.json").read_text())
    del raw["files"][missing]
    raw["components"][component]["files"].remove(missing)
    (path / "manifest.json").write_text(json.dumps(raw))
    problems = validate_checkpoint(path)
    assert len(problems) == 1 and problems[0].startswith(f"component '{component}'")
    assert missing in problems[0]


def test_stage_count_mismatch_without_resharding_is_named(tmp_path):
    path = save(tmp_path, world_size=2, num_stages=2)
    with pytest.raises(
        CheckpointError,
        match=r"component 'moments' was saved by 2 pipeline stage\(s\) and cannot be resharded to 1",
    ):
        load(path, Topology())


def test_rank_count_mismatch_is_named_or_handled(tmp_path):
    path = save(tmp_path, world_size=2)
    with pytest.raises(
        CheckpointError,
        match=r"component 'position' is per rank and .* written by 2 rank\(s\), this job has 1; resume with 2 process",
    ):
        load(path, Topology())
    seen = []
    got = load(path, Topology(), on_reshape=seen.append)
    assert seen == [f"{path.name} was written by 2 rank(s), this job has 1"]
    assert got["position"].state == {}  # not restored
    assert got["progress"].state == {"step": 7}


def test_a_reshape_handler_gets_every_saved_ranks_state(tmp_path):
    """What a data position needs to deal the rest of its epoch to another number of ranks."""
    path = save(tmp_path, world_size=4, num_stages=2)  # 2 replicas
    seen = []
    got = load(
        path,
        Topology(0, 1, 0),
        reshape=lambda description, states: seen.append((description, states)),
        on_reshape=lambda description: pytest.fail("reshape takes on_reshape's place"),
        reshard=list,
    )
    assert seen == [
        (
            f"{path.name} was written by 4 rank(s), this job has 1 (2 and 1 data-parallel "
            "replica(s))",
            [{"rank": rank} for rank in range(4)],  # in saved rank order
        )
    ]
    assert got["position"].state == {}  # the handler restores it, not load_state_dict


def test_per_rank_state_follows_the_data_parallel_replica_not_the_process(tmp_path):
    """2 stages x 1 replica -> 1 process (1 replica): rank 0 takes stage 0's position."""
    path = save(tmp_path, world_size=2, num_stages=2)
    seen = []
    got = load(path, Topology(), on_reshape=seen.append, reshard=lambda shards: shards)
    assert seen == []  # one replica on both sides: nothing to reshape
    assert got["position"].state == {"rank": 0}
    # 2 stages x 2 replicas -> 1 stage x 2 replicas: each replica keeps its own position
    path = save(tmp_path / "dp2", world_size=4, num_stages=2)
    for rank in range(2):
        got = load(path, Topology(rank, 2, rank), on_reshape=seen.append, reshard=list)
        assert got["position"].state == {"rank": rank * 2}  # the replica's stage 0
    # -> 4 stages x 1 replica, at the same world size: another data-parallel size, so the
    # per-rank state goes to on_reshape, never to a loader it does not fit
    got = load(path, Topology(3, 4, 3, 4), on_reshape=seen.append, reshard=list)
    assert seen == [
        f"{path.name} was written by 4 rank(s), this job has 4 (2 and 1 data-parallel replica(s))"
    ]
    assert got["position"].state == {}
    with pytest.raises(CheckpointError, match=r"resume with 2 data-parallel replica\(s\)"):
        load(path, Topology(3, 4, 3, 4), reshard=list)


def test_a_component_the_checkpoint_lacks_is_named_with_the_fix(tmp_path):
    path = save(tmp_path, world_size=1)
    registry = CheckpointRegistry(Topology())
    registry.register(Component("ema", Value({}), fix="set trainer.args.restore_ema_state: false"))
    with pytest.raises(CheckpointError, match=r"has no 'ema' component.*restore_ema_state: false"):
        registry.load(path)


def test_an_optional_component_the_checkpoint_lacks_starts_fresh_with_a_warning(tmp_path, caplog):
    path = save(tmp_path, world_size=1)
    registry = CheckpointRegistry(Topology())
    scaler, progress = Value({"scale": 1.0}), Value({})
    registry.register(Component("scaler", scaler, required=False, fix="unused"))
    registry.extend(components(Topology(), {"progress": progress}))
    registry.load(path)
    assert scaler.state == {"scale": 1.0}  # untouched
    assert progress.state == {"step": 7}  # and the components after it load
    assert f"{path.name}: has no 'scaler' component; it starts fresh" in caplog.text
    assert "unused" not in caplog.text


def test_a_checkpoint_of_the_older_format_says_so(tmp_path):
    path = save(tmp_path, world_size=1)
    raw = json.loads((path / "manifest.json").read_text())
    raw["format_version"] = 1
    del raw["components"], raw["topology"]
    (path / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="written by an older forge"):
        load(path, Topology())


# ---------------------------------------------------------------------------------------------
# optimizer state keyed by parameter name


def _trained(model: nn.Module) -> torch.optim.Optimizer:
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.ones(1, 4)).sum().backward()
        optimizer.step()
    return optimizer


def test_optimizer_state_is_keyed_by_name_and_never_loads_into_other_parameters():
    torch.manual_seed(0)
    full = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    state = OptimizerState(full, _trained(full)).state_dict()
    assert "state.1.weight.exp_avg" in state and "state.0.bias.exp_avg_sq" in state

    # a "stage" holding only layer 1 gets layer 1's moments, not layer 0's (same shapes)
    stage = nn.Sequential(nn.Identity(), nn.Linear(4, 4))
    stage_optimizer = torch.optim.AdamW(stage.parameters(), lr=0.1)
    OptimizerState(stage, stage_optimizer).load_state_dict(state)
    moments = stage_optimizer.state[stage[1].weight]["exp_avg"]
    assert torch.equal(moments, state["state.1.weight.exp_avg"])
    assert not torch.equal(moments, state["state.0.weight.exp_avg"])

    stranger = nn.ModuleDict({"encoder": nn.Linear(4, 4)})
    with pytest.raises(CheckpointError, match="names none of this model's parameters"):
        OptimizerState(stranger, torch.optim.AdamW(stranger.parameters())).load_state_dict(state)


def test_an_optimizer_without_state_keeps_its_groups_settings_by_name():
    """SGD without momentum keeps no per-parameter state: the learning rate the schedule set is
    saved all the same (the first resumed step reads it from the group)."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    optimizer.param_groups[0]["lr"] = 0.025
    state = OptimizerState(model, optimizer).state_dict()
    assert not optimizer.state and state["param_groups.1.weight.lr"] == 0.025

    fresh = torch.optim.SGD(model.parameters(), lr=0.1)
    OptimizerState(model, fresh).load_state_dict(state)
    assert fresh.param_groups[0]["lr"] == 0.025 and not fresh.state

    stranger = nn.ModuleDict({"encoder": nn.Linear(4, 4)})
    with pytest.raises(CheckpointError, match="name none of this model's parameters"):
        OptimizerState(stranger, torch.optim.SGD(stranger.parameters())).load_state_dict(state)


def test_weights_component_writes_a_from_pretrained_directory(tmp_path):
    from transformers import AutoModelForCausalLM

    from tests.checkpoint.checkpoint_helpers import tiny_llama

    model = tiny_llama(0)
    registry = CheckpointRegistry(Topology())
    registry.register(Component("model", ModelWeights(model), Scope.STAGE, weights=True))
    with CheckpointWriter(tmp_path, 3) as writer:
        registry.save(writer)
    files = read_manifest(writer.final_path).components["model"]["files"]
    assert "model.safetensors" in files and "config.json" in files
    loaded = AutoModelForCausalLM.from_pretrained(writer.final_path)
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


def test_weights_restore_and_the_components_after_them_load_too(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(3, 3)
    registry = CheckpointRegistry(Topology())
    registry.register(Component("model", ModelWeights(model), Scope.STAGE, weights=True))
    registry.register(Component("progress", Value({"step": 3})))
    with CheckpointWriter(tmp_path, 3) as writer:
        registry.save(writer)
    fresh, progress = nn.Linear(3, 3), Value({})
    again = CheckpointRegistry(Topology())
    again.register(Component("model", ModelWeights(fresh), Scope.STAGE, weights=True))
    again.register(Component("progress", progress))
    again.load(writer.final_path)
    assert torch.equal(fresh.weight, model.weight)
    assert progress.state == {"step": 3}


def test_a_component_saved_with_another_scope_is_named_with_the_fix(tmp_path):
    path = save(tmp_path, world_size=1)
    registry = CheckpointRegistry(Topology())
    registry.register(Component("progress", Value({}), Scope.RANK, fix="set the fix: true"))
    with pytest.raises(
        CheckpointError,
        match=r"'progress' was saved with scope 'shared', this trainer uses 'rank'; set the fix",
    ):
        registry.load(path)


def test_a_manifest_without_components_cannot_resume(tmp_path):
    path = save(tmp_path, world_size=1)
    raw = json.loads((path / "manifest.json").read_text())
    raw["components"] = {}
    (path / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="written by an older forge"):
        load(path, Topology())


def test_a_torch_file_without_the_component_header_is_refused(tmp_path):
    path = save(tmp_path, world_size=1)
    torch.save({"step": 7}, path / "progress.pt")  # a bare state, as another tool would write
    rehash(path)
    with pytest.raises(CheckpointError, match=r"progress\.pt: not a forge component file"):
        load(path, Topology())
