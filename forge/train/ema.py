"""An exponential moving average (EMA) of a model's trainable parameters.

``WeightsEMA`` keeps an fp32 copy of every trainable parameter on that parameter's device and
moves it towards the weights after each applied optimizer step (``on_optimizer_step``; a
skipped step leaves it as it was), every ``update_every`` applied steps. With ``n`` the applied
optimizer steps so far (this one included), an update is

    decay_n = decay * min(1, (n - 1) / warmup_steps)      (decay_n = decay when warmup_steps is 0)
    ema     = decay_n * ema + (1 - decay_n) * weights

so with a warmup the first update takes the weights as they are and the decay reaches
``decay`` at step ``warmup_steps + 1``; before its first update the average is the weights the
training started from. The update is ``torch.optim.swa_utils.get_ema_multi_avg_fn`` (one
``_foreach_lerp_`` over the parameters).

It is a stage-scoped checkpoint component keyed by parameter name, so each pipeline stage
keeps the average of its own parameters and a checkpoint of one split loads into another, as
the optimizer's state does. Under FSDP2 the parameters are DTensors holding each rank's rows: the
average is a DTensor sharded as its parameter, updated on the local rows alone (no gather), and
a sharded component: each rank writes its rows, and any process count or trainer reads them
back (a merge by name, as the sharded optimizer's). ``swapped_in`` evaluates with the average: it puts the average into
the parameters and, after, the weights back bit for bit. ``read_ema_state`` reads a
checkpoint's average for ``forge export --ema`` and ``forge evaluate --ema``.

Why not ``torch.optim.swa_utils.AveragedModel``: it deep-copies the whole module (frozen
weights and buffers included, and wrappers such as DDP, a compiled module or a pipeline stage's
hooks), in the module's own dtype, and evaluates that copy rather than the trained module; forge
needs an fp32 average of the trainable parameters only, a warmup, a state keyed by the
parameter names every trainer saves, and evaluation through the trainer's own model (a
pipeline's stages hold it).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim.swa_utils import get_ema_multi_avg_fn

from forge.checkpoint import CheckpointError, Component, Scope, read_manifest
from forge.checkpoint.registry import read_component_states
from forge.checkpoint.sharded import has_dtensors, local_piece, merge_sharded, split_state
from forge.train.callbacks import TrainerCallback
from forge.wrappers import unwrap_model

logger = logging.getLogger(__name__)

#: the checkpoint component's name (files ``ema.pt``, ``ema-stage-K-of-N.pt`` or
#: ``ema-shard-RRRRR-of-WWWWW.pt``)
EMA_COMPONENT = "ema"

#: a sharded average's files key each tensor as ``weights.<name>`` beside ``steps``, ``updates``
_WEIGHTS = "weights."


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a DTensor (sharing its memory), or the tensor itself."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _sharded_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that FSDP2's ``fully_shard`` made ``FSDPModule``s."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in unwrap_model(model).modules() if isinstance(m, FSDPModule)]


def nested_state(state: dict[str, Any]) -> dict[str, Any]:
    """An average's state as ``WeightsEMA.state_dict`` gives it whole, from that or from a
    sharded average's shards merged (``weights.<name>`` keys beside ``steps``, ``updates``)."""
    if "weights" in state:
        return state
    weights = {k.removeprefix(_WEIGHTS): v for k, v in state.items() if k.startswith(_WEIGHTS)}
    return {"steps": state["steps"], "updates": state["updates"], "weights": weights}


def trainable_parameters(model: nn.Module) -> list[tuple[list[str], nn.Parameter]]:
    """Each trainable parameter once, with every name it has (tied weights have several), as
    the model's checkpoints name its weights: inside the wrappers forge peels
    (``unwrap_model``: DDP, LossAdapter...; not a peft model, whose names are its own)."""
    found: dict[int, tuple[list[str], nn.Parameter]] = {}
    for name, param in unwrap_model(model).named_parameters(remove_duplicate=False):
        if param.requires_grad:
            plain = ".".join(part for part in name.split(".") if part != "_orig_mod")
            found.setdefault(id(param), ([], param))[0].append(plain)
    return list(found.values())


