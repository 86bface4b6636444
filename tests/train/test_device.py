"""Devices and precision checked before the first step, on a machine without a GPU: the CUDA
queries are replaced by a fake GPU node, so the decisions (which GPU a rank takes, which
precision a GPU can run, whose random generator a checkpoint holds) are tested on CPU."""

from __future__ import annotations

import functools
import os

import pytest
import torch

from forge.checkpoint import RngState
from forge.train import Trainer
from forge.train.args import TrainingArgumentsError
from forge.train.dist import resolve_device
from forge.train.precision import device_problems, numerics
from tests.train.common import make_args, make_trainer


@pytest.fixture
def gpus(monkeypatch):
    """A node with N visible GPUs of a given compute capability: ``gpus(2, (8, 0))``."""

    def node(count: int, capability: tuple[int, int] = (9, 0)) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
        monkeypatch.setattr(
            torch.cuda, "is_bf16_supported", lambda including_emulation=True: capability >= (8, 0)
        )

    return node


def as_rank(monkeypatch, rank: int, world_size: int, local_rank: int) -> None:
    for name, value in (("RANK", rank), ("WORLD_SIZE", world_size), ("LOCAL_RANK", local_rank)):
        monkeypatch.setenv(name, str(value))


@pytest.mark.parametrize(
    ("spec", "local_rank", "world_size", "count", "expected"),
    [
        ("cuda", 1, 2, 2, "cuda:1"),  # each rank its LOCAL_RANK's GPU
        ("auto", 3, 4, 4, "cuda:3"),
        ("cuda", 1, 2, 1, "cuda:0"),  # the launcher gave each process one GPU
        ("cuda:0", 0, 2, 2, "cuda:0"),  # rank 0 may name its own GPU
        ("cuda:1", 0, 1, 2, "cuda:1"),  # one process may take any GPU
        ("auto", 0, 1, 0, "cpu"),
        ("cpu", 1, 2, 2, "cpu"),
    ],
)
def test_each_rank_gets_its_own_device(gpus, spec, local_rank, world_size, count, expected):
    gpus(count)
    assert resolve_device(spec, local_rank, world_size) == torch.device(expected)


@pytest.mark.parametrize(
    ("spec", "local_rank", "world_size", "count", "message"),
    [
        ("cuda:0", 1, 2, 2, "every rank would train on GPU 0; use cuda or auto"),
        ("cuda", 2, 4, 2, "this node has 2 GPUs; start at most 2 processes per node"),
        ("cuda:3", 0, 1, 2, r"2 GPU\(s\) are visible \(cuda:0 to cuda:1\)"),
        ("cuda", 0, 1, 0, "CUDA is not available"),
    ],
)
def test_a_device_a_rank_cannot_use_is_refused(gpus, spec, local_rank, world_size, count, message):
    gpus(count)
    with pytest.raises(ValueError, match=message):
        resolve_device(spec, local_rank, world_size)


def test_the_trainer_names_the_device_key_under_torchrun(gpus, monkeypatch, tmp_path):
    gpus(2)
    as_rank(monkeypatch, rank=1, world_size=2, local_rank=1)
    with pytest.raises(TrainingArgumentsError, match=r"trainer\.args\.device is 'cuda:0' on local"):
        make_trainer(make_args(tmp_path, device="cuda:0"))


def test_bf16_on_a_gpu_without_it_fails_at_construction(gpus, tmp_path):
    gpus(1, capability=(7, 5))
    with pytest.raises(TrainingArgumentsError) as error:
        make_trainer(make_args(tmp_path, device="cuda", bf16=True, tf32=True))
    problems = error.value.problems
    assert len(problems) == 2
    assert "trainer.args.bf16 is true but Tesla T4 (compute capability 7.5)" in problems[0]
    assert "use fp16: true, or bf16: false" in problems[0]
    assert "trainer.args.tf32 is true but Tesla T4" in problems[1]


def test_precision_an_ampere_gpu_runs_is_accepted(gpus):
    gpus(1, capability=(8, 0))
    args = make_args("out", bf16=True, tf32=True)
    assert device_problems(args, torch.device("cuda", 0)) == []
    assert device_problems(make_args("out", bf16=True), torch.device("cpu")) == []


def test_tf32_off_a_gpu_is_refused():
    (problem,) = device_problems(make_args("out", tf32=True), torch.device("cpu"))
    assert "trainer.args.tf32 is true but the device is cpu" in problem
    assert device_problems(make_args("out", tf32=False), torch.device("cpu")) == []


