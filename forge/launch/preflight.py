"""The model/data contract, checked before ``forge train`` creates a run directory.

The trainer calls ``model(**batch)`` on every batch and reads ``.loss`` (or ``["loss"]``) from
what it returns. A mismatch would otherwise surface only once the run has started: this builds
the training dataset and the collator, collates the first items, and compares the batch's keys
with the parameters of the model's ``forward``. When the model is an ``nn.Module`` class, its
forward is also run once on the ``meta`` device (no memory, no arithmetic) to see what it
returns; a model that cannot run there (data-dependent code, as in most Hugging Face models)
is simply not checked that way.

A trainer class with a ``plan_job(model, args, world_size)`` classmethod (the pipeline
trainer's split into stages) is also asked for its plan of a job of the launch's process
count, on the model built on the meta device: its problems are reported here, located at the
training argument they name, instead of by every worker after torchrun starts.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import re
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

from forge.config import Config, ConfigError, Problem
from forge.config.build import Materializer
from forge.config.callables import Resolver
from forge.config.graph import CallNode, Loc, Node

logger = logging.getLogger(__name__)

SAMPLE_ITEMS = 2  # items collated into the sample batch
# What the trainer passes to the optimizer and scheduler partials (forge/train/optim.py).
FACTORY_CALLS = {
    "model": (),  # model_init(), after set_seed (forge/train/setup.py)
    "optimizer": ("parameters",),
    "lr_scheduler": ("optimizer", "num_training_steps"),
    "compute_loss_func": ("outputs", "labels"),  # and num_items_in_batch= where it takes it
}


def check_training_contract(
    cfg: Config,
    variables: Mapping[str, Any],
    allow: list[str] = (),
    *,
    config: str = "",
    world_size: int | None = None,
) -> list[str]:
    """Raise ConfigError (exit 2) when the batches cannot feed the model's forward, or the
    trainer's plan for a job of ``world_size`` processes cannot run (a pipeline split); the
    plan, as lines to print (empty for a trainer without one)."""
    trainer = cfg.targets.get("trainer")
    if not isinstance(trainer, CallNode) or trainer.args:
        return []  # a trainer given positionally or built another way: its own checks apply
    # one build of the config's objects for the checks and the sanity pass (a dataset is
    # built, and a corpus read, once)
    materializer = Materializer(_resolver(cfg, list(allow)).resolve, variables, cfg.describe_loc)
    problems = _check(cfg, trainer, variables, list(allow), materializer)
    if not problems:
        problems = _adapter_problems(cfg, trainer, variables, list(allow))
    plan: list[str] = []
    if not problems and world_size is not None:
        plan, problems = _plan_job(cfg, trainer, variables, list(allow), world_size)
    if not problems:
        problems = _sanity_problems(cfg, trainer, materializer)
    if problems:
        raise ConfigError(problems, config=config or cfg.origin)
    return plan


def _sanity_problems(cfg: Config, trainer: CallNode, materializer: Materializer) -> list[Problem]:
    """The sanity pass (forge/train/sanity.py) on a trainer built from the config here: what
    training runs, run once, each failure located at the line of the part that failed."""
    import gc
    import time

    from forge.train.args import TrainingArgumentsError
    from forge.train.sanity import SanityFailure, one_process_stand_in, run_sanity_pass

    args_node = trainer.kwargs.get("args")
    started = time.perf_counter()
    try:
        with one_process_stand_in():
            built = materializer.value(trainer)
    except TrainingArgumentsError as err:
        key = "trainer.args"
        if isinstance(args_node, CallNode):
            return _located(cfg, args_node, key, err.problems, trainer)
        return [cfg.problem(trainer.loc, p, None) for p in err.problems]
    except Exception as err:  # what the workers would fail on first, said before they start
        notes = " ".join(getattr(err, "__notes__", []))
        message = f"building the trainer failed: {type(err).__name__}: {err}"
        return [cfg.problem(trainer.loc, f"{message} ({notes})" if notes else message, None)]
    args = getattr(built, "args", None)
    if args is None or not getattr(args, "sanity_check", False):
        return []
    batches = int(getattr(args, "num_sanity_val_steps", 0) or 0)
    try:
        run_sanity_pass(built, batches)
    except SanityFailure as failure:
        if isinstance(failure.error, TrainingArgumentsError) and isinstance(args_node, CallNode):
            return _located(cfg, args_node, "trainer.args", failure.error.problems, trainer)
        return [_sanity_problem(cfg, trainer, failure, batches)]
    finally:
        del built
        gc.collect()
        _release_device_memory()
    logger.info(
        "sanity pass: one training batch and %d evaluation batch(es) ran in %.1f s",
        batches,
        time.perf_counter() - started,
    )
    return []


def _sanity_problem(cfg: Config, trainer: CallNode, failure: Any, batches: int) -> Problem:

    error = failure.error
    node = trainer.kwargs.get(failure.part)
    # where the part is written (the user's config), else where the trainer is given it
    loc = node.loc if isinstance(node, Node) else trainer.arg_locs.get(failure.part)
    text = f"{type(error).__name__}: {error}"
    message = (
        f"the sanity pass (what training runs, run once before it starts) failed while "
        f"{failure.doing}: {text}"
    )
    hint = None  # a failure before the evaluation batches is the run's first step's too
    if getattr(failure, "evaluating", False):
        hint = (
            "fix it before training (its first evaluation meets it too); "
            "trainer.args.num_sanity_val_steps: 0 skips the evaluation batches, "
            "sanity_check: false the whole pass"
        )
    return cfg.problem(loc or trainer.loc, message, hint)


def _release_device_memory() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _plan_job(
    cfg: Config, trainer: CallNode, variables: Mapping[str, Any], allow: list[str], world: int
) -> tuple[list[str], list[Problem]]:
    """The trainer class's ``plan_job(model, args, world_size)`` (the pipeline trainer's
    split), with the model built on the meta device: its plan, or its problems located at
    the training argument each names."""

    from forge.train.args import TrainingArgumentsError

    resolver = _resolver(cfg, allow)
    plan_job = getattr(resolver.resolve(trainer.spec), "plan_job", None)
    model_node, args_node = trainer.kwargs.get("model"), trainer.kwargs.get("args")
    if not callable(plan_job) or model_node is None or not isinstance(args_node, CallNode):
        return [], []
    materialize = Materializer(resolver.resolve, variables, cfg.describe_loc).value
    try:
        args = materialize(args_node)
        with on_meta_device():
            model = Materializer(resolver.resolve, variables, cfg.describe_loc).value(model_node)
    except Exception as err:  # the workers build them and report what fails
        logger.debug("pipeline plan not made before launch (%s: %s)", type(err).__name__, err)
        return [], []
    peft_node = trainer.kwargs.get("peft_config")
    try:  # LoRA: what the split allows of it (only a trainer that can split takes it)
        lora = {"peft_config": materialize(peft_node)} if isinstance(peft_node, CallNode) else {}
    except Exception as err:  # the trainer builds it and reports what fails
        logger.debug("LoRA config not built before launch (%s: %s)", type(err).__name__, err)
        lora = {}
    try:
        return plan_job(model, args, world, **lora) or [], []
    except TrainingArgumentsError as err:
        adapter = [m for m in err.problems if m.startswith("trainer.peft_config.")]
        rest = [m for m in err.problems if m not in adapter]
        problems = _located(cfg, args_node, type(args).config_key, rest, trainer)
        for message in adapter:  # at the line that names the LoRA targets
            field, _, text = message.removeprefix("trainer.peft_config.").partition(": ")
            problems.append(cfg.problem(peft_node.arg_locs.get(field) or peft_node.loc, text, None))
        return [], problems
    except Exception as err:  # not the plan's to report: the workers build the model and say
        logger.debug("pipeline plan not made before launch (%s: %s)", type(err).__name__, err)
        return [], []


def _adapter_problems(
    cfg: Config, trainer: CallNode, variables: Mapping[str, Any], allow: list[str]
) -> list[Problem]:
    """LoRA target modules (``trainer.peft_config``) that match no layer of the model, located
    at the line that names them; the model is built on the meta device (a base directory's
    from its config alone). What cannot be built here is left to the trainer, which checks the
    same before its first step."""
    import torch

    from forge.train.args import TrainingArgumentsError

    peft_node, model_node = trainer.kwargs.get("peft_config"), trainer.kwargs.get("model")
    if not isinstance(peft_node, CallNode) or not isinstance(model_node, CallNode):
        return []
    resolver = _resolver(cfg, allow)
    materialize = Materializer(resolver.resolve, variables, cfg.describe_loc).value
    try:
        from forge.train.lora import base_skeleton, lora_config_for

        peft_config = materialize(peft_node)
        if model_node.spec == "forge.train.lora:load_base_model":
            given = model_node.kwargs.get("path", model_node.args[0] if model_node.args else None)
            model = base_skeleton(materialize(given) if given is not None else None)
        else:
            with on_meta_device():
                model = materialize(model_node)
                model = model() if not isinstance(model, torch.nn.Module) else model
    except Exception as err:  # the trainer builds them and reports what fails
        logger.debug("LoRA targets not checked before launch (%s: %s)", type(err).__name__, err)
        return []
    from forge.train.lora import known_target_modules

    unnamed = hasattr(peft_config, "target_modules") and not peft_config.target_modules
    if unnamed and known_target_modules(model) is None:
        return [_unnamed_targets_problem(cfg, peft_node, model)]
    try:
        lora_config_for(model, peft_config)
    except TrainingArgumentsError as err:
        problems = []
        for message in err.problems:
            field = "modules_to_save" if ".modules_to_save:" in message else "target_modules"
            loc = peft_node.arg_locs.get(field) or peft_node.loc
            key, _, text = message.partition(": ")  # the location names the key
            problems.append(cfg.problem(loc, text if key.startswith("trainer.") else message, None))
        return problems
    return []


@contextlib.contextmanager
def on_meta_device() -> Iterator[None]:
    """Modules built inside have no storage (their structure is all a check reads); a builder
    that loads weights into them, which is a no-op there, warns of it once per tensor in torch:
    not the user's to see in a dry run."""
    import torch

    with torch.device("meta"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "for .*: copying from a non-meta parameter")
        yield


