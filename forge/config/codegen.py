"""``forge code``: a config's object graph written out as a standalone Python script.

The script imports the callables the config names and calls them with the config's
arguments, in the order :class:`forge.config.build.Materializer` would build them: arguments
before the call, positional before keyword, each singleton once (a variable every alias
reads) and each factory anew where it appears. It never imports forge's config layer.

Nothing here imports torch; the callables' modules are imported (as checking the config
does) only to learn which of a spec's attributes are submodules that need an import.
"""

from __future__ import annotations

import builtins
import datetime
import importlib
import json
import keyword
import math
import re
import sys
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from .callables import parse_spec
from .errors import ConfigError, Problem
from .graph import CallNode, ContainerNode, Node, VarNode, iter_children, walk

_WIDTH = 88
_INDENT = "    "


@dataclass(frozen=True)
class ScriptInput:
    """A ``!var`` the script receives: the parameter of ``build_*`` and its command-line flag.

    ``expression`` (when set) is the Python text used instead of a parameter, e.g. an
    environment lookup for ``rank``.
    """

    var: str
    parameter: str | None = None
    expression: str | None = None


def default_inputs(project_root: Path, config_name: str) -> dict[str, ScriptInput]:
    """What ``forge train`` passes as ``!var`` values, as the script computes them."""
    return {
        "run_dir": ScriptInput("run_dir", parameter="run_dir"),
        "output_root": ScriptInput("output_root", parameter="output_root"),
        "project_dir": ScriptInput("project_dir", expression="str(PROJECT_DIR)"),
        "config_name": ScriptInput("config_name", expression=repr(config_name)),
        "rank": ScriptInput("rank", expression='int(os.environ.get("RANK", "0"))'),
        "world_size": ScriptInput(
            "world_size", expression='int(os.environ.get("WORLD_SIZE", "1"))'
        ),
        "local_rank": ScriptInput(
            "local_rank", expression='int(os.environ.get("LOCAL_RANK", "0"))'
        ),
    }


