"""How the processes of a job of several nodes agree on its run before they train.

Node 0's forge creates the run directory (``forge resume``: claims it and resolves the
checkpoint) and passes it to its workers; the other nodes' forge processes know neither. So
before anything else every worker of a multi-node job meets at the job's rendezvous store
(torchrun's c10d store at ``--rdzv-endpoint``, alive as long as the job): a worker of node 0
publishes the run directory and the checkpoint, every worker reads them and checks that it
sees the run (a filesystem every node mounts at the same path), and all of them learn
whether every rank does. A node that cannot see it makes the whole job stop at once with one
message naming the host, instead of training on or waiting in a collective.

The global ranks are torchrun's to assign (the c10d rendezvous orders nodes by host name), so
nothing here assumes that global rank 0 runs on node 0.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
from pathlib import Path

from forge.launch.errors import LaunchUsageError
from forge.runs import RunError
from forge.train.topology import Topology

logger = logging.getLogger(__name__)

AGREE_TIMEOUT_S = 300  # node 0's workers publish as soon as they start: this is a lost job


def agree_on_run(
    endpoint: str,
    run_dir: Path | None,
    resume_from: str | None,
    *,
    tell_run_dir: Path | None = None,
    timeout_s: float = AGREE_TIMEOUT_S,
) -> tuple[Path, str | None]:
    """The run directory and checkpoint node 0 named, once every rank has seen them.

    ``run_dir`` is given on node 0's workers, None on the others. ``tell_run_dir``: a file
    this node's forge reads after the job (written by the node's first worker). Raises
    LaunchUsageError (the same on every rank) when a rank cannot see the run.
    """
    from torch.distributed import TCPStore

    topology = Topology.from_env()
    host, _, port = endpoint.rpartition(":")
    prefix = "forge/{}/{}/".format(
        os.environ.get("TORCHELASTIC_RUN_ID", "job"),
        os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"),
    )
    try:
        store = TCPStore(
            host,
            int(port),
            is_master=False,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
        if run_dir is not None and topology.local_rank == 0:
            named = {"run_dir": str(run_dir), "resume_from": resume_from, "host": _host()}
            store.set(prefix + "run", json.dumps(named))
        named = json.loads(store.get(prefix + "run"))
        learned = Path(named["run_dir"])
        if run_dir is not None and learned != run_dir:
            problem = (
                f"two nodes were started as node 0 (on {named['host']} and {_host()}): "
                "give each node its own --node-rank"
            )
        else:
            problem = _cannot_see(learned, named.get("resume_from"), named["host"])
        store.set(f"{prefix}seen/{topology.rank}", problem)
        problems = [
            store.get(f"{prefix}seen/{rank}").decode() for rank in range(topology.world_size)
        ]
    except (RuntimeError, OSError, ValueError) as err:  # the store went away or timed out
        raise RunError(
            f"the processes of the job could not agree on its run through the job's store at "
            f"{endpoint} ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''});"
            " another node stopped, or node 0's processes never started"
        ) from None
    failed = [p for p in problems if p]
    if failed:
        raise LaunchUsageError(failed[0])
    if tell_run_dir is not None and topology.local_rank == 0:
        tell_run_dir.write_text(str(learned))
    if run_dir is None:
        logger.info("node %s: training %s, created by node 0 (%s)", _host(), learned, named["host"])
    return learned, named.get("resume_from")


def _cannot_see(run_dir: Path, resume_from: str | None, creator: str) -> str:
    """What keeps this process from using the run node 0 created ('' when nothing does)."""
    missing = None
    if not (run_dir / "run.json").is_file():
        missing = f"the run directory {run_dir}"
    elif resume_from and not Path(resume_from).is_dir():
        missing = f"the checkpoint {resume_from}"
    if missing is None:
        return ""
    return (
        f"host {_host()} cannot see {missing}, which node 0 ({creator}) named: a job of "
        "several nodes keeps its runs on a filesystem every node mounts at the same path "
        "(put the project, or its output directory, there), and starts forge with the same "
        "-p on every node"
    )


def _host() -> str:
    return socket.gethostname()


_PEER_LOSS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


def peer_loss(err: BaseException) -> RunError | None:
    """A collective that failed because another process of the job is gone, said as such
    (torch's own text ends with a pointer to the other worker's logs); None for other errors."""
    text = str(err)
    if not isinstance(err, RuntimeError) or not any(s in text for s in _PEER_LOSS):
        return None
    reason = next(s for s in _PEER_LOSS if s in text)
    return RunError(
        f"lost contact with another process of the job ({reason.lower()}): it stopped, or its "
        "node did; the output of the node that stopped first says why"
    )