def _unnamed_targets_problem(cfg: Config, peft_node: CallNode, model: Any) -> Problem:
    """A model of no style forge knows, whose LoRA config names no target_modules: the fix is
    where the config sets them, a -D variable the line that writes them reads, that line, or a
    target_modules to add to the peft_config."""
    from forge.train.lora import example_targets, unknown_targets

    example = example_targets(model)
    loc = peft_node.arg_locs.get("target_modules")
    if loc is None:
        hint = f"add target_modules: {example} to trainer.peft_config (the layers to adapt)"
        return cfg.problem(peft_node.loc, unknown_targets(model), hint)
    names = cfg.variables_at(loc)
    if names:
        hint = "name them with " + " or ".join(f"-D {name}='{example}'" for name in names)
    else:
        hint = f"name them there, e.g. target_modules: {example}"
    return cfg.problem(loc, unknown_targets(model), hint)


def _located(
    cfg: Config, args_node: CallNode, key: str, messages: list[str], trainer: CallNode | None = None
) -> list[Problem]:
    """Each message (``trainer.args.NAME: ...``) at the line that sets argument NAME; one about
    another of the trainer's arguments (``trainer.model: ...``, a model the trainer refuses)
    at the line that sets that argument (the user's model block, not base.yaml's trainer)."""
    prefix = re.compile(rf"^{re.escape(key)}\.(\w+)")
    given = re.compile(rf"^{re.escape(key.rpartition('.')[0] or 'trainer')}\.(\w+):")
    problems = []
    for message in messages:
        match = prefix.match(message)
        loc = args_node.arg_locs.get(match.group(1)) if match else None
        if loc is None and trainer is not None and (other := given.match(message)):
            loc = _argument_loc(trainer, other.group(1))
            if loc is not None:  # the location names the key
                message = message[other.end() :].strip()
        problems.append(cfg.problem(loc or args_node.loc, message, None))
    return problems


