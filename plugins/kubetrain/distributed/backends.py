"""Which multi-worker backends a cluster serves, from API discovery, and the choice among them."""

from __future__ import annotations

from typing import Any

from airflow.sdk.exceptions import AirflowFailException

from kubetrain.distributed.cluster import BACKENDS

# backend -> (group, version, plural) of the API it creates; indexed_job needs only batch/v1.
APIS = {
    "tfjob": ("kubeflow.org", "v1", "tfjobs"),
    "trainjob": ("trainer.kubeflow.org", "v1alpha1", "trainjobs"),
    "indexed_job": ("batch", "v1", "jobs"),
}
INSTALL = {
    "tfjob": "the Kubeflow training operator v1 (TFJob CRD)",
    "trainjob": "Kubeflow Trainer v2 with JobSet (TrainJob and TrainingRuntime CRDs)",
    "indexed_job": "nothing: batch/v1 Jobs are built in",
}
AUTO_ORDER = ("tfjob", "trainjob", "indexed_job")


class BackendUnavailableError(AirflowFailException):
    """The requested backend's API is not served by the cluster; not retried."""


def serves(api_client: Any, backend: str) -> bool:
    """Whether the cluster's discovery lists the resource ``backend`` creates."""
    from kubernetes.client import CustomObjectsApi
    from kubernetes.client.rest import ApiException

    group, version, plural = APIS[backend]
    if backend == "indexed_job":
        return True
    try:
        listing = CustomObjectsApi(api_client).get_api_resources(group, version)
    except ApiException as exc:
        if exc.status in (404, 503):
            return False
        raise
    return any(r.name == plural for r in listing.resources or [])


def served_backends(api_client: Any) -> list[str]:
    """The backends the cluster serves, in the order ``auto`` tries them."""
    return [b for b in AUTO_ORDER if serves(api_client, b)]


def choose_backend(requested: str, served: list[str]) -> str:
    """``requested`` if the cluster serves it; for ``auto`` the first served of tfjob, trainjob, indexed_job.

    Raises:
        ValueError: ``requested`` is not a backend name.
        BackendUnavailableError: the cluster does not serve ``requested``'s API (the message names it and
            the backends it does serve).
    """
    if requested == "auto":
        return next(b for b in AUTO_ORDER if b in served)
    if requested not in BACKENDS:
        raise ValueError(f"backend={requested!r} is not valid: expected auto or one of {', '.join(BACKENDS)}")
    if requested not in served:
        group, version, plural = APIS[requested]
        raise BackendUnavailableError(
            f"backend {requested!r} needs the API {group}/{version} ({plural}), which this cluster does not serve "
            f"(install {INSTALL[requested]}); it serves: {', '.join(served)}"
        )
    return requested
