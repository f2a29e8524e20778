"""Where this process sits in a multi-worker TensorFlow job: TF_CONFIG, read or computed.

The rule is the contract's (kubetrain_contract.cluster), which the Airflow side follows too: the
engine's TF_CONFIG, else one computed from KUBETRAIN_TF_REPLICAS, KUBETRAIN_TF_HOSTS,
JOB_COMPLETION_INDEX and KUBETRAIN_TF_ROLE, else a single process. An inconsistent description
is a usage error (exit 2) naming the variable. This module does not import TensorFlow.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kubetrain_contract import cluster as rule
from kubetrain_contract.cluster import (
    CLUSTER_ROLES,
    HOSTS_ENV,
    INDEX_ENV,
    REPLICAS_ENV,
    ROLE_ENV,
    ROLE_ORDER,
    TF_CONFIG,
)
from trainer.common.contract import UsageError

__all__ = [
    "CLUSTER_ROLES",
    "HOSTS_ENV",
    "INDEX_ENV",
    "REPLICAS_ENV",
    "ROLE_ENV",
    "ROLE_ORDER",
    "TF_CONFIG",
    "ClusterConfigError",
    "ClusterInfo",
    "choose_mode",
    "placement",
    "serves_only",
    "tf_config",
]


class ClusterConfigError(UsageError):
    """The cluster description in the environment is inconsistent (the message names the variable; exit 2)."""


def tf_config(environ: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """TF_CONFIG of this replica as a dict: the engine's, else computed by the contract's rule; None alone."""
    try:
        return rule.tf_config(os.environ if environ is None else environ)
    except rule.ClusterError as exc:
        raise ClusterConfigError(str(exc)) from None


@dataclass(frozen=True)
class ClusterInfo:
    """This replica's place in the job.

    Attributes:
        config: TF_CONFIG (None: a single process).
        task_type: ``chief``, ``worker``, ``ps`` or ``evaluator`` (``worker`` alone).
        task_index: the index within the role.
    """

    config: dict[str, Any] | None
    task_type: str = "worker"
    task_index: int = 0

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> ClusterInfo:
        config = tf_config(environ)
        if config is None:
            return cls(None)
        task = config.get("task") or {}
        task_type, task_index = task.get("type", "worker"), task.get("index", 0)
        if task_type not in ROLE_ORDER or not isinstance(task_index, int) or task_index < 0:
            raise ClusterConfigError(
                f"TF_CONFIG task {task!r} is not valid: expected a type of "
                f"{', '.join(ROLE_ORDER)} and an index >= 0"
            )
        members = config["cluster"].get(task_type)
        if task_type in CLUSTER_ROLES and (not members or task_index >= len(members)):
            raise ClusterConfigError(
                f"TF_CONFIG task {task_type} {task_index} is not in its cluster {config['cluster']}"
            )
        return cls(config, task_type, task_index)

    @property
    def cluster(self) -> dict[str, list[str]]:
        return dict((self.config or {}).get("cluster") or {})

    @property
    def distributed(self) -> bool:
        """More than one process takes part in training."""
        cluster = self.cluster
        return sum(len(cluster.get(r, [])) for r in CLUSTER_ROLES) > 1

    @property
    def parameter_servers(self) -> int:
        return len(self.cluster.get("ps", []))

    @property
    def workers(self) -> int:
        """Processes that compute gradients: workers, plus the chief unless parameter servers coordinate."""
        cluster = self.cluster
        if not cluster:
            return 1
        chief = len(cluster.get("chief", [])) if not self.parameter_servers else 0
        return len(cluster.get("worker", [])) + chief

    @property
    def is_chief(self) -> bool:
        """The one replica that writes CHECKPOINT_DIR and OUTPUT_DIR: the chief, else worker 0."""
        if self.config is None:
            return True
        if "chief" in self.cluster:
            return self.task_type == "chief"
        return self.task_type == "worker" and self.task_index == 0

    def describe(self) -> str:
        if self.config is None:
            return "a single process"
        roles = ", ".join(f"{role} {len(hosts)}" for role, hosts in self.cluster.items())
        return (
            f"{self.task_type} {self.task_index}{' (chief)' if self.is_chief else ''} of a cluster of {roles}"
        )


MODES = ("mirrored", "multi_worker", "parameter_server")


def choose_mode(strategy: str, cluster: ClusterInfo) -> str:
    """The distribution mode for ``--strategy`` in ``cluster``.

    ``auto``: parameter_server when the cluster has parameter servers, multi_worker when it
    has several workers, else mirrored (MirroredStrategy over this pod's devices).

    Raises:
        ClusterConfigError: the strategy does not fit the cluster (the message says why).
    """
    if strategy == "auto":
        if cluster.parameter_servers:
            return "parameter_server"
        return "multi_worker" if cluster.distributed else "mirrored"
    if strategy == "parameter_server":
        if not cluster.parameter_servers or "chief" not in cluster.cluster:
            raise ClusterConfigError(
                "--strategy parameter_server needs a cluster with a chief (the coordinator) and ps replicas in "
                f"TF_CONFIG (or {REPLICAS_ENV}); this one is {cluster.cluster or 'empty'}"
            )
        return strategy
    if cluster.parameter_servers:
        raise ClusterConfigError(
            f"--strategy {strategy} cannot run in a cluster with parameter servers ({cluster.cluster}); "
            "use --strategy parameter_server or auto"
        )
    if strategy == "mirrored" and cluster.distributed:
        raise ClusterConfigError(
            f"--strategy mirrored trains on one pod's devices, but TF_CONFIG names several workers "
            f"({cluster.cluster}); use --strategy multi_worker or auto"
        )
    return strategy


def placement(strategy: str, environ: Mapping[str, str] | None = None) -> tuple[ClusterInfo, str]:
    """This process's place in the job and its distribution mode for ``--strategy``."""
    cluster = ClusterInfo.from_environ(environ)
    return cluster, choose_mode(strategy, cluster)


def serves_only(cluster: ClusterInfo, mode: str) -> bool:
    """A worker or ps replica in parameter-server mode: it serves the coordinator and trains nothing itself."""
    return mode == "parameter_server" and cluster.task_type in ("worker", "ps")