def _argument_loc(trainer: CallNode, name: str) -> Loc | None:
    """Where the trainer's argument ``name`` is written: its node's own line (where an anchor
    it is given through is defined), else the line that gives it to the trainer."""
    node = trainer.kwargs.get(name)
    if isinstance(node, Node) and node.loc is not None:
        return node.loc
    return trainer.arg_locs.get(name)


def _resolver(cfg: Config, allow: list[str]) -> Resolver:
    project = cfg.project
    return Resolver(
        project.root if project else None,
        [*(project.allowed_modules if project else []), *allow],
        project.meta_file if project else None,
    )


def _check(
    cfg: Config,
    trainer: CallNode,
    variables: Mapping[str, Any],
    allow: list[str],
    built: Materializer,
) -> list[Problem]:
    model_node = trainer.kwargs.get("model")
    dataset_node = trainer.kwargs.get("train_dataset")
    problems = []
    if model_node is None:
        problems.append(
            cfg.problem(
                trainer.arg_locs.get("model", trainer.loc),
                "null: there is no model to train",
                "fill the config's model block with an nn.Module or a !partial that builds "
                "one, e.g. model: &model !partial:./model.py:MyModel {hidden_size: 64}",
            )
        )
    if dataset_node is None:
        problems.append(
            cfg.problem(
                trainer.arg_locs.get("train_dataset", trainer.loc),
                "null: there is no data to train on",
                "fill the config's datasets block with a dataset (map-style, or a stream: an "
                "IterableDataset) whose items are dicts",
            )
        )
    if problems or not isinstance(model_node, CallNode):
        return problems
    resolver = _resolver(cfg, allow)
    for role, call_args in FACTORY_CALLS.items():
        node = trainer.kwargs.get(role)
        if isinstance(node, CallNode) and node.kind == "partial":
            problem = _partial_problem(cfg, node, built.value(node), role, call_args)
            problems += [problem] if problem else []
    trainer_class = resolver.resolve(trainer.spec)
    problems += _unsupported_problems(cfg, trainer, trainer_class)
    if problems:
        return problems
    if _overrides_compute_loss(trainer_class):
        logger.debug("the trainer computes its own loss; batch/forward contract not checked")
        return []
    model_class = _forward_owner(model_node, resolver)
    if not _is_module_class(model_class):
        logger.debug("model built by %s; forward checked at the first step", model_node.spec)
        return []

    from forge.data.columns import ModelInputs, forward_name, keep_model_inputs
    from forge.train.loss import loss_from_outputs, resolve_label_names, split_labels

    loss_func = trainer.kwargs.get("compute_loss_func") is not None
    dataset = built.value(dataset_node)
    collator = built.value(trainer.kwargs.get("data_collator"))
    args = built.value(trainer.kwargs.get("args"))
    dropped: list[str] = []
    whole = getattr(model_class, "takes_whole_batch", False)  # keeps every column
    if getattr(args, "remove_unused_columns", False) and not whole:  # as the trainer's loader will
        given = getattr(args, "label_names", None)
        inputs = ModelInputs.of(model_class, resolve_label_names(given, model_class, loss_func))
        keys = _item_keys(dataset)
        dropped = [k for k in keys if k not in inputs.columns]
        if len(dropped) < len(keys):  # with nothing kept, the key mismatch says more
            dataset, collator = keep_model_inputs(dataset, collator, inputs, quiet=True)
    size = getattr(args, "per_device_train_batch_size", SAMPLE_ITEMS)
    batch, problem = _sample_batch(
        cfg, dataset, collator, dataset_node, trainer, model_class, items=size, removed=dropped
    )
    if problem is not None or batch is None:
        return [problem] if problem else []
    # compute_loss_func or label smoothing: the trainer takes the labels out (HF's rule)
    from_outputs = loss_from_outputs(
        trainer.kwargs.get("compute_loss_func"), getattr(args, "label_smoothing_factor", 0.0)
    )
    if from_outputs:
        batch, _ = split_labels(batch)
    label = forward_name(model_class)
    signature = inspect.signature(model_class.forward)
    packing = _packing_problem(  # before the keys: a forward without position_ids says why
        cfg, trainer, trainer_class, model_node, resolver, variables, batch, args
    )
    if packing is not None:
        return [packing]
    mismatch = _signature_mismatch(signature, batch, label, dropped)
    if mismatch:
        return [cfg.problem(model_node.loc, mismatch, _FIX_KEYS)]
    if from_outputs:
        return []  # the loss is computed from whatever forward returns
    returned = _meta_forward(model_node, resolver, variables, cfg, batch)
    message = _return_problem(returned, label, batch, dropped)
    return [cfg.problem(model_node.loc, message, None)] if message else []


