"""The figures `forge train --dry-run` prints (forge/launch/job_plan.py) against the real thing:
parameters counted on the meta device against the built model, the memory formula against a
real optimizer's state, steps per epoch against forge's loader, per-stage parameters against
the pipeline's split; and the dry run builds no run directory and writes only data to stdout.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from forge.checkpoint.io import directory_bytes
from forge.cli import main
from forge.config import load_config, load_project
from forge.config.build import Materializer
from forge.launch.job_plan import (
    count_parameters,
    optimizer_states,
    rank_memory,
    steps_per_epoch,
)
from forge.launch.preflight import _resolver
from tests.helpers import TINY_LM
from tests.integration.conftest import SMALL

SMALL_VALUES = {k: int(v) for k, v in (item.split("=") for item in SMALL[1::2])}
MODEL_DEFINES = {**SMALL_VALUES, "num_layers": 4}


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """tiny_lm in a directory of its own (the model's vocabulary comes from its tokenizer,
    which is trained into the project's output on first use)."""
    dest = tmp_path_factory.mktemp("plan") / "tiny_lm"
    shutil.copytree(TINY_LM, dest, ignore=shutil.ignore_patterns("output"))
    return load_project(dest)


def materialize(cfg, node):
    from forge.launch.worker import build_variables

    variables = build_variables(cfg.project.output_dir / "build", cfg.project, "train")
    return Materializer(_resolver(cfg, []).resolve, variables, cfg.describe_loc).value(node)


def tiny_model(project, config: str = "train", *, meta: bool, defines=MODEL_DEFINES):
    cfg = load_config(project, config, defines)
    node = cfg.targets["trainer"].kwargs["model"]

    def build(node):
        return materialize(cfg, node)

    if meta:
        with torch.device("meta"):
            model = build(node)
            return model if isinstance(model, nn.Module) else model()
    model = build(node)
    return model if isinstance(model, nn.Module) else model()


def test_parameters_counted_on_the_meta_device_are_the_built_models(project):
    meta, real = tiny_model(project, meta=True), tiny_model(project, meta=False)
    counted = count_parameters(meta)
    assert next(meta.parameters()).is_meta
    unique = {id(p): p for p in real.parameters()}  # a tied embedding counted once
    assert counted.total == sum(p.numel() for p in unique.values())
    assert counted.trainable == counted.total and counted.per_process == [counted.total]
    assert (counted.dtype, counted.bytes_per_param) == ("float32", 4)


@pytest.mark.parametrize(
    "optimizer,kind,options",
    [
        (lambda ps: torch.optim.AdamW(ps, lr=1e-3), "adamw_torch_fused", {}),
        (lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9), "SGD", {"momentum": 0.9}),
        (lambda ps: torch.optim.SGD(ps, lr=1e-3), "sgd", {}),
        (lambda ps: torch.optim.RMSprop(ps, lr=1e-3, centered=True), "rmsprop", {"centered": True}),
        (lambda ps: torch.optim.Adagrad(ps, lr=1e-3), "Adagrad", {}),
    ],
    ids=["adamw", "sgd-momentum", "sgd", "rmsprop-centered", "adagrad"],
)
def test_the_memory_formula_is_what_a_real_optimizer_holds(optimizer, kind, options):
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    model[2].weight.requires_grad_(False)  # a frozen tensor has neither gradient nor state
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = optimizer(trainable)
    model(torch.randn(3, 16)).sum().backward()
    opt.step()
    held = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in trainable)
    figures = rank_memory(held, trained, 4, optimizer_states(kind, options))
    state_bytes = sum(
        t.numel() * t.element_size()
        for state in opt.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0  # `step` counters are scalars
    )
    assert figures.optimizer == state_bytes
    assert figures.gradients == sum(p.grad.numel() * 4 for p in trainable)
    assert figures.weights == sum(p.numel() * p.element_size() for p in model.parameters())


def test_a_shard_factor_divides_every_part_and_unknown_optimizers_say_so():
    whole = rank_memory(1000, 800, 2, 2)
    assert (whole.weights, whole.gradients, whole.optimizer) == (2000, 1600, 3200)
    halves = rank_memory(1000, 800, 2, 2, shard=2)
    assert (halves.weights, halves.gradients, halves.optimizer) == (1000, 800, 1600)
    assert optimizer_states("adafactor") is None
    with pytest.raises(ValueError, match="shard factor"):
        rank_memory(1, 1, 4, 2, shard=0)


