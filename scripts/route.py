"""The route of a checkpoint argument through forge's code, from ``forge export`` on.

Runs a real ``forge export CHECKPOINT OUT`` in this process under ``sys.setprofile`` and follows
the checkpoint: a *stop* is a call of a forge function that is given it (an argument that is
the checkpoint's path, as text or a path, or an object whose attributes hold it: the parsed
command line, a reader); the route is the sequence of forge modules the stops run in, going back
to a caller's module when a stop returns and that caller goes on to another stop (the last
unwinding, back to the command, is not part of it). It prints

    stops                 calls of forge functions given the checkpoint
    modules               the distinct forge modules on the route
    returns               moves back into a module the route had already left
    climbs to cli/        moves back up into forge/cli/ after going down to forge/checkpoint/
    route                 the route, one module per move

    python scripts/route.py                      # makes a tiny checkpoint first (tiny_lm, 2 steps)
    python scripts/route.py --checkpoint DIR     # follows an export of DIR
    python scripts/route.py --json               # the figures as one JSON object on stdout
    python scripts/route.py --checkpoint DIR --merge-lora   # a LoRA checkpoint's merged export

The forge measured is the one ``import forge`` finds: run it with ``PYTHONPATH=TREE`` to
measure another checkout (``--checkpoint`` then avoids training with it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path


def make_checkpoint(root: Path) -> Path:
    """A tiny_lm project trained 2 steps in this process; its last checkpoint."""
    import forge
    from forge.cli.new import new_project

    project = new_project("route_lm", root, "tiny_lm")
    run = forge.train(
        project=project,
        variables={
            "max_steps": 2, "save_steps": 2, "eval_steps": 2, "max_files": 20,
            "report_to": "none", "logging_steps": 1,
        },
    )  # fmt: skip
    return forge.CheckpointReader(run.run_dir).path


class Route:
    """The stops and the module route of one traced call."""

    def __init__(self, checkpoint: Path, package: Path) -> None:
        given = Path(checkpoint)
        self.forms = {str(given), str(given.absolute()), str(given.resolve())}
        self.package = str(package) + os.sep
        self.stack: list[tuple[object, str]] = []  # (frame, module) of the stops under way
        self.back: str | None = None  # the module a stop returned to, until the next stop
        self.stops = 0
        self.route: list[str] = []

    def holds(self, value: object, depth: int = 0) -> bool:
        """Whether ``value`` is the checkpoint, or (one level down) an object holding it."""
        if isinstance(value, (str, os.PathLike)):
            try:
                return os.fspath(value) in self.forms
            except TypeError:
                return False
        if depth == 0:
            attributes = getattr(value, "__dict__", None)
            if isinstance(attributes, dict):
                return any(self.holds(v, 1) for v in list(attributes.values()))
        return False

    def profile(self, frame, event: str, arg: object) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(self.package):
            arguments = frame.f_code.co_varnames[
                : frame.f_code.co_argcount + frame.f_code.co_kwonlyargcount
            ]
            given = frame.f_locals
            if any(self.holds(given.get(name)) for name in arguments):
                module = frame.f_globals.get("__name__", "?")
                self.stops += 1
                self.stack.append((frame, module))
                if self.back is not None:
                    self._move(self.back)
                self._move(module)
                self.back = None
        elif event == "return" and self.stack and self.stack[-1][0] is frame:
            self.stack.pop()
            self.back = self.stack[-1][1] if self.stack else None

    def _move(self, module: str) -> None:
        if not self.route or self.route[-1] != module:
            self.route.append(module)

    def figures(self) -> dict[str, object]:
        seen: set[str] = set()
        returns = climbs = 0
        below = False  # the route went down to forge/checkpoint/ since it last left forge/cli/
        previous = None
        for module in self.route:
            if module in seen and module != previous:
                returns += 1
            if module.startswith("forge.checkpoint"):
                below = True
            if module.startswith("forge.cli"):
                if below and previous is not None and not previous.startswith("forge.cli"):
                    climbs += 1
                below = False
            seen.add(module)
            previous = module
        return {
            "stops": self.stops,
            "modules": len(seen),
            "returns": returns,
            "climbs_to_cli": climbs,
            "route": self.route,
        }


def follow_export(checkpoint: Path, output: Path, *options: str) -> dict[str, object]:
    """The figures of a real ``forge export CHECKPOINT OUTPUT [OPTIONS]`` in this process."""
    import forge
    from forge.cli import main as forge_main

    route = Route(checkpoint, Path(forge.__file__).parent)
    sys.setprofile(route.profile)
    try:
        code = forge_main(["export", str(checkpoint), str(output), *options])
    finally:
        sys.setprofile(None)
    if code != 0:
        raise RuntimeError(f"forge export {checkpoint} {output} exited {code}")
    return route.figures()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", help="the checkpoint to export (default: a tiny one)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--merge-lora", action="store_true", help="export with --merge-lora")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="forge-route-") as scratch:
        scratch = Path(scratch)
        checkpoint = Path(args.checkpoint) if args.checkpoint else make_checkpoint(scratch)
        print(f"following forge export {checkpoint}", file=sys.stderr)
        options = ["--merge-lora"] if args.merge_lora else []
        figures = follow_export(checkpoint, scratch / "export", *options)
    if args.json:
        print(json.dumps(figures))
        return 0
    for name in ("stops", "modules", "returns", "climbs_to_cli"):
        print(f"{name.replace('_', ' '):16s} {figures[name]}")
    print("route            " + " -> ".join(figures["route"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
