"""A sweep's state in the project's output: ``output/sweeps/NAME/``.

    sweep.json          what the sweep searches (its spec), the config, the trial budget
    trials/NNNN.json    one record per trial: its values, run directory, status, objective
    study.journal       Optuna's journal file storage (studies only)
    .lock               held while a worker picks its next trial (a few milliseconds)

Every trial is an ordinary run (``output/CONFIG/run_NNN``) whose ``run.json`` has a ``sweep``
field naming the sweep and the trial. A worker picks its next trial under the sweep's lock:
a trial whose run no live process holds (its sweep was killed) is resumed; else a new trial
is numbered, its record written, its run created, all before the lock is released, so two
workers never share a trial number or a run directory. Optuna is imported only for studies.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forge.checkpoint.io import write_json_atomic
from forge.runs import now_iso
from forge.sweep.space import SweepSpec, SweepUsageError

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]

OPTUNA_INSTALL = "pip install 'forge[sweep]'"
ENDED = ("completed", "pruned", "failed")
SAMPLERS = {
    "tpe": "TPESampler",
    "cmaes": "CmaEsSampler",
    "gp": "GPSampler",
    "qmc": "QMCSampler",
    "nsgaii": "NSGAIISampler",
    "optuna-random": "RandomSampler",
}
PRUNERS = {
    "none": "NopPruner",
    "median": "MedianPruner",
    "percentile": "PercentilePruner",
    "hyperband": "HyperbandPruner",
    "successive-halving": "SuccessiveHalvingPruner",
    "threshold": "ThresholdPruner",
    "patient": "PatientPruner",
    "wilcoxon": "WilcoxonPruner",
}
# a median pruner that waits for 5 finished trials prunes nothing in a small sweep
PRUNER_DEFAULTS = {"median": {"n_startup_trials": 2}, "percentile": {"n_startup_trials": 2}}
_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


class SweepStateError(Exception):
    """A sweep's files cannot be used (another config's study, a damaged record): exit 2."""


def sweeps_root(output_dir: Path) -> Path:
    return Path(output_dir) / "sweeps"


@dataclass
class Sweep:
    """One sweep directory and its spec."""

    directory: Path
    spec: SweepSpec
    name: str
    trials: int  # the budget: trials in all, those done included

    @property
    def trials_dir(self) -> Path:
        return self.directory / "trials"

    @property
    def storage_path(self) -> Path:
        return self.directory / "study.journal"

    def trial_path(self, number: int) -> Path:
        return self.trials_dir / f"{number:04d}.json"

    def records(self) -> list[dict[str, Any]]:
        """Every trial's record, by number."""
        if not self.trials_dir.is_dir():
            return []
        found = []
        for path in sorted(self.trials_dir.glob("*.json")):
            with contextlib.suppress(OSError, ValueError):
                found.append(json.loads(path.read_text()))
        return sorted(found, key=lambda r: r["trial"])

    def write(self, record: dict[str, Any]) -> None:
        record["updated"] = now_iso()
        self.trials_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.trial_path(record["trial"]), record)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """The sweep's lock: one worker at a time picks, numbers and creates a trial."""
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self.directory / ".lock", "a+") as handle:
            if fcntl is not None:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
            yield

    def sweep_field(self, number: int, values: dict[str, Any], trial_id: int | None) -> dict:
        """What a trial's ``run.json`` says of its sweep."""
        spec = self.spec
        return {
            "name": self.name,
            "dir": str(self.directory),
            "trial": number,
            "params": values,
            "method": spec.method,
            "objective": spec.objective,
            "direction": spec.direction,
            "storage": str(self.storage_path) if spec.uses_optuna else None,
            "trial_id": trial_id,
            "pruner": spec.pruner,
        }


def default_name(spec: SweepSpec) -> str:
    """``CONFIG-HASH``: the same command continues the same sweep, another starts another."""
    stem = Path(spec.config).with_suffix("").as_posix().replace("/", "-")
    return f"{stem}-{spec.digest()}"


