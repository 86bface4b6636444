"""RNG capture/restore and loading torch files without running code."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from forge.checkpoint import (
    CheckpointError,
    CheckpointWriter,
    capture_rng_state,
    load_torch_state,
    restore_rng_state,
)


def _draw() -> tuple:
    return (
        [random.random() for _ in range(3)],
        random.gauss(0, 1),
        np.random.rand(3).tolist(),
        np.random.randn(),  # leaves a cached gaussian behind
        torch.rand(3).tolist(),
        torch.randint(0, 1000, (4,)).tolist(),
    )


def test_rng_state_restores_exactly_through_a_checkpoint(tmp_path: Path) -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    _draw()
    state = capture_rng_state()
    with CheckpointWriter(tmp_path, 1) as writer:
        writer.save_torch("rank_state_00000.pt", {"rng": state})
    expected = _draw()
    _draw()  # move every generator on
    loaded = load_torch_state(writer.final_path / "rank_state_00000.pt")["rng"]
    restore_rng_state(loaded)
    assert _draw() == expected
    restore_rng_state(state)
    assert _draw() == expected


def test_rng_state_is_plain_data() -> None:
    state = capture_rng_state()
    assert set(state) >= {"python", "numpy", "torch"}
    assert isinstance(state["numpy"]["keys"], torch.Tensor)
    assert not any(isinstance(v, np.generic) for v in state["numpy"].values())


class Payload:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


class Custom:
    def __init__(self) -> None:
        self.value = 1


@pytest.mark.parametrize(
    ("obj", "reason"),
    [
        ({"f": os.system}, "unsupported global posix.system"),
        ({"step": 1, "x": Payload()}, "unsupported global posix.system"),
        ({"obj": Custom()}, "Custom"),
    ],
)
def test_pickled_code_is_refused(tmp_path: Path, obj, reason: str) -> None:
    path = tmp_path / "training_state.pt"
    torch.save(obj, path)
    with pytest.raises(CheckpointError) as caught:
        load_torch_state(path)
    message = str(caught.value)
    assert message.startswith(
        f"{path}: refusing to load: it holds Python objects other than tensors and plain data ("
    )
    assert reason in message
    assert message.endswith("a checkpoint can never run code. Was it written by forge?")


def test_plain_state_loads_to_cpu(tmp_path: Path) -> None:
    path = tmp_path / "training_state.pt"
    optimizer = torch.optim.AdamW(torch.nn.Linear(3, 2).parameters())
    torch.save({"optimizer": optimizer.state_dict(), "step": 3, "t": torch.ones(2)}, path)
    state = load_torch_state(path)
    assert state["step"] == 3 and torch.equal(state["t"], torch.ones(2))
    assert state["optimizer"]["param_groups"][0]["lr"] == optimizer.param_groups[0]["lr"]


def test_missing_and_corrupt_files(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"training_state\.pt: missing"):
        load_torch_state(tmp_path / "training_state.pt")
    path = tmp_path / "rank_state_00000.pt"
    torch.save({"t": torch.randn(100)}, path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"rank_state_00000\.pt: unreadable, corrupt"):
        load_torch_state(path)


def test_rng_state_holds_the_generator_of_the_given_gpu(monkeypatch) -> None:
    """The CUDA generator saved and restored is the given device's (each rank its own GPU),
    else the current device's, and only once CUDA is in use; on CPU there is none."""
    calls = []

    def get(device="cuda"):
        calls.append(("get", device))
        return torch.full((4,), 7, dtype=torch.uint8)

    monkeypatch.setattr(torch.cuda, "get_rng_state", get)
    monkeypatch.setattr(
        torch.cuda, "set_rng_state", lambda s, d="cuda": calls.append(("set", d, s))
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    gpu1 = torch.device("cuda", 1)
    state = capture_rng_state(gpu1)
    assert torch.equal(state["cuda"], torch.full((4,), 7, dtype=torch.uint8))
    restore_rng_state(state, gpu1)
    assert calls[0] == ("get", gpu1) and calls[1][:2] == ("set", gpu1)
    assert torch.equal(calls[1][2], state["cuda"])
    calls.clear()
    restore_rng_state(capture_rng_state())  # no device named: the current one
    assert [c[:2] for c in calls] == [("get", "cuda"), ("set", "cuda")]
    calls.clear()
    assert "cuda" not in capture_rng_state(torch.device("cpu"))  # a CPU trainer: none
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert "cuda" not in capture_rng_state()  # CUDA never used: no context is created
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    restore_rng_state({**capture_rng_state(), "cuda": torch.zeros(4, dtype=torch.uint8)})
    assert calls == []  # a GPU checkpoint resumed on a CPU-only machine