@pytest.mark.parametrize(
    "size,batch,accum,dp,drop_last",
    [(103, 4, 2, 2, False), (103, 4, 3, 3, True), (8, 4, 4, 1, False)],
)
def test_steps_per_epoch_are_what_forges_loader_gives(size, batch, accum, dp, drop_last):
    import math

    from forge.data.loader import build_dataloader

    dataset = [{"x": torch.tensor([i])} for i in range(size)]
    lengths = {
        len(build_dataloader(dataset, batch_size=batch, rank=r, world_size=dp, drop_last=drop_last))
        for r in range(dp)
    }
    assert len(lengths) == 1  # every rank the same number of batches
    expected = math.ceil(lengths.pop() / accum)  # as the loop counts (forge/train/loop.py)
    assert steps_per_epoch(size, batch, accum, dp, drop_last) == expected


def test_per_stage_parameters_are_the_stages_own(project):
    from forge.train.pipeline.plan import plan_pipeline

    model = tiny_model(project, "pipeline", meta=True)
    cfg = load_config(project, "pipeline", MODEL_DEFINES)
    args = materialize(cfg, cfg.targets["trainer"].kwargs["args"])
    plan = plan_pipeline(model, args, 2)
    counted = count_parameters(model, plan)
    layers = [sum(p.numel() for p in model.model.layers[i].parameters()) for i in range(4)]
    embedding = model.model.embed_tokens.weight.numel()
    norm = model.model.norm.weight.numel()
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    assert counted.per_process[0] == embedding + layers[0] + layers[1]
    head = embedding if tied else model.lm_head.weight.numel()
    assert counted.per_process[1] == layers[2] + layers[3] + norm + head
    assert sum(counted.per_process) == counted.total + (embedding if tied else 0)


def test_dry_run_prints_the_plan_on_stdout_and_creates_nothing(project, capsys):
    code = main(["train", "-p", str(project.root), *SMALL, "--nproc", "2", "--dry-run"])
    out, err = capsys.readouterr()
    assert code == 0, err
    lines = out.splitlines()
    assert lines[:2] == [
        "config train.yaml renders and checks; would train with 2 process(es) in",
        f"  {project.root}/output/train/run_NNN/",
    ]
    assert "  parallelism   2 data-parallel x 1 pipeline stage = 2 process(es) on 1 node" in lines
    assert (
        "  batch         4 per device x 2 accumulation x 2 data-parallel = 16 per optimizer step"
        in lines
    )
    params = next(line for line in lines if line.startswith("  parameters"))
    total = count_parameters(tiny_model(project, meta=True, defines=SMALL_VALUES)).total
    assert params.startswith(f"  parameters    {total:,} total, {total:,} trainable (float32)")
    memory = next(line for line in lines if line.startswith("  memory/rank"))
    assert "(adamw_torch_fused: 2 state(s) per parameter)" in memory
    assert f"in {project.root}/output/train/run_NNN/checkpoints/" in lines[-1]
    assert "every 10 steps (4 save(s), 3 kept)" in lines[-1]
    assert "stdlib train split" in err and "stdlib" not in out  # logs on stderr
    assert not (project.root / "output" / "train").exists()


def test_an_fsdp_dry_run_shards_the_model_state_over_its_ranks(project, capsys):
    plain = ["train", "-p", str(project.root), *SMALL, "--nproc", "2", "--dry-run"]
    assert main(plain) == 0
    whole = next(line for line in capsys.readouterr()[0].splitlines() if "memory/rank" in line)
    code = main([*plain, "--set", "trainer.args.fsdp=full_shard"])
    out, err = capsys.readouterr()
    assert code == 0, err
    lines = out.splitlines()
    assert (
        "  parallelism   2 data-parallel (FSDP2: the model state sharded over 2) x 1 pipeline "
        "stage = 2 process(es) on 1 node" in lines
    )
    assert any("(sharded data parallel, FSDP2)" in line for line in lines)
    # each rank reads its own batches, as under DDP
    assert (
        "  batch         4 per device x 2 accumulation x 2 data-parallel = 16 per optimizer step"
        in lines
    )
    sharded = next(line for line in lines if "memory/rank" in line)
    units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
    total = [
        float(n) * units[u] for n, u in re.findall(r"= ([\d.]+) (B|KiB|MiB|GiB);", whole + sharded)
    ]
    assert len(total) == 2 and total[1] == pytest.approx(total[0] / 2, rel=0.02)


