"""The TF_CONFIG rule on the Airflow side, and the host names each engine gives the replicas.

The rule is the contract's (kubetrain_contract.cluster), which the pod side follows too: the Airflow
side writes ``KUBETRAIN_TF_REPLICAS``, ``KUBETRAIN_TF_HOSTS`` and, where an engine runs one group of
pods per role, ``KUBETRAIN_TF_ROLE`` into every replica's base container (:func:`replica_env`), and
the replica computes its TF_CONFIG from them.

A TFJob gets its TF_CONFIG from the Kubeflow training operator, whose host names are
``<job>-<role>-<index>.<namespace>.svc:<port>``; :func:`host_pattern` gives that pattern too, so the
operator can log and check the cluster each backend will form. tests/plugins/distributed and
tests/trainer/common check both sides against one table of cases.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kubetrain_contract.cluster import (
    CLUSTER_ROLES,
    HOSTS_ENV,
    REPLICAS_ENV,
    ROLE_ENV,
    ROLE_ORDER,
    cluster_spec,
    replicas_json,
    task_of,
    tf_config_of,
)

__all__ = [
    "BACKENDS",
    "CLUSTER_ROLES",
    "DEFAULT_PORT",
    "HOSTS_ENV",
    "REPLICAS_ENV",
    "ROLE_ENV",
    "ROLE_ORDER",
    "cluster_spec",
    "host_pattern",
    "replica_env",
    "task_of",
    "tf_config",
]

DEFAULT_PORT = 2222
BACKENDS = ("tfjob", "trainjob", "indexed_job")


def tf_config(replicas: Mapping[str, int], hosts: str, index: int, role: str | None = None) -> dict[str, Any]:
    """The TF_CONFIG of one replica, as the pod side computes it."""
    return tf_config_of(replicas, hosts, index, role)


def host_pattern(backend: str, *, job: str, namespace: str, port: int = DEFAULT_PORT) -> str:
    """How the replicas of a job named ``job`` are reached under ``backend``.

    * ``indexed_job``: one Indexed Job ``<job>-<role>`` per role, the headless Service ``<job>`` as
      their subdomain: pods are ``<job>-<role>-<index>.<job>``;
    * ``tfjob``: the training operator's Service per replica, ``<job>-<role>-<index>.<namespace>.svc``;
    * ``trainjob``: JobSet's pods ``<jobset>-<replicatedJob>-<job index>-<pod index>`` under the
      JobSet's headless Service (the JobSet is named like the TrainJob), one replicated job per role.
    """
    if backend == "indexed_job":
        return f"{job}-{{role}}-{{index}}.{job}:{port}"
    if backend == "tfjob":
        return f"{job}-{{role}}-{{index}}.{namespace}.svc:{port}"
    if backend == "trainjob":
        return f"{job}-{{role}}-0-{{index}}.{job}:{port}"
    raise ValueError(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")


def replica_env(replicas: Mapping[str, int], hosts: str, role: str | None) -> dict[str, str]:
    """The variables from which a replica computes its TF_CONFIG (no TF_CONFIG itself)."""
    env = {REPLICAS_ENV: replicas_json(replicas), HOSTS_ENV: hosts}
    if role is not None:
        env[ROLE_ENV] = role
    return env