def _packing_problem(
    cfg: Config,
    trainer: CallNode,
    trainer_class: Any,
    model_node: CallNode,
    resolver: Resolver,
    variables: Mapping[str, Any],
    batch: Mapping,
    args: Any,
) -> Problem | None:
    """A packed sample batch (forge/train/packing.py) for a model or trainer that would let its
    sequences attend to each other, located at the model (the model built on the meta device
    for its attention implementation; its class where it cannot be built there)."""
    import torch

    from forge.train.packing import is_packed_batch, packing_refusal

    if not is_packed_batch(batch):
        return None
    model: Any = _forward_owner(model_node, resolver)
    materializer = Materializer(resolver.resolve, variables, cfg.describe_loc)
    try:
        with on_meta_device():
            instance = materializer.value(model_node)
            model = instance() if not isinstance(instance, torch.nn.Module) else instance
    except Exception as err:  # the class alone then; the sanity pass runs the real model
        logger.debug("packing checked on the model class (%s: %s)", type(err).__name__, err)
    refusal = packing_refusal(
        model,
        use_cache=bool(getattr(args, "use_cache", False)),
        batch_keys=list(batch),
        trainer_reason=getattr(trainer_class, "refuses_packed_batches", None),
    )
    if refusal is None:
        return None
    message, fix = refusal
    collator = trainer.kwargs.get("data_collator")
    made_by = f" (data_collator {collator.spec})" if isinstance(collator, CallNode) else ""
    return cfg.problem(model_node.loc, message + made_by, fix)