def test_tf32_and_full_determinism_hold_while_training_and_are_put_back(tmp_path, monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = (torch.backends.cudnn.allow_tf32, torch.are_deterministic_algorithms_enabled())
    seen = {}

    class Probe(Trainer):
        def optimizer_step(self):
            seen["cudnn_tf32"] = torch.backends.cudnn.allow_tf32
            seen["matmul_tf32"] = torch.backends.cuda.matmul.allow_tf32
            seen["deterministic"] = torch.are_deterministic_algorithms_enabled()
            seen["cudnn_benchmark"] = torch.backends.cudnn.benchmark
            seen["cublas"] = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
            super().optimizer_step()

    args = make_args(tmp_path, max_steps=2, tf32=False, full_determinism=True)
    make_trainer(args, trainer_cls=Probe).train()
    assert seen == {
        "cudnn_tf32": False,
        "matmul_tf32": False,
        "deterministic": True,
        "cudnn_benchmark": False,
        "cublas": ":4096:8",
    }
    after = (torch.backends.cudnn.allow_tf32, torch.are_deterministic_algorithms_enabled())
    assert after == before
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ


def test_numerics_leave_torch_alone_by_default():
    before = torch.backends.cudnn.allow_tf32
    with numerics(make_args("out")):
        assert torch.backends.cudnn.allow_tf32 == before
        assert not torch.are_deterministic_algorithms_enabled()


@pytest.mark.parametrize("value", ["yes", 1])
def test_tf32_and_full_determinism_are_booleans(value):
    with pytest.raises(TrainingArgumentsError) as error:
        make_args("out", tf32=value, full_determinism=value)
    assert [p.split(" must")[0] for p in error.value.problems] == [
        "trainer.args.tf32",
        "trainer.args.full_determinism",
    ]


def test_random_state_is_the_trainers_gpu_on_every_rank(gpus, monkeypatch, tmp_path):
    """Rank 1 saves and restores the generator of cuda:1, not of the current device."""
    gpus(2)
    as_rank(monkeypatch, rank=1, world_size=2, local_rank=1)
    calls = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(
        torch.cuda,
        "get_rng_state",
        lambda device="cuda": calls.append(("get", device)) or torch.zeros(8, dtype=torch.uint8),
    )
    monkeypatch.setattr(
        torch.cuda, "set_rng_state", lambda state, device="cuda": calls.append(("set", device))
    )
    trainer = make_trainer(make_args(tmp_path, device="cuda"))
    assert trainer.device == torch.device("cuda", 1)
    rng = trainer.build_checkpoint_manager().components["rng"].obj
    assert isinstance(rng, RngState)
    rng.load_state_dict(rng.state_dict())
    assert calls == [("get", torch.device("cuda", 1)), ("set", torch.device("cuda", 1))]


def test_loaders_pin_memory_for_a_gpu_and_keep_their_workers(tmp_path):
    # HF's names: dataloader_persistent_workers (default false, as HF), dataloader_pin_memory
    args = make_args(tmp_path, dataloader_num_workers=2, dataloader_persistent_workers=True)
    trainer = make_trainer(args, eval_size=8)
    trainer.model = trainer.model_init()  # remove_unused_columns reads forward's parameters
    for loader in (trainer.build_train_loader(), trainer.build_eval_loader()):
        assert loader.num_workers == 2 and loader.persistent_workers
        assert not loader.pin_memory  # nothing to pin for on CPU
    trainer.device = torch.device("cuda", 0)
    settings = trainer._worker_settings()
    assert settings["num_workers"] == 2 and settings["persistent_workers"] is True
    assert settings["pin_memory"] is True
    trainer = make_trainer(make_args(tmp_path))
    assert "persistent_workers" not in trainer._worker_settings()  # no workers to keep


class EvalModels(Trainer):
    """Records the module evaluation calls."""

    def compute_loss(self, model, batch, return_outputs=False):
        if not model.training:
            self.eval_models.append(model)
        return super().compute_loss(model, batch, return_outputs=return_outputs)


@pytest.mark.slow
def test_evaluation_runs_the_compiled_model(tmp_path, monkeypatch):
    compile_eager = functools.partial(torch.compile, backend="eager")  # no C++ toolchain needed
    monkeypatch.setattr(torch, "compile", compile_eager)
    args = make_args(
        tmp_path, max_steps=1, torch_compile=True, eval_strategy="steps", max_eval_batches=1
    )
    trainer = make_trainer(args, eval_size=8, trainer_cls=EvalModels)
    trainer.eval_models = []
    trainer.train()
    assert trainer.eval_models
    for model in trainer.eval_models:
        assert isinstance(model, torch._dynamo.eval_frame.OptimizedModule)
        assert model._orig_mod is trainer.model
