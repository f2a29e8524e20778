"""Where this process sits in a multi-worker TensorFlow job: TF_CONFIG, read or computed.

One rule for every engine, so that one image runs under each of them:

1. ``TF_CONFIG`` in the environment (the Kubeflow training operator's TFJob sets it) is used as is.
2. Otherwise it is computed from what the Airflow side passes to every replica:

   * ``KUBETRAIN_TF_REPLICAS``: the roles and their counts, a JSON object such as
     ``{"worker": 2}`` (multi-worker mirrored) or ``{"chief": 1, "worker": 2, "ps": 1}``
     (parameter servers);
   * ``KUBETRAIN_TF_HOSTS``: the host pattern of a replica, ``host:port`` with the fields
     ``{role}``, ``{index}`` (the replica's index within its role) and ``{replica}`` (its
     index across all roles, counted in the order chief, worker, ps, evaluator);
   * the replica's own place: ``JOB_COMPLETION_INDEX`` (set by Kubernetes in every pod of an
     Indexed Job, and by JobSet, which TrainJob runs on) is its index across all roles, or,
     when ``KUBETRAIN_TF_ROLE`` names the role (one group of pods per role, as a JobSet's
     replicated jobs are), its index within that role.

   The cluster is ``{role: [pattern.format(role=role, index=i, replica=offset + i) for i ...]}``
   and the task ``{"type": role, "index": index}``.
3. Neither: a single process, no cluster.

The Airflow side (plugins/kubetrain/distributed/cluster.py) implements the same rule for the
addresses it logs and the Services it creates; both are tested against one table of cases.
This module does not import TensorFlow.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from trainer.common.contract import UsageError

ROLE_ORDER = ("chief", "worker", "ps", "evaluator")
# The roles that hold a place in the cluster spec; an evaluator runs beside it (as TensorFlow's).
CLUSTER_ROLES = ("chief", "worker", "ps")
TF_CONFIG = "TF_CONFIG"
REPLICAS_ENV = "KUBETRAIN_TF_REPLICAS"
HOSTS_ENV = "KUBETRAIN_TF_HOSTS"
ROLE_ENV = "KUBETRAIN_TF_ROLE"
INDEX_ENV = "JOB_COMPLETION_INDEX"


class ClusterConfigError(UsageError):
    """The cluster description in the environment is inconsistent (the message names the variable; exit 2)."""


def parse_replicas(text: str) -> dict[str, int]:
    """``{"worker": 2}`` -> ``{"worker": 2}``, checked: known roles, counts >= 1 (0 drops the role)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ClusterConfigError(f"{REPLICAS_ENV}={text!r} is not JSON: expected e.g. {{\"worker\": 2}}") from exc
    if not isinstance(value, dict) or not value:
        raise ClusterConfigError(f"{REPLICAS_ENV}={text!r} is not a JSON object of role counts, e.g. {{\"worker\": 2}}")
    counts = {}
    for role, count in value.items():
        if role not in ROLE_ORDER:
            raise ClusterConfigError(f"{REPLICAS_ENV}: unknown role {role!r}; expected some of {', '.join(ROLE_ORDER)}")
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ClusterConfigError(f"{REPLICAS_ENV}: {role} count {count!r} is not an integer >= 0")
        if count:
            counts[role] = count
    return {role: counts[role] for role in ROLE_ORDER if role in counts}


def cluster_spec(replicas: Mapping[str, int], hosts: str) -> dict[str, list[str]]:
    """The cluster of a job with ``replicas`` per role whose replicas are reached at ``hosts``."""
    spec: dict[str, list[str]] = {}
    offset = 0
    for role in ROLE_ORDER:
        count = replicas.get(role, 0)
        if role in CLUSTER_ROLES and count:
            try:
                spec[role] = [hosts.format(role=role, index=i, replica=offset + i) for i in range(count)]
            except (KeyError, IndexError, ValueError) as exc:
                raise ClusterConfigError(
                    f"{HOSTS_ENV}={hosts!r} is not a host pattern: expected e.g. job-{{replica}}.job:2222 with the "
                    f"fields {{role}}, {{index}} and {{replica}} ({exc})"
                ) from None
        offset += count
    return spec


def task_of(replicas: Mapping[str, int], index: int, role: str | None = None) -> tuple[str, int]:
    """The (role, index within the role) of the replica at ``index``.

    Args:
        replicas: the roles and counts.
        index: the replica's index across all roles, or within ``role`` when that is given.
        role: the replica's role, when its engine runs a group of pods per role.
    """
    if role is not None:
        if role not in replicas:
            raise ClusterConfigError(f"{ROLE_ENV}={role!r} is not one of the job's roles {', '.join(replicas)}")
        if not 0 <= index < replicas[role]:
            raise ClusterConfigError(f"{INDEX_ENV}={index} is outside the {replicas[role]} {role} replica(s)")
        return role, index
    offset = 0
    for name in ROLE_ORDER:
        count = replicas.get(name, 0)
        if index < offset + count:
            return name, index - offset
        offset += count
    raise ClusterConfigError(f"{INDEX_ENV}={index} is outside the job's {offset} replica(s) ({json.dumps(dict(replicas))})")


def tf_config(environ: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """TF_CONFIG of this replica as a dict: the engine's, else computed by the rule above; None alone."""
    env = os.environ if environ is None else environ
    if env.get(TF_CONFIG):
        try:
            config = json.loads(env[TF_CONFIG])
        except json.JSONDecodeError as exc:
            raise ClusterConfigError(f"TF_CONFIG is not JSON: {exc}") from None
        if not isinstance(config, dict) or not isinstance(config.get("cluster"), dict):
            raise ClusterConfigError("TF_CONFIG has no cluster: expected {\"cluster\": {...}, \"task\": {...}}")
        return config
    if not env.get(REPLICAS_ENV):
        return None
    replicas = parse_replicas(env[REPLICAS_ENV])
    hosts = env.get(HOSTS_ENV)
    if not hosts:
        raise ClusterConfigError(f"{REPLICAS_ENV} is set but {HOSTS_ENV} is not: the replicas' addresses are unknown")
    raw = env.get(INDEX_ENV)
    try:
        index = int(raw) if raw is not None else None
    except ValueError:
        index = None
    if index is None or index < 0:
        raise ClusterConfigError(f"{INDEX_ENV}={raw!r} is not a replica index: expected an integer >= 0 "
                                 "(Kubernetes sets it in the pods of an Indexed Job)")
    role, role_index = task_of(replicas, index, env.get(ROLE_ENV) or None)
    return {"cluster": cluster_spec(replicas, hosts), "task": {"type": role, "index": role_index}}


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
            raise ClusterConfigError(f"TF_CONFIG task {task!r} is not valid: expected a type of "
                                     f"{', '.join(ROLE_ORDER)} and an index >= 0")
        members = config["cluster"].get(task_type)
        if task_type in CLUSTER_ROLES and (not members or task_index >= len(members)):
            raise ClusterConfigError(f"TF_CONFIG task {task_type} {task_index} is not in its cluster {config['cluster']}")
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
        return f"{self.task_type} {self.task_index}{' (chief)' if self.is_chief else ''} of a cluster of {roles}"


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
