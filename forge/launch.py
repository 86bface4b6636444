"""Starting the training processes: in this process, or one per rank under torchrun.

``python -m forge.launch TORCHRUN_ARGS`` is torchrun without its own traceback on failure:
torchrun (``torch.distributed.run``) reports a failed worker by raising ``ChildFailedError``,
which prints a Python traceback and a failure table after the worker has already printed its
own one-line error. forge's workers report their errors themselves (and record them in
``run.json``), so this wrapper runs the same launcher and only passes on the exit code.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from forge.errors import EXIT_FAILURE, EXIT_USAGE, UsageError
from forge.train.topology import Topology

logger = logging.getLogger(__name__)

EXIT_OK = 0


def resolve_nproc(value: str | None, default: int = 1) -> int:
    """``--nproc N|auto``: a positive process count (``auto``: one per CUDA device, at least 1)."""
    if value is None:
        return default
    if value == "auto":
        import torch

        return max(torch.cuda.device_count(), 1)
    try:
        n = int(value)
    except ValueError as err:
        raise UsageError(f"--nproc must be a positive integer or 'auto' (got {value!r})") from err
    if n < 1:
        raise UsageError(f"--nproc must be a positive integer or 'auto' (got {value!r})")
    return n


def resolve_max_restarts(value: int | None) -> int:
    """``--max-restarts N``: how often torchrun may restart the workers (0: never)."""
    if value is None:
        return 0
    if value < 0:
        raise UsageError(f"--max-restarts must be 0 or a positive integer (got {value})")
    return value


def torchrun_command(
    run_dir: Path,
    project_root: Path,
    nproc: int,
    *,
    torchrun_args: Sequence[str] = (),
    resume_from: str | None = None,
    allow: Sequence[str] = (),
    verbose: bool = False,
    max_restarts: int = 0,
) -> list[str]:
    """The argv that starts ``nproc`` workers of ``run_dir`` under torchrun."""
    command = [sys.executable, "-m", "forge.launch", f"--nproc_per_node={nproc}"]
    if not any(a.startswith(("--rdzv", "--nnodes", "--master")) for a in torchrun_args):
        command.append("--standalone")
    if max_restarts:
        if any(a.startswith(("--max-restarts", "--max_restarts")) for a in torchrun_args):
            raise UsageError("give --max-restarts once: to forge, or to torchrun after --")
        command.append(f"--max-restarts={max_restarts}")
    command += list(torchrun_args)
    command += ["-m", "forge.cli", "_worker", "--run-dir", str(run_dir), "-p", str(project_root)]
    if resume_from:
        command += ["--resume-from", str(resume_from)]
    for module in allow:
        command += ["--allow", module]
    if verbose:
        command.append("-v")
    return command


def launch_training(
    project,
    run_dir: Path,
    nproc: int,
    *,
    torchrun_args: Sequence[str] = (),
    resume_from: str | None = None,
    allow: Sequence[str] = (),
    verbose: bool = False,
    max_restarts: int = 0,
) -> int:
    """Train ``run_dir`` here (one process) or under torchrun, forwarding Ctrl-C/SIGTERM.

    With ``max_restarts`` the job always runs under torchrun, whose elastic agent starts the
    workers again (up to that many times) when one dies; they continue from the run's newest
    checkpoint (forge/worker.py). Returns the exit code: 0 completed, 2 config error, 128+N
    stopped by signal N, else 1.
    """
    if nproc == 1 and not torchrun_args and not max_restarts:
        from forge.worker import run_worker

        return run_worker(run_dir, project, resume_from=resume_from, allow=list(allow))
    command = torchrun_command(
        run_dir,
        project.root,
        nproc,
        torchrun_args=torchrun_args,
        resume_from=resume_from,
        allow=allow,
        verbose=verbose,
        max_restarts=max_restarts,
    )
    logger.info("launching %d processes: %s", nproc, " ".join(command))
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max((os.cpu_count() or 1) // nproc, 1)))
    if max_restarts:
        # The agent's TCP store, shared with the workers by default, keeps the previous
        # attempt's keys: restarted workers then connect to dead peers' addresses
        # (pytorch/pytorch#135712). A store per attempt avoids that.
        env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    child = subprocess.Popen(command, start_new_session=True, env=env)

    def forward(signum, _frame):
        child.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = child.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return exit_code_from_record(run_dir, code)


def join_launched_job(make_run: Callable[[], Path] | None, topology: Topology) -> Path:
    """In a job another launcher started (``accelerate launch``, a user's torchrun): start the
    process group, let rank 0 create the run (``make_run``) and tell every rank its directory.

    The group stays up for the trainer (which then neither creates nor ends one); the caller
    ends it with ``leave_launched_job``. Gloo carries CPU tensors and NCCL CUDA ones, so the
    group suits whichever device the config trains on.
    """
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        raise UsageError("forge train must start before any torch.distributed process group")
    backend = "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(topology.local_rank)
        backend = "cpu:gloo,cuda:nccl"
    dist.init_process_group(backend, rank=topology.rank, world_size=topology.world_size)
    box: list[Any] = [None]
    if topology.is_main:
        try:
            box = [str(make_run())]
        except Exception as err:  # the others learn that there is no run, and stop
            dist.broadcast_object_list([f"error: {err}"], src=0)
            leave_launched_job(ok=False)
            raise
    dist.broadcast_object_list(box, src=0)
    if box[0].startswith("error: "):
        leave_launched_job(ok=False)
        raise UsageError(f"rank 0 could not create the run ({box[0][7:]})")
    return Path(box[0])


def leave_launched_job(*, ok: bool) -> None:
    """End the group ``join_launched_job`` started (after a last barrier when all went well)."""
    import torch.distributed as dist

    if dist.is_initialized():
        if ok:
            dist.barrier()
        dist.destroy_process_group()


def exit_code_from_record(run_dir: Path, code: int) -> int:
    """The CLI's exit code for a launched job, from what rank 0 recorded in ``run.json``."""
    from forge.runs import RunRecord

    data = RunRecord.load(run_dir).data
    if data.get("status") == "interrupted" and data.get("signal"):
        return 128 + int(signal.Signals[data["signal"]])
    if data.get("status") == "completed":
        return EXIT_OK
    if data.get("status") == "failed" and data.get("error_kind") == "usage":
        return EXIT_USAGE  # rank 0 has printed the message
    return code if code > 0 else EXIT_FAILURE


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        run(parse_args(sys.argv[1:] if argv is None else argv))
    except ChildFailedError as failure:
        codes = [f.exitcode for f in failure.failures.values() if f.exitcode and f.exitcode > 0]
        return codes[0] if codes else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
