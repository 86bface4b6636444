"""Where this process sits in the job: rank, data-parallel replica, pipeline stage.

One ``Topology`` replaces every separate reading of RANK / WORLD_SIZE: the CLI (log prefixes),
the worker (build variables), the trainers (loader sharding, loss reduction, device) and the
checkpoint layer (who writes which file) all read it. Torch-free, so the CLI can use it without
loading the ML stack.

Ranks are laid out stage-major within a replica: rank = dp_rank * num_stages + stage, so the
stages of one pipeline replica are neighbouring ranks (on one node when they fit).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Launchers that do not go through torchrun (MPI, as `accelerate launch` uses for multi-CPU
# jobs) name the rank differently; the first variable present wins.
_RANK_VARS = ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK")
_WORLD_VARS = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
_LOCAL_RANK_VARS = ("LOCAL_RANK", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK")
_LOCAL_WORLD_VARS = ("LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE")


def _first_int(env: Mapping[str, str], names: tuple[str, ...], default: int) -> int:
    for name in names:
        value = env.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError:
                raise ValueError(
                    f"environment variable {name}={value!r} is not an integer"
                ) from None
    return default


@dataclass(frozen=True)
class Topology:
    """This process's coordinates in the job; ``num_stages`` > 1 only for pipeline jobs."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    num_stages: int = 1
    local_world_size: int = 0  # processes on this node; 0: not told (all of them)

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in a world of size {self.world_size}")
        if self.num_stages < 1 or self.world_size % self.num_stages:
            raise ValueError(
                f"{self.num_stages} pipeline stage(s) do not divide {self.world_size} process(es)"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, *, num_stages: int = 1) -> Topology:
        """Read the launcher's environment (torchrun, ``accelerate launch``, MPI)."""
        env = os.environ if env is None else env
        return cls(
            rank=_first_int(env, _RANK_VARS, 0),
            world_size=_first_int(env, _WORLD_VARS, 1),
            local_rank=_first_int(env, _LOCAL_RANK_VARS, 0),
            num_stages=num_stages,
            local_world_size=_first_int(env, _LOCAL_WORLD_VARS, 0),
        )

    def with_stages(self, num_stages: int) -> Topology:
        """The same process in a job split into ``num_stages`` pipeline stages."""
        return Topology(
            self.rank, self.world_size, self.local_rank, num_stages, self.local_world_size
        )

    @property
    def node_size(self) -> int:
        """The processes on one node (the launcher's LOCAL_WORLD_SIZE; all when not told)."""
        return self.local_world_size or self.world_size

    @property
    def is_main(self) -> bool:
        """Rank 0: logs, reports and writes shared files."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def stage(self) -> int:
        """Index of the pipeline stage this rank runs (0 without pipelining)."""
        return self.rank % self.num_stages

    @property
    def dp_size(self) -> int:
        """Number of data-parallel replicas (of the whole pipeline, when there is one)."""
        return self.world_size // self.num_stages

    @property
    def dp_rank(self) -> int:
        """Which replica this rank belongs to: selects its shard of the data."""
        return self.rank // self.num_stages

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.num_stages - 1

    def stage_ranks(self, stage: int | None = None) -> list[int]:
        """The ranks running ``stage`` (default: this rank's), one per replica."""
        stage = self.stage if stage is None else stage
        return [dp * self.num_stages + stage for dp in range(self.dp_size)]

    def replica_ranks(self, dp_rank: int | None = None) -> list[int]:
        """The ranks of one pipeline replica, stage 0 first."""
        dp_rank = self.dp_rank if dp_rank is None else dp_rank
        return [dp_rank * self.num_stages + s for s in range(self.num_stages)]

    def to_dict(self) -> dict[str, Any]:
        """What a checkpoint manifest records (the shape of the job, not this rank)."""
        return {
            "world_size": self.world_size,
            "num_stages": self.num_stages,
            "dp_size": self.dp_size,
        }
