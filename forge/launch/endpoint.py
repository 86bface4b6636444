"""Where the nodes of a job meet: node 0's agent serves the job's store at the endpoint, every
other node's agent finds it there, and each says whom it waits for.

torchrun's c10d rendezvous meets at a TCP store on ``--rdzv-endpoint``. forge's agent on node
0 (``python -m forge.launch``) serves that store itself before torchrun's rendezvous starts, and
every torchrun is its client (``is_host=false``), so that the nodes check each other at the
door and nobody waits in silence:

- node 0 serves the port, or says at once who holds it (another forge job, a store that is no
  forge job's, a program that is no store) and stops (exit 2); it names the job in the store:
  a rendezvous id of its own (so no other job's nodes join its rendezvous), its size, the
  command and the config it rendered;
- every other node waits for node 0, saying at once and every 30 s whom it waits for; tells a
  port that accepts but does not answer, or answers as no forge job's store, from node 0's
  (exit 2); takes its node rank in the job, which a second job on a busy endpoint (or a node
  started with a rank already taken) finds taken and stops at once (exit 2); and compares its
  node count, command and rendered config with node 0's, refusing the whole job on a mismatch
  with one message naming the keys that differ (exit 2 on every node);
- until every node is there, each node's agent says whom it still waits for, and stops when a
  node refused the job.

Before any of this, the ``forge`` command itself checks that the endpoint's host resolves
(forge/launch/cluster.py: ``check_host``): one that does not is named there, never as a lost
connection. The keys live under ``forge/`` in the store; torch's rendezvous keys beside them
are its own. ``meet_for_torchrun`` is what forge's agent runs before torch's ``run``.
"""

from __future__ import annotations

import datetime
import json
import os
import secrets
import signal
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forge.launch.cluster import RDZV_ID, split_endpoint
from forge.launch.errors import LaunchUsageError
from forge.runs import RunError, now_iso

JOIN_TIMEOUT_S = 600  # torch's default join_timeout: how long nodes wait for each other
NOTE_EVERY_S = 30.0  # a node that waits says whom it waits for at once, then this often
ANSWER_S = 5.0  # a store answers a connection at once: a listener silent this long is none
POLL_S = 0.5  # how often a waiting node looks at the store

JOB_KEY = "forge/job"  # node 0's job: id, size, command, config
REFUSED_KEY = "forge/refused"  # the message of a node that refused the job
_SHOWN_KEYS = 6  # a config mismatch names this many keys, then a count


def node_key(node: int) -> str:
    return f"forge/node/{node}"  # taken by the node that holds this rank (first comes, wins)


def ready_key(node: int) -> str:
    return f"forge/ready/{node}"  # the node checked the job and starts its torchrun


def _is_this_machine(host: str) -> bool:
    """Whether ``host`` names an address of this machine (one can bind to it)."""
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return False
    for family, kind, proto, _, address in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.bind((address[0], 0, *address[2:]))
            return True
        except OSError:
            continue
    return False


# --------------------------------------------------------------------------- one connection


def _connect(
    host: str, port: int, timeout_s: float, said: Callable[[], None] = lambda: None
) -> tuple[str, Any]:
    """What answers at ``host:port``: ("nobody", reason), ("silent", None) for a listener that
    does not answer as a store in ``ANSWER_S``, ("other", reason) for one that answers
    otherwise, or ("store", a TCPStore client)."""
    from torch.distributed import TCPStore

    try:
        with socket.create_connection((host, port), timeout=2.0):
            pass
    except OSError as err:
        return "nobody", (err.strerror or "timed out").lower()
    box: list[Any] = []

    def attach() -> None:  # a listener that never answers holds this thread, not the agent
        try:
            box.append(
                TCPStore(
                    host,
                    port,
                    is_master=False,
                    wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=timeout_s),
                )
            )
        except (RuntimeError, OSError, ValueError) as err:
            box.append(err)

    thread = threading.Thread(target=attach, daemon=True, name="forge-endpoint-probe")
    thread.start()
    thread.join(1.0)
    if not box:  # a store answers at once: say what this node waits for
        said()
        thread.join(ANSWER_S - 1.0)
    if not box:
        return "silent", None
    if isinstance(box[0], Exception):
        return "other", str(box[0]).splitlines()[0] if str(box[0]) else type(box[0]).__name__
    return "store", box[0]


