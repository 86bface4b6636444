"""The kill harness: train tiny_lm, SIGKILL it at chosen and at random moments, resume after
each kill, and check that nothing committed is lost and the end is an uninterrupted run's.

For each trainer in TRAINERS (adding one is one entry), the harness trains the small tiny_lm
straight through once (the reference), then trains it again and kills it ``kills`` times:

* ``after-file``: a process kills itself right after writing one file of a save (a shard, the
  optimizer state, a rank's file), chosen in turn from the checkpoint's files, by the rank that
  writes it (the test-only fault point ``after:FILE@STEP:RANK`` of tests/faults);
* ``before-manifest`` / ``before-rename``: rank 0 kills itself with every file written and
  before the manifest, or with the manifest written and before the directory's rename;
* ``random``: every process of the job is SIGKILLed at once at a random moment of training
  (after 0 to 2 more saves, then up to half a second further): a machine crash;
* ``rotation``: every process is SIGKILLed the moment an old checkpoint is being deleted
  (``.tmp-delete-*`` seen), or failing that right after a deletion;
* ``one-rank`` (several processes): one random worker is SIGKILLed at a random moment; the
  rest of the job must stop by itself.

After every kill: every checkpoint under a final name is valid; every checkpoint the job had
reported saved and not deleted is still there (rotation may have removed the oldest ones),
and the next `forge resume` starts from the newest valid checkpoint. At the end the run is
resumed to its last step and its weights and optimizer state must equal the reference's bit
for bit.

Run: ``python -m tests.reliability.kill_harness --kills 20 --report out.json`` (what
``make reliability`` does through tests/reliability/test_kills.py), or import
:func:`run_trainer`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tests.faults import fault_env
from tests.helpers import REPO, TINY_LM, run_forge
from tests.integration.conftest import SMALL
from tests.reliability.procs import alive, descendants, kill_tree, worker_pids

HANG_S = 600  # a job that has not stopped by itself by then is a hang, reported as a failure


@dataclass(frozen=True)
class TrainerCase:
    """One trainer and topology the harness trains and kills."""

    name: str
    config: str
    nproc: int
    defines: tuple[str, ...] = ()


# Synchronous saves, chosen explicitly (async_save is on by default).
SYNC = ("--set", "trainer.args.async_save=false")
TRAINERS = [
    TrainerCase("plain-1", "train", 1, SYNC),
    TrainerCase("plain-2", "train", 2, SYNC),
    TrainerCase("accel-2", "accel", 2, SYNC),
    TrainerCase("pipeline-2", "pipeline", 2, SYNC),  # 2 stages of 2 layers each
]

# The same jobs with ``async_save: true``: every save's files, manifest and rename happen on
# a background thread while the loop trains on, so a kill lands inside an async commit.
ASYNC = ("--set", "trainer.args.async_save=true")
ASYNC_TRAINERS = [
    TrainerCase(f"{case.name}-async", case.config, case.nproc, (*case.defines, *ASYNC))
    for case in TRAINERS
]
ALL_TRAINERS = [*TRAINERS, *ASYNC_TRAINERS]

KINDS_ONE = ["after-file", "random", "before-manifest", "after-file", "rotation", "before-rename"]
KINDS_MANY = [*KINDS_ONE, "one-rank"]


@dataclass
class Kill:
    """One attempt of the job and how it ended."""

    kind: str
    detail: str = ""
    resumed_from_step: int | None = None
    seen_on_disk: str = ""
    exit: str = ""
    problems: list[str] = field(default_factory=list)


@dataclass
class TrainerResult:
    trainer: str
    config: str
    nproc: int
    max_steps: int
    save_steps: int
    kills: list[Kill] = field(default_factory=list)
    final_step: int | None = None
    bit_identical: bool = False
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.bit_identical and not self.problems and not any(k.problems for k in self.kills)

    def summary(self) -> dict[str, Any]:
        return {
            **{k: v for k, v in asdict(self).items() if k != "kills"},
            "ok": self.ok,
            "kill_count": len(self.kills),
            "kinds": dict(Counter(k.kind for k in self.kills)),
            "seen_on_disk": dict(Counter(k.seen_on_disk for k in self.kills)),
            "resumes_ok": sum(k.resumed_from_step is not None for k in self.kills),
            "kills": [asdict(k) for k in self.kills],
        }


# --------------------------------------------------------------------------- one job


class Job:
    """A `forge train` / `forge resume` process whose stderr is read as it comes."""

    def __init__(
        self,
        args: list[str],
        env: dict[str, str] | None = None,
        launcher: list[str] | None = None,
    ) -> None:
        """``launcher``: the command that runs ``-m forge.cli ARGS`` (default: this Python; a
        user's ``torchrun --nproc_per_node=2``, ``accelerate launch ...``)."""
        full_env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
        full_env.setdefault("OMP_NUM_THREADS", "1")
        full_env.update(env or {})
        self.proc = subprocess.Popen(
            [*(launcher or [sys.executable]), "-m", "forge.cli", *args],
            cwd=REPO,
            env=full_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self.changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            with self.changed:
                self.lines.append(line.rstrip("\n"))
                self.changed.notify_all()
        with self.changed:
            self.changed.notify_all()

    def wait_for_line(self, pattern: str, *, after: int = 0) -> re.Match | None:
        """The first stderr line from index ``after`` matching ``pattern``, waiting for it;
        None once the job has ended without one."""
        regex = re.compile(pattern)
        index = after
        with self.changed:
            while True:
                while index < len(self.lines):
                    match = regex.search(self.lines[index])
                    if match:
                        return match
                    index += 1
                if not self._reader.is_alive():
                    return None
                self.changed.wait(timeout=0.5)

    def wait_for_count(self, pattern: str, count: int) -> bool:
        """Wait until ``count`` stderr lines match ``pattern``; False if the job ends first."""
        regex = re.compile(pattern)
        with self.changed:
            while sum(bool(regex.search(line)) for line in self.lines) < count:
                if not self._reader.is_alive():
                    return False
                self.changed.wait(timeout=0.5)
        return True

    def wait(self) -> int:
        """The exit status once the job has stopped by itself (a hang raises)."""
        try:
            code = self.proc.wait(timeout=HANG_S)
        except subprocess.TimeoutExpired:
            kill_tree(self.proc.pid)
            self.proc.wait()
            raise RuntimeError(f"the job did not stop within {HANG_S} s: a hang") from None
        self._reader.join()
        return code

    def kill_all(self) -> None:
        """SIGKILL every process of the job at once, and wait until all are gone."""
        victims = kill_tree(self.proc.pid)
        self.proc.wait()
        self._reader.join()
        while any(alive(pid) for pid in victims):
            time.sleep(0.01)

    def text(self) -> str:
        return "\n".join(self.lines)


# --------------------------------------------------------------------------- checks


def committed(lines: list[str]) -> tuple[set[str], set[str]]:
    """Checkpoints the job reported saved, and those it reported deleted (by name)."""
    saved = {Path(m.group(1)).name for line in lines if (m := _SAVED.search(line))}
    deleted = {m.group(1) for line in lines if (m := _DELETED.search(line))}
    return saved, deleted


_SAVED = re.compile(r"saved checkpoint (\S+)$")
_DELETED = re.compile(r"deleted old checkpoint (checkpoint-\d+)")
_RESUMED = re.compile(r"resumed from (\S+) at step (\d+)")


def snapshot(checkpoints: Path) -> set[tuple[str, int, int]]:
    """The entries of a checkpoints directory with their inodes and modification times, to
    tell new ones from those an earlier kill left (a name and even an inode may come again)."""
    found = set()
    try:
        for entry in os.scandir(checkpoints):
            try:
                found.add((entry.name, entry.inode(), entry.stat().st_mtime_ns))
            except OSError:  # removed while we looked
                continue
    except OSError:
        pass
    return found


def what_is_on_disk(checkpoints: Path, limit: int, before: set[tuple[str, int, int]]) -> str:
    """Where in a save (or between saves) the kill came, judged from what it left (entries
    in ``before``, left by an earlier kill, do not count)."""
    names = sorted(name for name, *_ in snapshot(checkpoints) - before)
    every = [name for name, *_ in snapshot(checkpoints)]
    for name in names:
        if name.startswith(".tmp-delete-"):
            return "during rotation (a deletion half done)"
    for name in names:
        if name.startswith(".tmp-old-"):
            return "while replacing a checkpoint of the same step"
    for name in names:
        if name.startswith(".tmp-checkpoint-"):
            if (checkpoints / name / "manifest.json").exists():
                return "inside a save: manifest written, not renamed"
            return "inside a save: no manifest yet"
    if len([n for n in every if n.startswith("checkpoint-")]) > limit:
        return "after a commit, before rotation"
    return "between saves"


def check_after_kill(checkpoints: Path, alive_before: set[str], limit: int) -> list[str]:
    """Problems with what a kill left: invalid checkpoints, committed ones lost."""
    from forge.checkpoint import find_checkpoints, parse_checkpoint_step

    problems = []
    infos = {info.path.name: info for info in find_checkpoints(checkpoints)}
    for name, info in infos.items():
        if not info.valid:
            problems.append(f"{name} is invalid after the kill: {'; '.join(info.problems)}")
    present = {n for n, info in infos.items() if info.valid}
    missing = sorted(alive_before - present, key=parse_checkpoint_step)
    newest = max(alive_before, key=parse_checkpoint_step, default=None)
    # rotation deletes the oldest beyond save_total_limit, never the newest
    if newest in missing or len(missing) > max(len(alive_before) - limit, 0):
        problems.append(f"committed checkpoints lost: {missing} (had {sorted(alive_before)})")
    return problems


def final_tensors(checkpoint: Path) -> dict[str, Any]:
    """The weights (every model*.safetensors) and optimizer state (every optimizer*.pt)."""
    import torch
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    for file in sorted(checkpoint.glob("model*.safetensors")):
        tensors.update({f"weights/{k}": v for k, v in load_file(file).items()})
    for file in sorted(checkpoint.glob("optimizer*.pt")):
        tensors[file.name] = torch.load(file, weights_only=True)["state"]
    return tensors


def differences(a: Any, b: Any, where: str = "") -> list[str]:
    import torch

    if isinstance(a, torch.Tensor):
        same = isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
        return [] if same else [where]
    if isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            return [f"{where} (keys differ)"]
        return [d for k in a for d in differences(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, (list, tuple)):
        if not isinstance(b, (list, tuple)) or len(a) != len(b):
            return [f"{where} (lengths differ)"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in differences(x, y)]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def fault_points(checkpoint: Path) -> list[tuple[str, int]]:
    """(``after:FILE`` point, the rank that writes FILE) for every file a save writes."""
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    stages = int(manifest["topology"].get("num_stages", 1))
    points = []
    for _, component in sorted(manifest["components"].items()):
        for file in component["files"]:
            if component.get("weights"):
                if stages == 1:
                    points.append(("after:model", 0))
                    break
                if match := re.search(r"-stage-(\d+)-of-", file):
                    points.append((f"after:{file}", int(match.group(1))))
            elif component["scope"] == "shared":
                points.append((f"after:{file}", 0))
            elif component["scope"] == "stage":
                match = re.search(r"-stage-(\d+)-of-", file)
                points.append((f"after:{file}", int(match.group(1)) if match else 0))
            else:
                points.append((f"after:{file}", int(re.search(r"-rank-(\d+)", file).group(1))))
    return points


# --------------------------------------------------------------------------- one trainer


def run_trainer(
    case: TrainerCase,
    workdir: Path,
    *,
    kills: int,
    seed: int = 0,
    max_steps: int = 200,
    save_steps: int = 3,
    limit: int = 2,
    log=print,
) -> TrainerResult:
    """Train ``case`` straight, then train it again with ``kills`` kills; see the module."""
    started = time.monotonic()
    rng = random.Random(f"{case.name}-{seed}")
    project = workdir / case.name / "tiny_lm"
    shutil.copytree(TINY_LM, project, ignore=shutil.ignore_patterns("output"))
    settings = [
        *SMALL,
        *case.defines,
        "-D",
        f"max_steps={max_steps}",
        "-D",
        f"save_steps={save_steps}",
        "-D",
        f"save_total_limit={limit}",
    ]
    result = TrainerResult(case.name, case.config, case.nproc, max_steps, save_steps)
    train = ["train", case.config, "-p", str(project), *settings, "--nproc", str(case.nproc)]

    reference = run_forge(*train)
    if reference.returncode != 0:
        result.problems.append(f"the reference run failed: {reference.stderr[-2000:]}")
        return result
    reference_dir = Path(reference.stdout.splitlines()[0])
    final_name = f"checkpoint-{max_steps:06d}"
    points = fault_points(reference_dir / "checkpoints" / final_name)
    log(f"{case.name}: reference trained ({len(points)} files per save)")

    kinds = KINDS_MANY if case.nproc > 1 else KINDS_ONE
    rng.shuffle(points)  # the after-file kills take the files in this order, round and round
    after_file = 0
    run_dir: Path | None = None
    checkpoints = Path()
    alive_set: set[str] = set()
    expected_start = 0
    for index in range(kills):
        kind = kinds[index % len(kinds)]
        kill = Kill(kind)
        env = {}
        # the save a fault kills: the next one, or one or two later (so the run moves on)
        next_save = (expected_start // save_steps + 1 + rng.randrange(3)) * save_steps
        if run_dir is None:  # the first kill comes after a checkpoint, or there is no run to resume
            next_save += save_steps
        if kind == "after-file":
            point, rank = points[after_file % len(points)]
            after_file += 1
            kill.detail = f"{point}@{next_save}:{rank}"
            env.update(fault_env(kill=kill.detail))
        elif kind in ("before-manifest", "before-rename"):
            kill.detail = f"{kind}@{next_save}:0"
            env.update(fault_env(kill=kill.detail))
        args = (
            train if run_dir is None else ["resume", "-p", str(project), "--run-dir", str(run_dir)]
        )
        before = snapshot(checkpoints) if run_dir is not None else set()
        job = Job(args, env)
        if run_dir is None:
            first = job.proc.stdout.readline().strip()
            run_dir = Path(first)
            checkpoints = run_dir / "checkpoints"
        start = job.wait_for_line(_RESUMED.pattern if index else r"training for \d+ steps")
        if index == 0 and kind in ("random", "rotation", "one-rank"):
            start = job.wait_for_line(_SAVED.pattern)
        if start is None:
            code = job.wait()
            kill.problems.append(f"the job ended ({code}) before training: {job.text()[-1500:]}")
            result.kills.append(kill)
            log(f"{case.name}: kill {index + 1}/{kills} {kind}: PROBLEMS {kill.problems}")
            break
        kill.resumed_from_step = int(start.group(2)) if index else 0
        if kill.resumed_from_step != expected_start:
            kill.problems.append(
                f"resumed at step {kill.resumed_from_step}, the newest valid checkpoint is "
                f"at step {expected_start}"
            )
        try:
            kill.exit = _kill(job, kind, kill, rng, checkpoints, before)
        except RuntimeError as err:
            kill.problems.append(str(err))
        kill.seen_on_disk = what_is_on_disk(checkpoints, limit, before)
        saved, deleted = committed(job.lines)
        alive_set = (alive_set | saved) - deleted
        kill.problems += check_after_kill(checkpoints, alive_set, limit)
        from forge.checkpoint import find_latest_checkpoint, parse_checkpoint_step

        newest = find_latest_checkpoint(checkpoints)
        expected_start = parse_checkpoint_step(newest) if newest else 0
        alive_set = {n for n in alive_set if (checkpoints / n).is_dir()}
        result.kills.append(kill)
        log(
            f"{case.name}: kill {index + 1}/{kills} {kind} {kill.detail} -> {kill.seen_on_disk}; "
            f"newest valid step {expected_start}"
            + (f"; PROBLEMS {kill.problems}" if kill.problems else "")
        )
        if expected_start >= max_steps:
            result.problems.append("the run reached max_steps before every kill was made")
            break

    final = Job(["resume", "-p", str(project), "--run-dir", str(run_dir)])
    code = final.wait()
    match = _RESUMED.search(final.text())
    if code != 0 or match is None or int(match.group(2)) != expected_start:
        result.problems.append(f"the final resume failed ({code}): {final.text()[-2000:]}")
        return result
    result.final_step = max_steps
    diff = differences(
        final_tensors(reference_dir / "checkpoints" / final_name),
        final_tensors(checkpoints / final_name),
    )
    result.bit_identical = not diff
    if diff:
        result.problems.append(f"final state differs from the reference: {diff[:5]}")
    result.seconds = round(time.monotonic() - started, 1)
    log(f"{case.name}: {'OK' if result.ok else 'FAILED'} in {result.seconds} s")
    return result


def _kill(
    job: Job,
    kind: str,
    kill: Kill,
    rng: random.Random,
    checkpoints: Path,
    before: set[tuple[str, int, int]],
) -> str:
    """Make the kill of ``kind`` happen; how the job ended."""
    if kind in ("after-file", "before-manifest", "before-rename"):
        code = job.wait()  # it kills itself at the fault point; the others must stop too
        job.kill_all()  # nothing should be left; make sure
        if code == 0:
            kill.problems.append(f"the job never reached the fault point {kill.detail}")
        return f"exit {code}"
    if kind == "rotation":
        rotations = 0
        while job.proc.poll() is None:
            if any(n.startswith(".tmp-delete-") for n, *_ in snapshot(checkpoints) - before):
                break
            now = sum(bool(_DELETED.search(line)) for line in job.lines)
            if now >= rotations + 3:  # the deletion was too quick to see three times
                break
            time.sleep(0.001)
        job.kill_all()
        return "SIGKILL to every process"
    # a random moment: after 0, 1 or 2 more saves, then up to half a second further
    job.wait_for_count(
        _SAVED.pattern, sum(map(bool, map(_SAVED.search, job.lines))) + rng.randrange(3)
    )
    time.sleep(rng.uniform(0.0, 0.5))
    if kind == "one-rank":
        workers = worker_pids(job.proc.pid)
        if workers:
            rank = rng.choice(sorted(workers))
            kill.detail = f"rank {rank}"
            os.kill(workers[rank], signal.SIGKILL)
            code = job.wait()
            leftovers = [pid for pid in descendants(job.proc.pid) if alive(pid)]
            job.kill_all()
            if leftovers:
                kill.problems.append(f"processes left after the job stopped: {leftovers}")
            return f"exit {code}"
    job.kill_all()
    return "SIGKILL to every process"


# --------------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--trainers",
        default=",".join(c.name for c in TRAINERS),
        help=f"comma-separated, of {', '.join(c.name for c in ALL_TRAINERS)}",
    )
    parser.add_argument("--report", help="write the results here as JSON")
    parser.add_argument("--workdir", help="where runs go (default: a temporary directory)")
    args = parser.parse_args(argv)
    chosen = [c for c in ALL_TRAINERS if c.name in args.trainers.split(",")]
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="forge-kills-"))
    results = [run_trainer(case, workdir, kills=args.kills, seed=args.seed) for case in chosen]
    if args.report:
        Path(args.report).write_text(json.dumps([r.summary() for r in results], indent=2))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
