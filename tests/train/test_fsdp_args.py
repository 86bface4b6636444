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
        ("hybrid_shard", None, "2-D device mesh"),
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


def test_the_pipeline_trainer_refuses_sharding_with_the_reason():
    with pytest.raises(TrainingArgumentsError, match="does not shard its stages"):
        PipelineTrainingArguments(output_dir="o", fsdp="full_shard")


def test_a_moving_average_is_refused_under_fsdp():
    # the average is stage-scoped: under fsdp it would be saved as one rank's shard
    with pytest.raises(TrainingArgumentsError, match="ema_decay: a moving average .* under fsdp"):
        TrainingArguments(output_dir="out", fsdp="full_shard", ema_decay=0.99)
    TrainingArguments(output_dir="out", fsdp="full_shard", ema_decay=0)  # 0 is off
    TrainingArguments(output_dir="out", ema_decay=0.99)


def test_an_async_save_is_refused_under_fsdp():
    # its deferred copies ran into FSDP's DTensor storage ("invalid python storage") at the save
    with pytest.raises(
        TrainingArgumentsError, match="async_save: saves under fsdp are synchronous"
    ):
        TrainingArguments(output_dir="out", fsdp="full_shard", async_save=True)
    TrainingArguments(output_dir="out", fsdp="full_shard", async_save=False)
