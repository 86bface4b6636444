"""Counting host reads of tensors per training step (shared by test_host_sync.py and its DDP
script).

On a GPU, reading a tensor on the host (``.item()``, ``.tolist()``, ``float()``, ``bool()``,
``.cpu()``, ...) waits for every kernel queued before it, so the CPU stops running ahead of
the device. On CPU nothing waits, but the same calls are made, so counting them on CPU says
which steps would wait on a GPU.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from forge.train import TrainerCallback
from tests.train.common import VOCAB

READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__")

# Host-side data preparation (sampling indices, seeding workers, collating) reads CPU tensors
# before anything reaches the device; it is not a device sync.
HOST_DATA_MODULES = ("torch.utils.data", "torchdata", "forge.data")


class SmallLM(nn.Module):
    """A next-token model without host reads of its own (unlike Hugging Face's mask helpers),
    so every read counted comes from the loop or from torch under it; dropout on, so the
    random generators matter."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, input_ids, attention_mask=None, labels=None):
        logits = self.head(self.drop(self.embed(input_ids)))
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return {"loss": loss}


class HostReads(TrainerCallback):
    """Records every host read with the step it belongs to, while entered as a context.

    A read before ``on_step_end`` of step k belongs to step k (the step's own work); a read
    after it belongs to step k too (its logging, evaluation, checkpoint and stop check) until
    the collator is called for the next step's batches.
    """

    def __init__(self) -> None:
        self.reads: list[tuple[int, str, str, int]] = []  # step, method, module, line
        self.step = 0  # the step whose work runs now (0: setting up)
        self._after_step_end = True
        self._originals: dict[str, Any] = {}

    def on_step_end(self, args, state, control, **kwargs):
        self.step = state.global_step
        self._after_step_end = True

    def collator(self, inner):
        """Wraps a collator: its call starts the next step's batches."""

        def collate(items):
            self.step_start()
            return inner(items)

        return collate

    def step_start(self) -> None:
        if self._after_step_end:
            self.step += 1
            self._after_step_end = False

    def __enter__(self) -> HostReads:
        for name in READS:
            original = getattr(torch.Tensor, name)
            self._originals[name] = original
            setattr(torch.Tensor, name, self._counting(name, original))
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)
        self._originals.clear()

    def _counting(self, name: str, original: Any) -> Any:
        def read(tensor, *args, **kwargs):
            caller = sys._getframe(1)
            module = caller.f_globals.get("__name__", "?")
            if not module.startswith(HOST_DATA_MODULES) and not _reads_a_finished_vote(caller):
                self.reads.append((self.step, name, module, caller.f_lineno))
            return original(tensor, *args, **kwargs)

        return read

    def by_step(self) -> dict[int, list[tuple[str, str, int]]]:
        steps: dict[int, list[tuple[str, str, int]]] = {}
        for step, *where in self.reads:
            steps.setdefault(step, []).append(tuple(where))
        return steps


def _reads_a_finished_vote(frame: Any) -> bool:
    """The stop vote (forge.train.loop_state.StopVote) reads the previous step's agreement,
    copied to the host when that step ended and, on a GPU, behind an event that has fired by
    the end of the next step: nothing waits for the device there."""
    return (
        frame.f_globals.get("__name__") == "forge.train.loop_state"
        and frame.f_code.co_name == "cast"
    )


def quiet_steps(max_steps: int, logging_steps: int, save_steps: int | None) -> list[int]:
    """Steps that neither log nor save (the last step always does both)."""
    return [
        step
        for step in range(1, max_steps)
        if step % logging_steps and (save_steps is None or step % save_steps)
    ]
