"""Starting the training processes: in this process, or one per rank under torchrun.

``python -m forge.launch [--run-dir=RUN --project=DIR] TORCHRUN_ARGS`` is torchrun (the elastic
agent) with three differences. It prints no traceback: torchrun reports a failed worker by
raising ``ChildFailedError`` and a signal by raising ``SignalException``, each with a Python
traceback beside the worker's own one-line message; this wrapper passes on the exit code. It
settles ``run.json`` when a rank failed and no rank said why (rank 0 records its own errors,
but is torn down unrecorded when another rank dies). And it dies with its launcher.

**Lifetime.** ``forge`` starts the agent in a session of its own (Ctrl-C in a terminal then
reaches the job once, through forge, which forwards it), and torch starts each worker in a
session of its own; so neither is hit by a signal to forge's process group, and either would
train on as an orphan after ``kill -9``. Each therefore asks to be signalled when the process
that started it dies (:func:`stop_with_parent`): on Linux the kernel does it
(``prctl(PR_SET_PDEATHSIG)``), elsewhere a thread that watches the parent pid. The agent then
has torch kill the workers at once and records the run as ``killed``; a worker whose agent is
gone is killed outright. A dead launcher is not a request to save: the job stops as a SIGKILL
to every process would have stopped it, the checkpoint layer guarantees that a save cut short
leaves the committed checkpoints valid, and the run's locks are free for ``forge resume`` the
moment the processes are gone. SIGTERM and Ctrl-C to ``forge`` are forwarded and save first.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forge.launch.cluster import ONE_NODE, Nodes
from forge.launch.endpoint import Here, meet_for_torchrun
from forge.launch.errors import LaunchUsageError
from forge.launch.scheduler import stopped_codes
from forge.lifetime import scheduler_signal, signal_on_parent_death, stop_signals
from forge.runs import EXIT_DIVERGED, RunError, go_on_note, now_iso
from forge.train.signals import launched_children
from forge.train.topology import Topology

logger = logging.getLogger(__name__)

# the CLI's exit codes (forge/cli/exits.py), which a launched job ends with
EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2

PARENT_ENV = "FORGE_PARENT_PID"  # the launcher a training process must not outlive
# what the agent receives when forge dies: a signal no scheduler sends (SIGUSR1/2 are theirs)
LAUNCHER_DIED = signal.SIGRTMIN + 2 if hasattr(signal, "SIGRTMIN") else signal.SIGUSR2
# how long the agent waits for the ranks to save after a stop signal (torch's default: 30 s)
SHUTDOWN_TIMEOUT_S = 600
_WATCH_INTERVAL_S = 0.2


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
        raise LaunchUsageError(
            f"--nproc must be a positive integer or 'auto' (got {value!r})"
        ) from err
    if n < 1:
        raise LaunchUsageError(f"--nproc must be a positive integer or 'auto' (got {value!r})")
    return n


def resolve_max_restarts(value: int | None) -> int:
    """``--max-restarts N``: how often torchrun may restart the workers (0: never)."""
    if value is None:
        return 0
    if value < 0:
        raise LaunchUsageError(f"--max-restarts must be 0 or a positive integer (got {value})")
    return value


def torchrun_command(
    run_dir: Path | None,
    project_root: Path,
    nproc: int,
    *,
    torchrun_args: Sequence[str] = (),
    nodes: Nodes = ONE_NODE,
    resume_from: str | os.PathLike | None = None,
    allow: Sequence[str] = (),
    verbose: bool = False,
    max_restarts: int = 0,
    tell_run_dir: Path | None = None,
    here: Here | None = None,
) -> list[str]:
    """The argv that starts ``nproc`` workers of ``run_dir`` under torchrun on this node.

    On one node torchrun runs ``--standalone``; a job of several nodes meets at ``nodes``'s
    c10d rendezvous, whose store node 0's agent serves (forge/launch/endpoint.py: ``here`` is
    what this node was started to run, which every node compares with node 0's). ``run_dir``
    is None on a node that did not create the run: its workers learn the run (and the
    checkpoint to resume from) from node 0's (forge/launch/multinode.py), and the first of them
    writes the run directory to ``tell_run_dir`` for this node's forge.
    """
    command = [sys.executable, "-m", "forge.launch"]
    if run_dir is not None:
        command.append(f"--run-dir={run_dir}")
    command.append(f"--project={project_root}")
    if nodes.multinode:
        here = here or Here()
        command += [f"--node={nodes.node_rank}", f"--command={here.command}"]
        if here.config_name:
            command.append(f"--config-name={here.config_name}")
        if here.config_file:
            command.append(f"--config={here.config_file}")
    command.append(f"--nproc_per_node={nproc}")
    if nodes.multinode:
        command += nodes.torchrun_args()
    elif not any(a.startswith(("--rdzv", "--nnodes", "--master")) for a in torchrun_args):
        command.append("--standalone")
    if max_restarts:
        if any(a.startswith(("--max-restarts", "--max_restarts")) for a in torchrun_args):
            raise LaunchUsageError("give --max-restarts once: to forge, or to torchrun after --")
        command.append(f"--max-restarts={max_restarts}")
    command += list(torchrun_args)
    command += ["-m", "forge.cli", "_worker", "-p", str(project_root)]
    if run_dir is not None:
        command += ["--run-dir", str(run_dir)]
    if nodes.multinode:
        command += ["--agree-at", str(nodes.endpoint)]
    if tell_run_dir is not None:
        command += ["--tell-run-dir", str(tell_run_dir)]
    if resume_from:
        command += ["--resume-from", str(resume_from)]
    for module in allow:
        command += ["--allow", module]
    if verbose:
        command.append("-v")
    return command


def launch_training(
    project,
    run_dir: Path | None,
    nproc: int,
    *,
    torchrun_args: Sequence[str] = (),
    nodes: Nodes = ONE_NODE,
    resume_from: str | os.PathLike | None = None,
    allow: Sequence[str] = (),
    verbose: bool = False,
    max_restarts: int = 0,
    tell_run_dir: Path | None = None,
    here: Here | None = None,
) -> int:
    """Train ``run_dir`` here (one process) or under torchrun, forwarding Ctrl-C/SIGTERM.

    ``resume_from`` is a checkpoint resolved (and hashed) by forge.checkpoint.resolve: this
    process's trainer takes it as it is, torchrun's workers get its path and check its sizes.

    With ``max_restarts`` the job always runs under torchrun, whose elastic agent starts the
    workers again (up to that many times) when one dies; they continue from the run's newest
    checkpoint (forge/launch/worker.py). Returns the exit code: 0 completed, 2 config error, 128+N
    stopped by signal N, else 1. ``run_dir`` None: a node that joins a job of several nodes
    (:func:`join_job`).
    """
    single = nproc == 1 and not nodes.multinode
    if single and not torchrun_args and not max_restarts and run_dir is not None:
        from forge.launch.worker import run_worker

        return run_worker(run_dir, project, resume_from=resume_from, allow=list(allow))
    command = torchrun_command(
        run_dir,
        project.root,
        nproc,
        torchrun_args=torchrun_args,
        nodes=nodes,
        resume_from=resume_from,
        allow=allow,
        verbose=verbose,
        max_restarts=max_restarts,
        tell_run_dir=tell_run_dir,
        here=here,
    )
    where = f" on {nodes.describe()}" if nodes.multinode else ""
    logger.info("launching %d processes%s: %s", nproc, where, " ".join(command))
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max((os.cpu_count() or 1) // nproc, 1)))
    if max_restarts:
        # The agent's TCP store, shared with the workers by default, keeps the previous
        # attempt's keys: restarted workers then connect to dead peers' addresses
        # (pytorch/pytorch#135712). A store per attempt avoids that.
        env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    env[PARENT_ENV] = str(os.getpid())  # torchrun and its workers stop when this process dies
    launched_children()  # from now on a stop is passed on to torchrun (forward below)
    launched = now_iso()
    child = subprocess.Popen(command, start_new_session=True, env=env)

    def forward(signum, _frame):
        child.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in stop_signals()}
    try:
        code = child.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if run_dir is None:
        return code if code >= 0 else 128 - code
    if code < 0:  # torchrun itself was killed (its workers die with it): no rank said why
        what = f"torchrun (pid {child.pid}) {exit_text(code)}"
        if settle_failure(
            run_dir, what, {"process": "torchrun", "pid": child.pid, "exitcode": code}
        ):
            print(f"error: {what}; {failed_note(run_dir, project.root)}", file=sys.stderr)
    return exit_code_from_record(run_dir, code, since=launched)


def join_job(
    project,
    nproc: int,
    nodes: Nodes,
    here: Here,
    config_text: str | None = None,
    **launch: Any,
) -> tuple[int, Path | None]:
    """Start this node's share of a job node 0 launches (``--node-rank`` > 0): its workers
    learn the run from node 0's. ``config_text``: the config this node rendered (forge train),
    which its agent compares with node 0's before the job starts. Returns the exit code and
    the run directory (None when the job ended before the workers learnt it).

    This node writes nothing to ``run.json``: node 0's forge owns the record (it created or
    claimed the run), and the job's rank 0 keeps it current wherever it runs. The exit code
    follows the record where this node sees it (0 once the job completed), else torchrun's.
    """
    logger.info(
        "%s: joining the job; node 0 creates the run directory and this node learns it",
        nodes.describe(),
    )
    with tempfile.TemporaryDirectory(prefix="forge-node-") as scratch:
        told = Path(scratch) / "run_dir"
        if config_text is not None:  # what node 0's config is compared with
            rendered = Path(scratch) / "config.yaml"
            rendered.write_text(config_text)
            here = Here(here.command, here.config_name, rendered)
        code = launch_training(
            project, None, nproc, nodes=nodes, tell_run_dir=told, here=here, **launch
        )
        run_dir = Path(told.read_text()) if told.is_file() else None
    if run_dir is not None and (run_dir / "run.json").is_file():
        return exit_code_from_record(run_dir, code), run_dir
    return code, run_dir


@contextlib.contextmanager
def launched_job_group(topology: Topology) -> Iterator[None]:
    """In a job another launcher started (``accelerate launch``, a user's torchrun): the process
    group of the whole command, started once, before the checks that run the trainer's paths.

    Once per process, because a default group started again on the launcher's store reads the
    keys the first one left there: a rank that looks up its peer before the peer has written
    its new address connects to the old, closed one (gloo's ``connectFullMesh``: "Connection
    refused"). The trainer, finding the group up, neither creates nor ends one. Gloo carries
    CPU tensors and NCCL CUDA ones, so the group suits whichever device the config trains on.
    On success the ranks meet once more, so that none ends the group under a collective still
    in flight.
    """
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        raise LaunchUsageError("forge train must start before any torch.distributed process group")
    backend = "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(topology.local_rank)
        backend = "cpu:gloo,cuda:nccl"
    dist.init_process_group(backend, rank=topology.rank, world_size=topology.world_size)
    ok = False
    try:
        yield
        ok = True
    finally:
        if dist.is_initialized():
            if ok:
                dist.barrier()
            dist.destroy_process_group()


def share_from_rank_0(decide: Callable[[], Any] | None) -> Any:
    """Rank 0 decides (``decide``: create the run, or plan a resume) and every rank gets the
    result, which must pickle; the others pass None. Inside :func:`launched_job_group`. A
    failure on rank 0 stops every rank: rank 0 raises its error, the others a usage error that
    points at it."""
    import torch.distributed as dist

    box: list[Any] = [None]
    if decide is not None:
        try:
            box = [decide()]
        except Exception as err:  # the others learn that rank 0 failed, and stop
            dist.broadcast_object_list([_Failed(str(err))], src=0)
            raise
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], _Failed):
        raise LaunchUsageError(f"rank 0 failed before training ({box[0].message})")
    return box[0]


@dataclass(frozen=True)
class _Failed:
    """What rank 0 tells the other ranks when its decision failed."""

    message: str


# --------------------------------------------------------------------------- lifetime


def stop_with_parent(signum: int) -> None:
    """Have ``signum`` delivered to this process when its launcher (``FORGE_PARENT_PID``) dies.

    Linux: the kernel sends it (``PR_SET_PDEATHSIG``, which fires when the *thread* that started
    this process ends; forge and torchrun start their children from the main thread, which
    waits for them). Elsewhere a daemon thread polls the parent pid. The variable is consumed,
    so the processes this one starts do not inherit it. A process no forge launcher started
    (``accelerate launch``, a user's torchrun) names none, and nothing happens.
    """
    value = os.environ.pop(PARENT_ENV, "")
    if not value.isdigit():
        return
    parent = int(value)
    if not signal_on_parent_death(signum):
        watch = threading.Thread(target=_watch_parent, args=(parent, signum), daemon=True)
        watch.start()
    if os.getppid() != parent:  # it died before the watch began
        os.kill(os.getpid(), signum)


def _watch_parent(parent: int, signum: int) -> None:
    while os.getppid() == parent:  # an orphan is adopted: its parent pid changes
        time.sleep(_WATCH_INTERVAL_S)
    os.kill(os.getpid(), signum)


# --------------------------------------------------------------------------- the record


def exit_text(code: int) -> str:
    """``-9`` -> 'was killed by SIGKILL', ``1`` -> 'exited with code 1' (a Popen return code)."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def failed_note(run_dir: Path, project_root: Path) -> str:
    """The end of the message about a failed job: its record and how to go on."""
    return f"{Path(run_dir).name} is marked failed; {go_on_note(run_dir, project_root)}"


def settle_failure(run_dir: Path, what: str, failure: dict[str, Any]) -> bool:
    """Mark ``run_dir`` failed with ``what`` if no rank recorded why the job ended (its record
    still says created or running, or killed from an earlier job); True if it did. A record
    that already says failed (rank 0's own error) only gains ``failure``, the process that
    failed first."""
    from forge.runs import RunError, RunRecord

    try:
        record = RunRecord.load(run_dir)
        status = record.data.get("status")
        if status in ("created", "running", "killed"):
            record.set_status(
                "failed", error=what, error_type="ProcessFailure", error_kind="runtime",
                failure=failure,
            )  # fmt: skip
            return True
        if status == "failed" and "failure" not in record.data:
            record.update(failure=failure)
    except RunError as err:
        _tell(f"error: {err}")
    return False


#: How long the agent waits for the launch lock of a launcher that died. The kernel sends the
#: parent-death signal as the launcher's thread that started the agent exits, and lets the lock
#: go only when its last thread has: under load that can be a while later.
DEAD_LAUNCHER_WAIT_S = 60.0


def record_launcher_death(run_dir: Path, project_root: Path, launcher: str) -> None:
    """What the agent does when forge died, once its workers are gone: the record says so.

    It takes the launch lock that forge held, once forge's threads have all exited: a
    ``forge resume`` that has claimed the run in the meantime owns the record, and this one
    leaves it alone."""
    from forge.runs import RunRecord

    what = f"the forge process that launched the job (pid {launcher}) died"
    try:
        lock = _dead_launchers_lock(run_dir, launcher)
        if lock is None:
            return  # another command claimed the run
        with lock:
            record = RunRecord.load(run_dir)
            if record.data.get("status") in ("created", "running"):
                record.set_status("killed", error=f"{what}; its training processes were stopped")
    except RunError as err:
        _tell(f"error: {err}")
    _tell(f"stopped {Path(run_dir).name}: {what}; {go_on_note(run_dir, project_root)}")


def _dead_launchers_lock(run_dir: Path, launcher: str) -> Any:
    """The launch lock of ``run_dir``, waiting while the dead ``launcher`` (its signer) still
    holds it; None when another process signed it (a ``forge resume``). RunError when the
    launcher's lock outlives :data:`DEAD_LAUNCHER_WAIT_S`."""
    from forge.runs import LAUNCH_LOCK, RunBusyError, RunLock, lock_signer

    deadline = time.monotonic() + DEAD_LAUNCHER_WAIT_S
    while True:
        try:
            return RunLock.acquire(run_dir, LAUNCH_LOCK, wait=0.0, sign=False)
        except RunBusyError:
            if str(lock_signer(run_dir, LAUNCH_LOCK)) != launcher:
                return None
            if time.monotonic() >= deadline:
                raise RunError(
                    f"{Path(run_dir) / LAUNCH_LOCK}: still held {DEAD_LAUNCHER_WAIT_S:.0f} s after "
                    f"the launcher died (pid {launcher}; a process it forked may hold it), so "
                    "run.json was left as it was"
                ) from None
            time.sleep(0.05)


def _tell(message: str) -> None:
    """A line on stderr, which a killed forge may have left without a reader."""
    with contextlib.suppress(OSError):
        print(message, file=sys.stderr, flush=True)


def exit_code_from_record(run_dir: Path, code: int, since: str | None = None) -> int:
    """The CLI's exit code for a launched job, from what rank 0 recorded in ``run.json``. A
    resume launched at ``since`` that failed before its first step left the run's status as it
    was and recorded the failure beside it (``failed_resume``): its kind decides."""
    from forge.runs import RunRecord

    data = RunRecord.load(run_dir).data
    failed = data.get("failed_resume") or {}
    if code != 0 and since is not None and str(failed.get("at", "")) >= since:
        return EXIT_USAGE if failed.get("kind") == "usage" else (code if code > 0 else EXIT_FAILURE)
    if data.get("status") == "interrupted" and data.get("signal"):
        return 128 + int(signal.Signals[data["signal"]])
    if data.get("status") == "completed":
        return EXIT_OK
    if data.get("status") == "diverged":
        return EXIT_DIVERGED
    if data.get("status") == "failed" and data.get("error_kind") == "usage":
        return EXIT_USAGE  # rank 0 has printed the message
    return code if code > 0 else EXIT_FAILURE


_NODE_NOTE = (
    "; this node's processes stopped. If another node's processes stopped first, its output "
    "says why; node 0's run.json records the job"
)


def rendezvous_message(
    err: BaseException, argv: Sequence[str], missing: Sequence[int] | None = None
) -> str:
    """What a node says when torchrun's rendezvous failed: which endpoint, and what to check
    (``missing``: the nodes that never joined, where known)."""
    endpoint = next(
        (
            a.split("=", 1)[1]
            for a in argv
            if a.startswith(("--rdzv-endpoint=", "--rdzv_endpoint="))
        ),
        "the rendezvous endpoint",
    )
    kind = type(err).__name__
    if kind == "RendezvousTimeoutError" and missing:
        names = ", ".join(map(str, missing))
        what = f"node{'s' if len(missing) > 1 else ''} {names} never joined the job at {endpoint}"
    elif kind == "RendezvousTimeoutError":
        what = f"the nodes did not all join the job at {endpoint} in time"
    elif kind == "RendezvousConnectionError":
        return (
            f"this node lost the connection to the job's rendezvous store at {endpoint}, which "
            "node 0's forge serves: node 0 stopped (its forge or its machine died; its output "
            "says why), or the network between the nodes failed. This node's processes were "
            "stopped"
        )
    elif kind == "RendezvousClosedError":
        return (
            f"the job at {endpoint} was closed by another node, whose processes ended (its "
            "output says why). This node's processes were stopped"
        )
    else:
        what = f"the rendezvous at {endpoint} failed ({kind}: {err})"
    return (
        f"{what}; every node must run forge with the same --nnodes and --rdzv-endpoint, the "
        "endpoint's host must be reachable from every node, and node 0's output says whether "
        "it started (a config error there stops the job before it meets)"
    )


def _first_failure(failures: dict[int, Any]) -> tuple[int, Any]:
    """The rank that ended first and its ``ProcessFailure`` (torch stops the others then)."""
    return min(failures.items(), key=lambda item: item[1].timestamp)


def _launcher_died(signum: int, frame: Any) -> None:
    from torch.distributed.elastic.multiprocessing.api import SignalException

    # torch's agent answers a SignalException by sending its sigval to every worker's process
    # group; SIGKILL (which no process can catch, so torch never raises it itself) stops them
    # at once and marks this cause for main().
    raise SignalException("the forge process that launched the job died", signal.SIGKILL)


def _pass_stops_on_once() -> None:
    """Have torch's agent pass a stop signal on to the ranks once: a scheduler signals every
    process of a job and forge forwards its own copy too, and torch's handler would answer the
    second copy by abandoning the ranks in the middle of their save. A Ctrl-C after the first
    signal still stops at once (the ranks die with this process)."""
    import torch.distributed.elastic.multiprocessing.api as processes

    received: list[int] = []

    def stop(signum: int, frame: Any) -> None:
        if received and signum != signal.SIGINT:
            return  # the same request again: the ranks are saving
        received.append(signum)
        raise processes.SignalException(
            f"process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum)
        )

    processes._terminate_process_handler = stop  # what the agent installs for each signal
    for signum in stop_signals():  # and from now on: while it waits for the other nodes too
        signal.signal(signum, stop)


def _announce_restarts() -> None:
    """Have torch's agent say which rank died, and how, when it restarts the workers
    (``--max-restarts``); the restarted workers read it (``RESTART_CAUSE_ENV``) for run.json.

    torch's agent says only that it restarts; the failure it restarts after is in the result
    of its ``_monitor_workers``. The agent that ``torch.distributed.run`` builds is therefore
    this subclass, in this process only (forge's agent, never a user's torchrun)."""
    import torch.distributed.launcher.api as launcher
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    from forge.launch.worker import RESTART_CAUSE_ENV

    class RestartNamingAgent(LocalElasticAgent):
        def _monitor_workers(self, worker_group):
            result = super()._monitor_workers(worker_group)
            failed = result.state == WorkerState.FAILED and result.failures
            if failed and _first_failure(result.failures)[1].exitcode in stopped_codes():
                # the first rank to end stopped on a signal after saving (forge's 128 + N; a
                # rank killed by a signal has a negative code; torch stops the others as it
                # sees it): a stop the job asked for, never restarted
                self._remaining_restarts = 0
            elif failed and self._remaining_restarts:
                rank, first = _first_failure(result.failures)
                what = f"rank {rank} (pid {first.pid}) {exit_text(first.exitcode)}"
                done = worker_group.spec.max_restarts - self._remaining_restarts + 1
                os.environ[RESTART_CAUSE_ENV] = what  # the restarted workers inherit it
                _tell(
                    f"warning: {what}; restarting the workers (restart {done} of "
                    f"{worker_group.spec.max_restarts}, --max-restarts): they continue from the "
                    "run's newest checkpoint"
                )
            return result

    launcher.LocalElasticAgent = RestartNamingAgent


def _quiet_torchelastic() -> None:
    """Keep torch's elastic agent from adding its log lines (a failed worker, a forwarded
    signal) to forge's one message; torch's LOGLEVEL variable brings them back."""
    if "LOGLEVEL" in os.environ:
        return
    elastic = logging.getLogger("torch.distributed.elastic")
    elastic.addHandler(logging.NullHandler())  # its modules set their own levels: cut the path
    elastic.propagate = False


_FORGE_OPTIONS = (
    "--run-dir=",
    "--project=",
    "--node=",
    "--command=",
    "--config-name=",
    "--config=",
)


def _forge_options(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """The ``--run-dir=``, ``--project=`` and (several nodes) ``--node=``, ``--command=``,
    ``--config-name=``, ``--config=`` that forge puts before torchrun's arguments."""
    options: dict[str, str] = {}
    while argv and argv[0].startswith(_FORGE_OPTIONS):
        key, value = argv.pop(0)[2:].split("=", 1)
        options[key] = value
    return options, argv


def main(argv: list[str] | None = None) -> int:
    early: list[int] = []  # a stop before the agent's own handlers are in place (torch loads)
    for signum in stop_signals():
        signal.signal(signum, lambda signum, _: early.append(signum))
    # torch's C++ store client prints a warning with a native stack trace for every failed
    # read once a node is gone; forge says it once. Read when libtorch loads, so set before the
    # import and taken back before the workers start (they inherit this environment).
    quiet_native = "TORCH_CPP_LOG_LEVEL" not in os.environ
    if quiet_native:
        os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import parse_args, run

    options, argv = _forge_options(list(sys.argv[1:] if argv is None else argv))
    run_dir = Path(options["run-dir"]) if "run-dir" in options else None
    project_root = Path(options.get("project", "."))
    launcher = os.environ.get(PARENT_ENV, "")
    if quiet_native:
        del os.environ["TORCH_CPP_LOG_LEVEL"]
    _quiet_torchelastic()
    _announce_restarts()
    _pass_stops_on_once()
    if early:  # no worker has started: nothing to pass the stop on to
        return 128 + early[0]
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SHUTDOWN_TIMEOUT_S))
    args = parse_args(argv)
    warning = scheduler_signal().name
    handled = getattr(args, "signals_to_handle", None)  # torch >= 2.7 (older: its four)
    if handled is not None and warning not in handled.split(","):  # passed on to every rank
        args.signals_to_handle += f",{warning}"
    meeting = None
    try:
        signal.signal(LAUNCHER_DIED, _launcher_died)
        stop_with_parent(LAUNCHER_DIED)
        os.environ[PARENT_ENV] = str(os.getpid())  # every worker stops when this process dies
        if "node" in options and args.rdzv_backend == "c10d":  # meet at the endpoint first
            meeting = meet_for_torchrun(options, args)
        run(args)
    except KeyboardInterrupt:  # a second Ctrl-C inside torch's own clean-up
        signal.signal(LAUNCHER_DIED, signal.SIG_IGN)
        return 128 + signal.SIGINT
    except LaunchUsageError as err:  # the nodes do not make one job (JobRefused among them)
        signal.signal(LAUNCHER_DIED, signal.SIG_IGN)
        _tell(f"error: {err}")
        return EXIT_USAGE
    except RunError as err:  # node 0 never came, or could not serve the endpoint
        signal.signal(LAUNCHER_DIED, signal.SIG_IGN)
        what = str(err)
        if run_dir is not None and settle_failure(run_dir, what, {"process": "rendezvous"}):
            what += f"; {failed_note(run_dir, project_root)}"
        _tell(f"error: {what}")
        return EXIT_FAILURE
    except ChildFailedError as failure:
        signal.signal(LAUNCHER_DIED, signal.SIG_IGN)  # the workers are gone already
        rank, first = failure.get_first_failure()
        what = f"rank {rank} (pid {first.pid}) {exit_text(first.exitcode)}"
        details = {"rank": rank, "pid": first.pid, "exitcode": first.exitcode}
        if first.exitcode in stopped_codes():  # stopped on a signal; rank 0's record says so
            return first.exitcode
        if run_dir is None:  # a node that joined: node 0 keeps the record
            _tell(f"error: {what}{_NODE_NOTE}")
        elif settle_failure(run_dir, what, details) or first.exitcode < 0:
            # a rank killed by a signal never says why itself: name it, also when another
            # rank recorded first what that death did to it ("lost contact ...")
            _tell(f"error: {what}; {failed_note(run_dir, project_root)}")
        codes = [f.exitcode for f in failure.failures.values() if f.exitcode and f.exitcode > 0]
        return codes[0] if codes else EXIT_FAILURE
    except SignalException as stop:  # torch has passed the signal on and waited for the workers
        signal.signal(LAUNCHER_DIED, signal.SIG_IGN)
        if stop.sigval == signal.SIGKILL and run_dir is not None:
            record_launcher_death(run_dir, project_root, launcher)
        elif stop.sigval == signal.SIGKILL:
            _tell(
                f"stopped this node's training processes: the forge process that launched them "
                f"(pid {launcher}) died; the other nodes' processes stop as they lose contact"
            )
        return 128 + int(stop.sigval)
    except RendezvousError as err:  # the nodes never met, or the job's store went away
        signal.signal(LAUNCHER_DIED, signal.SIG_IGN)
        what = rendezvous_message(err, argv, meeting and meeting.still_missing())
        if run_dir is not None and settle_failure(run_dir, what, {"process": "rendezvous"}):
            what += f"; {failed_note(run_dir, project_root)}"
        _tell(f"error: {what}")
        return EXIT_FAILURE
    finally:
        if meeting is not None:
            meeting.close()
    signal.signal(LAUNCHER_DIED, signal.SIG_IGN)
    return EXIT_OK
