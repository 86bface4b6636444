"""Which nodes a job spans and how torchrun joins them: forge's flags, or SLURM's variables.

``forge train --nnodes 2 --node-rank R --rdzv-endpoint HOST:PORT`` is started once on every
node; each starts torchrun for its own processes, and the torchruns meet at the endpoint through
torchrun's c10d rendezvous (a TCP store that node 0's agent serves there, and where the nodes
check each other first: forge/launch/endpoint.py). ``--master-addr`` and
``--master-port`` are the same endpoint under the names torchrun's static launch uses.

Under SLURM, ``srun forge train ...`` starts **one forge per node** (``--ntasks-per-node=1``):
forge then starts torchrun with one process per GPU of that node, as on any machine. The node
count, this node's index and the endpoint come from SLURM's variables: ``SLURM_NNODES``,
``SLURM_NODEID``, the first host of ``SLURM_JOB_NODELIST`` (parsed here: ``scontrol`` may not
exist where forge runs) and a port derived from ``SLURM_JOB_ID``, which also names the
rendezvous. Several tasks on a node (one per GPU, torchrun's work done by srun) are refused
with the fix, on one node as on several, since each task would start a job of its own. Flags
given to forge win over SLURM's values.

Torch-free: the CLI builds the command without loading the ML stack.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from forge.launch.errors import LaunchUsageError

DEFAULT_PORT = 29500  # torchrun's own default for the endpoint
SLURM_PORT_BASE, SLURM_PORT_SPAN = 29500, 2000  # a port per job, so jobs sharing a node differ
RDZV_ID = "forge"  # the rendezvous id when SLURM names none: node 0 makes one per job of it

# torchrun options forge sets itself (either spelling), so a copy after `--` would clash
_NODE_OPTIONS = {
    "nnodes": ("--nnodes",),
    "node_rank": ("--node-rank", "--node_rank"),
    "rdzv_endpoint": ("--rdzv-endpoint", "--rdzv_endpoint"),
    "master_addr": ("--master-addr", "--master_addr"),
    "master_port": ("--master-port", "--master_port"),
}


@dataclass(frozen=True)
class Nodes:
    """The nodes of one job as this node sees them."""

    nnodes: int = 1
    node_rank: int = 0
    endpoint: str | None = None  # HOST:PORT of the c10d rendezvous; None on one node
    rdzv_id: str = RDZV_ID
    source: str = "flags"  # "flags" or "SLURM", for messages
    endpoint_from: str = field(default="flags", compare=False)  # the same, for the endpoint

    @property
    def multinode(self) -> bool:
        return self.nnodes > 1

    @property
    def creates_run(self) -> bool:
        """Node 0's forge creates (or, resuming, claims) the run; the others learn it."""
        return self.node_rank == 0

    def torchrun_args(self) -> list[str]:
        """torchrun's options for this node (none for one node: forge adds --standalone)."""
        if not self.multinode:
            return []
        return [
            f"--nnodes={self.nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={self.endpoint}",
            f"--rdzv-id={self.rdzv_id}",
        ]

    def describe(self) -> str:
        if not self.multinode:
            return "1 node"
        named = f", id {self.rdzv_id}" if self.rdzv_id != RDZV_ID else ""
        return (
            f"node {self.node_rank} of {self.nnodes} (rendezvous {self.endpoint}{named}, "
            f"from {self.source})"
        )


def first_host(nodelist: str) -> str:
    """The first host of a SLURM hostlist: ``node[01-04,07],gpu7`` -> ``node01``."""
    text = nodelist.strip()
    match = re.match(r"([^,\[]*)(?:\[([^\]]*)\])?", text)
    if not text or match is None or not (match.group(1) or match.group(2)):
        raise LaunchUsageError(f"SLURM_JOB_NODELIST={nodelist!r} names no host")
    prefix, ranges = match.group(1), match.group(2)
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0].strip()
    if not first:
        raise LaunchUsageError(f"SLURM_JOB_NODELIST={nodelist!r}: cannot read its first host")
    return prefix + first  # the range keeps its zero padding: node[01-04] starts at node01


def _int(value: str | None, name: str, *, low: int) -> int:
    try:
        number = int(value or "")
    except ValueError:
        raise LaunchUsageError(f"{name} must be an integer (got {value!r})") from None
    if number < low:
        raise LaunchUsageError(f"{name} must be at least {low} (got {number})")
    return number