class _Emitter:
    """Turns nodes into Python expressions, appending a statement for each object built."""

    def __init__(
        self,
        values: list[Any],
        inputs: Mapping[str, ScriptInput],
        project_root: Path,
        omit: Mapping[int, set[str]] | None = None,
    ):
        self.omit = dict(omit or {})  # node id -> keyword arguments not written
        self.inputs = inputs
        self.project_root = project_root
        self.statements: list[str] = []
        self.imports: set[str] = set()
        self.project_imports: set[str] = set()
        self.parameters: list[str] = []
        self.uses_os = False
        self._names: dict[int, str] = {}
        self._building: set[int] = set()
        self._taken = set(dir(builtins)) | set(keyword.kwlist) | {"PROJECT_DIR", "main"}
        self._shared = _shared_nodes(values)
        for value in values:  # module roots the script imports must not be shadowed
            for node in walk([value]):
                if isinstance(node, CallNode):
                    self._taken.add(self._module_root(node.spec))

    # ---------------------------------------------------------------- values
    def expr(self, value: Any, *, name_hint: str | None = None) -> str:
        if not isinstance(value, Node):
            return self._literal(value)
        if id(value) in self._names:
            return self._names[id(value)]
        if isinstance(value, VarNode):
            return self._var(value)
        if id(value) in self._building:
            raise _problem(value, f"{value.key_path} depends on itself")
        self._building.add(id(value))
        try:
            if isinstance(value, ContainerNode):
                text = self._container(value)
                named = id(value) in self._shared or name_hint is not None
            else:
                assert isinstance(value, CallNode)
                text = self._call(value)
                named = value.kind != "factory"
        finally:
            self._building.discard(id(value))
        if not named:
            return text
        name = self._new_name(name_hint or value.name or value.key_path)
        self.statements.append(f"{name} = {text}")
        self._names[id(value)] = name
        return name

    def _var(self, node: VarNode) -> str:
        given = self.inputs.get(node.var)
        if given is not None:
            if given.expression is not None:
                self.uses_os |= "os." in given.expression
                return given.expression
            if given.parameter not in self.parameters:
                self.parameters.append(given.parameter)
            return given.parameter
        if node.has_default:
            return self.expr(node.default)
        raise _problem(
            node,
            f"!var {node.var} has no value and no default",
            f"give it a default (!var {{name: {node.var}, default: ...}})",
        )

    def _container(self, node: ContainerNode) -> str:
        if node.kind == "dict":
            parts = [f"{self._literal(k)}: {self.expr(v)}" for k, v in node.items.items()]
            return _bracketed("{", parts, "}")
        parts = [self.expr(v) for v in node.items]
        if node.kind == "tuple":
            return _bracketed("(", parts, ")", trailing_comma=len(parts) == 1)
        return _bracketed("[", parts, "]")

    def _call(self, node: CallNode) -> str:
        function = self._callable(node.spec)
        parts = [self.expr(v) for v in node.args]
        odd: list[str] = []
        dropped = self.omit.get(id(node), set())
        for key, value in node.kwargs.items():
            if key in dropped:
                continue
            text = self.expr(value)
            if key.isidentifier() and not keyword.iskeyword(key):
                parts.append(f"{key}={text}")
            else:
                odd.append(f"{_string(key)}: {text}")
        if odd:
            parts.append("**" + _bracketed("{", odd, "}"))
        if node.kind == "partial":
            self.imports.add("functools")
            return _bracketed("functools.partial(", [function, *parts], ")")
        return _bracketed(f"{function}(", parts, ")")

    # ---------------------------------------------------------------- names
    def _callable(self, text: str) -> str:
        """The Python expression for a spec, recording the imports it needs."""
        spec = parse_spec(text)
        if spec.file is not None:
            module = self._project_module(spec.file)
            self.project_imports.add(f"from {module} import {spec.attrs[0]}")
            return ".".join(spec.attrs)
        if spec.module == "builtins":
            return spec.attrs[0]
        module_name = spec.module
        obj: Any = importlib.import_module(module_name)
        for attr in spec.attrs:
            obj = getattr(obj, attr, None)
            # A submodule the parent does not import itself needs its own import line.
            if isinstance(obj, ModuleType) and obj.__name__ == f"{module_name}.{attr}":
                module_name = obj.__name__
            else:
                break
        self.imports.add(module_name)
        return ".".join([spec.module, *spec.attrs])

    def _project_module(self, file: str) -> str:
        path = (self.project_root / file).resolve()
        try:
            relative = path.relative_to(self.project_root).with_suffix("")
        except ValueError:
            relative = None
        parts = relative.parts if relative is not None else ()
        if not parts or not all(p.isidentifier() and not keyword.iskeyword(p) for p in parts):
            raise ConfigError(
                Problem(
                    f"forge code imports project files as modules; {file!r} is not an "
                    "importable module path inside the project (name its directories and file "
                    "as Python identifiers)"
                )
            )
        return ".".join(parts)

    def _module_root(self, text: str) -> str:
        try:
            spec = parse_spec(text)
        except Exception:  # a bad spec is reported by the check
            return ""
        if spec.file is not None:
            return spec.attrs[0]  # imported as `from module import attr`
        return (spec.module or "").split(".")[0]

    def _new_name(self, hint: str) -> str:
        parts = [p for p in re.split(r"[^0-9A-Za-z_]+", hint) if p]
        if len(parts) > 1 and parts[-1].isdigit():
            base = f"{parts[-2]}_{parts[-1]}"
        else:
            base = parts[-1] if parts else "value"
        base = re.sub(r"^(?=\d)", "_", base)
        name, index = base, 2
        while name in self._taken:
            name, index = f"{base}_{index}", index + 1
        self._taken.add(name)
        return name

    # ---------------------------------------------------------------- literals
    def _literal(self, value: Any) -> str:
        if isinstance(value, float) and not math.isfinite(value):
            return f"float({str(value)!r})"
        if isinstance(value, datetime.date):
            self.imports.add("datetime")
        if isinstance(value, list | tuple | dict | set):
            raise TypeError(f"unexpected plain container in the graph: {value!r}")
        if isinstance(value, str):
            return _string(value)
        return repr(value)


def _string(value: str) -> str:
    """A double-quoted Python literal (JSON's string syntax is Python's, for these escapes)."""
    return json.dumps(value, ensure_ascii=False)


def _shared_nodes(values: list[Any]) -> set[int]:
    """Nodes that more than one parent (or a target and a parent) refer to."""
    counts: Counter[int] = Counter(id(v) for v in values if isinstance(v, Node))
    for node in walk(values):
        for child, _ in iter_children(node):
            if isinstance(child, Node):
                counts[id(child)] += 1
    return {key for key, count in counts.items() if count > 1}


def _bracketed(open_: str, parts: list[str], close: str, *, trailing_comma: bool = False) -> str:
    """``f(a, b)`` on one line when it fits, else one part per line, indented."""
    one_line = open_ + ", ".join(parts) + ("," if trailing_comma else "") + close
    if len(one_line) <= _WIDTH - 20 and "\n" not in one_line:
        return one_line
    body = "".join(f"{_INDENT}{p.replace(chr(10), chr(10) + _INDENT)},\n" for p in parts)
    return f"{open_}\n{body}{close}"