class WeightsEMA:
    """The moving average of ``model``'s trainable parameters; see the module docstring."""

    def __init__(
        self,
        model: nn.Module,
        decay: float,
        *,
        warmup_steps: int = 0,
        update_every: int = 1,
    ) -> None:
        if not 0 < decay < 1:
            raise ValueError(f"EMA decay must be in (0, 1) (got {decay!r})")
        self.decay = float(decay)
        self.warmup_steps = int(warmup_steps)
        self.update_every = int(update_every)
        self.params = trainable_parameters(model)
        if not self.params:
            raise ValueError("the model has no trainable parameters to average")
        self.shadow = [self._fp32_copy(p) for _, p in self.params]
        self.sharded = has_dtensors(self.shadow)  # FSDP2: each rank holds its rows
        self._gathered = _sharded_modules(model) if self.sharded else []
        self.steps = 0  # applied optimizer steps
        self.updates = 0

    @staticmethod
    def _fp32_copy(param: torch.Tensor) -> torch.Tensor:
        """An fp32 copy laid out as ``param`` (a DTensor's: sharded the same way)."""
        with torch.no_grad():
            return torch.empty_like(param, dtype=torch.float32).copy_(param.detach())

    def _locals(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(this rank's rows of each parameter, of its average): what an update touches."""
        return [_local(p.detach()) for _, p in self.params], [_local(s) for s in self.shadow]

    # ------------------------------------------------------------------ updates
    def decay_at(self, step: int) -> float:
        """The decay of an update after applied optimizer step ``step`` (1-based)."""
        if self.warmup_steps <= 0:
            return self.decay
        return self.decay * min(1.0, (step - 1) / self.warmup_steps)

    def on_optimizer_step(self, applied: bool) -> None:
        """After each optimizer step: count it if it was applied, and update every
        ``update_every`` applied steps. A skipped step changes nothing."""
        if not applied:
            return
        self.steps += 1
        if self.steps % self.update_every:
            return
        weights, shadow = self._locals()  # a sharded average updates its own rows: no gather
        weights = [w if w.dtype == torch.float32 else w.float() for w in weights]
        with torch.no_grad():
            get_ema_multi_avg_fn(self.decay_at(self.steps))(shadow, weights, None)
        self.updates += 1

    def reset_to_weights(self) -> None:
        """Start the average afresh from the current weights (no steps counted)."""
        with torch.no_grad():
            for weights, shadow in zip(*self._locals(), strict=True):
                shadow.copy_(weights)
        self.steps = self.updates = 0

    # ------------------------------------------------------------------ evaluation
    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The average in the parameters (in their dtype) for the duration; the weights are
        put back exactly afterwards, whatever happens inside."""
        params, shadows = self._locals()
        with torch.no_grad():
            kept = [p.clone() for p in params]
            for param, shadow in zip(params, shadows, strict=True):
                param.copy_(shadow)
        self._drop_gathered()
        try:
            yield
        finally:
            with torch.no_grad():
                for param, weights in zip(params, kept, strict=True):
                    param.copy_(weights)
            self._drop_gathered()

    def _drop_gathered(self) -> None:
        """Free the parameters FSDP2 keeps gathered between forwards (the root's, which is
        not resharded after a forward without backward): the next forward gathers the rows
        just swapped in or out, never the other weights' stale copy."""
        for module in self._gathered:
            module.reshard()

    def copy_to_weights(self) -> None:
        """Put the average into the parameters (in their dtype), for good."""
        with torch.no_grad():
            for param, shadow in zip(*self._locals(), strict=True):
                param.copy_(shadow)
        self._drop_gathered()

    # ------------------------------------------------------------------ checkpoint component
    def state_dict(self) -> dict[str, Any]:
        """``{"steps", "updates", "weights": {name: fp32 tensor}}``: each tied parameter under
        every name it has (one tensor, saved once), so any split finds the names it holds.
        A sharded average gives this rank's shard (``split_state``) of ``weights.<name>``
        keys: its rows of each average; rank 0 also the counts."""
        weights = {}
        for (names, _), shadow in zip(self.params, self.shadow, strict=True):
            for name in names:
                weights[name] = shadow
        if not self.sharded:
            return {"steps": self.steps, "updates": self.updates, "weights": weights}
        import torch.distributed as dist

        flat = {f"{_WEIGHTS}{name}": tensor for name, tensor in weights.items()}
        flat.update(steps=self.steps, updates=self.updates)
        return split_state(flat, keep_whole=not dist.is_initialized() or dist.get_rank() == 0)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """This model's names from a checkpoint of any split (``reshard`` merged them) or any
        number of shards (merged whole); a sharded average keeps this rank's rows."""
        state = nested_state(state)
        saved = state["weights"]
        missing = [names[0] for names, _ in self.params if not any(n in saved for n in names)]
        if missing:
            shown = ", ".join(missing[:5]) + (
                f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            )
            raise CheckpointError(
                f"the checkpoint's moving average of the weights (component '{EMA_COMPONENT}') "
                f"has no average of {shown}; it was written for another model or other "
                "trainable parameters"
            )
        with torch.no_grad():
            for (names, _), shadow in zip(self.params, self.shadow, strict=True):
                found = saved[next(n for n in names if n in saved)]
                if found.shape != shadow.shape:
                    raise CheckpointError(
                        f"the checkpoint's moving average of {names[0]} has shape "
                        f"{tuple(found.shape)}, the parameter {tuple(shadow.shape)}"
                    )
                local, offset, _ = local_piece(shadow)
                local.copy_(found[offset : offset + local.shape[0]] if local.dim() else found)
        self.steps, self.updates = int(state["steps"]), int(state["updates"])

    @staticmethod
    def reshard(shards: list[dict[str, Any]]) -> dict[str, Any]:
        """The average of another pipeline split: the stages' names merged (every stage
        counts the same steps)."""
        steps = {(s["steps"], s["updates"]) for s in shards}
        if len(steps) != 1:
            raise CheckpointError(
                f"the stages' moving averages of the weights counted other steps ({sorted(steps)})"
            )
        weights: dict[str, torch.Tensor] = {}
        for shard in shards:
            weights.update(shard["weights"])
        return {**shards[0], "weights": weights}


class EMACallback(TrainerCallback):
    """A moving average of the weights on the trainer's seams (the trainer adds it when
    ``ema_decay`` is set): ``on_register`` starts the average of the model's trainable
    parameters and registers it as a stage-scoped checkpoint component, which follows every
    applied optimizer step (``WeightsEMA.on_optimizer_step``); a checkpoint without one (trained
    without ``ema_decay``) starts it from the restored weights, with a warning. With ``evaluate``
    (``eval_with_ema``) evaluation runs with the average (``evaluation_weights``), and at the end
    of training the best checkpoint's average replaces its weights (``load_best_model_at_end``:
    its metric was the average's)."""

    def __init__(
        self,
        decay: float,
        *,
        warmup_steps: int = 0,
        update_every: int = 1,
        evaluate: bool = False,
    ) -> None:
        self.decay = decay
        self.warmup_steps = warmup_steps
        self.update_every = update_every
        self.evaluate = evaluate
        self.average: WeightsEMA | None = None  # built by on_register, once per train()

    @classmethod
    def from_args(cls, args: Any) -> EMACallback:
        return cls(
            args.ema_decay,
            warmup_steps=args.ema_warmup_steps,
            update_every=args.ema_update_every,
            evaluate=args.eval_with_ema,
        )

    def on_register(self, args, state, control, register, model=None, **kwargs):
        self.average = WeightsEMA(
            model, self.decay, warmup_steps=self.warmup_steps, update_every=self.update_every
        )
        stages = getattr(kwargs.get("topology"), "num_stages", 1)
        logger.info("%s", self.describe(stages))
        register(
            Component(
                EMA_COMPONENT,
                self.average,
                Scope.SHARDED if self.average.sharded else Scope.STAGE,
                required=False,
                reshard=WeightsEMA.reshard,
                on_absent=self.average.reset_to_weights,  # after the weights were restored
            )
        )

    def describe(self, stages: int = 1) -> str:
        """The log line that says the average is on, how it updates, and which weights
        evaluation uses (of this process's parameters: with ``stages`` > 1, a stage's own)."""
        count = sum(param.numel() for _, param in self.average.params) if self.average else 0
        whose = f" (this process's pipeline stage of {stages})" if stages > 1 else ""
        warmup = f"warmup {self.warmup_steps} steps" if self.warmup_steps else "no warmup"
        every = (
            f"every {self.update_every} applied optimizer steps"
            if self.update_every > 1
            else "after every applied optimizer step"
        )
        evaluation = (
            "evaluation and the best checkpoint use the average (eval_with_ema)"
            if self.evaluate
            else "evaluation uses the trained weights (eval_with_ema: false)"
        )
        return (
            f"moving average of the weights (EMA) of {count:,} trainable parameters{whose}: decay "
            f"{self.decay:g}, {warmup}, updated {every}; {evaluation}"
        )

    def evaluation_weights(self, args, state, control, **kwargs):
        if self.evaluate and self.average is not None:
            return self.average.swapped_in()
        return None

    def on_train_end(self, args, state, control, interrupted=None, **kwargs):
        if interrupted or not self.evaluate or self.average is None:
            return
        if args.load_best_model_at_end and state.best_checkpoint:
            self.average.load_state_dict(read_ema_component(Path(state.best_checkpoint)))
            self.average.copy_to_weights()
            logger.info(
                "the model holds the moving average of the weights of the best checkpoint, %s "
                "(load_best_model_at_end with eval_with_ema: its metric was the average's)",
                state.best_checkpoint,
            )


def moving_average(trainer: Any) -> WeightsEMA | None:
    """The moving average a trainer keeps (its ``EMACallback``'s), or None."""
    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, EMACallback):
            return callback.average
    return None


# ---------------------------------------------------------------------------------------------
# reading a checkpoint's average (forge export --ema, forge evaluate --ema)


def read_ema_component(checkpoint: str | Path) -> dict[str, Any]:
    """A checkpoint's saved average (``WeightsEMA.state_dict``), its pipeline stages merged.
    A checkpoint without one is a CheckpointError that says so."""
    checkpoint = Path(checkpoint)
    try:
        manifest = read_manifest(checkpoint)
    except (CheckpointError, OSError, ValueError):
        manifest = None
    if manifest is None or not (manifest.components or {}).get(EMA_COMPONENT):
        raise CheckpointError(
            f"{checkpoint} holds no moving average of the weights (no '{EMA_COMPONENT}' "
            "component): it was not trained with trainer.args.ema_decay set; leave out --ema "
            "to use its weights"
        )
    shards = read_component_states(checkpoint, EMA_COMPONENT)
    if not shards:
        raise CheckpointError(f"{checkpoint}: its '{EMA_COMPONENT}' component lists no files")
    if manifest.components[EMA_COMPONENT].get("scope") == Scope.SHARDED.value:
        return nested_state(merge_sharded(shards))
    return WeightsEMA.reshard(shards)


def read_ema_state(checkpoint: str | Path) -> dict[str, torch.Tensor]:
    """The moving average a checkpoint holds, by parameter name (fp32, on the CPU)."""
    weights = read_ema_component(checkpoint)["weights"]
    return {name: tensor.cpu() for name, tensor in weights.items()}


def with_ema_weights(
    weights: dict[str, torch.Tensor], average: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """A checkpoint's ``weights`` with the average in place of every tensor it covers, each
    in the saved tensor's dtype (frozen weights and buffers stay as saved)."""
    return {
        name: average[name].to(tensor.dtype) if name in average else tensor
        for name, tensor in weights.items()
    }


def load_ema_weights(model: nn.Module, average: dict[str, torch.Tensor], where: str = "") -> None:
    """Put a checkpoint's moving average (``read_ema_state``) into ``model``'s trainable
    parameters, each in its dtype. Every trainable parameter must be covered."""
    params = trainable_parameters(model)
    missing = [names[0] for names, _ in params if not any(n in average for n in names)]
    if missing:
        raise CheckpointError(
            f"{where or 'the checkpoint'}: its moving average of the weights has no average of "
            f"{', '.join(missing[:5])}; it was written for another model"
        )
    with torch.no_grad():
        for names, param in params:
            param.copy_(average[next(n for n in names if n in average)])
