"""Pods that compete with training runs for the dev stack's Kueue quota (tests and benches).

One definition of the workload that holds or takes a LocalQueue's quota, so that what the tests and
the kill soak run against the Kueue stand-in is the same pod: restricted Pod Security, a busybox
container that sleeps until it is deleted, and requests equal to its limits.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"


def queued_pod(
    name: str, resources: Mapping[str, str], *, queue: str = "training", priority: str | None = None
) -> dict[str, Any]:
    """A pod in LocalQueue ``queue`` that takes ``resources`` of its quota until it is deleted.

    :param name: the pod's name.
    :param resources: what it requests (and is limited to), e.g. ``{"nvidia.com/gpu": "1"}``.
    :param queue: the LocalQueue.
    :param priority: a WorkloadPriorityClass name (``high`` preempts the stack's ``low`` runs).
    """
    labels = {QUEUE_LABEL: queue, **({PRIORITY_LABEL: priority} if priority else {})}
    return {
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": 10001,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": [
                {
                    "name": "hold",
                    "image": "busybox:1.36",
                    "command": ["sh", "-c", "sleep 600"],
                    "resources": {"requests": dict(resources), "limits": dict(resources)},
                    "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
                }
            ],
        },
    }