def _unsupported_problems(cfg: Config, trainer: CallNode, trainer_class: Any) -> list[Problem]:
    """Trainer arguments the chosen trainer refuses (``unsupported_arguments``), located."""
    refused = getattr(trainer_class, "unsupported_arguments", None) or {}
    return [
        cfg.problem(trainer.arg_locs.get(name, trainer.loc), reason, None)
        for name, reason in refused.items()
        if trainer.kwargs.get(name) is not None
    ]


def _forward_owner(model_node: CallNode, resolver: Resolver) -> Any:
    """The class whose forward the batches reach: the model's, or for a ``LossAdapter`` the
    class of the module it wraps (None when that is not known before building it)."""
    from forge.train.plain_models import LossAdapter

    model_class = resolver.resolve(model_node.spec)
    if not (isinstance(model_class, type) and issubclass(model_class, LossAdapter)):
        return model_class
    inner = model_node.kwargs.get("module", model_node.args[0] if model_node.args else None)
    return resolver.resolve(inner.spec) if isinstance(inner, CallNode) else None


def _item_keys(dataset: Any) -> list[str]:
    """The keys of the dataset's first item (empty when items are not dicts)."""
    try:
        item = dataset[0]
    except Exception:  # not map-style or empty: _sample_batch reports it
        return []
    return [str(k) for k in item] if isinstance(item, Mapping) else []


