"""The TF_CONFIG rule: where a replica of a multi-worker job sits, from what the Airflow side passes it.

1. ``TF_CONFIG`` in the environment (the Kubeflow training operator's TFJob sets it) is used as is.
2. Otherwise it is computed from three values the Airflow side writes into every replica:

   * ``KUBETRAIN_TF_REPLICAS``: the roles and their counts, a JSON object such as ``{"worker": 2}``
     (multi-worker mirrored) or ``{"chief": 1, "worker": 2, "ps": 1}`` (parameter servers);
   * ``KUBETRAIN_TF_HOSTS``: the host pattern of a replica, ``host:port`` with the fields ``{role}``,
     ``{index}`` (within its role) and ``{replica}`` (across all roles, in the order chief, worker,
     ps, evaluator);
   * the replica's own place: ``JOB_COMPLETION_INDEX`` (Kubernetes sets it in the pods of an Indexed
     Job, and JobSet, which TrainJob runs on) is its index across all roles, or, when
     ``KUBETRAIN_TF_ROLE`` names the role (one group of pods per role), its index within that role.

   The cluster is ``{role: [pattern.format(role=role, index=i, replica=offset + i) for i ...]}`` and
   the task ``{"type": role, "index": index}``.
3. Neither: a single process, no cluster.

The Airflow side (kubetrain.distributed.cluster) writes the values and logs the cluster each
backend forms; the pod side (trainer.common.cluster) reads them: both call these functions.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

ROLE_ORDER = ("chief", "worker", "ps", "evaluator")
# The roles that hold a place in the cluster spec; an evaluator runs beside it (as TensorFlow's).
CLUSTER_ROLES = ("chief", "worker", "ps")
TF_CONFIG = "TF_CONFIG"
REPLICAS_ENV = "KUBETRAIN_TF_REPLICAS"
HOSTS_ENV = "KUBETRAIN_TF_HOSTS"
ROLE_ENV = "KUBETRAIN_TF_ROLE"
INDEX_ENV = "JOB_COMPLETION_INDEX"


class ClusterError(ValueError):
    """The cluster description is inconsistent; the message names the variable and what was expected."""


def parse_replicas(text: str) -> dict[str, int]:
    """``{"worker": 2}`` -> ``{"worker": 2}``, checked: known roles, counts >= 1 (0 drops the role)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ClusterError(f'{REPLICAS_ENV}={text!r} is not JSON: expected e.g. {{"worker": 2}}') from exc
    if not isinstance(value, dict) or not value:
        raise ClusterError(
            f'{REPLICAS_ENV}={text!r} is not a JSON object of role counts, e.g. {{"worker": 2}}'
        )
    counts = {}
    for role, count in value.items():
        if role not in ROLE_ORDER:
            raise ClusterError(
                f"{REPLICAS_ENV}: unknown role {role!r}; expected some of {', '.join(ROLE_ORDER)}"
            )
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ClusterError(f"{REPLICAS_ENV}: {role} count {count!r} is not an integer >= 0")
        if count:
            counts[role] = count
    return {role: counts[role] for role in ROLE_ORDER if role in counts}


def replicas_json(replicas: Mapping[str, int]) -> str:
    """The ``KUBETRAIN_TF_REPLICAS`` value of ``replicas``: the roles with replicas, in the rule's order."""
    return json.dumps({role: int(replicas[role]) for role in ROLE_ORDER if replicas.get(role)})


def cluster_spec(replicas: Mapping[str, int], hosts: str) -> dict[str, list[str]]:
    """``{role: [host:port, ...]}`` of a job with ``replicas`` per role whose replicas are reached at ``hosts``."""
    spec: dict[str, list[str]] = {}
    offset = 0
    for role in ROLE_ORDER:
        count = int(replicas.get(role, 0))
        if role in CLUSTER_ROLES and count:
            try:
                spec[role] = [hosts.format(role=role, index=i, replica=offset + i) for i in range(count)]
            except (KeyError, IndexError, ValueError) as exc:
                raise ClusterError(
                    f"{HOSTS_ENV}={hosts!r} is not a host pattern: expected e.g. job-{{replica}}.job:2222 with the "
                    f"fields {{role}}, {{index}} and {{replica}} ({exc})"
                ) from None
        offset += count
    return spec


def task_of(replicas: Mapping[str, int], index: int, role: str | None = None) -> tuple[str, int]:
    """(role, index within the role) of the replica at ``index`` (within ``role`` when that is given)."""
    if role is not None:
        if role not in replicas:
            raise ClusterError(f"{ROLE_ENV}={role!r} is not one of the job's roles {', '.join(replicas)}")
        if not 0 <= index < replicas[role]:
            raise ClusterError(f"{INDEX_ENV}={index} is outside the {replicas[role]} {role} replica(s)")
        return role, index
    offset = 0
    for name in ROLE_ORDER:
        count = replicas.get(name, 0)
        if index < offset + count:
            return name, index - offset
        offset += count
    raise ClusterError(
        f"{INDEX_ENV}={index} is outside the job's {offset} replica(s) ({json.dumps(dict(replicas))})"
    )


def tf_config_of(
    replicas: Mapping[str, int], hosts: str, index: int, role: str | None = None
) -> dict[str, Any]:
    """The TF_CONFIG of the replica at ``index`` (within ``role`` when given)."""
    task_role, task_index = task_of(replicas, index, role)
    return {"cluster": cluster_spec(replicas, hosts), "task": {"type": task_role, "index": task_index}}


def tf_config(environ: Mapping[str, str]) -> dict[str, Any] | None:
    """This replica's TF_CONFIG as a dict: the engine's, else computed by the rule above; None when alone."""
    if environ.get(TF_CONFIG):
        try:
            config = json.loads(environ[TF_CONFIG])
        except json.JSONDecodeError as exc:
            raise ClusterError(f"TF_CONFIG is not JSON: {exc}") from None
        if not isinstance(config, dict) or not isinstance(config.get("cluster"), dict):
            raise ClusterError('TF_CONFIG has no cluster: expected {"cluster": {...}, "task": {...}}')
        return config
    if not environ.get(REPLICAS_ENV):
        return None
    replicas = parse_replicas(environ[REPLICAS_ENV])
    hosts = environ.get(HOSTS_ENV)
    if not hosts:
        raise ClusterError(
            f"{REPLICAS_ENV} is set but {HOSTS_ENV} is not: the replicas' addresses are unknown"
        )
    raw = environ.get(INDEX_ENV)
    try:
        index = int(raw) if raw is not None else None
    except ValueError:
        index = None
    if index is None or index < 0:
        raise ClusterError(
            f"{INDEX_ENV}={raw!r} is not a replica index: expected an integer >= 0 "
            "(Kubernetes sets it in the pods of an Indexed Job)"
        )
    return tf_config_of(replicas, hosts, index, environ.get(ROLE_ENV) or None)