def open_sweep(output_dir: Path, spec: SweepSpec, name: str | None, trials: int) -> Sweep:
    """The sweep ``name`` (created, or continued when its spec is this one); refuses a sweep
    directory of another config or another search, naming the difference."""
    name = name or default_name(spec)
    if not _NAME_RE.match(name):
        raise SweepUsageError(f"--name {name!r}: use letters, digits, '_', '-' or '.'")
    directory = sweeps_root(output_dir) / name
    sweep = Sweep(directory, spec, name, trials)
    path = directory / "sweep.json"
    with sweep.locked():
        if path.is_file():
            stored = read_sweep_file(directory)
            _refuse_another(stored, spec, directory)
            if stored.get("trials") != trials:
                stored["trials"] = trials
                write_json_atomic(path, stored)
        else:
            write_json_atomic(
                path,
                {
                    "name": name,
                    "config": spec.config,
                    "spec": spec.identity(),
                    "trials": trials,
                    "created": now_iso(),
                },
            )
    return sweep


def read_sweep_file(directory: Path) -> dict[str, Any]:
    path = Path(directory) / "sweep.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise SweepStateError(f"{path}: unreadable ({err})") from err
    if not isinstance(data, dict) or not isinstance(data.get("spec"), dict):
        raise SweepStateError(f"{path}: not a forge sweep record")
    return data


def _refuse_another(stored: dict[str, Any], spec: SweepSpec, directory: Path) -> None:
    if stored.get("config") != spec.config:
        raise SweepStateError(
            f"{directory} is a sweep of config {stored.get('config')!r}, not {spec.config!r}; "
            "give this sweep another --name"
        )
    mine = spec.identity()
    differ = [k for k in mine if stored["spec"].get(k) != mine[k]]
    if differ:
        key = differ[0]
        raise SweepStateError(
            f"{directory} searches another space: its {key} is "
            f"{json.dumps(stored['spec'].get(key))}, this command's {json.dumps(mine[key])}; "
            "run the command that started it to continue it, or give another --name"
        )


def find_sweep(output_dir: Path, name: str | None) -> Path:
    """The sweep directory ``name``, or the newest sweep of the project."""
    root = sweeps_root(output_dir)
    found = (
        sorted((p for p in root.glob("*/sweep.json")), key=lambda p: p.stat().st_mtime)
        if root.is_dir()
        else []
    )
    names = [p.parent.name for p in found]
    if name is None:
        if not found:
            raise SweepStateError(f"no sweeps under {root}; start one with `forge sweep CONFIG`")
        return found[-1].parent
    if name not in names:
        from forge.suggest import suggestion

        raise SweepUsageError(
            f"no sweep {name!r} under {root} (sweeps: {', '.join(names) or 'none'})"
            + suggestion(name, names)
        )
    return root / name


# --------------------------------------------------------------------------- Optuna


def require_optuna(method: str):
    try:
        import optuna
    except ImportError:
        raise SweepUsageError(
            f"--method {method} runs an Optuna study, and Optuna is not installed: "
            f"{OPTUNA_INSTALL} (grid and random search need nothing more)"
        ) from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


def parse_named(text: str, table: dict[str, str], what: str) -> tuple[str, dict[str, Any]]:
    """``median`` or ``threshold(upper=0.5)``: the name in ``table`` and its keyword arguments."""
    from forge.config.yaml_io import parse_value
    from forge.suggest import suggestion

    match = re.match(r"^\s*([A-Za-z0-9_-]+)\s*(?:\((.*)\))?\s*$", text)
    if not match:
        raise SweepUsageError(f"{what} {text!r}: write NAME or NAME(key=value,...)")
    name, inner = match.group(1).lower(), match.group(2) or ""
    if name not in table:
        raise SweepUsageError(
            f"{what} {name!r} is not one forge knows ({', '.join(table)})" + suggestion(name, table)
        )
    kwargs = {}
    for part in filter(None, (p.strip() for p in inner.split(","))):
        key, sep, value = part.partition("=")
        if not sep:
            raise SweepUsageError(f"{what} {text!r}: {part!r} is not key=value")
        kwargs[key.strip()] = parse_value(value.strip())
    return name, kwargs


