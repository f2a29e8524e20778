"""Creating a run's objects in order when a webhook has not seen the one created just before.

Kubeflow Trainer's TrainJob webhook looks the TrainJob's runtime up in its controller's cache, which
follows the API server a moment behind: a TrainJob created right after its TrainingRuntime can be refused
with ``spec.runtimeRef: Invalid value: ...: trainingruntimes.trainer.kubeflow.org "<name>" not found:
specified trainingRuntime must be created before the TrainJob is created``
(pkg/runtime/core/trainingruntime.go, ValidateObjects). That refusal alone is retried, with a bounded
backoff; any other refusal fails as before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

from kubetrain.distributed.builders import Resource

T = TypeVar("T")
# the end of the Trainer's refusal (a TrainingRuntime's and a ClusterTrainingRuntime's)
RUNTIME_NOT_SEEN = "must be created before the TrainJob is created"
ATTEMPTS = 8  # about 25 s of backoff in all: the cache lags by a second or two
log = logging.getLogger(__name__)


def runtime_not_seen(exc: BaseException) -> bool:
    """Whether ``exc`` is the API's refusal of a TrainJob whose runtime the webhook has not seen yet."""
    from kubernetes.client.exceptions import ApiException

    if not isinstance(exc, ApiException):
        return False
    return RUNTIME_NOT_SEEN in f"{exc.body or ''} {exc.reason or ''}"


def create_retrying(
    create: Callable[..., T],
    namespace: str,
    resource: Resource,
    *,
    logger: logging.Logger | Any = log,
    attempts: int = ATTEMPTS,
    wait_s: float = 0.5,
    max_wait_s: float = 5.0,
) -> T:
    """``create(namespace, resource)``, again after a growing pause while the API refuses a TrainJob whose
    runtime its webhook has not seen yet (at most ``attempts`` times); every other error at once.

    :param create: what creates one object (the operator's ``_create``).
    :param wait_s: the first pause; each next one doubles, up to ``max_wait_s``.
    """
    import tenacity

    def note(state: tenacity.RetryCallState) -> None:
        logger.warning(
            "The API refused %s %s/%s: the Trainer has not seen its runtime yet (%s); trying again in %.1f s "
            "(attempt %d of %d)",
            resource.kind,
            namespace,
            resource.name,
            RUNTIME_NOT_SEEN,
            state.next_action.sleep if state.next_action else 0.0,
            state.attempt_number,
            attempts,
        )

    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception(runtime_not_seen),
        wait=tenacity.wait_exponential(multiplier=wait_s, max=max_wait_s),
        stop=tenacity.stop_after_attempt(attempts),
        before_sleep=note,
        reraise=True,
    )
    return retrying(create, namespace, resource)
