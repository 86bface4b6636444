"""The fixed cost of a sweep's trial: forge sweep (trials forked from its fork server, and
trials as fresh processes, FORGE_SWEEP_FORK=0) against Hugging Face's
``Trainer.hyperparameter_search`` with Optuna, which runs every trial in its own process.

A trial's fixed cost is its wall time minus its training loop's (``train_runtime``): starting
the trial's process, building the model, data and trainer, writing its run. Trials train one
step of a tiny model, so the fixed cost is nearly all of a trial. forge's trial wall time is
taken between the sweep's "trial N:" and "trial N completed" lines; HF's between its
``model_init`` call and its objective's. The first forked trial also starts the fork server
(the imports, once per sweep), reported apart as ``first_trial_s``; ``per_trial_s`` is the
sweep's whole wall time over its trials, imports and all. The machine's load is printed with
the figures: on a busy machine they spread widely.

    .venv/bin/python bench/sweep_trials.py [--trials 6] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGET_S = 1.5  # the goal for a forked trial's fixed cost
SHORT = ["-D", "max_steps=1", "-D", "eval_steps=1", "-D", "save_steps=1000"]
SHORT += ["-D", "logging_steps=1", "-D", "report_to=none"]


def forge_sweep(project: Path, trials: int, fork: bool) -> dict:
    values = ",".join(f"{0.001 * (i + 1):g}" for i in range(trials))
    name = "forked" if fork else "fresh"
    command = [sys.executable, "-m", "forge.cli", "sweep", "train", "-p", str(project)]
    command += ["-D", f"learning_rate={values}", *SHORT, "--name", name]
    env = dict(os.environ, FORGE_SWEEP_FORK="1" if fork else "0", OMP_NUM_THREADS="1")
    started, ended, lines = {}, {}, []
    begin = time.perf_counter()
    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL)
    for raw in process.stderr:
        line = raw.decode(errors="replace")
        lines.append(line)
        now = time.perf_counter()
        if match := re.search(r"trial (\d+): ", line):
            started[int(match.group(1))] = now
        elif match := re.search(r"trial (\d+) completed", line):
            ended[int(match.group(1))] = now
    process.wait()
    wall = time.perf_counter() - begin
    if process.returncode != 0 or len(ended) != trials:
        raise SystemExit(f"forge sweep ({name}) failed:\n{''.join(lines[-30:])}")
    fixed = []
    for number in sorted(ended):
        record = json.loads(
            (project / "output" / "sweeps" / name / "trials" / f"{number:04d}.json").read_text()
        )
        loop = train_runtime(Path(record["run_dir"]))
        fixed.append(ended[number] - started[number] - loop)
    return summary(fixed, wall, trials)


def train_runtime(run_dir: Path) -> float:
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "train_runtime" in row:
            return float(row["train_runtime"])
    return 0.0


HF_SCRIPT = r"""
import json, sys, time
begin = time.perf_counter()
import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments
from transformers import TrainerCallback

trials, out = int(sys.argv[1]), sys.argv[2]
g = torch.Generator().manual_seed(0)
data = [{"input_ids": torch.randint(5, 100, (16,), generator=g), "labels": int(i % 2)} for i in range(256)]
config = BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                    intermediate_size=64, num_labels=2)
marks, runtimes = [], []

def model_init(trial=None):
    marks.append([time.perf_counter(), None])
    return BertForSequenceClassification(config)