@pytest.mark.slow  # two dry runs (~25 s on a busy machine); the mesh sizes: test_fsdp_args.py
def test_a_hybrid_dry_run_prints_the_mesh_and_divides_by_the_shards(project, capsys):
    """2 nodes of 2 processes: a 2 x 2 mesh by default; memory per rank is DDP's over 2."""
    base = ["train", "-p", str(project.root), *SMALL, "--nproc", "2", "--nnodes", "2"]
    base += ["--rdzv-endpoint", "127.0.0.1:29400"]
    plain = [*base, "--dry-run"]
    assert main(plain) == 0
    whole = next(line for line in capsys.readouterr()[0].splitlines() if "memory/rank" in line)
    code = main([*plain, "--set", "trainer.args.fsdp=hybrid_shard"])
    out, err = capsys.readouterr()
    assert code == 0, err
    lines = out.splitlines()
    assert (
        "  parallelism   4 data-parallel (HSDP: a 2 x 2 mesh, 2 replica(s) of the model state "
        "sharded over 2) x 1 pipeline stage = 4 process(es) on 2 nodes" in lines
    ), lines
    assert any("(hybrid sharded data parallel, FSDP2 (HSDP))" in line for line in lines)
    sharded = next(line for line in lines if "memory/rank" in line)
    total = [
        float(n) * UNITS[u] for n, u in re.findall(r"= ([\d.]+) (B|KiB|MiB|GiB);", whole + sharded)
    ]
    assert len(total) == 2 and total[1] == pytest.approx(total[0] / 2, rel=0.02)


# ---------------------------------------------------------------------------------------------
# what a checkpoint holds: the moving average of the weights, a LoRA run's adapter

UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
LORA_CONFIG = """\
-- extends 'configs/lm.yaml'
-- block trainer
    == super()
    peft_config: !singleton:peft:LoraConfig
        r: 64
        target_modules: [head]
-- endblock
"""  # an adapter large enough that the files' fixed overhead is a few percent of them


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    from tests.plain_project import write_project

    root = write_project(tmp_path_factory.mktemp("plain") / "plain")
    (root / "templates" / "configs" / "lora.yaml").write_text(LORA_CONFIG)
    return root