def _read_job(store: Any) -> dict[str, Any] | None:
    """Node 0's job from its store (it names it right after serving), None if none comes."""
    deadline = time.monotonic() + ANSWER_S
    while time.monotonic() < deadline:
        if store.check([JOB_KEY]):
            return json.loads(store.get(JOB_KEY))
        time.sleep(0.1)
    return None


def _describe_job(job: Mapping[str, Any]) -> str:
    trains = f", `forge {job['command']} {job['config_name']}`" if job.get("config_name") else ""
    return (
        f"job {job['id']}: node 0 on {job['host']} (pid {job['pid']}) since "
        f"{job['started']}{trains}, {job['nnodes']} nodes"
    )


def _holder(host: str, port: int) -> str:
    """What holds a port this node could not serve on, as the other nodes would find it."""

    def said() -> None:
        tell(
            f"node 0: port {port} of this machine is taken; waiting up to {ANSWER_S:.0f} s for "
            "what holds it to answer, to say what it is"
        )

    kind, found = _connect(host, port, ANSWER_S, said)
    if kind == "store":
        job = _read_job(found)
        if job is None:
            return "a rendezvous store that is no forge job's (a torchrun started without forge)"
        return f"another forge job ({_describe_job(job)})"
    if kind == "silent":
        return "a program that accepts connections but does not answer as a rendezvous store"
    return "another program"


# --------------------------------------------------------------------------- the meeting


@dataclass(frozen=True)
class Here:
    """What this node was started to run, for comparing with node 0."""

    command: str = "train"  # forge train / forge resume
    config_name: str | None = None
    config_file: Path | None = None  # the rendered config (forge train; resume: node 0's)

    def config(self) -> str | None:
        return Path(self.config_file).read_text() if self.config_file else None


@dataclass
class Meeting:
    """This node's place in a job of several nodes, once it met node 0's store."""

    node: int
    nnodes: int
    endpoint: str
    job: dict[str, Any]
    store: Any  # a torch.distributed.TCPStore: node 0's server, or a client of it
    join_timeout: float = JOIN_TIMEOUT_S
    refusal: str | None = None  # the message of the node that refused the job, once seen
    _done: threading.Event = field(default_factory=threading.Event)

    @property
    def job_id(self) -> str:
        return str(self.job["id"])

    def missing(self) -> list[int]:
        """The nodes that have not yet checked the job and started their torchrun."""
        return [n for n in range(self.nnodes) if not self.store.check([ready_key(n)])]

    def watch(self, stop: Callable[[str], None]) -> None:
        """Say whom this node waits for (at once, then every ``NOTE_EVERY_S``) until every
        node is here; ``stop(message)`` when a node refuses the job. In a thread of its own."""
        thread = threading.Thread(target=self._watch, args=(stop,), daemon=True)
        thread.name = "forge-endpoint-watch"
        thread.start()

    def close(self) -> None:
        self._done.set()

    def still_missing(self) -> list[int] | None:
        """The nodes that never joined, where the store still says (None: unknown)."""
        try:
            return self.missing()
        except (RuntimeError, OSError, ValueError):
            return None

    def _watch(self, stop: Callable[[str], None]) -> None:
        start = time.monotonic()
        notes = Notes()
        try:
            while not self._done.is_set():
                if self.store.check([REFUSED_KEY]):
                    self.refusal = self.store.get(REFUSED_KEY).decode()
                    self.store.set(f"forge/refusal-seen/{self.node}", "1")
                    if self.node == 0:  # the others read it from this store: let them
                        self._wait_for_acknowledgements()
                    stop(self.refusal)
                    return
                missing = self.missing()
                if not missing:
                    if notes.said:
                        tell(f"node {self.node} of {self.nnodes}: all nodes joined the job")
                    elif self.node:
                        tell(
                            f"node {self.node} of {self.nnodes}: joined the job at "
                            f"{self.endpoint} ({_describe_job(self.job)}); all nodes are here"
                        )
                    return
                waited = time.monotonic() - start
                notes.say(*self._waiting_notes(missing, waited))
                if waited > self.join_timeout + NOTE_EVERY_S:  # torch's rendezvous said it
                    return
                self._done.wait(POLL_S)
        except (RuntimeError, OSError, ValueError):  # node 0's store went away: torch says it
            return

    def _waiting_notes(self, missing: list[int], waited: float) -> tuple[str, str]:
        """What this node says when it starts to wait, and again while it waits."""
        who = _node_names(missing)
        head = f"node {self.node} of {self.nnodes}"
        if self.node == 0:
            first = (
                f"{head}: serving the job's rendezvous at {self.endpoint} (job {self.job_id}); "
                f"waiting for {who} to join (up to {self.join_timeout:.0f} s)"
            )
        else:
            first = (
                f"{head}: joined the job at {self.endpoint} ({_describe_job(self.job)}); "
                f"waiting for {who} (up to {self.join_timeout:.0f} s)"
            )
        again = (
            f"{head}: still waiting for {who} at {self.endpoint} ({waited:.0f} s of "
            f"{self.join_timeout:.0f} s): start forge there with the same --nnodes "
            f"{self.nnodes} and --rdzv-endpoint {self.endpoint}, and its own --node-rank"
        )
        return first, again

    def _wait_for_acknowledgements(self) -> None:
        """Keep node 0's store up until every node that joined has read the refusal (the
        node that refused knows it), a few polls at most."""
        deadline = time.monotonic() + 3 * POLL_S + 1.0
        while time.monotonic() < deadline:
            joined = [n for n in range(1, self.nnodes) if self.store.check([node_key(n)])]
            seen = [n for n in joined if self.store.check([f"forge/refusal-seen/{n}"])]
            if len(joined) - len(seen) <= 1:
                return
            time.sleep(0.1)


