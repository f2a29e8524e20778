"""The preflight's pods: short-lived pods placed and secured as training pods are, watched until they ran or
cannot pull, their log read, and deleted (never left behind)."""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kubetrain.preflight.check import api_message, short_error
from kubetrain.preflight.cluster import Cluster

log = logging.getLogger(__name__)

PULL_FAILURES = (
    "ErrImagePull",
    "ImagePullBackOff",
    "InvalidImageName",
    "ErrImageNeverPull",
    "RegistryUnavailable",
)
CONFIG_FAILURES = ("CreateContainerConfigError", "CreateContainerError", "RunContainerError")
LABELS = {"app.kubernetes.io/name": "kubetrain", "app.kubernetes.io/component": "preflight"}


@dataclass(frozen=True)
class PodOutcome:
    """How a preflight pod ended: pulled or not, exit code, its log, and what stopped it."""

    pulled: bool
    exit_code: int | None = None
    reason: str = ""
    message: str = ""
    logs: str = ""


@dataclass
class PodRunner:
    """Starts preflight pods and tells how each ended (:class:`PodOutcome`); calls may run in parallel threads.

    :param cluster: the namespace and the clients.
    :param pod_timeout: seconds a preflight pod may take to pull and run.
    """

    cluster: Cluster
    pod_timeout: float = 45.0

    def pod(self, purpose: str, image: str, command: Sequence[str], *, with_s3: bool):
        """A short-lived pod like a training pod's: same namespace, account, pull Secrets and placement (the GPU
        vendor's taint tolerated, as GPU training pods tolerate it), and Pod Security level restricted."""
        from kubernetes.client import models as k8s

        from kubetrain.pod_spec import gpu_tolerations

        d = self.cluster.deployment
        tolerations = [
            *gpu_tolerations(1, d.gpu_resource),
            *(k8s.V1Toleration(**_snake(t)) for t in d.tolerations),
        ]
        env_from = (
            [k8s.V1EnvFromSource(secret_ref=k8s.V1SecretEnvSource(name=d.s3_secret))]
            if with_s3 and d.s3_secret
            else None
        )
        return k8s.V1Pod(
            metadata=k8s.V1ObjectMeta(
                name=f"kubetrain-preflight-{purpose}-{secrets.token_hex(3)}",
                namespace=self.cluster.namespace,
                labels={**LABELS, "kubetrain.io/preflight": purpose},
            ),
            spec=k8s.V1PodSpec(
                restart_policy="Never",
                active_deadline_seconds=max(int(self.pod_timeout) * 2, 60),
                termination_grace_period_seconds=1,
                service_account_name=d.service_account,
                image_pull_secrets=[k8s.V1LocalObjectReference(name=n) for n in d.image_pull_secrets] or None,
                node_selector=d.node_selector or None,
                tolerations=tolerations or None,
                security_context=k8s.V1PodSecurityContext(
                    run_as_non_root=True, seccomp_profile=k8s.V1SeccompProfile(type="RuntimeDefault")
                ),
                containers=[
                    k8s.V1Container(
                        name="check",
                        image=image,
                        command=list(command),
                        env_from=env_from,
                        resources=k8s.V1ResourceRequirements(
                            requests={"cpu": "50m", "memory": "64Mi"}, limits={"memory": "256Mi"}
                        ),
                        security_context=k8s.V1SecurityContext(
                            run_as_non_root=True,
                            allow_privilege_escalation=False,
                            privileged=False,
                            capabilities=k8s.V1Capabilities(drop=["ALL"]),
                            seccomp_profile=k8s.V1SeccompProfile(type="RuntimeDefault"),
                        ),
                    )
                ],
            ),
        )

    def run_pod(self, purpose: str, image: str, command: Sequence[str], *, with_s3: bool) -> PodOutcome:
        """Create the pod, watch it until it ran or cannot pull, read its log, delete it."""
        from kubernetes.client.exceptions import ApiException

        body = self.pod(purpose, image, command, with_s3=with_s3)
        name = body.metadata.name
        try:
            self.cluster.core.create_namespaced_pod(self.cluster.namespace, body)
        except ApiException as exc:
            if exc.status == 403:
                return PodOutcome(False, reason="Forbidden", message=api_message(exc))
            raise
        try:
            return self._watch(name)
        finally:
            self._delete(name)

    def _watch(self, name: str) -> PodOutcome:
        from kubernetes import watch

        deadline = time.monotonic() + self.pod_timeout
        pod = None
        started = False
        while time.monotonic() < deadline:
            w = watch.Watch()
            for event in w.stream(
                self.cluster.core.list_namespaced_pod,
                self.cluster.namespace,
                field_selector=f"metadata.name={name}",
                timeout_seconds=max(1, int(deadline - time.monotonic())),
            ):
                pod = event["object"]
                outcome = self._decide(pod)
                if outcome is not None:
                    w.stop()
                    if outcome.pulled:
                        started = True
                        if outcome.exit_code is None:
                            continue  # running: wait for it to end
                    return self._with_logs(name, outcome)
        return PodOutcome(
            started,
            reason="Timeout",
            message=f"the pod did not finish within {self.pod_timeout:.0f} s"
            + (f" (phase {pod.status.phase})" if pod is not None and pod.status else ""),
        )

    @staticmethod
    def _decide(pod) -> PodOutcome | None:
        status = pod.status
        if status is None:
            return None
        for cond in status.conditions or []:
            if cond.type == "PodScheduled" and cond.status == "False" and cond.reason == "Unschedulable":
                return PodOutcome(False, reason="Unschedulable", message=cond.message or "")
        for cs in status.container_statuses or []:
            state = cs.state
            if state is None:
                continue
            if state.waiting and state.waiting.reason in (*PULL_FAILURES, *CONFIG_FAILURES):
                return PodOutcome(False, reason=state.waiting.reason, message=state.waiting.message or "")
            if state.terminated:
                return PodOutcome(
                    True,
                    exit_code=state.terminated.exit_code,
                    reason=state.terminated.reason or "",
                    message=state.terminated.message or "",
                )
            if state.running:
                return PodOutcome(True)
        if status.phase == "Failed":
            return PodOutcome(False, reason=status.reason or "Failed", message=status.message or "")
        return None

    def _with_logs(self, name: str, outcome: PodOutcome) -> PodOutcome:
        if not outcome.pulled:
            return outcome
        try:
            response = self.cluster.core.read_namespaced_pod_log(
                name,
                self.cluster.namespace,
                container="check",
                tail_lines=50,
                _request_timeout=15,
                _preload_content=False,
            )
            logs = response.data.decode("utf-8", "replace")
        except Exception as exc:  # noqa: BLE001 - the outcome stands without its log
            logs = f"(log unavailable: {short_error(exc)})"
        return PodOutcome(outcome.pulled, outcome.exit_code, outcome.reason, outcome.message, logs or "")

    def _delete(self, name: str) -> None:
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        try:
            self.cluster.core.delete_namespaced_pod(name, self.cluster.namespace, grace_period_seconds=0)
        except ApiException as exc:
            if exc.status == 404:
                return
            raise
        try:
            pod = self.cluster.core.read_namespaced_pod(name, self.cluster.namespace)
        except ApiException as exc:
            if exc.status == 404:
                return
            raise
        # from the version just read, so that a deletion between the read and the watch is replayed
        w = watch.Watch()
        for event in w.stream(
            self.cluster.core.list_namespaced_pod,
            self.cluster.namespace,
            field_selector=f"metadata.name={name}",
            resource_version=pod.metadata.resource_version,
            timeout_seconds=30,
        ):
            if event["type"] == "DELETED":
                w.stop()
                return
        log.warning("preflight pod %s was not gone within 30 s", name)


def _snake(toleration: dict[str, Any]) -> dict[str, Any]:
    names = {"tolerationSeconds": "toleration_seconds"}
    return {names.get(k, k): v for k, v in toleration.items()}
