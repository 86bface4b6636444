"""Small records the loop keeps: one step's agreed numbers and log tallies (the data position
is ``forge.train.data_position.DataPosition``)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

Batch = dict[str, Any]


class TrainOutput(NamedTuple):
    """What ``train()`` returns: the final step, the mean training loss of this call, metrics."""

    global_step: int
    training_loss: float
    metrics: dict[str, float]


@dataclass
class StepResult:
    """One optimizer step's numbers, identical on every rank.

    All four are 0-d tensors on the trainer's device: reading one on the host would wait for
    the step to finish, so the loop keeps them there and reads them at logging steps
    (``Tally.settle``).
    """

    loss: torch.Tensor  # mean micro-batch loss, averaged over ranks (float64)
    tokens: torch.Tensor  # tokens of the step, summed over ranks (float64)
    grad_norm: torch.Tensor  # before clipping
    finite: torch.Tensor  # bool; False: the step must be skipped (when skip_nonfinite)
    samples: torch.Tensor | float = 0.0  # items the step trained on, over ranks (float64)
    flops: torch.Tensor | float = 0.0  # its floating-point operations, over ranks (float64)
    #: (sum of the stop signals the ranks had received when the step ended, how many had one):
    #: a stop agreed in the step's own all-reduce, read one step later (``StopVote``)
    stop: torch.Tensor | None = None


class StopVote:
    """When the ranks of a job stop for a signal: they agree in each optimizer step's
    all-reduce (the signal each had received rides along with the loss), and the loop reads what
    step ``k`` agreed at the end of step ``k + 1``, when that reduce has long finished, so no step
    waits for the device. A signal that arrives during step ``k`` stops the job after step
    ``k + 2`` (``k + 1`` when it arrived before the step's reduce), on every rank alike."""

    def __init__(self) -> None:
        self._previous: tuple[torch.Tensor, Any] | None = None  # last step's (sum, count)

    def cast(self, stop: torch.Tensor | None) -> int:
        """Keep this step's vote (copied to the host without waiting); return the signal the
        previous step agreed on (0: none)."""
        previous, self._previous = self._previous, None
        if stop is not None:
            event = None
            if stop.is_cuda:  # the copy lands when the step's reduce has run: an event says so
                stop = stop.to("cpu", non_blocking=True)
                event = torch.cuda.Event()
                event.record()
            self._previous = (stop, event)
        if previous is None:
            return 0
        votes, event = previous
        if event is not None:
            event.synchronize()  # a step later: long done
        total, count = votes.tolist()
        return int(round(total / count)) if count else 0

    def reset(self) -> None:
        self._previous = None


class Tally:
    """Sums step results between two logs (and over a whole ``train()`` call).

    ``add`` runs on the device (no host sync); ``settle`` reads what was added since the last
    settle into the plain numbers, once, at a logging step or a checkpoint.
    """

    _SUMS = ("loss_sum", "finite_steps", "skipped", "tokens", "samples", "flops")

    def __init__(self) -> None:
        self.steps = self.finite_steps = self.skipped = self.tokens = self.samples = 0
        self.loss_sum = self.flops = 0.0
        self.grad_norm = float("nan")
        self.started = time.perf_counter()
        self._pending: torch.Tensor | None = None  # sums of _SUMS since the last settle
        self._last_norm: torch.Tensor | None = None
        # the model's own metrics (``model_metrics``): sums on the device, counts on the host
        self._metric_sums: dict[str, torch.Tensor | float] = {}
        self.metric_counts: dict[str, int] = {}
        self.metric_totals: dict[str, float] = {}

    def add(self, step: StepResult) -> None:
        self.steps += 1
        finite = step.finite
        row = torch.stack(
            [
                torch.where(finite, step.loss, 0.0),  # not loss * finite: nan * 0 is nan
                finite.double(),
                (~finite).double(),
                step.tokens.double(),
                torch.as_tensor(step.samples, dtype=torch.float64, device=finite.device),
                torch.as_tensor(step.flops, dtype=torch.float64, device=finite.device),
            ]
        )
        self._pending = row if self._pending is None else self._pending + row
        self._last_norm = step.grad_norm

    def add_outputs(self, outputs: Any) -> None:
        """Add one micro-batch's ``model_metrics`` (on the device: no host sync)."""
        for name, value in model_metrics(outputs).items():
            value = value.detach().double() if isinstance(value, torch.Tensor) else float(value)
            held = self._metric_sums.get(name)
            self._metric_sums[name] = value if held is None else held + value
            self.metric_counts[name] = self.metric_counts.get(name, 0) + 1

    def outputs_mark(self) -> tuple[dict[str, Any], dict[str, int]]:
        """The model metrics added so far, to go back to (``rewind_outputs``)."""
        return dict(self._metric_sums), dict(self.metric_counts)

    def rewind_outputs(self, mark: tuple[dict[str, Any], dict[str, int]]) -> None:
        """Forget the model metrics added since ``mark`` (a step tried again)."""
        self._metric_sums, self.metric_counts = dict(mark[0]), dict(mark[1])

    def metric_means(self) -> dict[str, float]:
        """Each model metric's mean over the micro-batches added (reads the device once)."""
        sums, self._metric_sums = self._metric_sums, {}
        on_device = {n: v for n, v in sums.items() if isinstance(v, torch.Tensor)}
        read = dict(sums)
        if on_device:  # one read of them all, stacked where they live
            by_device: dict[torch.device, list[str]] = {}
            for name, value in on_device.items():
                by_device.setdefault(value.device, []).append(name)
            for names in by_device.values():
                values = torch.stack([on_device[n] for n in names]).tolist()  # sync
                read.update(zip(names, values, strict=True))
        for name, value in read.items():
            self.metric_totals[name] = self.metric_totals.get(name, 0.0) + value
        return {
            name: total / self.metric_counts[name] for name, total in self.metric_totals.items()
        }

    def settle(self) -> Settled:
        """Fold the device-side sums into the plain numbers; returns what was folded in."""
        if self._pending is None:
            return Settled(0, 0)
        loss_sum, finite_steps, skipped, tokens, samples, flops = self._pending.tolist()  # sync
        norm = self._last_norm
        self._pending = self._last_norm = None
        self.loss_sum += loss_sum
        self.finite_steps += int(finite_steps)
        self.skipped += int(skipped)
        self.tokens += int(tokens)
        self.samples += int(samples)
        self.flops += flops
        self.grad_norm = float(norm)
        return Settled(int(tokens), int(skipped))

    def state_dict(self) -> dict[str, Any]:
        """The loss part (not tokens or time) and the model's metrics, so a resumed run logs the
        same means."""
        self.settle()
        self.metric_means()
        keys = ("steps", "finite_steps", "skipped", "loss_sum", "grad_norm")
        if self.metric_counts:  # a model that returns metrics: their window so far too
            keys += ("metric_counts", "metric_totals")
        return {key: getattr(self, key) for key in keys}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._pending = self._last_norm = None
        self._metric_sums = {}
        for key, value in state.items():
            setattr(self, key, value)

    @property
    def mean_loss(self) -> float:
        return self.loss_sum / self.finite_steps if self.finite_steps else float("nan")

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / max(time.perf_counter() - self.started, 1e-9)


class Settled(NamedTuple):
    """What one ``Tally.settle`` read from the device: tokens and skipped steps."""

    tokens: int
    skipped: int


#: model output fields that are no metric to log: the loss (logged as such) and predictions
_NOT_METRICS = ("loss", "logits")


def model_metrics(outputs: Any) -> dict[str, torch.Tensor | float]:
    """The extra loss parts and metrics a model returns (a ponder cost, the passes taken...):
    every field of its outputs (a mapping, or an object such as Hugging Face's ``ModelOutput``)
    besides ``loss`` and ``logits`` that is a float or a 0-d floating-point tensor."""
    if isinstance(outputs, Mapping):
        fields = outputs.items()
    elif hasattr(outputs, "__dict__") and not isinstance(outputs, torch.Tensor):
        fields = vars(outputs).items()
    else:
        return {}
    return {
        name: value
        for name, value in fields
        if name not in _NOT_METRICS
        and not name.startswith("_")
        and (
            (isinstance(value, float))
            or (isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_floating_point())
        )
    }


def count_tokens(batch: Batch) -> torch.Tensor | int:
    """Tokens in a batch: the attention mask's ones (a tensor where the mask is, so counting
    never waits for the device), else the number of input ids (known on the host)."""
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor):
        return mask.sum()
    ids = batch.get("input_ids")
    return ids.numel() if isinstance(ids, torch.Tensor) else 0