class Notes:
    """When a waiting node speaks: at once, then every ``every`` seconds."""

    def __init__(self, every: float = NOTE_EVERY_S, clock: Callable[[], float] = time.monotonic):
        self.every, self.clock = every, clock
        self.said = 0  # notes given so far
        self._next = clock()

    def due(self) -> bool:
        """Whether a note is due now (counted as said)."""
        if self.clock() < self._next:
            return False
        self.said += 1
        self._next += self.every
        return True

    def say(self, first: str, again: str) -> None:
        """``first`` at once, ``again`` (a warning) every ``every`` seconds after."""
        if self.due():
            tell(first if self.said == 1 else again, warn=self.said > 1)


def tell(message: str, *, warn: bool = False) -> None:
    """A line on stderr from the agent (which has no logging of its own)."""
    import sys

    print(("warning: " if warn else "") + message, file=sys.stderr, flush=True)


def _node_names(nodes: list[int]) -> str:
    if len(nodes) == 1:
        return f"node {nodes[0]}"
    return "nodes " + ", ".join(map(str, nodes[:-1])) + f" and {nodes[-1]}"


def meet(
    node: int,
    nnodes: int,
    endpoint: str,
    here: Here,
    *,
    rdzv_id: str = RDZV_ID,
    join_timeout: float = JOIN_TIMEOUT_S,
) -> Meeting:
    """Node 0 serves the job's store and names the job; another node finds it, takes its rank
    and checks that it runs what node 0 runs. Raises LaunchUsageError (exit 2) or RunError."""
    if node == 0:
        return _serve(nnodes, endpoint, here, rdzv_id, join_timeout)
    return _join(node, nnodes, endpoint, here, join_timeout)


def _me() -> str:
    """This node as the store records it (a token tells two claims of one second apart)."""
    me = {"host": socket.gethostname(), "pid": os.getpid(), "at": now_iso()}
    return json.dumps({**me, "token": secrets.token_hex(8)})