def _argument(flag: str, options: list[str], help_text: str) -> str:
    """One ``parser.add_argument`` statement of the script's ``main``."""
    parts = [_string(flag), *options, f"help={_string(help_text)}"]
    return "    parser.add_argument(\n" + "".join(f"        {p},\n" for p in parts) + "    )"


def _problem(node: Node, message: str, hint: str | None = None) -> ConfigError:
    return ConfigError(Problem(message, line=node.loc.line, key_path=node.key_path, hint=hint))


def generate_script(
    targets: Mapping[str, Any],
    *,
    target: str,
    project_root: Path,
    config_name: str,
    command: str,
    script_name: str = "train.py",
    inputs: Mapping[str, ScriptInput] | None = None,
    omit: Mapping[int, set[str]] | None = None,
) -> str:
    """A standalone script that builds ``targets[target]`` and, for a trainer, trains it;
    ``omit`` names keyword arguments (by their call node's id) not to write (values that
    change nothing)."""
    if target not in targets:
        raise ConfigError(Problem(f"no target {target!r}", hint="targets: " + ", ".join(targets)))
    project_root = Path(project_root).resolve()
    if inputs is None:
        inputs = default_inputs(project_root, config_name)
    emitter = _Emitter([targets[target]], inputs, project_root, omit)
    result = emitter.expr(targets[target], name_hint=target)
    is_trainer = target == "trainer"
    function = f"build_{re.sub(r'[^0-9A-Za-z_]', '_', target).lstrip('_') or 'target'}"
    body = "\n".join(_INDENT + line.replace("\n", "\n" + _INDENT) for line in emitter.statements)
    parameters = ", ".join(f"{p}: str" for p in emitter.parameters)
    imports = sorted(
        emitter.imports | {"argparse", "logging", "sys"} | ({"os"} if emitter.uses_os else set())
    )
    stdlib = [m for m in imports if m.split(".")[0] in sys.stdlib_module_names]
    third = [m for m in imports if m.split(".")[0] not in sys.stdlib_module_names]
    import_lines = [f"import {m}" for m in stdlib] + ["from pathlib import Path"]
    if third:
        import_lines += [""] + [f"import {m}" for m in third]
    project_lines = []
    if emitter.project_imports:
        project_lines = [
            "sys.path.insert(0, str(PROJECT_DIR))  # the project's own files, e.g. model.py",
            *sorted(emitter.project_imports),
        ]
    project_block = "\n\n" + "\n".join(project_lines) if project_lines else ""
    arguments = {
        "run_dir": _argument(
            "--output-dir",
            ["required=True", 'metavar="DIR"'],
            "metrics, events and checkpoints go here (!var run_dir)",
        ),
        "output_root": _argument(
            "--output-root",
            ['default=str(PROJECT_DIR / "output")', 'metavar="DIR"'],
            "caches such as the tokenizer (!var output_root)",
        ),
    }
    call_args = {"run_dir": "str(run_dir)", "output_root": "args.output_root"}
    parser_lines = [arguments[p] for p in emitter.parameters if p in arguments]
    if "run_dir" not in emitter.parameters and is_trainer:
        parser_lines.insert(
            0, arguments["run_dir"].replace("!var run_dir", "unused by this config")
        )
    if is_trainer:
        parser_lines.append(
            _argument(
                "--resume",
                ['action="store_true"'],
                "continue from the newest valid checkpoint in --output-dir",
            )
        )
    run_lines = []
    if is_trainer or "run_dir" in emitter.parameters:
        run_lines += [
            "    run_dir = Path(args.output_dir).resolve()",
            "    run_dir.mkdir(parents=True, exist_ok=True)",
        ]
    call = f"{function}({', '.join(call_args[p] for p in emitter.parameters)})"
    if is_trainer:
        run_lines += [
            f"    trainer = {call}",
            "    trainer.train(resume_from_checkpoint=True if args.resume else None)",
        ]
    else:
        run_lines += [f"    print(repr({call}))"]
    what = "train it as `forge train` does" if is_trainer else "print its repr"
    usage = "--output-dir DIR [--resume]" if is_trainer else "[--output-dir DIR]"
    source = f'''#!/usr/bin/env python
"""Build the `{target}` target of {config_name} (project {project_root.name}) and {what}.

Generated by: {command}
Run it with:  python {script_name} {usage}

The objects are built in the order forge builds them, with the config's arguments; only
the callables the config names are imported, not forge's config layer.
"""

from __future__ import annotations

{chr(10).join(import_lines)}

PROJECT_DIR = Path({_string(str(project_root))}){project_block}


def {function}({parameters}):
    """The `{target}` target and everything it needs, in build order."""
{body}
    return {result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
{chr(10).join(parser_lines)}
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
{chr(10).join(run_lines)}


if __name__ == "__main__":
    main()
'''
    return source
