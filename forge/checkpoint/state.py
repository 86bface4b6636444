"""What a checkpoint holds besides weights: random-number state and safely loaded torch files."""

from __future__ import annotations

import os
import pickle
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from forge.checkpoint.io import CheckpointError


def capture_rng_state() -> dict[str, Any]:
    """The state of every random generator a training step draws from.

    Python ``random``, numpy's global generator, torch CPU and (when CUDA is in use) the current
    CUDA device, encoded as tensors and plain data so ``torch.load(weights_only=True)`` reads it.
    """
    version, internal, gauss_next = random.getstate()
    algorithm, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    state: dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss_next": gauss_next},
        "numpy": {
            "algorithm": str(algorithm),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # Only the current device: touching every device would create a CUDA context on each
        # GPU from every rank.
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put every generator back to a state from ``capture_rng_state``."""
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
    npy = state["numpy"]
    np.random.set_state(
        (
            npy["algorithm"],
            np.asarray(npy["keys"].numpy(), dtype=np.uint32),
            npy["pos"],
            npy["has_gauss"],
            npy["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


_GLOBAL_RE = re.compile(r"GLOBAL ([\w.]+)")
_OPERAND_RE = re.compile(r"Unsupported operand (\d+)")


def _refusal_reason(message: str) -> str:
    if match := _GLOBAL_RE.search(message):
        return f"unsupported global {match.group(1)}"
    if match := _OPERAND_RE.search(message):
        return f"unsupported pickle opcode {match.group(1)}"
    return message.strip().splitlines()[0][:200] if message.strip() else "rejected by weights_only"


def load_torch_state(path: str | os.PathLike) -> Any:
    """``torch.load`` a checkpoint file to CPU with ``weights_only=True``.

    A file holding anything besides tensors and plain data (a pickled function or class) is
    refused with a CheckpointError, as is a missing or corrupt file.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: missing")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"{path}: refusing to load: it holds Python objects other than tensors and plain "
            f"data ({_refusal_reason(str(exc))}); a checkpoint can never run code. "
            "Was it written by forge?"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        first = str(exc).strip().split(". ")[0] or type(exc).__name__
        raise CheckpointError(f"{path}: unreadable, corrupt or truncated ({first})") from exc