def _serve(nnodes: int, endpoint: str, here: Here, rdzv_id: str, timeout: float) -> Meeting:
    from torch.distributed import TCPStore

    host, port = split_endpoint(endpoint)
    local = _is_this_machine(host)
    try:
        store = TCPStore(
            host if local else "localhost",  # the server listens on every address
            port,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout),
        )
    except (RuntimeError, OSError) as err:
        text = str(err)
        if "EADDRINUSE" not in text and "address already in use" not in text.lower():
            raise RunError(
                f"node 0 could not serve the job's rendezvous at {endpoint}: "
                f"{text.splitlines()[0] if text else type(err).__name__}"
            ) from None
        raise LaunchUsageError(
            f"port {port} of this machine ({socket.gethostname()}) is taken by "
            f"{_holder(host if local else 'localhost', port)}: node 0 serves the job's "
            "rendezvous there, so every job needs a port of its own. Give this job a free "
            "one, the same on every node: --rdzv-endpoint HOST:PORT"
        ) from None
    if not local:
        tell(
            f"node 0 serves the job's rendezvous on this machine ({socket.gethostname()}), "
            f"but {host} (in --rdzv-endpoint {endpoint}) does not name one of its addresses: "
            "the other nodes look for node 0 there",
            warn=True,
        )
    job = {
        "id": rdzv_id if rdzv_id != RDZV_ID else f"forge-{secrets.token_hex(4)}",
        "nnodes": nnodes,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": now_iso(),
        "command": here.command,
        "config_name": here.config_name,
        "config": here.config(),
    }
    store.set(JOB_KEY, json.dumps(job))
    store.set(node_key(0), _me())
    store.set(ready_key(0), "1")
    return Meeting(0, nnodes, endpoint, job, store, timeout)


def _join(node: int, nnodes: int, endpoint: str, here: Here, timeout: float) -> Meeting:
    host, port = split_endpoint(endpoint)
    head = f"node {node} of {nnodes}"
    start = time.monotonic()
    notes = Notes()

    def said() -> None:
        tell(
            f"{head}: something listens at {endpoint}; waiting up to {ANSWER_S:.0f} s for it to "
            "answer as node 0's rendezvous store"
        )

    while True:
        kind, found = _connect(host, port, timeout, said)
        if kind == "store":
            store = found
            break
        if kind != "nobody":
            how = "does not answer" if kind == "silent" else f"answers otherwise ({found})"
            raise LaunchUsageError(
                f"{host}:{port} accepts connections but {how}: it is no rendezvous store, so "
                f"another program holds that port on {host}. Node 0's forge serves the job's "
                "rendezvous there: give the job a free port, the same --rdzv-endpoint on every "
                "node"
            )
        waited = time.monotonic() - start
        if waited >= timeout:
            raise RunError(
                f"{head}: node 0 never served the job's rendezvous at {endpoint} in "
                f"{timeout:.0f} s ({found}): start forge on node 0 with --node-rank 0 and the "
                "same --nnodes and --rdzv-endpoint (its output says whether it stopped first)"
            )

        notes.say(
            f"{head}: waiting for node 0 at {endpoint}, where nobody answers yet ({found}); "
            "node 0's forge serves the job's rendezvous there once its config checks "
            f"(waiting up to {timeout:.0f} s)",
            f"{head}: still waiting for node 0 at {endpoint} ({waited:.0f} s of {timeout:.0f} s;"
            f" {found}): start forge on node 0 with --node-rank 0 and the same --nnodes {nnodes}"
            f" and --rdzv-endpoint {endpoint}",
        )
        time.sleep(1.0)
    job = _read_job(store)
    if job is None:
        raise LaunchUsageError(
            f"the rendezvous store at {endpoint} is no forge job's (node 0's forge names its "
            "job there): a torchrun started without forge serves it. Give this job a port of "
            "its own, the same --rdzv-endpoint on every node"
        )
    if node >= int(job["nnodes"]):
        raise LaunchUsageError(
            f"{head}: the job at {endpoint} ({_describe_job(job)}) has no node {node}: another "
            "job is using this endpoint, or this node was started with another --nnodes than "
            "node 0. Give each job its own port, and every node of a job the same --nnodes"
        )
    me = _me()
    holder = store.compare_set(node_key(node), "", me).decode()
    if holder != me:
        other = json.loads(holder)
        raise LaunchUsageError(
            f"{head}: the job at {endpoint} has its node {node} already (on {other['host']}, "
            f"pid {other['pid']}, since {other['at']}; {_describe_job(job)}): another job is "
            f"using this endpoint, or two nodes were started with --node-rank {node}. Give "
            "each job a port of its own (--rdzv-endpoint HOST:PORT on all its nodes) and each "
            "node of a job its own --node-rank"
        )
    problem = mismatch(job, node, nnodes, here)
    if problem is not None:
        said = store.compare_set(REFUSED_KEY, "", problem).decode()
        raise LaunchUsageError(said)
    if store.check([REFUSED_KEY]):  # another node refused the job already
        raise LaunchUsageError(store.get(REFUSED_KEY).decode())
    store.set(ready_key(node), "1")
    return Meeting(node, nnodes, endpoint, job, store, timeout)


