"""The replicas of a multi-worker job: roles, counts and each role's resources, checked on creation.

Roles, as TensorFlow names them:

* multi-worker mirrored (``ps_replicas == 0``): ``workers`` processes train in lock step; the first
  one is the ``chief`` (it also trains, and alone writes checkpoints and outputs), the others are
  ``worker`` 0 .. workers-2;
* parameter servers (``ps_replicas > 0``): the ``chief`` coordinates (it runs the training loop and
  writes checkpoints, without a GPU), ``workers`` replicas of role ``worker`` compute the steps, and
  ``ps_replicas`` replicas of role ``ps`` hold the variables.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

MAX_WORKERS = 64
MAX_PS = 16


def _int(name: str, value: object, low: int, high: int) -> int:
    try:
        number = int(value) if isinstance(value, int | str) and not isinstance(value, bool) else None
    except ValueError:
        number = None
    if number is None or not low <= number <= high:
        raise ValueError(f"{name}={value!r} is not valid: expected an integer from {low} to {high}")
    return number


@dataclass(frozen=True)
class RoleResources:
    """Requests (== limits) of one role's base container."""

    cpu: str
    memory: str
    gpus: int = 0


@dataclass(frozen=True)
class DistributedSpec:
    """How many replicas of which role, and what each role gets.

    :param workers: training processes, 1-64 (the chief included in multi-worker mirrored mode).
    :param ps_replicas: parameter servers, 0-16; more than 0 means parameter-server mode.
    :param gpus_per_worker: GPUs of each training replica (the chief too in multi-worker mode).
    :param gpus_per_ps: GPUs of each parameter server (default 0: they move variables).
    :param worker_cpu: CPU of each training replica.
    :param worker_memory: memory of each training replica.
    :param ps_cpu: CPU of each parameter server.
    :param ps_memory: memory of each parameter server.
    :param chief_cpu: CPU of the coordinator in parameter-server mode (default: the workers').
    :param chief_memory: memory of the coordinator in parameter-server mode (default: the workers').
    :param port: the TensorFlow server's port in every replica.
    :param max_restarts: replacements a role's pods may get before the job fails.
    """

    workers: int = 2
    ps_replicas: int = 0
    gpus_per_worker: int = 0
    gpus_per_ps: int = 0
    worker_cpu: str = "1"
    worker_memory: str = "2Gi"
    ps_cpu: str = "1"
    ps_memory: str = "2Gi"
    chief_cpu: str | None = None
    chief_memory: str | None = None
    port: int = 2222
    max_restarts: int = 3

    def __post_init__(self) -> None:
        object.__setattr__(self, "workers", _int("workers", self.workers, 1, MAX_WORKERS))
        object.__setattr__(self, "ps_replicas", _int("ps_replicas", self.ps_replicas, 0, MAX_PS))
        object.__setattr__(self, "gpus_per_worker", _int("gpus_per_worker", self.gpus_per_worker, 0, 16))
        object.__setattr__(self, "gpus_per_ps", _int("gpus_per_ps", self.gpus_per_ps, 0, 16))
        object.__setattr__(self, "port", _int("port", self.port, 1, 65535))
        object.__setattr__(self, "max_restarts", _int("max_restarts", self.max_restarts, 0, 100))

    @property
    def parameter_server(self) -> bool:
        return self.ps_replicas > 0

    def replicas(self) -> dict[str, int]:
        """Replicas per role, in the order chief, worker, ps (roles without replicas left out)."""
        if self.parameter_server:
            counts = {"chief": 1, "worker": self.workers, "ps": self.ps_replicas}
        else:
            counts = {"chief": 1, "worker": self.workers - 1}
        return {role: n for role, n in counts.items() if n}

    @property
    def total(self) -> int:
        return sum(self.replicas().values())

    def resources(self, role: str) -> RoleResources:
        """The base container's resources of ``role``."""
        if role == "ps":
            return RoleResources(self.ps_cpu, self.ps_memory, self.gpus_per_ps)
        if role == "chief" and self.parameter_server:
            return RoleResources(
                self.chief_cpu or self.worker_cpu, self.chief_memory or self.worker_memory, 0
            )
        return RoleResources(self.worker_cpu, self.worker_memory, self.gpus_per_worker)

    def describe(self) -> str:
        if self.parameter_server:
            return (
                f"parameter servers: chief (coordinator) + {self.workers} worker(s) + {self.ps_replicas} ps, "
                f"{self.gpus_per_worker} GPU(s) per worker"
            )
        return f"multi-worker mirrored: {self.workers} worker(s) (the chief first), {self.gpus_per_worker} GPU(s) each"

    def replace(self, **changes: Any) -> DistributedSpec:
        """A copy with ``changes`` (fields by name), checked as a new spec is."""
        return dataclasses.replace(self, **changes)
