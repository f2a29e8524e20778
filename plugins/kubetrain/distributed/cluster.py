"""The TF_CONFIG rule on the Airflow side, and the host names each engine gives the replicas.

The pod side computes each replica's TF_CONFIG (``trainer/common/cluster.py``) from three
values that the Airflow side writes into every replica's base container:

* ``KUBETRAIN_TF_REPLICAS``: the roles and counts, e.g. ``{"chief": 1, "worker": 1}``;
* ``KUBETRAIN_TF_HOSTS``: the host pattern, with ``{role}``, ``{index}`` (within the role) and
  ``{replica}`` (across roles, in the order chief, worker, ps, evaluator);
* ``KUBETRAIN_TF_ROLE``: the replica's role, when its engine runs one group of pods per role; its
  index is then ``JOB_COMPLETION_INDEX`` within that role (else across all roles).

A TFJob gets its TF_CONFIG from the Kubeflow training operator, whose host names are
``<job>-<role>-<index>.<namespace>.svc:<port>``; :func:`host_pattern` gives that pattern too, so the
operator can log and check the cluster each backend will form. tests/plugins/distributed and
tests/trainer/common check both sides against one table of cases.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

ROLE_ORDER = ("chief", "worker", "ps", "evaluator")
CLUSTER_ROLES = ("chief", "worker", "ps")
REPLICAS_ENV = "KUBETRAIN_TF_REPLICAS"
HOSTS_ENV = "KUBETRAIN_TF_HOSTS"
ROLE_ENV = "KUBETRAIN_TF_ROLE"
DEFAULT_PORT = 2222
BACKENDS = ("tfjob", "trainjob", "indexed_job")


def cluster_spec(replicas: Mapping[str, int], hosts: str) -> dict[str, list[str]]:
    """``{role: [host:port, ...]}`` of a job with ``replicas`` per role reached at ``hosts``."""
    spec: dict[str, list[str]] = {}
    offset = 0
    for role in ROLE_ORDER:
        count = int(replicas.get(role, 0))
        if role in CLUSTER_ROLES and count:
            spec[role] = [hosts.format(role=role, index=i, replica=offset + i) for i in range(count)]
        offset += count
    return spec


def task_of(replicas: Mapping[str, int], index: int, role: str | None = None) -> tuple[str, int]:
    """(role, index within the role) of the replica at ``index`` (within ``role`` when given)."""
    if role is not None:
        if not 0 <= index < replicas.get(role, 0):
            raise ValueError(f"index {index} is outside the {replicas.get(role, 0)} {role} replica(s)")
        return role, index
    offset = 0
    for name in ROLE_ORDER:
        count = replicas.get(name, 0)
        if index < offset + count:
            return name, index - offset
        offset += count
    raise ValueError(f"index {index} is outside the job's {offset} replica(s)")


def tf_config(replicas: Mapping[str, int], hosts: str, index: int, role: str | None = None) -> dict[str, Any]:
    """The TF_CONFIG of one replica, as the pod side computes it."""
    task_role, task_index = task_of(replicas, index, role)
    return {"cluster": cluster_spec(replicas, hosts), "task": {"type": task_role, "index": task_index}}


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
    env = {REPLICAS_ENV: json.dumps({r: replicas[r] for r in ROLE_ORDER if replicas.get(r)}), HOSTS_ENV: hosts}
    if role is not None:
        env[ROLE_ENV] = role
    return env
