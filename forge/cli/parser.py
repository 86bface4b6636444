"""The ``forge`` argument parser: every command, its options and its worked examples.

Only argparse lives here; the parsed ``args.command`` names the function in
:data:`forge.cli.commands.COMMANDS` that runs it.
"""

from __future__ import annotations

import argparse
import textwrap

from forge import __version__
from forge.cli.new import SCAFFOLDS

EXAMPLES = {
    "ls": """
        examples:
          forge ls                          # the project that contains the working directory
          forge ls -p projects/tiny_lm      # an explicit project
          forge ls -p projects/tiny_lm --no-check   # render and parse only (no imports)
    """,
    "render": """
        examples:
          forge render -p projects/tiny_lm                    # the default config, as YAML
          forge render train -p projects/tiny_lm -D max_steps=50
          forge render train -p projects/tiny_lm --set trainer.args.save_steps=25
          forge render train -p projects/tiny_lm --chain      # which templates, in order
          forge render train -p projects/tiny_lm --graph      # nodes with callables resolved
          forge render train -p projects/tiny_lm --resolved   # each key once, with its line
    """,
    "vars": """
        examples:
          forge vars train -p projects/tiny_lm                # every variable the config reads
          forge vars train -p projects/tiny_lm -D max_steps=50
    """,
    "build": """
        examples:
          forge build train -p projects/tiny_lm --target meta
          forge build train -p projects/tiny_lm --target optimizer
    """,
    "train": """
        examples:
          forge train -p projects/tiny_lm                         # default config, 1 process
          forge train train -p projects/tiny_lm -D max_steps=100 -D save_steps=25
          forge train train -p projects/tiny_lm --set trainer.args.learning_rate=1e-3
          forge train train -p projects/tiny_lm --nproc 2        # DDP under torchrun (gloo on CPU)
          forge train train -p projects/tiny_lm --dry-run        # render and check only
          forge train train -p projects/tiny_lm --nproc 2 --max-restarts 3   # survive crashes
          forge train train --nproc auto --nnodes 2 --node-rank 0 --rdzv-endpoint node0:29400
          forge train train --nproc auto --nnodes 2 --node-rank 1 --rdzv-endpoint node0:29400
          srun --ntasks-per-node=1 forge train train --nproc auto   # SLURM: nodes from srun
          forge train train --nproc auto --requeue   # sbatch --signal=USR1@90: save, requeue
          forge train train --nproc 2 -- --log-dir logs   # anything after -- goes to torchrun
    """,
    "resume": """
        examples:
          forge resume -p projects/tiny_lm                          # newest run, newest checkpoint
          forge resume -p projects/tiny_lm --run 3
          forge resume --run-dir projects/tiny_lm/output/train/run_003
          forge resume -p projects/tiny_lm --set trainer.args.max_steps=800   # train longer
          forge resume -p projects/tiny_lm --from path/to/checkpoint-000400
          forge resume -p projects/tiny_lm --nnodes 2 --node-rank 0 --rdzv-endpoint node0:29400
          forge resume -p projects/tiny_lm --nnodes 2 --node-rank 1 --rdzv-endpoint node0:29400
    """,
    "runs": """
        examples:
          forge runs -p projects/tiny_lm
    """,
    "checkpoints": """
        examples:
          forge checkpoints -p projects/tiny_lm             # sizes checked
          forge checkpoints -p projects/tiny_lm --verify    # hashes too
          forge checkpoints -p projects/tiny_lm --run 2
    """,
    "generate": """
        examples:
          forge generate projects/tiny_lm/output/train/run_001 --prompt "def "
          forge generate projects/tiny_lm/output/train/run_001 --best --prompt "class "
          forge generate path/to/checkpoint-000400 --prompt "import " --num 3
    """,
    "export": """
        examples:
          forge export projects/tiny_lm/output/train/run_001 exported/   # the run's newest
          forge export path/to/checkpoint-000400 exported/ --force        # replace exported/
          python -c "from transformers import AutoModelForCausalLM; AutoModelForCausalLM.from_pretrained('exported')"
    """,
    "evaluate": """
        examples:
          forge evaluate projects/text_cls/output/train/run_001 --best     # the best checkpoint
          forge evaluate projects/text_cls/output/train/run_001/best       # the same, by its link
          forge evaluate path/to/run_001/checkpoints/checkpoint-000100 --split train
          forge evaluate projects/text_cls/output/train/run_001 --json     # one JSON object
    """,
    "predict": """
        examples:
          forge predict projects/text_cls/output/train/run_001 --best \\
              --input reviews.jsonl --output labelled.jsonl    # {"text": ...} per line
          forge predict projects/tiny_lm/output/train/run_001 --input prompts.jsonl \\
              --output continued.jsonl --max-new-tokens 40     # a causal LM continues each text
          forge predict path/to/checkpoint-000400 --input ids.jsonl \\
              --output out.jsonl                   # {"input_ids": [...]} or forward's inputs
    """,
    "new": """
        examples:
          forge new my_lm                              # a tiny Llama LM project in ./my_lm
          forge new demo_cls --from classifier         # MLP classifier, synthetic data
          forge new scratch --from blank -p projects   # an empty config to fill, in projects/
          forge train -p demo_cls -D max_steps=50
    """,
    "new-config": """
        examples:
          forge new-config long --extends train -p projects/tiny_lm
          forge new-config lm --extends projects/causal_lm.yaml -p my_project
    """,
    "code": """
        examples:
          forge code train -p projects/tiny_lm > train.py     # the script, on stdout
          forge code train -p projects/tiny_lm -D max_steps=50 -o train.py
          python train.py --output-dir runs/a                 # trains as `forge train` would
    """,
    "plot": """
        examples:
          forge plot -p projects/tiny_lm                      # the newest run -> RUN_DIR/metrics.png
          forge plot train/run_001 -p projects/tiny_lm --metric loss,eval_loss -o curves.png
          forge plot 3 -p projects/tiny_lm --metric learning_rate
    """,
    "tb": """
        examples:
          forge tb -p projects/tiny_lm                        # every run of the project
          forge tb train/run_002 -p projects/tiny_lm --port 6007
          forge tb -p projects/tiny_lm --print-command        # show the command, start nothing
    """,
    "sweep": """
        examples:
          forge sweep train -p demo -D learning_rate=1e-4,1e-3,1e-2      # a grid: 3 runs
          forge sweep train -p demo -D "learning_rate=loguniform(1e-4,1e-2)" \\
              -D "hidden_size=int(32,256)" --trials 20                     # an Optuna study (TPE)
          forge sweep train -p demo --file lr.yaml --jobs 2              # templates/sweeps/lr.yaml
          forge sweep train -p demo -D "learning_rate=uniform(0.001,0.01)" --method random \\
              --trials 8 --objective eval_accuracy --direction maximize
          forge sweep train -p demo ... --dry-run   # the plan of trials and a SLURM array script
          forge sweep show -p demo                   # the newest sweep's trials, best first
          forge sweep plot -p demo                   # objective over trials, each variable
    """,
    "env": """
        examples:
          forge env            # paste this into a bug report
    """,
}