def planned(root, config, *overrides, capsys):
    """The plan's lines for ``config`` of the project at ``root`` (--set ``overrides``)."""
    sets = [word for item in overrides for word in ("--set", item)]
    code = main(["train", config, "-p", str(root), *sets, "--dry-run"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out.splitlines()


def planned_size(lines) -> float:
    line = next(line for line in lines if line.startswith("  checkpoints"))
    number, unit = re.search(r"about ([\d.]+) (B|KiB|MiB|GiB) each", line).groups()
    return float(number) * UNITS[unit]


def test_the_checkpoint_size_is_every_file_a_plain_run_writes(plain, capsys):
    """The plan's size is the whole directory (weights, optimizer state, the names the files
    key them by, tokenizer, loop state), as `forge checkpoints` and `du -b` count it."""
    from tests.plain_project import train_in_process

    lines = planned(plain, "lm", capsys=capsys)
    checkpoint = train_in_process(plain, "lm") / "checkpoints" / "checkpoint-000004"
    assert planned_size(lines) == pytest.approx(directory_bytes(checkpoint), rel=0.05)
    assert "+ tokenizer and loop state " in next(x for x in lines if "  checkpoints" in x)


def test_the_checkpoint_size_counts_the_moving_average_of_the_weights(plain, capsys):
    from tests.plain_project import train_in_process

    ema = ["trainer.args.ema_decay=0.9"]
    lines = planned(plain, "lm", *ema, capsys=capsys)
    checkpoint = train_in_process(plain, "lm", ema) / "checkpoints" / "checkpoint-000004"
    assert planned_size(lines) == pytest.approx(directory_bytes(checkpoint), rel=0.05)
    checkpoints = next(line for line in lines if line.startswith("  checkpoints"))
    assert "+ moving average" in checkpoints
    memory = next(line for line in lines if line.startswith("  memory/rank"))
    assert "+ moving average" in memory


def test_a_lora_runs_trainable_parameters_and_checkpoint_are_the_adapters(plain, capsys):
    from safetensors.torch import load_file

    from tests.plain_project import train_in_process

    lines = planned(plain, "lora", capsys=capsys)
    run = train_in_process(plain, "lora")
    checkpoint = run / "checkpoints" / "checkpoint-000004"
    adapter = load_file(checkpoint / "adapter_model.safetensors")
    trainable = sum(t.numel() for t in adapter.values())
    params = next(line for line in lines if line.startswith("  parameters"))
    assert f", {trainable:,} trainable (float32" in params, params
    assert planned_size(lines) == pytest.approx(directory_bytes(checkpoint), rel=0.05)
    assert "(the adapter " in next(line for line in lines if line.startswith("  checkpoints"))


def test_define_null_turns_the_moving_average_off_as_yaml_null_does(plain, capsys):
    """`-D ema_decay=null` is YAML's null, the documented "off" (it rendered as the string
    'None', which the argument check refused)."""
    (plain / "templates" / "configs" / "ema.yaml").write_text(
        "-- extends 'configs/lm.yaml'\n-- block trainer_args\n    == super()\n"
        "    ema_decay: {{ ema_decay | default(0.9) }}\n-- endblock\n"
    )
    on = main(["train", "ema", "-p", str(plain), "--dry-run"])
    assert on == 0 and "+ moving average" in capsys.readouterr().out
    off = main(["train", "ema", "-p", str(plain), "-D", "ema_decay=null", "--dry-run"])
    out, err = capsys.readouterr()
    assert off == 0, err
    assert "memory/rank" in out and "moving average" not in out


# ---------------------------------------------------------------------------------------------
# two processes: FSDP2's shard files, and pipeline stages that each hold the tied embedding

SHORT = ["-D", "max_steps=2", "-D", "save_steps=2", "-D", "eval_steps=1000"]


@pytest.mark.slow  # two torchrun processes (gloo) per case
@pytest.mark.parametrize(
    "config, extra",
    [
        ("train", ["--set", "trainer.args.fsdp=full_shard"]),
        ("pipeline", []),  # 2 stages: the tied embedding's optimizer state on both
        # each rank's rows of the moving average too
        ("train", ["--set", "trainer.args.fsdp=full_shard", "--set", "trainer.args.ema_decay=0.9"]),
        # pipeline x FSDP: 2 stages x 2 shards, each rank its rows of its stage's state
        (
            "pipeline",
            [
                "--nproc",
                "4",
                "--set",
                "trainer.args.pipeline_parallel_size=2",
                "--set",
                "trainer.args.fsdp=full_shard",
                "--set",
                "trainer.args.ema_decay=0.9",
            ],
        ),  # fmt: skip
    ],
    ids=["fsdp", "pipeline", "fsdp-ema", "pipeline-fsdp-ema"],
)
def test_the_planned_checkpoint_size_matches_two_processes_files(project, config, extra, capsys):
    from tests.helpers import run_forge

    command = ["train", config, "-p", str(project.root), *SMALL, *SHORT, "--nproc", "2", *extra]
    assert main([*command, "--dry-run"]) == 0
    lines = capsys.readouterr()[0].splitlines()
    result = run_forge(*command)
    assert result.returncode == 0, result.stderr
    checkpoint = Path(result.stdout.splitlines()[0]) / "checkpoints" / "checkpoint-000002"
    assert planned_size(lines) == pytest.approx(directory_bytes(checkpoint), rel=0.05)
    table = run_forge(
        "checkpoints", "-p", str(project.root), "--run-dir", str(checkpoint.parents[1])
    )
    assert table.returncode == 0, table.stderr
    size = re.search(r"checkpoint-000002\s+2\s+[\d.]+\s+([\d.]+) (KiB|MiB)\s", table.stdout)
    assert size is not None, table.stdout
    assert float(size[1]) * UNITS[size[2]] == pytest.approx(directory_bytes(checkpoint), rel=0.01)
