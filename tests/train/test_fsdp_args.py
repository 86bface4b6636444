"""HF's ``fsdp`` / ``fsdp_config`` arguments read for FSDP2, and refused where they cannot apply."""

from __future__ import annotations

import pytest

from forge.train import TrainingArguments
from forge.train.args import TrainingArgumentsError
from forge.train.args.fsdp import FsdpSettings, parse_fsdp
from forge.train.args.pipeline import PipelineTrainingArguments


def settings(fsdp, config=None) -> FsdpSettings | None:
    found, problems = parse_fsdp(fsdp, config, "trainer.args")
    assert problems == []
    return found


def test_the_strategies_and_options():
    assert settings(None) is None and settings("") is None and settings([]) is None
    assert settings("full_shard") == FsdpSettings()
    zero2 = settings("shard_grad_op auto_wrap")
    assert zero2.strategy == "shard_grad_op" and zero2.reshard_after_forward is False
    assert settings(["full_shard", "offload"]).offload_params is True
    assert settings(True) == FsdpSettings()


def test_the_config_keys_that_apply_to_fsdp2():
    found = settings(
        "full_shard",
        {
            "fsdp_version": 2,
            "reshard_after_forward": False,
            "cpu_offload": True,
            "mixed_precision": {"param_dtype": "bf16", "reduce_dtype": "torch.float32"},
            "transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
        },
    )
    assert found.reshard_after_forward is False and found.offload_params is True
    assert (found.param_dtype, found.reduce_dtype) == ("bfloat16", "float32")
    assert found.modules == ("LlamaDecoderLayer",)


@pytest.mark.parametrize(
    ("fsdp", "config", "says"),
    [
        ("full_shard", {"shard_size": 2}, "shard_size sizes a hybrid mesh"),
        ("hybrid_shard", {"replicate_size": 0}, "replicate_size must be a positive integer"),
        ("no_shard", None, "leave fsdp unset"),
        ("full_shard shard_grad_op", None, "choose one"),
        ("full_shrad", None, "unknown option 'full_shrad'"),
        ("full_shard", {"version": 1}, "FSDP2"),
        ("full_shard", {"min_num_params": 100}, "does not apply to FSDP2"),
        ("full_shard", {"mixed_precision": {"param_dtype": "int8"}}, "not one of"),
        (None, {"reshard_after_forward": True}, "fsdp is not"),
    ],
)
def test_what_cannot_apply_is_refused_with_the_reason(fsdp, config, says):
    with pytest.raises(TrainingArgumentsError, match=says):
        TrainingArguments(output_dir="o", fsdp=fsdp, fsdp_config=config)


def test_the_pipeline_trainer_shards_its_stages_and_refuses_what_cannot_compose():
    """Pipeline x FSDP: each stage sharded over its replicas (full_shard, shard_grad_op); a
    hybrid mesh, named blocks and several stages per process are refused with the reason, and
    a process count that is no multiple of the stages says stages x shards."""
    from types import SimpleNamespace

    from forge.train.pipeline.plan import pipeline_size

    for strategy in ("full_shard", "shard_grad_op"):
        args = PipelineTrainingArguments(output_dir="o", fsdp=strategy, pipeline_parallel_size=2)
        assert args.fsdp_settings().strategy == strategy
        assert not args.async_save  # saves under fsdp are synchronous
    refused = {
        "hybrid_shard is not supported by the pipeline trainer": {"fsdp": "hybrid_shard"},
        "modules are not read by the pipeline trainer": {
            "fsdp": "full_shard",
            "fsdp_config": {"transformer_layer_cls_to_wrap": "LlamaDecoderLayer"},
        },
        "under fsdp each process shards exactly one stage": {
            "fsdp": "full_shard",
            "pipeline_schedule": "interleaved_1f1b",
            "pipeline_stages_per_rank": 2,
        },
    }
    for says, values in refused.items():
        with pytest.raises(TrainingArgumentsError, match=says):
            PipelineTrainingArguments(output_dir="o", **values)
    args = SimpleNamespace(pipeline_parallel_size=2, config_key="trainer.args", fsdp="full_shard")
    size, (problem,) = pipeline_size(args, 3)
    assert problem.startswith("trainer.args.pipeline_parallel_size 2 does not divide the 3 ")
    assert "fsdp shards each stage over the groups: stages x shards" in problem


def test_an_async_save_is_refused_under_fsdp():
    # its deferred copies ran into FSDP's DTensor storage ("invalid python storage") at the save
    with pytest.raises(
        TrainingArgumentsError, match="async_save: saves under fsdp are synchronous"
    ):
        TrainingArguments(output_dir="out", fsdp="full_shard", async_save=True)
    TrainingArguments(output_dir="out", fsdp="full_shard", async_save=False)


def test_hybrid_sharding_takes_hf_names_and_the_mesh_sizes():
    from forge.train.args.fsdp import parse_fsdp

    found, problems = parse_fsdp("hybrid_shard", None, "trainer.args")
    assert problems == [] and found.hybrid and found.reshard_after_forward
    # by default the processes of a node shard and the nodes replicate
    assert found.hybrid_mesh(world_size=8, local_world_size=4) == (2, 4)
    zero2, _ = parse_fsdp("hybrid_shard_zero2", {"dp_shard_size": 2}, "trainer.args")
    assert zero2.hybrid and not zero2.reshard_after_forward
    assert zero2.hybrid_mesh(world_size=8, local_world_size=8) == (4, 2)
    sized, _ = parse_fsdp("hybrid_shard", {"replicate_size": 2}, "trainer.args")
    assert sized.hybrid_mesh(world_size=4, local_world_size=4) == (2, 2)
    assert sized.hybrid_mesh(world_size=6, local_world_size=6) == (2, 3)
    with pytest.raises(ValueError, match="must be the 5 processes"):
        sized.hybrid_mesh(world_size=5, local_world_size=5)
    wrong, _ = parse_fsdp("hybrid_shard", {"replicate_size": 2, "shard_size": 2}, "t")
    with pytest.raises(ValueError, match=r"must be the 6 processes \(got 2 x 2\)"):
        wrong.hybrid_mesh(world_size=6, local_world_size=6)