class Runtime(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "train_runtime" in logs:
            runtimes.append(logs["train_runtime"])

def objective(metrics):
    marks[-1][1] = time.perf_counter()
    return metrics["eval_loss"]

args = TrainingArguments(out, max_steps=1, eval_strategy="steps", eval_steps=1, logging_steps=1,
                         save_strategy="no", report_to="none", per_device_train_batch_size=64,
                         disable_tqdm=True, use_cpu=True)
trainer = Trainer(model_init=model_init, args=args, train_dataset=data, eval_dataset=data[:64],
                  callbacks=[Runtime()])
marks.clear()  # the Trainer's own first model_init
trainer.hyperparameter_search(
    direction="minimize", backend="optuna", n_trials=trials, compute_objective=objective,
    hp_space=lambda t: {"learning_rate": t.suggest_float("learning_rate", 1e-4, 1e-2, log=True)},
)
ends = [m for m in marks if m[1] is not None]
fixed = [end - start - run for (start, end), run in zip(ends, runtimes)]
print(json.dumps({"fixed": fixed, "wall": time.perf_counter() - begin}))
"""


def hf_search(trials: int, scratch: Path) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error")
    begin = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", HF_SCRIPT, str(trials), str(scratch / "hf")],
        env=env,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - begin
    if done.returncode != 0:
        raise SystemExit(f"HF hyperparameter_search failed:\n{done.stderr[-3000:]}")
    found = json.loads(done.stdout.strip().splitlines()[-1])
    return summary(found["fixed"], wall, trials)


def summary(fixed: list[float], wall: float, trials: int) -> dict:
    later = fixed[1:] or fixed
    return {
        "fixed_s_median": statistics.median(later),  # the first trial apart (server, imports)
        "fixed_s_spread": [min(later), max(later)],
        "first_trial_s": fixed[0],
        "per_trial_s": wall / trials,
        "wall_s": wall,
        "trials": trials,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--parts", default="forked,fresh,hf", help="of forked,fresh,hf")
    args = parser.parse_args()
    parts = [p for p in args.parts.split(",") if p]
    load_start = os.getloadavg()[0]
    results: dict = {}
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        made = subprocess.run(
            [
                sys.executable,
                "-m",
                "forge.cli",
                "new",
                "cls",
                "--from",
                "classifier",
                "-p",
                scratch,
            ],
            capture_output=True,
            text=True,
        )
        if made.returncode != 0:
            raise SystemExit(made.stderr)
        if "forked" in parts:
            results["forge_forked"] = forge_sweep(root / "cls", args.trials, fork=True)
        if "fresh" in parts:
            results["forge_fresh"] = forge_sweep(root / "cls", args.trials, fork=False)
        if "hf" in parts:
            results["hf_optuna"] = hf_search(args.trials, root)
    results["machine"] = {
        "cpus": os.cpu_count(),
        "load_start": load_start,
        "load_end": os.getloadavg()[0],
    }
    ratios = {}
    if "forge_forked" in results and "hf_optuna" in results:
        ratios["fixed_forked_vs_hf"] = (
            results["forge_forked"]["fixed_s_median"] / results["hf_optuna"]["fixed_s_median"]
        )
    if "forge_forked" in results and "forge_fresh" in results:
        ratios["fixed_fresh_vs_forked"] = (
            results["forge_fresh"]["fixed_s_median"] / results["forge_forked"]["fixed_s_median"]
        )
    results["ratios"] = ratios
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"{'case':14s} {'fixed s (median, min-max)':>28s} {'first s':>8s} {'per trial s':>12s}")
    for name in ("forge_forked", "forge_fresh", "hf_optuna"):
        if name in results:
            r = results[name]
            spread = f"{r['fixed_s_median']:.2f} ({r['fixed_s_spread'][0]:.2f}-{r['fixed_s_spread'][1]:.2f})"
            print(f"{name:14s} {spread:>28s} {r['first_trial_s']:8.2f} {r['per_trial_s']:12.2f}")
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}")
    machine = results["machine"]
    print(
        f"load {machine['load_start']:.1f} -> {machine['load_end']:.1f} on {machine['cpus']} CPUs"
    )
    if "forge_forked" in results:
        fixed = results["forge_forked"]["fixed_s_median"]
        verdict = "meets" if fixed <= TARGET_S else "misses"
        print(f"forked trial's fixed cost {fixed:.2f} s: {verdict} the {TARGET_S} s goal")


if __name__ == "__main__":
    main()
