"""Checking a graph before anything is built: every callable resolves and takes its arguments."""

from __future__ import annotations

import inspect
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forge.suggest import did_you_mean, offer, suggestion
from forge.text import short_list

from .callables import Resolver, SpecError
from .graph import CallNode, ContainerNode, Loc, Node, walk
from .hf_config_keys import config_keywords, is_transformers_config

logger = logging.getLogger(__name__)

# (loc, message, hint); the config turns these into located Problems.
Finding = tuple[Loc, str, "str | None"]
NEAR_MISS_CUTOFF = 0.85  # how alike a **kwargs keyword and a named one must be to warn
_MISSING_RE = re.compile(r"missing a required (?:keyword-only )?argument: '(\w+)'")


def callable_label(obj: Any) -> str:
    """A short name for messages: `TrainingArguments`, `sqrt`."""
    return getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or repr(obj)


@dataclass(frozen=True)
class Keywords:
    """The keyword arguments a callable takes: the ones it names, and whether it takes
    any other (a `**kwargs`)."""

    names: tuple[str, ...]
    takes_any: bool

    def accepts(self, key: str) -> bool:
        return self.takes_any or key in self.names


def keywords_of(target: Any) -> Keywords | None:
    """What keywords `target` takes, or None when it has no readable signature."""
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return None
    params = signature.parameters.values()
    names = tuple(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params) or _passes_extra_keywords(target)
    return Keywords(names, takes_any)


def _passes_extra_keywords(target: Any) -> bool:
    """A class whose `__init__` wraps a closed signature in `(*args, **kwargs)` and hands
    the extra keywords to `__post_init__(**kwargs)`, as Hugging Face configs do
    (`BertConfig(num_labels=2)`); `inspect.signature` shows only the wrapped one."""
    if not isinstance(target, type) or not hasattr(target.__init__, "__wrapped__"):
        return False
    try:
        outer = inspect.signature(target.__init__, follow_wrapped=False)
        post_init = inspect.signature(target.__post_init__)  # type: ignore[attr-defined]
    except (AttributeError, TypeError, ValueError):
        return False
    return any(p.kind is p.VAR_KEYWORD for p in outer.parameters.values()) and any(
        p.kind is p.VAR_KEYWORD for p in post_init.parameters.values()
    )


def check_graph(
    values: list[Any], resolver: Resolver, warnings: list[Finding] | None = None
) -> list[Finding]:
    """All problems with the callables reachable from `values`, in graph order; likely
    mistakes that are not errors go to `warnings`."""
    findings: list[Finding] = []
    warnings = [] if warnings is None else warnings
    for node in walk(values):
        if isinstance(node, CallNode) and node.spec:
            findings.extend(check_call(node, resolver, warnings))
    return findings


def check_call(
    node: CallNode, resolver: Resolver, warnings: list[Finding] | None = None
) -> list[Finding]:
    """Problems with one call: the spec, callability and how its arguments bind."""
    try:
        target = resolver.resolve(node.spec)
    except SpecError as err:
        return [(node.loc, err.message, err.hint)]
    if not callable(target):
        return [(node.loc, f"`{node.spec}` is not callable (it is {type(target).__name__})", None)]
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        logger.debug("no signature for %s; arguments not checked", node.spec)
        return []
    findings = _check_binding(node, target, signature, [] if warnings is None else warnings)
    if not findings:
        findings = _check_values(node, target, signature) + _missing_local_path(node, target)
    return findings


# a name the Hugging Face Hub could hold: "gpt2", "org/name"
_HUB_NAME = re.compile(r"^[\w-][\w.-]*(/[\w-][\w.-]*)?$")


def _missing_local_path(node: CallNode, target: Any) -> list[Finding]:
    """A ``from_pretrained`` given a path that looks local (absolute, ``./``, ``~``, several
    parts) and does not exist: named now, where transformers would ask the Hub for it and
    report a failed connection after its retries."""
    if getattr(target, "__name__", None) != "from_pretrained":
        return []
    key: int | str = 0 if node.args else "pretrained_model_name_or_path"
    value = node.args[0] if node.args else node.kwargs.get(key)
    if not isinstance(value, str) or not value or _HUB_NAME.match(value):
        return []
    path = Path(value).expanduser()
    if path.exists():
        return []
    where = "" if path.is_absolute() else f" (relative to the working directory {Path.cwd()})"
    return [
        (
            node.arg_locs.get(key, node.loc),
            f"{callable_label(target)}(): {value!r} looks like a local path, and there is "
            f"nothing there{where}",
            "give the directory that holds the files; a path in the project can be written "
            "{{ joinpath(project_dir, 'DIR') }}, which holds wherever forge is started",
        )
    ]


