"""Whether this pod's checkpoint-sync sidecar syncs: only the chief's does.

In a multi-worker run whose replicas share one pod template (a queued run's one Indexed Job, which
Kueue admits all or nothing), every replica's pod has the sidecar; the chief alone writes
CHECKPOINT_DIR and OUTPUT_DIR, so the others' sidecars must not write pass manifests (readers
trust the newest one). The sidecar tells which it is from the same values the trainer computes its
TF_CONFIG from: ``KUBETRAIN_TF_REPLICAS`` and ``JOB_COMPLETION_INDEX`` (Kubernetes sets it in every
container of an Indexed Job's pod). Without ``KUBETRAIN_TF_REPLICAS`` the pod is a single-pod run or
the chief of a job with one template per role: it syncs.
"""

from __future__ import annotations

from collections.abc import Mapping

from kubetrain_contract.cluster import (
    INDEX_ENV,
    REPLICAS_ENV,
    ROLE_ENV,
    ClusterError,
    parse_replicas,
    task_of,
)


def idle_reason(environ: Mapping[str, str]) -> str | None:
    """Why this replica's sidecar must not sync (it is not the chief), or None when it syncs.

    :raises ClusterError: the replica values are malformed (named with what was expected).
    """
    text = environ.get(REPLICAS_ENV)
    if not text:
        return None
    replicas = parse_replicas(text)
    raw = environ.get(INDEX_ENV, "")
    try:
        index = int(raw)
    except ValueError:
        raise ClusterError(f"{INDEX_ENV}={raw!r} is not an integer: expected this replica's index") from None
    role, position = task_of(replicas, index, environ.get(ROLE_ENV) or None)
    chief = ("chief", 0) if "chief" in replicas else ("worker", 0)
    if (role, position) == chief:
        return None
    return f"replica {role} {position} is not the chief: only the chief writes checkpoints and outputs"