def _slurm_step(env: Mapping[str, str]) -> bool:
    return "SLURM_STEP_ID" in env or "SLURM_STEPID" in env


def check_one_task_per_node(env: Mapping[str, str]) -> None:
    """Refuse an ``srun`` step with several tasks on a node: each task would be a job of its
    own (its own run, trained alone), whatever the node count."""
    if "SLURM_JOB_ID" not in env or not _slurm_step(env):
        return
    nnodes = _int(
        env.get("SLURM_STEP_NUM_NODES", env.get("SLURM_NNODES", "1")), "SLURM_NNODES", low=1
    )
    ntasks = _int(
        env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS", str(nnodes))),
        "SLURM_NTASKS",
        low=1,
    )
    if ntasks <= nnodes:
        return
    nodes = f"{nnodes} node" + ("s" if nnodes > 1 else "")
    per_node = max(ntasks // nnodes, 1)
    raise LaunchUsageError(
        f"srun started {ntasks} tasks on {nodes}: each task would start a job of its own "
        "(its own run, trained alone). forge starts the processes of its node itself, so it "
        f"needs one task per node: `srun --ntasks-per-node=1 forge train ... --nproc {per_node}` "
        "(or --nproc auto: one process per GPU)"
    )


def slurm_nodes(env: Mapping[str, str]) -> Nodes | None:
    """The job's nodes from SLURM's variables, inside an ``srun`` step; None outside SLURM
    or in an allocation of one node. Raises LaunchUsageError where forge cannot run as started."""
    if "SLURM_JOB_ID" not in env or "SLURM_NNODES" not in env:
        return None
    nnodes = _int(env["SLURM_NNODES"], "SLURM_NNODES", low=1)
    check_one_task_per_node(env)
    if nnodes == 1:
        return None
    if not _slurm_step(env):  # the batch script itself, on the first node only
        raise LaunchUsageError(
            f"this SLURM job has {nnodes} nodes but forge was not started by srun, so it "
            "would run on one of them and wait for the rest: start it with "
            "`srun --ntasks-per-node=1 forge train ...`, or pass --nnodes 1 to train here only"
        )
    node_rank = _int(env.get("SLURM_NODEID", env.get("SLURM_PROCID")), "SLURM_NODEID", low=0)
    job = env["SLURM_JOB_ID"]
    port = DEFAULT_PORT
    if job.isdigit():
        port = SLURM_PORT_BASE + int(job) % SLURM_PORT_SPAN
    host = first_host(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", ""))
    return Nodes(nnodes, node_rank, f"{host}:{port}", f"slurm-{job}", "SLURM", "SLURM")


def take_node_options(torchrun_args: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """The node options given after ``--`` (``--nnodes 2``, ``--node_rank=1``), and the rest."""
    spelled = {flag: key for key, flags in _NODE_OPTIONS.items() for flag in flags}
    found: dict[str, str] = {}
    rest: list[str] = []
    words = list(torchrun_args)
    index = 0
    while index < len(words):
        word = words[index]
        flag, eq, value = word.partition("=")
        if flag in spelled:
            if not eq:
                if index + 1 >= len(words):
                    raise LaunchUsageError(f"torchrun option {flag} after -- needs a value")
                index += 1
                value = words[index]
            found[spelled[flag]] = value
        else:
            rest.append(word)
        index += 1
    return found, rest


def resolve_nodes(
    *,
    nnodes: int | str | None = None,
    node_rank: int | None = None,
    rdzv_endpoint: str | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    torchrun_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> tuple[Nodes, list[str]]:
    """This node's view of the job from forge's flags (or the same options after ``--``),
    else SLURM's variables; and the torchrun arguments left to pass on unchanged."""
    env = os.environ if env is None else env
    given, rest = take_node_options(torchrun_args)
    flags = {
        "nnodes": nnodes,
        "node_rank": node_rank,
        "rdzv_endpoint": rdzv_endpoint,
        "master_addr": master_addr,
        "master_port": master_port,
    }
    for key, value in given.items():
        if flags[key] is not None:
            raise LaunchUsageError(
                f"give --{key.replace('_', '-')} once: to forge, or to torchrun after --"
            )
        flags[key] = value
    if flags["nnodes"] is not None and not str(flags["nnodes"]).isdigit():
        elastic = (
            "; an elastic range (MIN:MAX) is not supported: every node must know the job's "
            "size to agree on its run"
        )
        raise LaunchUsageError(
            f"--nnodes must be a positive integer (got {str(flags['nnodes'])!r})"
            + (elastic if ":" in str(flags["nnodes"]) else "")
        )
    if flags["rdzv_endpoint"] and (flags["master_addr"] or flags["master_port"]):
        raise LaunchUsageError(
            "give the rendezvous once: --rdzv-endpoint HOST:PORT, or --master-addr HOST "
            "with --master-port PORT (the same thing under torchrun's older names)"
        )
    if flags["node_rank"] is None:  # with --node-rank each task is told its place in a job
        check_one_task_per_node(env)
    slurm = None
    if flags["nnodes"] is None or int(flags["nnodes"]) > 1:
        try:
            slurm = slurm_nodes(env)
        except LaunchUsageError:
            if flags["nnodes"] is None:  # SLURM's count is the one to go by, and it is wrong
                raise
    nodes_count = int(flags["nnodes"]) if flags["nnodes"] is not None else None
    if nodes_count is None:
        nodes_count = slurm.nnodes if slurm else 1
    if nodes_count < 1:
        raise LaunchUsageError(f"--nnodes must be a positive integer (got {nodes_count})")
    rank_value = flags["node_rank"]
    if rank_value is None:
        rank = slurm.node_rank if slurm else 0
    else:
        rank = _int(str(rank_value), "--node-rank", low=0)
    if rank >= nodes_count:
        raise LaunchUsageError(
            f"--node-rank {rank} is not below --nnodes {nodes_count} (nodes count from 0)"
        )
    endpoint = flags["rdzv_endpoint"]
    if endpoint is None and flags["master_addr"]:
        port = _int(str(flags["master_port"] or DEFAULT_PORT), "--master-port", low=1)
        endpoint = f"{flags['master_addr']}:{port}"
    elif endpoint is None and flags["master_port"]:
        raise LaunchUsageError("--master-port needs --master-addr (the host of node 0)")
    endpoint_from = "flags"
    if endpoint is None and slurm is not None:
        endpoint, endpoint_from = slurm.endpoint, "SLURM"
    if nodes_count == 1:
        if endpoint:
            raise LaunchUsageError(
                "a rendezvous endpoint is for a job of several nodes; add --nnodes N, or drop it"
            )
        return ONE_NODE, rest
    if endpoint is None:
        raise LaunchUsageError(
            f"a job of {nodes_count} nodes needs the rendezvous address every node reaches: "
            "--rdzv-endpoint HOST:PORT (HOST is node 0, PORT a free port), the same on every node"
        )
    if ":" not in endpoint:
        endpoint = f"{endpoint}:{DEFAULT_PORT}"
    rdzv_id = slurm.rdzv_id if slurm is not None else RDZV_ID
    source = "SLURM" if slurm is not None and flags["nnodes"] is None else "flags"
    return Nodes(nodes_count, rank, endpoint, rdzv_id, source, endpoint_from), rest


ONE_NODE = Nodes()  # a job on this machine alone


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for an IPv6 address) -> (host, port)."""
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


def endpoint_origin(nodes: Nodes, env: Mapping[str, str] | None = None) -> str:
    """Where this node read the endpoint from, for messages."""
    env = os.environ if env is None else env
    if nodes.endpoint_from == "SLURM":
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "")
        return f"the first host of SLURM_JOB_NODELIST={nodelist}"
    return f"--rdzv-endpoint {nodes.endpoint}"


def check_host(nodes: Nodes, env: Mapping[str, str] | None = None) -> None:
    """Refuse an endpoint whose host does not resolve here (this node would never connect)."""
    host, port = split_endpoint(str(nodes.endpoint))
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as err:
        reason = getattr(err, "strerror", None) or str(err)
        if nodes.endpoint_from == "SLURM":
            fix = (
                "forge reads node 0's host from SLURM's node list, which names hosts the "
                "allocation's nodes resolve: run forge on them under srun, or give "
                "--rdzv-endpoint HOST:PORT with a host every node resolves"
            )
        else:
            fix = "give every node a --rdzv-endpoint naming node 0 by a host every node resolves"
        raise LaunchUsageError(
            f"the rendezvous host {host!r} ({endpoint_origin(nodes, env)}) does not resolve on "
            f"this machine ({socket.gethostname()}: {reason}), so this node never connected to "
            f"the job: {fix}"
        ) from None