def _check_binding(
    node: CallNode, target: Any, signature: inspect.Signature, warnings: list[Finding]
) -> list[Finding]:
    label = callable_label(target)
    params = signature.parameters.values()
    binds_any = any(p.kind is p.VAR_KEYWORD for p in params)
    known = keywords_of(target)
    keywords = list(known.names) if known else []
    findings: list[Finding] = []
    accepted: dict[str, object] = {}
    closed = config_keywords(target) if is_transformers_config(target) else None
    for key in node.kwargs:
        if closed is not None and key not in closed:
            findings.append(_unknown_config_key(node, label, key, closed))
            continue
        if binds_any or key in keywords:
            accepted[key] = None
            continue
        if known and known.takes_any:
            warnings.extend(_near_miss(node, label, key, keywords))
            continue  # passed on through **kwargs, which `signature` does not show
        findings.append(
            (
                node.arg_locs.get(key, node.loc),
                f"{label}() got an unexpected keyword argument {key!r}"
                f"{suggestion(key, keywords)} (valid: {short_list(keywords)})",
                None,
            )
        )
    bind: Callable[..., Any] = signature.bind_partial if node.kind == "partial" else signature.bind
    try:
        bind(*[None] * len(node.args), **accepted)
    except TypeError as err:
        findings.append((node.loc, _binding_message(label, str(err), signature, node), None))
    return findings


def _check_values(node: CallNode, target: Any, signature: inspect.Signature) -> list[Finding]:
    """The callable's own checks of the values a config gives it, for callables that offer
    them: a `forge_check_values(values, computed)` classmethod returning `(argument, message)`
    pairs (forge's TrainingArguments), so that bad values are found before anything is built.
    `values` holds the literal arguments; `computed` names those only the build will know."""
    hook = getattr(target, "forge_check_values", None)
    if not isinstance(target, type) or not callable(hook):
        return []
    try:
        bound = signature.bind_partial(*node.args, **node.kwargs).arguments
    except TypeError:
        return []
    values, computed = {}, []
    for name, value in bound.items():
        known, literal = _literal(value)
        if known:
            values[name] = literal
        else:
            computed.append(name)
    return [
        (node.arg_locs.get(name, node.loc) if name else node.loc, message, None)
        for name, message in hook(values, computed)
    ]


def _literal(value: Any) -> tuple[bool, Any]:
    """(True, the plain value) for a scalar or a container of them; (False, None) for a
    value the build computes (a call or a `!var`)."""
    if isinstance(value, ContainerNode):
        value = value.items
    if isinstance(value, Node):
        return False, None
    if isinstance(value, dict):
        items = {key: _literal(item) for key, item in value.items()}
        if all(known for known, _ in items.values()):
            return True, {key: item for key, (_, item) in items.items()}
        return False, None
    if isinstance(value, (list, tuple)):
        items = [_literal(item) for item in value]
        if all(known for known, _ in items):
            return True, [item for _, item in items]
        return False, None
    return True, value


def _unknown_config_key(node: CallNode, label: str, key: str, names: frozenset[str]) -> Finding:
    """A key a transformers model config does not take: the class would keep it as an
    attribute no model reads and build its default instead."""
    message = (
        f"{label}() has no setting {key!r} (a transformers config would keep it as an "
        f"attribute that no model reads and build its default){suggestion(key, names, n=1)}"
    )
    return (node.arg_locs.get(key, node.loc), message, "correct the name or remove the key")


def _near_miss(node: CallNode, label: str, key: str, keywords: list[str]) -> list[Finding]:
    """A warning for a keyword that **kwargs swallows but that is one typo away from a
    named one (`hidden_sise` for `hidden_size`)."""
    close = did_you_mean(key, keywords, n=1, cutoff=NEAR_MISS_CUTOFF)
    if not close:
        return []
    message = f"{label}() takes any keyword, so {key!r} is passed on as is"
    return [(node.arg_locs.get(key, node.loc), message, offer(close))]


def _binding_message(label: str, error: str, signature: inspect.Signature, node: CallNode) -> str:
    missing = _MISSING_RE.search(error)
    if missing:
        return f"{label}() is missing the required argument {missing.group(1)!r}"
    if "too many positional" in error:
        params = signature.parameters.values()
        most = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
        return f"{label}() takes at most {most} positional arguments ({len(node.args)} given)"
    return f"{label}(): {error}"
