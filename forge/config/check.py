"""Checking a graph before anything is built: every callable resolves and takes its arguments."""

from __future__ import annotations

import inspect
import logging
import re
from collections.abc import Callable
from typing import Any

from .errors import short_list, suggestion
from .graph import CallNode, Loc, walk
from .resolve import Resolver, SpecError

logger = logging.getLogger(__name__)

# (loc, message, hint); the config turns these into located Problems.
Finding = tuple[Loc, str, "str | None"]
_MISSING_RE = re.compile(r"missing a required (?:keyword-only )?argument: '(\w+)'")


def callable_label(obj: Any) -> str:
    """A short name for messages: `TrainingArguments`, `sqrt`."""
    return getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or repr(obj)


def check_graph(values: list[Any], resolver: Resolver) -> list[Finding]:
    """All problems with the callables reachable from `values`, in graph order."""
    findings: list[Finding] = []
    for node in walk(values):
        if isinstance(node, CallNode) and node.spec:
            findings.extend(check_call(node, resolver))
    return findings


def check_call(node: CallNode, resolver: Resolver) -> list[Finding]:
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
    return _check_binding(node, target, signature)


def _check_binding(node: CallNode, target: Any, signature: inspect.Signature) -> list[Finding]:
    label = callable_label(target)
    params = signature.parameters.values()
    takes_any_kw = any(p.kind is p.VAR_KEYWORD for p in params)
    keywords = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    findings: list[Finding] = []
    accepted: dict[str, object] = {}
    for key in node.kwargs:
        if takes_any_kw or key in keywords:
            accepted[key] = None
            continue
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


def _binding_message(label: str, error: str, signature: inspect.Signature, node: CallNode) -> str:
    missing = _MISSING_RE.search(error)
    if missing:
        return f"{label}() is missing the required argument {missing.group(1)!r}"
    if "too many positional" in error:
        params = signature.parameters.values()
        most = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
        return f"{label}() takes at most {most} positional arguments ({len(node.args)} given)"
    return f"{label}(): {error}"