def _sub(subparsers, name: str, help_text: str) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        name,
        help=help_text,
        description=help_text,
        epilog=textwrap.dedent(EXAMPLES.get(name, "")),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="show tracebacks and debug logs"
    )
    return parser


def _add_project(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-p",
        "--project",
        metavar="DIR",
        help="project directory (default: nearest ancestor of the cwd with a meta.yaml)",
    )


def _add_config_inputs(parser: argparse.ArgumentParser, *, config: bool = True) -> None:
    if config:
        parser.add_argument(
            "config",
            nargs="?",
            metavar="CONFIG",
            help="config name (default: meta.yaml's default_config)",
        )
    _add_project(parser)
    parser.add_argument(
        "-D",
        "--define",
        action="append",
        metavar="VAR=VALUE",
        help="template variable (value parsed as YAML)",
    )
    parser.add_argument(
        "--set",
        action="append",
        metavar="KEY.PATH=VALUE",
        help="override a key of the rendered YAML",
    )
    parser.add_argument(
        "--allow", action="append", metavar="MODULE", help="allow callables from this module root"
    )


def _add_nodes(parser: argparse.ArgumentParser, *, resume: bool = False) -> None:
    """The options of a job of several nodes (torchrun's, under the same names)."""
    default = "as the run was started" if resume else "1, or SLURM's count under srun"
    group = parser.add_argument_group(
        "several nodes",
        "start forge once on every node with the same options but --node-rank; node 0 "
        "creates the run on a filesystem every node mounts, the others learn it. Under "
        "SLURM, `srun --ntasks-per-node=1 forge ...` reads them from SLURM's variables",
    )
    group.add_argument(  # a string: forge.launch.cluster says why 1:2 is refused
        "--nnodes", metavar="N", help=f"nodes in the job (default: {default})"
    )
    group.add_argument(
        "--node-rank", type=int, metavar="R", help="this node's index, 0 to N-1 (default: 0)"
    )
    group.add_argument(
        "--rdzv-endpoint",
        metavar="HOST:PORT",
        help="where the nodes meet (torchrun's c10d rendezvous): node 0's host, a free port",
    )
    group.add_argument("--master-addr", metavar="HOST", help="the same as --rdzv-endpoint's HOST")
    group.add_argument(
        "--master-port", type=int, metavar="PORT", help="the same as --rdzv-endpoint's PORT"
    )


