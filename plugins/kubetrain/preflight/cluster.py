"""The cluster's lines: ``api``, ``access``, ``gpu-nodes``, ``training-apis`` and ``queue``.

The access lists say what each of Airflow's identities does in the training namespace; deploy/rbac.yaml
grants exactly these (tests/deploy/test_rbac.py). The ``access`` line reviews the workers' account from the
worker; :class:`kubetrain.triggers.access.AccessReviewTrigger` reviews the triggerer's from the triggerer, and
:func:`triggerer_check` gives its line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from kubetrain.preflight.check import Check, short_error
from kubetrain.settings import Deployment

MINIMUM_VERSION = (1, 29)
# What each of Airflow's identities does in the training namespace: (verb, group, resource[/subresource], name).
# deploy/rbac.yaml grants exactly these (tests/deploy/test_rbac.py); the access check reviews them.
WORKER_ACCESS: tuple[tuple[str, str, str, str], ...] = (
    *((verb, "", "pods", "") for verb in ("create", "get", "list", "watch", "patch", "delete")),
    ("get", "", "pods/log", ""),
    *((verb, "", "events", "") for verb in ("get", "list", "watch")),
    ("get", "", "secrets", "<s3_secret>"),
    ("get", "", "serviceaccounts", ""),
    *((verb, "", "services", "") for verb in ("create", "get", "list", "watch", "delete")),
    *((verb, "batch", "jobs", "") for verb in ("create", "get", "list", "watch", "patch", "delete")),
    ("get", "batch", "jobs/status", ""),
    *((verb, "kubeflow.org", "tfjobs", "") for verb in ("create", "get", "list", "watch", "patch", "delete")),
    *(
        (verb, "trainer.kubeflow.org", "trainjobs", "")
        for verb in ("create", "get", "list", "watch", "patch", "delete")
    ),
    *(
        (verb, "trainer.kubeflow.org", "trainingruntimes", "")
        for verb in ("create", "get", "list", "watch", "delete")
    ),
    ("create", "", "pods/exec", ""),
    ("get", "", "pods/exec", ""),
    *(
        (verb, "kueue.x-k8s.io", resource, "")
        for verb in ("get", "list")
        for resource in ("workloads", "localqueues")
    ),
)
TRIGGERER_ACCESS: tuple[tuple[str, str, str, str], ...] = (
    *((verb, "", "pods", "") for verb in ("get", "list", "watch", "delete")),
    ("get", "", "pods/log", ""),
    *((verb, "", "events", "") for verb in ("get", "list", "watch")),
    ("delete", "", "services", ""),
    *((verb, "batch", "jobs", "") for verb in ("get", "list", "watch", "delete")),
    ("get", "batch", "jobs/status", ""),
    *((verb, "kubeflow.org", "tfjobs", "") for verb in ("get", "watch", "delete")),
    *((verb, "trainer.kubeflow.org", "trainjobs", "") for verb in ("get", "watch", "delete")),
    ("delete", "trainer.kubeflow.org", "trainingruntimes", ""),
    *(
        (verb, "kueue.x-k8s.io", resource, "")
        for verb in ("get", "list")
        for resource in ("workloads", "localqueues")
    ),
)
# (group/version, resource, what it is) of the engines a multi-worker job can be handed to
TRAINING_APIS = (
    ("kubeflow.org/v1", "tfjobs", "Kubeflow TFJob"),
    ("trainer.kubeflow.org/v1alpha1", "trainjobs", "Kubeflow Trainer TrainJob"),
    ("batch/v1", "jobs", "Indexed Job"),
)
KUEUE_GROUP = "kueue.x-k8s.io"
# A node annotated so serves requests for the listed GPU resources (comma-separated) on CPU when it has too few,
# instead of leaving the pod Pending: the dev stack's node without --strict-gpu (include/devstack/kubeapi/cluster.py).
CPU_FALLBACK_ANNOTATION = "kubetrain.io/gpu-requests-served-on-cpu"


def access_attributes(access, namespace: str, s3_secret: str | None) -> list[dict[str, str]]:
    """SelfSubjectAccessReview resourceAttributes for ``access`` in ``namespace``."""
    out = []
    for verb, group, resource, name in access:
        if name == "<s3_secret>":
            if not s3_secret:
                continue
            name = s3_secret
        base, _, sub = resource.partition("/")
        out.append(
            {
                "namespace": namespace,
                "verb": verb,
                "group": group,
                "resource": base,
                "subresource": sub,
                "name": name,
            }
        )
    return out


def describe(attrs: dict[str, str]) -> str:
    resource = attrs["resource"] + (f"/{attrs['subresource']}" if attrs["subresource"] else "")
    qualified = f"{resource}.{attrs['group']}" if attrs["group"] else resource
    return f"{attrs['verb']} {qualified}" + (f" {attrs['name']!r}" if attrs["name"] else "")


def access_check(name: str, account: str, refused: list[dict[str, str]], total: int, namespace: str) -> Check:
    """The line of an access review: PASS, or FAIL naming what is refused and the manifest that grants it."""
    if not refused:
        return Check(
            name, "PASS", f"{account} may do all {total} things kubetrain does in namespace {namespace!r}"
        )
    shown = ", ".join(describe(a) for a in refused[:6]) + (
        f" (+{len(refused) - 6} more)" if len(refused) > 6 else ""
    )
    return Check(
        name,
        "FAIL",
        f"{account} may not {shown} in namespace {namespace!r}",
        f"kubectl apply -f deploy/rbac.yaml in namespace {namespace} (it binds the Helm chart's airflow-worker "
        "and airflow-triggerer), or bind its Roles to this account",
    )


def triggerer_check(event: dict[str, Any], namespace: str) -> Check:
    """The line of the triggerer's access review (:class:`kubetrain.triggers.access.AccessReviewTrigger`'s event)."""
    if event.get("error"):
        return Check(
            "access:triggerer",
            "FAIL",
            f"the triggerer could not ask the API what it may do: {event['error']}",
            "give the triggerer a connection to the cluster (with the Helm chart: in_cluster, its service "
            "account airflow-triggerer) and apply deploy/rbac.yaml",
        )
    return access_check(
        "access:triggerer", "the triggerer's account", event["refused"], event["total"], namespace
    )


@dataclass
class Cluster:
    """The training namespace of one deployment, on the cluster of one connection: the clients every group of
    checks and the pod runner share.

    :param deployment: the settings (namespace, Secret, images, ...).
    :param kubernetes_conn_id: the cluster's connection.
    """

    deployment: Deployment
    kubernetes_conn_id: str = "kubernetes_default"

    @cached_property
    def hook(self):
        from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook

        return KubernetesHook(conn_id=self.kubernetes_conn_id)

    @cached_property
    def core(self):
        return self.hook.core_v1_client

    @property
    def namespace(self) -> str:
        return self.deployment.namespace


@dataclass
class ClusterChecks:
    """The lines that ask the Kubernetes API: its version and the namespace, what the workers may do there,
    the GPU nodes, the training engines served and the Kueue queue."""

    cluster: Cluster

    def check_api(self) -> Check:
        """The API answers, is at least :data:`MINIMUM_VERSION`, and the namespace exists (or is usable)."""
        from kubernetes.client.exceptions import ApiException

        try:
            info, version = self._version()
        except Exception as exc:  # noqa: BLE001 - any failure to reach the API is this check's answer
            return Check(
                "api",
                "FAIL",
                f"the Kubernetes API of connection {self.cluster.kubernetes_conn_id!r} does not answer: "
                f"{short_error(exc)}",
                f"point the {self.cluster.kubernetes_conn_id} connection (kube_config_path, in_cluster) "
                "or KUBECONFIG at a reachable cluster",
            )
        if version < MINIMUM_VERSION:
            minimum = ".".join(map(str, MINIMUM_VERSION))
            return Check(
                "api",
                "FAIL",
                f"API {info} is older than {minimum}, the oldest Kubernetes kubetrain supports: "
                "the training pod's checkpoint-sync is a native sidecar (an init container with restartPolicy "
                "Always), which older servers drop, so pods would hang in Init",
                f"upgrade the cluster to Kubernetes {minimum} or later",
            )
        namespace = self.cluster.namespace
        try:
            self.cluster.core.read_namespace(namespace)
        except ApiException as exc:
            if exc.status == 404:
                return Check(
                    "api",
                    "FAIL",
                    f"API {info} answers, but namespace {namespace!r} does not exist",
                    f"kubectl create namespace {namespace}, or set KUBETRAIN_NAMESPACE to an existing one",
                )
            if exc.status == 403:
                # A Role in the namespace may not allow reading the namespace itself: listing pods there is enough.
                try:
                    self.cluster.core.list_namespaced_pod(namespace, limit=1)
                except ApiException as inner:
                    return Check(
                        "api",
                        "FAIL",
                        f"API {info} answers, but namespace {namespace!r} is not "
                        f"usable: {inner.status} {inner.reason}",
                        "apply deploy/rbac.yaml in the namespace for Airflow's service account",
                    )
            else:
                raise
        return Check("api", "PASS", f"API {info} answers and namespace {namespace!r} exists")

    def _version(self) -> tuple[str, tuple[int, int]]:
        from kubernetes import client

        api_client = self.cluster.hook.api_client
        info = client.VersionApi(api_client).get_code(_request_timeout=10)
        text = f"{info.git_version or info.major + '.' + info.minor} at {api_client.configuration.host}"
        major, minor = (
            int(re.sub(r"\D.*", "", part) or 0) for part in (info.major, info.minor)
        )  # "27+" on EKS
        return text, (major, minor)

    def check_access(self) -> Check:
        """Access reviews (SelfSubjectAccessReview) of everything the workers do."""
        from kubernetes import client

        d = self.cluster.deployment
        wanted = access_attributes(WORKER_ACCESS, self.cluster.namespace, d.s3_secret)
        api = client.AuthorizationV1Api(self.cluster.hook.api_client)
        refused = []
        for attrs in wanted:
            review = client.V1SelfSubjectAccessReview(
                spec=client.V1SelfSubjectAccessReviewSpec(
                    resource_attributes=client.V1ResourceAttributes(**{k: v for k, v in attrs.items() if v})
                )
            )
            if not api.create_self_subject_access_review(review, _request_timeout=15).status.allowed:
                refused.append(attrs)
        return access_check("access", "the workers' account", refused, len(wanted), self.cluster.namespace)

    def check_gpu_nodes(self) -> Check:
        """Nodes that offer the GPU resource, with their taints; a node that serves GPU requests on CPU
        (the dev stack's, annotated :data:`CPU_FALLBACK_ANNOTATION`) is named as such, not as a GPU node."""
        resource = self.cluster.deployment.gpu_resource
        try:
            nodes = self.cluster.core.list_node(_request_timeout=15).items
        except Exception as exc:  # noqa: BLE001 - e.g. 403: a namespaced Role cannot list nodes
            return Check(
                "gpu-nodes", "INFO", f"nodes cannot be listed ({short_error(exc)}); GPU nodes unknown"
            )
        gpu = []
        on_cpu = []
        for node in nodes:
            count = (node.status.allocatable or {}).get(resource) if node.status else None
            annotations = (node.metadata.annotations or {}) if node.metadata else {}
            served_on_cpu = resource in annotations.get(CPU_FALLBACK_ANNOTATION, "").split(",")
            if count and str(count) not in ("0", ""):
                taints = (
                    ", ".join(f"{t.key}={t.value or ''}:{t.effect}" for t in (node.spec.taints or []))
                    or "no taints"
                )
                beyond = "; requests beyond them are served on CPU" if served_on_cpu else ""
                gpu.append(f"{node.metadata.name} ({count} {resource}; {taints}{beyond})")
            elif served_on_cpu:
                on_cpu.append(node.metadata.name)
        if not gpu and on_cpu:
            return Check(
                "gpu-nodes",
                "INFO",
                f"none of {len(nodes)} node(s) offers {resource}; node(s) {', '.join(on_cpu)} serve GPU requests "
                f"on CPU (the dev stack, annotation {CPU_FALLBACK_ANNOTATION}): training pods that ask for GPUs "
                "start and train on CPU, where a cluster without GPU nodes would keep them Pending",
            )
        if not gpu:
            return Check(
                "gpu-nodes",
                "WARN",
                f"none of {len(nodes)} node(s) offers {resource}: training pods that ask "
                "for GPUs stay Pending; run with gpus=0 (training runs on CPU) or add GPU nodes with the "
                "device plugin",
            )
        return Check("gpu-nodes", "PASS", f"{len(gpu)} of {len(nodes)} node(s): {'; '.join(gpu)}")

    def check_training_apis(self) -> Check:
        """Which engines a multi-worker job can go to, and whether Kueue is there, with the versions served."""
        from kubernetes import client

        groups = {
            g.name: [v.version for v in g.versions]
            for g in client.ApisApi(self.cluster.hook.api_client).get_api_versions(_request_timeout=10).groups
        }
        api = client.CustomObjectsApi(self.cluster.hook.api_client)
        served: list[str] = []
        missing: list[str] = []
        for group_version, resource, what in TRAINING_APIS:
            group, version = group_version.split("/")
            if group != "batch" and version not in groups.get(group, []):
                others = groups.get(group)
                missing.append(
                    f"{what} ({group_version}"
                    + (f"; the cluster serves {group} {', '.join(others)})" if others else ")")
                )
                continue
            try:
                listing = api.get_api_resources(group, version, _request_timeout=10)
            except Exception:  # noqa: BLE001 - 404: the API is not served
                missing.append(f"{what} ({group_version})")
                continue
            names = {r.name for r in (listing.resources or [])}
            (served if resource in names else missing).append(f"{what} ({group_version})")
        kueue = groups.get(KUEUE_GROUP)
        queues = f"Kueue served ({KUEUE_GROUP} {', '.join(kueue)})" if kueue else "Kueue not served"
        if not served:
            return Check(
                "training-apis",
                "FAIL",
                f"none served: {', '.join(missing)}",
                "batch/v1 Jobs are part of every cluster: check the API server",
            )
        detail = f"served: {', '.join(served)}" + (f"; not served: {', '.join(missing)}" if missing else "")
        return Check("training-apis", "INFO", f"{detail}; {queues}")

    def check_queue(self) -> Check:
        """Whether the configured Kueue LocalQueue exists in the training namespace."""
        from kubernetes import client
        from kubernetes.client.rest import ApiException

        queue = self.cluster.deployment.queue
        if not queue:
            return Check(
                "queue", "INFO", "no Kueue queue configured (KUBETRAIN_QUEUE): pods go to the scheduler"
            )
        from kubetrain.pod_startup import choose_kueue_version

        groups = (
            client.ApisApi(self.cluster.hook.api_client).get_api_versions(_request_timeout=10).groups or []
        )
        if KUEUE_GROUP not in {g.name for g in groups}:
            return Check(
                "queue",
                "FAIL",
                f"KUBETRAIN_QUEUE is {queue!r} but the cluster does not serve Kueue ({KUEUE_GROUP})",
                "install Kueue with its plain-pod integration enabled, or empty KUBETRAIN_QUEUE",
            )
        version = choose_kueue_version(
            groups
        )  # the cluster's: Kueue v0.19 prefers v1beta2, older only v1beta1
        try:
            found = client.CustomObjectsApi(self.cluster.hook.api_client).get_namespaced_custom_object(
                KUEUE_GROUP, version, self.cluster.namespace, "localqueues", queue, _request_timeout=10
            )
        except ApiException as exc:
            if exc.status != 404:
                raise
            return Check(
                "queue",
                "FAIL",
                f"LocalQueue {queue!r} does not exist in namespace {self.cluster.namespace}",
                f"create it (kind: LocalQueue, namespace {self.cluster.namespace}, "
                "spec.clusterQueue: <your ClusterQueue>) "
                "or set KUBETRAIN_QUEUE to one that exists",
            )
        cluster_queue = (found.get("spec") or {}).get("clusterQueue", "?")
        # a run's priority_class must name one of these: Kueue makes no Workload for a class that does not exist
        try:
            listing = client.CustomObjectsApi(self.cluster.hook.api_client).list_cluster_custom_object(
                KUEUE_GROUP, version, "workloadpriorityclasses", _request_timeout=10
            )
            names = sorted(item["metadata"]["name"] for item in listing.get("items") or [])
            classes = f"WorkloadPriorityClasses: {', '.join(names) or 'none'}"
        except ApiException as exc:
            classes = f"WorkloadPriorityClasses not readable ({exc.status} {exc.reason})"
        return Check("queue", "PASS", f"LocalQueue {queue!r} feeds ClusterQueue {cluster_queue!r}; {classes}")