def _with_dropped(keys: list[str], dropped: list[str]) -> list[str]:
    """The batch's keys with the dropped columns put back (sorted when there are any)."""
    return sorted({*keys, *dropped}) if dropped else keys


def _dropped_note(dropped: list[str]) -> str:
    """How the batch lost ``dropped``, for a message that lists the batch's keys."""
    them = "it" if len(dropped) == 1 else "them"
    return f"forward takes no {_names(dropped)} (remove_unused_columns drops {them})"


_FIX_KEYS = (
    "make the dataset's items (or the data_collator) produce forward's argument names, "
    "or change forward to take the batch's keys"
)


def _partial_problem(
    cfg: Config, node: CallNode, value: Any, role: str, call_args: tuple[str, ...]
) -> Problem | None:
    """The trainer calls ``value(*call_args)``: does that bind with what the partial gives?"""
    if not isinstance(value, functools.partial):
        return None
    try:
        signature = inspect.signature(value.func)
    except (TypeError, ValueError):
        return None
    try:
        signature.bind(*value.args, *call_args, **value.keywords)
        return None
    except TypeError as err:
        error = str(err)
    label = getattr(value.func, "__name__", "the callable")
    positional = [
        p.name
        for p in signature.parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    receiving = positional[len(value.args) : len(value.args) + len(call_args)]
    clashes = [name for name in receiving if name in value.keywords]
    hint = None
    if clashes:
        passed = dict(zip(receiving, call_args, strict=False))
        hint = "; ".join(
            f"leave out {name!r}: the trainer passes {passed[name]} in its place"
            for name in clashes
        )
    return cfg.problem(
        node.loc,
        f"the trainer calls this partial as {role}({', '.join(call_args)}), and "
        f"{label}() then fails: {error}",
        hint,
    )


def _overrides_compute_loss(trainer_class: Any) -> bool:
    from forge.train.loop import BaseTrainer

    if not (isinstance(trainer_class, type) and issubclass(trainer_class, BaseTrainer)):
        return True  # not a forge trainer: its contract is its own
    return trainer_class.compute_loss is not BaseTrainer.compute_loss


def _is_module_class(obj: Any) -> bool:
    from torch import nn

    return isinstance(obj, type) and issubclass(obj, nn.Module)


def _sample_batch(
    cfg: Config,
    dataset: Any,
    collator: Any,
    dataset_node: Any,
    trainer: CallNode,
    model_class: Any = None,
    items: Any = SAMPLE_ITEMS,
    removed: list[str] = (),
) -> tuple[Any, Problem | None]:
    """The first items of ``dataset`` collated as the trainer's loader would (no more than the
    configured batch size: a collator may rely on it); ``removed``: the columns
    ``remove_unused_columns`` takes out before the collator."""
    from torch.utils.data import default_collate

    where = dataset_node.loc if isinstance(dataset_node, Node) else trainer.loc
    try:
        limit = items if isinstance(items, int) and items >= 1 else SAMPLE_ITEMS
        count = min(SAMPLE_ITEMS, limit, len(dataset))
    except TypeError:
        return None, None  # not map-style: the trainer reports that itself
    if count == 0:
        return None, cfg.problem(where, "the training dataset is empty", None)
    items = [dataset[index] for index in range(count)]
    try:
        batch = (collator or default_collate)(items)
    except Exception as err:  # the user's data or collator
        from forge.data.columns import RemovedColumnError, forward_name, removed_column_note

        name = "data_collator" if collator is not None else "torch's default collation"
        forward = forward_name(model_class) if model_class else "the model's forward"
        note = removed_column_note(err, removed, forward)  # a datasets.Dataset's column
        if isinstance(err, RemovedColumnError) or note:
            said = str(err) if note is None else f"KeyError: {err}: {note}"
            return None, cfg.problem(
                where, f"{name} failed on the first {count} items of train_dataset: {said}", None
            )
        seen = items[0]
        if removed and isinstance(seen, Mapping):  # what the collator got
            seen = {key: value for key, value in seen.items() if key not in removed}
        return None, cfg.problem(
            where,
            f"{name} failed on the first {count} items of train_dataset: "
            f"{type(err).__name__}: {err}",
            f"the items it was given look like: {_describe_item(seen)}",
        )
    if not isinstance(batch, Mapping):
        from forge.train.plain_models import not_a_dict_batch

        return None, cfg.problem(where, not_a_dict_batch(batch, model_class), None)
    return batch, None


def _describe_item(item: Any) -> str:
    if isinstance(item, Mapping):
        return "{" + ", ".join(f"{k!r}: {type(v).__name__}" for k, v in item.items()) + "}"
    return type(item).__name__


def _signature_mismatch(
    signature: inspect.Signature, batch: Mapping, label: str, dropped: list[str] = ()
) -> str | None:
    """What keeps ``batch`` (whose keys ``dropped`` were removed from) from binding."""
    params = list(signature.parameters.values())[1:]  # drop self
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
    by_name = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    required = [
        p.name
        for p in params
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    keys = [str(k) for k in batch]
    extra = [] if takes_any else [k for k in keys if k not in by_name]
    missing = [name for name in required if name not in keys]
    if not extra and not missing:
        return None
    said = []
    if extra:
        said.append(f"forward takes no {_names(extra)}")
    if missing and dropped:
        said.append(_dropped_note(list(dropped)))
    if missing:
        said.append(f"it needs {_names(missing)}, which the batch lacks")
    shown = ", ".join(str(p.replace(annotation=p.empty)) for p in params)
    if missing and dropped:
        keys = _with_dropped(keys, dropped)
    return (
        f"the batches do not fit {label}: {'; '.join(said)} "
        f"(batch keys: {', '.join(keys)}; forward({shown}))"
    )


def _names(names: list[str]) -> str:
    return " or ".join(repr(n) for n in names) if len(names) < 3 else ", ".join(map(repr, names))


def _meta_forward(
    model_node: CallNode,
    resolver: Resolver,
    variables: Mapping[str, Any],
    cfg: Config,
    batch: Mapping,
) -> Any:
    """What forward returns for ``batch``, run on the meta device; None when it cannot run."""
    import torch

    try:
        with on_meta_device():
            model = Materializer(resolver.resolve, variables, cfg.describe_loc).value(model_node)
            if not isinstance(model, torch.nn.Module):
                model = model()
        meta_batch = {
            k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in batch.items()
        }
        with torch.no_grad():
            return model(**meta_batch)
    except Exception as err:  # cannot run on meta: checked at the first step instead
        logger.debug("forward not run before training (%s: %s)", type(err).__name__, err)
        return None


def _return_problem(
    returned: Any, label: str, batch: Mapping, dropped: list[str] = ()
) -> str | None:
    """What the trainer would say, reading the loss from what forward ``returned`` (None when
    it could not run on the meta device)."""
    from forge.train.loss import model_loss

    if returned is None:
        return None
    keys = ", ".join(_with_dropped([str(k) for k in batch], dropped))
    if dropped:
        keys += f", of which {_dropped_note(list(dropped))}"
    try:
        model_loss(returned, label, batch_keys=keys)
    except ValueError as err:
        return str(err)
    return None