def _add_max_restarts(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-restarts",
        type=int,
        metavar="N",
        help="when a training process dies, start the workers again (up to N times) from the "
        "run's newest checkpoint; runs under torchrun's elastic agent (default: 0)",
    )


def _add_scheduler(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--stop-signal",
        metavar="SIG",
        help="the signal a scheduler sends ahead of its time limit (SLURM's --signal=USR1@90): "
        "save a checkpoint and stop, like SIGTERM; default USR1",
    )
    parser.add_argument(
        "--requeue",
        action="store_true",
        help="under SLURM: once stopped by --stop-signal, requeue the job (scontrol requeue "
        "$SLURM_JOB_ID); the requeued job's forge train continues this run by itself",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="forge",
        description="Turn inheritable Jinja/YAML templates into resumable PyTorch training jobs.",
        epilog=textwrap.dedent(
            """
            quick start:
              forge ls -p projects/tiny_lm
              forge render -p projects/tiny_lm
              forge train -p projects/tiny_lm -D max_steps=100
              forge resume -p projects/tiny_lm
              forge generate projects/tiny_lm/output/train/run_001 --prompt "def "

            a project of your own:
              forge new my_project --from classifier     # or tiny_lm, blank
              forge train -p my_project

            `forge COMMAND --help` shows worked examples for each command.
            Exit codes: 0 ok, 1 runtime failure, 2 usage or config error, 130 Ctrl-C, 143 SIGTERM.
            """
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"forge {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = _sub(subparsers, "ls", "list a project's configs, each rendered and checked")
    _add_project(p)
    p.add_argument(
        "--check",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="import every callable and check its arguments (default; loads torch); "
        "--no-check only renders and parses, which is faster",
    )
    p.add_argument("-D", "--define", action="append", metavar="VAR=VALUE", help="template variable")
    p.add_argument("--allow", action="append", metavar="MODULE", help="allow this module root")

    p = _sub(
        subparsers, "render", "print a config's rendered YAML (or its graph or template chain)"
    )
    _add_config_inputs(p)
    view = p.add_mutually_exclusive_group()
    view.add_argument(
        "--graph", action="store_true", help="show the node tree with callables resolved"
    )
    view.add_argument("--chain", action="store_true", help="show the template files used, in order")
    view.add_argument(
        "--resolved",
        action="store_true",
        help="each key once (the value that wins) with the template line it came from",
    )

    p = _sub(
        subparsers,
        "vars",
        "every template variable a config reads, its value or default, and where it is set",
    )
    _add_config_inputs(p)

    p = _sub(subparsers, "build", "build one target of a config and print its repr")
    _add_config_inputs(p)
    p.add_argument("--target", required=True, metavar="NAME", help="top-level key to build")
    p.add_argument("--run-dir", metavar="DIR", help="value of !var run_dir (default: output/build)")

    p = _sub(subparsers, "train", "train a config in a new run directory")
    _add_config_inputs(p)
    p.add_argument(
        "--nproc",
        metavar="N|auto",
        help="processes on this node (>1 runs under torchrun); auto: one per visible GPU, "
        "or 1 without one",
    )
    _add_max_restarts(p)
    _add_scheduler(p)
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="render, check and print the plan (parallelism, batches, steps, parameters, "
        "memory, checkpoints) without training",
    )
    p.add_argument(
        "--memory",
        metavar="SIZE",
        help="with --dry-run: the device memory (16GiB, 80GB) to print the largest "
        "per-device batch that fits in (default: the GPU's; measured on one real micro-batch)",
    )
    _add_nodes(p)

    p = _sub(subparsers, "resume", "continue a run from its newest valid checkpoint")
    _add_project(p)
    which = p.add_mutually_exclusive_group()
    which.add_argument("--run", type=int, metavar="N", help="run number (default: newest run)")
    which.add_argument("--run-dir", metavar="DIR", help="run directory")
    p.add_argument("--config", metavar="NAME", help="config whose runs --run numbers")
    p.add_argument(
        "--from", dest="from_checkpoint", metavar="CKPT", help="checkpoint to resume from"
    )
    p.add_argument(
        "--set",
        action="append",
        metavar="KEY.PATH=VALUE",
        help="override a key of the run's config",
    )
    p.add_argument("--allow", action="append", metavar="MODULE", help="allow this module root")
    p.add_argument(
        "--nproc",
        metavar="N|auto",
        help="processes on this node (default: as the run was started)",
    )
    _add_max_restarts(p)
    _add_scheduler(p)
    _add_nodes(p, resume=True)

    p = _sub(subparsers, "runs", "table of a project's runs")
    _add_project(p)

    p = _sub(subparsers, "checkpoints", "table of checkpoints and whether each is valid")
    _add_project(p)
    p.add_argument("--run", type=int, metavar="N", help="only this run number")
    p.add_argument("--run-dir", metavar="DIR", help="only this run directory")
    p.add_argument(
        "--verify",
        action="store_true",
        help="check every file's hash and every state file's header, not only sizes",
    )

    p = _sub(subparsers, "generate", "sample text from a checkpoint (or a run's newest one)")
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory or run directory")
    p.add_argument("--best", action="store_true", help="the run's best checkpoint (RUN/best)")
    p.add_argument("--prompt", default="", help="text to continue")
    p.add_argument("--num", type=int, default=1, help="number of samples")
    p.add_argument("--max-new-tokens", type=int, default=80)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--allow", action="append", metavar="MODULE", help="allow this module root")

    p = _sub(
        subparsers,
        "export",
        "write a checkpoint's model as one Hugging Face model directory (any trainer or split)",
    )
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory, or a run directory")
    p.add_argument("output", metavar="OUT", help="directory to write (absent or empty)")
    p.add_argument("--force", action="store_true", help="replace a non-empty OUT")
    p.add_argument(
        "--max-shard-size",
        default="5GB",
        metavar="SIZE",
        help="largest weights file before sharding, as save_pretrained (default: 5GB)",
    )
    p.add_argument(
        "--submodule",
        metavar="NAME",
        help="export only the transformers model the checkpoint's model holds as NAME "
        "(a wrapper's self.NAME), leaving the wrapper's other weights out",
    )
    p.add_argument(
        "--ema",
        action="store_true",
        help="export the moving average of the weights (a run trained with ema_decay)",
    )
    p.add_argument(
        "--merge-lora",
        action="store_true",
        help="of a LoRA checkpoint, write its base with the adapter merged in (loads without "
        "peft); without it a LoRA checkpoint exports its adapter in peft's layout",
    )

    p = _sub(subparsers, "evaluate", "print a checkpoint's metrics on a split of its run's data")
    p.add_argument(
        "checkpoint",
        metavar="CKPT|RUN",
        help="checkpoint directory (RUN/best too) or run directory (its newest checkpoint)",
    )
    p.add_argument("--best", action="store_true", help="the run's best checkpoint (RUN/best)")
    p.add_argument(
        "--split",
        default="eval",
        metavar="NAME",
        help="eval (default), train, or NAME for the config's NAME_dataset target",
    )
    p.add_argument(
        "--ema",
        action="store_true",
        help="evaluate the moving average of the weights (a run trained with ema_decay)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--allow", action="append", metavar="MODULE", help="allow this module root")

    p = _sub(subparsers, "predict", "write a checkpoint's predictions for a JSON Lines file")
    p.add_argument(
        "checkpoint",
        metavar="CKPT|RUN",
        help="checkpoint directory (RUN/best too) or run directory (its newest checkpoint)",
    )
    p.add_argument("--best", action="store_true", help="the run's best checkpoint (RUN/best)")
    p.add_argument("--input", required=True, metavar="FILE.jsonl", help="one JSON object a line")
    p.add_argument("--output", required=True, metavar="FILE.jsonl", help="where to write them")
    p.add_argument(
        "--text-field",
        default="text",
        metavar="NAME",
        help="the text field (default: text); lines without it hold the model's inputs, "
        'e.g. {"input_ids": [...]}',
    )
    p.add_argument("--batch-size", type=int, default=32, metavar="N")
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        metavar="N",
        help="causal LMs, encoder-decoders: tokens to add (default: 50, or the run's "
        "generation_max_length where its evaluation generated: predict_with_generate)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="causal LMs: 0 (default) continues greedily; above 0 samples",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--allow", action="append", metavar="MODULE", help="allow this module root")

    p = _sub(subparsers, "new", "create a project that trains at once (from a scaffold)")
    p.add_argument("name", metavar="NAME", help="project name; the directory PARENT/NAME")
    p.add_argument(
        "--from",
        dest="template",
        choices=list(SCAFFOLDS),
        default="tiny_lm",
        help="scaffold: tiny_lm (default), classifier or blank",
    )
    p.add_argument("-p", "--parent", metavar="PARENT", help="where to create it (default: .)")

    p = _sub(subparsers, "new-config", "add a config to a project that extends another config")
    p.add_argument("name", metavar="NAME", help="the new config (templates/configs/NAME.yaml)")
    p.add_argument(
        "--extends",
        required=True,
        metavar="CONFIG",
        help="a config of the project, or a library template such as projects/causal_lm.yaml",
    )
    _add_project(p)

    p = _sub(subparsers, "code", "write a standalone Python script that builds and trains a config")
    _add_config_inputs(p)
    p.add_argument("-o", "--output", metavar="FILE", help="write the script here (default: stdout)")
    p.add_argument(
        "--target", default="trainer", metavar="NAME", help="target to build (default: trainer)"
    )

    p = _sub(subparsers, "plot", "draw a run's metric curves (metrics.jsonl) as a PNG")
    p.add_argument(
        "run",
        nargs="?",
        metavar="RUN",
        help="run directory, path under output/ (train/run_001) or number (default: newest)",
    )
    _add_project(p)
    p.add_argument(
        "--metric",
        metavar="NAME[,NAME...]",
        help="metrics to draw, comma-separated (default: loss,eval_loss)",
    )
    p.add_argument("-o", "--output", metavar="PNG", help="image file (default: RUN/metrics.png)")

    p = _sub(subparsers, "tb", "start TensorBoard on a project's runs (or one run)")
    p.add_argument("run", nargs="?", metavar="RUN", help="only this run (default: every run)")
    _add_project(p)
    p.add_argument("--port", type=int, help="TensorBoard's port (default: its own, 6006)")
    p.add_argument("--host", help="address to bind (default: localhost)")
    p.add_argument(
        "--print-command", action="store_true", help="print the command instead of running it"
    )

    p = _sub(
        subparsers,
        "sweep",
        "search over a config's variables (grid, random, Optuna study), each trial a run",
    )
    p.add_argument(
        "words",
        nargs="*",
        metavar="CONFIG | show [NAME] | plot [NAME]",
        help="the config to sweep (default: meta.yaml's default_config); `show` prints a "
        "sweep's trials, `plot` draws them (default: the newest sweep)",
    )
    _add_config_inputs(p, config=False)
    p.add_argument(
        "--file", metavar="FILE", help="sweep file (YAML), or NAME for templates/sweeps/NAME.yaml"
    )
    p.add_argument(
        "--method",
        metavar="NAME",
        help="grid (default for lists), random, or an Optuna sampler: tpe (default otherwise), "
        "cmaes, gp, qmc, nsgaii, optuna-random; NAME(key=value,...) passes its options",
    )
    p.add_argument("--trials", type=int, metavar="N", help="trials in all, those done included")
    p.add_argument(
        "--objective", metavar="METRIC", help="logged metric to optimise (default: eval_loss)"
    )
    p.add_argument(
        "--direction",
        metavar="minimize|maximize",
        help="needed unless the objective is a loss (then minimize)",
    )
    p.add_argument("--seed", type=int, metavar="N", help="the sampler's seed (default: 0)")
    p.add_argument(
        "--pruner",
        metavar="NAME",
        help="Optuna pruner for studies: median (default), percentile, hyperband, "
        "successive-halving, threshold(upper=X), patient, wilcoxon, none",
    )
    p.add_argument(
        "--name", metavar="NAME", help="the sweep's name (default: CONFIG-HASH of its search)"
    )
    p.add_argument(
        "--jobs",
        type=int,
        metavar="N",
        help="trials at once on this machine: one GPU each, or a share of the CPU cores",
    )
    p.add_argument(
        "--one-trial",
        action="store_true",
        help="run one trial of the study and exit (a worker, e.g. a SLURM array task)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="check everything, print the plan of trials and a SLURM array script; train nothing",
    )
    p.add_argument(
        "-o", "--output", metavar="PNG", help="plot: image file (default: SWEEP/sweep.png)"
    )

    _sub(subparsers, "env", "versions, devices and backends (for bug reports)")

    p = subparsers.add_parser("_worker")  # internal: one rank of a launched job
    p.add_argument("--run-dir")  # absent on a node that learns the run (--agree-at)
    p.add_argument("-p", "--project", required=True)
    p.add_argument("--agree-at", metavar="HOST:PORT")  # the job's store, several nodes
    p.add_argument("--tell-run-dir", metavar="FILE")  # where this node's forge reads the run
    p.add_argument("--resume-from")
    p.add_argument("--allow", action="append")
    p.add_argument("-v", "--verbose", action="store_true")
    return parser


def split_torchrun_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """``forge train ... -- TORCHRUN_ARGS``: the arguments before and after ``--``."""
    if "--" in argv:
        index = argv.index("--")
        return argv[:index], argv[index + 1 :]
    return argv, []