def make_sampler(spec: SweepSpec, number: int | None = None):
    """The study's sampler; for trial ``number``, seeded from the sweep's seed and that number
    (QMC's sequence keeps the sweep's seed: it indexes the sequence by trial itself)."""
    optuna = require_optuna(spec.method)
    name, kwargs = parse_named(spec.method, SAMPLERS, "--method")
    cls = getattr(optuna.samplers, SAMPLERS[name])
    seed = kwargs.get("seed", spec.seed)
    if number is not None and name != "qmc" and seed is not None:
        seed = trial_seed(int(seed), number)
    kwargs["seed"] = seed
    return cls(**kwargs)


def trial_seed(seed: int, number: int) -> int:
    """A 32-bit seed of the sweep's ``seed`` and a trial's number."""
    digest = hashlib.blake2b(f"{seed}:{number}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


def ask(study, spec: SweepSpec):
    """A new trial of ``study``, drawn from the study as it stands in its storage: call under
    the sweep's lock. Its sampler is seeded by the new trial's number, so every worker (a
    thread, another ``forge sweep``, a SLURM array task) draws its own point, and a study run
    again from the same seed draws the same points in the same order of results."""
    number = len(study.get_trials(deepcopy=False))
    study.sampler = make_sampler(spec, number)
    return study.ask(distributions(spec))


def make_pruner(text: str):
    optuna = require_optuna("(a pruner)")
    name, kwargs = parse_named(text, PRUNERS, "--pruner")
    kwargs = {**PRUNER_DEFAULTS.get(name, {}), **kwargs}
    try:
        return getattr(optuna.pruners, PRUNERS[name])(**kwargs)
    except (TypeError, ValueError) as err:
        raise SweepUsageError(f"--pruner {text}: {err}") from None


def _storage(path: Path):
    optuna = require_optuna("(a study)")
    from optuna.storages.journal import JournalFileBackend

    return optuna.storages.JournalStorage(JournalFileBackend(str(path)))


def load_study(sweep: Sweep):
    """The sweep's Optuna study (created on first use), stored in ``study.journal``."""
    optuna = require_optuna(sweep.spec.method)
    return optuna.create_study(
        study_name=sweep.name,
        storage=_storage(sweep.storage_path),
        sampler=make_sampler(sweep.spec),
        pruner=make_pruner(sweep.spec.pruner),
        direction=sweep.spec.direction,
        load_if_exists=True,
    )


def distributions(spec: SweepSpec) -> dict[str, Any]:
    optuna = require_optuna(spec.method)
    dists = optuna.distributions
    found = {}
    for axis in spec.axes:
        if axis.is_list:
            found[axis.name] = dists.CategoricalDistribution(list(axis.values))
        elif axis.kind == "int":
            found[axis.name] = dists.IntDistribution(int(axis.low), int(axis.high), log=axis.log)
        else:
            log = axis.kind == "loguniform"
            found[axis.name] = dists.FloatDistribution(axis.low, axis.high, log=log)
    return found


def load_trial(sweep_field: dict[str, Any]):
    """The Optuna trial a training process reports to (forge.sweep.pruning)."""
    optuna = require_optuna(sweep_field.get("method", "tpe"))
    study = optuna.load_study(
        study_name=sweep_field["name"],
        storage=_storage(Path(sweep_field["storage"])),
        pruner=make_pruner(sweep_field.get("pruner", "none")),
    )
    return optuna.trial.Trial(study, int(sweep_field["trial_id"]))


def tell(study, record: dict[str, Any]) -> None:
    """The trial's end, told to the study (once: a finished trial is not told again)."""
    from optuna.trial import TrialState

    trial = study._storage.get_trial(record["trial_id"])
    if trial.state.is_finished():
        return
    if record["status"] == "completed":
        study.tell(record["trial"], record["value"])
    elif record["status"] == "pruned":
        study.tell(record["trial"], state=TrialState.PRUNED)
    else:
        study.tell(record["trial"], state=TrialState.FAIL)