def mismatch(job: Mapping[str, Any], node: int, nnodes: int, here: Here) -> str | None:
    """Why node ``node`` cannot join node 0's ``job`` (the same message on every node), or
    None when it runs what node 0 runs."""
    fix = "start forge on every node with the same command, CONFIG, -D and --set"
    if int(job["nnodes"]) != nnodes:
        return (
            f"node {node} was started with --nnodes {nnodes}, node 0 with --nnodes "
            f"{job['nnodes']}: every node of a job gives the same --nnodes"
        )
    if job.get("command") != here.command:
        return (
            f"node 0 runs `forge {job.get('command')}`, node {node} `forge {here.command}`: {fix}"
        )
    theirs, ours = job.get("config"), here.config()
    if theirs is None or ours is None:
        return None  # forge resume trains node 0's run: the others render nothing
    from forge.config.compare import config_differences

    differences = config_differences(theirs, ours)
    public = [d for d in differences if not d[0].startswith(".")]  # hidden helpers repeat them
    shown = public or differences
    if not shown:
        return None
    names = ""
    if job.get("config_name") != here.config_name:
        names = f" (node 0: {job.get('config_name')}, node {node}: {here.config_name})"
    keys = "; ".join(
        f"{key} (node 0: {_clip(zeros)}, node {node}: {_clip(mine)})"
        for key, zeros, mine in shown[:_SHOWN_KEYS]
    )
    more = f"; and {len(shown) - _SHOWN_KEYS} more" if len(shown) > _SHOWN_KEYS else ""
    return (
        f"node {node} rendered another config than node 0{names}, which would train node 0's: "
        f"they differ at {keys}{more}. Every node of a job trains one config: {fix}"
    )


def _clip(value: str | None, width: int = 40) -> str:
    if value is None:
        return "(absent)"
    return value if len(value) <= width else value[: width - 3] + "..."


# --------------------------------------------------------------------------- in the agent


class JobRefused(LaunchUsageError):
    """A node refused the job (another config, --nnodes or command than node 0's): raised in
    the agent's main thread, which waits in torch's rendezvous, when the watch sees it."""


JOB_REFUSED = signal.SIGUSR2  # how the watching thread stops the main thread's rendezvous


def meet_for_torchrun(options: Mapping[str, str], args: Any) -> Meeting:
    """In forge's agent: meet the job's other nodes at its endpoint (``options``: forge's
    ``--node=``, ``--command=``, ``--config-name=``, ``--config=``), then point torch's
    rendezvous (``args``, torchrun's parsed arguments) at the store node 0's agent serves,
    under the job's id. A refusal seen later stops the main thread's rendezvous (JobRefused)."""
    # torch's --rdzv-conf is `key=value,key=value`; a user's copy after -- is kept
    conf = dict(p.split("=", 1) for p in str(args.rdzv_conf or "").split(",") if "=" in p)
    try:
        join_timeout = float(conf.get("join_timeout", JOIN_TIMEOUT_S))
    except ValueError:
        raise LaunchUsageError(f"--rdzv-conf join_timeout must be seconds (got {conf})") from None
    conf["is_host"] = "false"  # node 0's agent serves the store itself, before torch's rendezvous
    args.rdzv_conf = ",".join(f"{key}={value}" for key, value in conf.items())
    config = options.get("config")
    here = Here(
        options.get("command", "train"), options.get("config-name"), config and Path(config)
    )
    node = int(options["node"])
    meeting = meet(
        node,
        int(args.nnodes),
        args.rdzv_endpoint,
        here,
        rdzv_id=args.rdzv_id,
        join_timeout=join_timeout,
    )
    args.rdzv_id = meeting.job_id

    def refused(_signum: int, _frame: Any) -> None:
        if meeting.refusal:
            raise JobRefused(meeting.refusal)

    signal.signal(JOB_REFUSED, refused)
    meeting.watch(lambda _message: os.kill(os.getpid(), JOB_REFUSED))
    return meeting
