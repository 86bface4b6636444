"""What the device can compute in, checked before the first step; TF32 and full determinism.

``device_problems`` turns a precision the device lacks (bf16 on a GPU older than Ampere, TF32
off an Ampere GPU) into a config error at trainer construction, instead of a failure or a
silent emulation at the first step. ``numerics`` applies ``tf32`` and ``full_determinism`` (as
Hugging Face's ``TrainingArguments`` name them) for the duration of ``train()`` and puts the
previous process-wide settings back afterwards.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import torch

from forge.train.args import TrainingArguments

#: cuBLAS needs a fixed workspace to be deterministic (PyTorch's reproducibility notes)
CUBLAS_WORKSPACE = ":4096:8"


def _gpu_name(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor})"


def device_problems(args: TrainingArguments, device: torch.device) -> list[str]:
    """Every precision setting in ``args`` that ``device`` cannot run, each with its fix."""
    key = args.config_key
    problems: list[str] = []
    on_gpu = device.type == "cuda"
    if args.bf16 and on_gpu and not torch.cuda.is_bf16_supported(including_emulation=False):
        problems.append(
            f"{key}.bf16 is true but {_gpu_name(device)} has no bfloat16 arithmetic (it needs "
            "compute capability 8.0, Ampere, or newer); use fp16: true, or bf16: false"
        )
    if args.tf32:
        if not on_gpu:
            problems.append(
                f"{key}.tf32 is true but the device is {device}; TF32 is a mode of NVIDIA GPUs "
                "from Ampere on: set tf32: null (leave torch's default) or false"
            )
        elif torch.cuda.get_device_capability(device) < (8, 0):
            problems.append(
                f"{key}.tf32 is true but {_gpu_name(device)} has no TF32 (it needs compute "
                "capability 8.0, Ampere, or newer); set tf32: null or false"
            )
    return problems


@contextmanager
def numerics(args: TrainingArguments) -> Iterator[None]:
    """TF32 and full determinism as ``args`` ask, for the duration of the block.

    ``tf32`` None leaves torch's settings alone; true / false sets TF32 for matmuls and
    cuDNN convolutions. ``full_determinism`` makes torch use deterministic algorithms only
    (an op without one raises), turns cuDNN's benchmark off and gives cuBLAS the fixed
    workspace it needs; slower, and the same bits on every run of the same hardware. Only
    the settings asked for are touched, and each is put back on exit.
    """
    with ExitStack() as stack:
        if args.tf32 is not None:
            stack.enter_context(_tf32(bool(args.tf32)))
        if args.full_determinism:
            stack.enter_context(_full_determinism())
        yield


@contextmanager
def _tf32(enabled: bool) -> Iterator[None]:
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@contextmanager
def _full_determinism() -> Iterator[None]:
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    saved_env = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    # read when cuBLAS starts on a device; a user's own setting wins
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        enabled, warn_only, deterministic, benchmark = saved
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
        torch.backends.cudnn.deterministic = deterministic
        torch.backends.cudnn.benchmark = benchmark
        if saved_env is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = saved_env