def step_logs(
    tally: Tally, state: Any, learning_rate: float, tokens_seen: bool
) -> dict[str, float]:
    """What a logging step reports of the steps since the last log: mean loss, the model's
    extra metrics (``model_metrics``: means over the window), learning rate, grad norm,
    tokens/s (when the batches hold tokens: ``count_tokens``), epoch, skipped steps, and with
    ``tokens_seen`` the input tokens so far."""
    logs: dict[str, float] = {
        "loss": tally.mean_loss,
        **tally.metric_means(),
        "learning_rate": learning_rate,
        "grad_norm": tally.grad_norm,
    }
    if tally.tokens:  # a model without input_ids or attention_mask has no tokens to rate
        logs["tokens_per_second"] = tally.tokens_per_second
    logs["epoch"] = round(state.epoch, 4)
    if tally.skipped:
        logs["nonfinite_skipped"] = state.nonfinite_skipped
    if tokens_seen:
        logs["num_input_tokens_seen"] = state.tokens_seen
    return logs


def train_summary(steps: int, run_tally: Tally, state: Any, counts_flops: bool) -> dict[str, float]:
    """Hugging Face's end-of-training metrics for one ``train()`` call (a resumed run counts the
    steps and samples it ran itself): ``train_runtime`` (seconds, from the first step),
    ``train_samples_per_second`` (the items trained on, over ranks),
    ``train_steps_per_second``, ``total_flos`` (over the whole run, for a model that estimates
    them), ``train_loss`` and ``epoch``."""
    runtime = max(time.perf_counter() - run_tally.started, 1e-9)
    summary = {
        "train_runtime": round(runtime, 4),
        "train_samples_per_second": round(run_tally.samples / runtime, 3),
        "train_steps_per_second": round(steps / runtime, 3),
    }
    if counts_flops:
        summary["total_flos"] = state.total_flos
    summary["train_loss"] = run_tally.mean_loss
    summary["epoch"] = state.epoch
    return summary
