"""Preflight: check that a cluster, its S3 store and registry are ready for kubetrain's training pods.

    make preflight            # in the checkout; kubetrain-preflight where the wheel is installed;
                              # or trigger the kubetrain_preflight DAG

Each check prints one line, ``PASS``, ``FAIL``, ``WARN``, ``INFO`` or ``SKIP``, and every FAIL
says how to fix it. The exit status is 1 when any check failed. The settings are the
deployment's (:mod:`kubetrain.settings`); the cluster is the ``kubernetes_default`` connection,
the registry the ``kubetrain_registry_default`` connection (else the ``registry`` setting).

Checks, in order:

* ``api``: the Kubernetes API answers, is at least 1.29 (the checkpoint-sync sidecar is a native
  sidecar, which older servers drop: pods would hang in Init) and the namespace exists;
* ``access``: the worker's account may do everything kubetrain does (access reviews of every verb
  and resource, as deploy/rbac.yaml grants them); the triggerer's account is reviewed from the
  triggerer by the kubetrain_preflight DAG (:class:`kubetrain.triggers.access.AccessReviewTrigger`);
* ``s3-secret``: the S3 Secret has the keys the pods read and the workers may read it (or, with
  workload identity, the service account carries an IAM role: GKE's and Azure's identities give
  tokens that S3's SigV4 cannot use);
* ``image:trainer`` / ``image:sync``: each image is pullable, seen by a short-lived pod that
  runs it (deleted afterwards);
* ``s3-from-pod`` / ``s3-region`` / ``s3-write``: a pod of the sync image, with the pods' credentials, runs
  ``python -m trainer.sync probe``: it lists the datasets bucket, asks S3 each bucket's region (FAIL when it is
  not the one the pods sign for), and writes, reads back through the CRT (stage-in's download path) and
  deletes an object under ``preflight/`` in the training bucket;
* ``gpu-nodes``: nodes that offer the GPU resource, with their taints (WARN when none; INFO when a node says,
  by the annotation ``kubetrain.io/gpu-requests-served-on-cpu``, that it runs GPU requests on CPU, as the dev
  stack's does unless started with ``--strict-gpu``);
* ``gpu-pool``: the Airflow pool ``gpu`` that bounds concurrent GPU pods, read through Airflow's REST API
  (below);
* ``registry``: the registry answers the Airflow workers (where images are built and pushed);
* ``training-apis``: which distributed-training APIs the cluster serves, and whether Kueue does, with the
  versions served.

The pool is read through Airflow's public REST API (``GET /api/v2/pools/{name}`` on the API server), never
through the ORM: a task of Airflow 3 may not open the metadata database, and from a shell the ORM would create
an empty ``airflow.db`` wherever ``AIRFLOW_HOME`` points. The API is the connection ``airflow_api`` (type http:
``AIRFLOW_CONN_AIRFLOW_API='http://admin:<password>@localhost:8080'``, or ``airflow connections add``): its host
and port are the API server's, its login and password a user's, exchanged for a JWT at ``POST /auth/token``
(the simple auth manager's and FAB's endpoint), or its extra ``{"token": "<JWT>"}`` a token used as is. The CLI's
``--airflow-api-url`` replaces the connection's host; Airflow's ``[api] base_url`` stands in for a host neither
gives, and from the CLI without the connection the API is asked there with no credentials. With neither, the line is INFO and names ``airflow pools get gpu``;
an API that does not answer or refuses is WARN naming the URL and what to set. One GET and, with a password,
the token's POST do not justify a client library: they go through ``requests``, already a dependency
(``apache-airflow-client`` is not in the lock).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import logging
import secrets
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from kubetrain.settings import Deployment

log = logging.getLogger(__name__)

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
RESTRICTED_FIX = (
    "the preflight's pods pass Pod Security level restricted, as training pods do; check the namespace's "
    "pod-security.kubernetes.io labels and admission webhooks"
)


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


STATUSES = ("PASS", "FAIL", "WARN", "INFO", "SKIP")
REQUIRED_SECRET_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
OPTIONAL_SECRET_KEYS = ("AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION")
IDENTITY_ANNOTATIONS = (
    "eks.amazonaws.com/role-arn",
    "iam.gke.io/gcp-service-account",
    "azure.workload.identity/client-id",
)
PULL_FAILURES = (
    "ErrImagePull",
    "ImagePullBackOff",
    "InvalidImageName",
    "ErrImageNeverPull",
    "RegistryUnavailable",
)
CONFIG_FAILURES = ("CreateContainerConfigError", "CreateContainerError", "RunContainerError")
LABELS = {"app.kubernetes.io/name": "kubetrain", "app.kubernetes.io/component": "preflight"}
# (group/version, resource, what it is) of the engines a multi-worker job can be handed to
TRAINING_APIS = (
    ("kubeflow.org/v1", "tfjobs", "Kubeflow TFJob"),
    ("trainer.kubeflow.org/v1alpha1", "trainjobs", "Kubeflow Trainer TrainJob"),
    ("batch/v1", "jobs", "Indexed Job"),
)
KUEUE_GROUP = "kueue.x-k8s.io"
# The sync image's own probe (trainer/sync/probe.py): the clients, environment and network path of stage-in and the
# sidecar, with the pods' credentials (AWS_* from the Secret, or workload identity). Its last line is this and JSON.
PROBE_PREFIX = "KUBETRAIN_PROBE "
S3_CHECKS = ("s3-from-pod", "s3-region", "s3-write")
# The connection to Airflow's REST API, where the pool line reads the pool.
AIRFLOW_API_CONN_ID = "airflow_api"
# A node annotated so serves requests for the listed GPU resources (comma-separated) on CPU when it has too few,
# instead of leaving the pod Pending: the dev stack's node without --strict-gpu (include/devstack/kubeapi/cluster.py).
CPU_FALLBACK_ANNOTATION = "kubetrain.io/gpu-requests-served-on-cpu"


@dataclass(frozen=True)
class Check:
    """One line of the preflight: ``status name: detail``, and the fix for a FAIL."""

    name: str
    status: str
    detail: str
    fix: str = ""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"invalid status {self.status!r}: expected one of {', '.join(STATUSES)}")

    def line(self) -> str:
        text = f"{self.status:<4}  {self.name}: {self.detail}"
        return f"{text} -> fix: {self.fix}" if self.fix else text


class AirflowApiError(Exception):
    """Airflow's REST API could not be asked: unreachable, or it refused (``unauthorized``: 401 or 403)."""

    def __init__(self, message: str, *, unauthorized: bool = False) -> None:
        super().__init__(message)
        self.unauthorized = unauthorized


@dataclass(frozen=True)
class AirflowApi:
    """Airflow's public REST API (the API server's ``/api/v2``), for the one thing the preflight reads there.

    :param url: the API server's base URL (``http://host:8080``, without ``/api/v2``).
    :param where: where the URL came from, for messages.
    :param token: a JWT (or other bearer token) the API server accepts; sent as is.
    :param username: with ``password``: exchanged for a JWT at ``POST /auth/token`` (the simple auth manager's
        and FAB's token endpoint) when no ``token`` is given.
    :param password: the user's password.
    :param timeout: seconds per request.
    """

    url: str
    where: str
    token: str = ""
    username: str = ""
    password: str = field(default="", repr=False)
    timeout: float = 10.0

    def _request(self, method: str, path: str, **kwargs: Any):
        import requests

        target = f"{self.url.rstrip('/')}{path}"
        try:
            return requests.request(method, target, timeout=self.timeout, **kwargs)
        except requests.RequestException as exc:
            raise AirflowApiError(f"does not answer: {_short(exc)}") from exc

    def _headers(self) -> dict[str, str]:
        token = self.token
        if not token and self.username:
            answer = self._request(
                "POST", "/auth/token", json={"username": self.username, "password": self.password}
            )
            if answer.status_code in (401, 403):
                raise AirflowApiError(
                    f"refused user {self.username!r} at POST /auth/token ({answer.status_code})",
                    unauthorized=True,
                )
            if answer.status_code not in (200, 201):
                raise AirflowApiError(
                    f"answered POST /auth/token with {answer.status_code}: {answer.text[:200]}"
                )
            token = answer.json().get("access_token") or ""
        return {"Authorization": f"Bearer {token}"} if token else {}

    def pool(self, name: str) -> dict[str, Any] | None:
        """``GET /api/v2/pools/{name}``: the pool (``slots``, ``occupied_slots``, ...), None when it does not exist."""
        from urllib.parse import quote

        answer = self._request("GET", f"/api/v2/pools/{quote(name, safe='')}", headers=self._headers())
        if answer.status_code == 404:
            try:
                detail = answer.json().get("detail")
            except ValueError:
                detail = None
            # Airflow's answer for a pool it lacks: {"detail": "The Pool with name: `gpu` was not found"}; a path
            # that is no route of it (a URL with the wrong prefix) gets {"detail": "Not Found"}
            if isinstance(detail, str) and f"`{name}`" in detail:
                return None
            raise AirflowApiError(
                f"answered 404 to GET /api/v2/pools/{name} ({detail or answer.text[:100]!r}): "
                "is it the API server's URL?"
            )
        if answer.status_code in (401, 403):
            who = f"user {self.username!r}" if self.username and not self.token else "the request"
            raise AirflowApiError(
                f"refused {who} at GET /api/v2/pools ({answer.status_code})", unauthorized=True
            )
        if answer.status_code != 200:
            raise AirflowApiError(
                f"answered GET /api/v2/pools with {answer.status_code}: {answer.text[:200]}"
            )
        try:
            pool = answer.json()
        except ValueError:
            pool = None
        if not isinstance(pool, dict) or "slots" not in pool:
            raise AirflowApiError(
                f"answered GET /api/v2/pools/{name} with no pool ({answer.headers.get('content-type')}: "
                f"{answer.text[:80]!r}): is it the API server's URL?"
            )
        return pool


def _connection_url(conn: Any) -> str:
    """The base URL of an http connection: its host (with a scheme, or the schema/type's), and port."""
    host = (conn.host or "").rstrip("/")
    if not host:
        return ""
    if "://" not in host:
        scheme = (
            conn.schema
            if conn.schema in ("http", "https")
            else "https"
            if conn.conn_type == "https"
            else "http"
        )
        host = f"{scheme}://{host}"
    return f"{host}:{conn.port}" if conn.port else host


@dataclass(frozen=True)
class PodOutcome:
    """How a preflight pod ended: pulled or not, exit code, its log, and what stopped it."""

    pulled: bool
    exit_code: int | None = None
    reason: str = ""
    message: str = ""
    logs: str = ""


@dataclass
class Preflight:
    """The checks against one deployment.

    :param deployment: the settings (namespace, Secret, images, ...).
    :param kubernetes_conn_id: the cluster's connection.
    :param registry_conn_id: the registry's connection; the ``registry`` setting when it is not defined.
    :param pool: the Airflow pool of GPU training tasks.
    :param pod_timeout: seconds a preflight pod may take to pull and run.
    :param airflow_api_conn_id: the connection to Airflow's REST API (where the pool is read).
    :param airflow_api_url: the API server's URL, over the connection's host (the CLI's ``--airflow-api-url``).
    :param airflow_api_default_url: the URL when neither gives one (the CLI: Airflow's ``[api] base_url``).
    """

    deployment: Deployment
    kubernetes_conn_id: str = "kubernetes_default"
    registry_conn_id: str = "kubetrain_registry_default"
    pool: str = "gpu"
    pod_timeout: float = 45.0
    airflow_api_conn_id: str = AIRFLOW_API_CONN_ID
    airflow_api_url: str | None = None
    airflow_api_default_url: str | None = None
    results: list[Check] = field(default_factory=list)

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

    def images(self) -> dict[str, str]:
        from kubetrain.imagebuild.products import default_images

        d = self.deployment
        defaults = default_images(d.registry, d.image_tag, d.trainer_variant)
        return {
            "trainer": self.deployment.trainer_image or defaults["trainer"],
            "sync": self.deployment.sync_image or defaults["sync"],
        }

    # -- running ---------------------------------------------------------------------------

    def run(self, emit: Callable[[Check], None] | None = None) -> list[Check]:
        """Run every check; ``emit`` receives each line as it is decided."""

        def add(check: Check) -> None:
            self.results.append(check)
            if emit:
                emit(check)

        api = self.check_api()
        add(api)
        cluster_ok = api.status == "PASS"
        if cluster_ok:
            add(self.guarded("access", self.check_access))
            add(self.guarded("s3-secret", self.check_s3_secret))
            try:
                pod_checks = self.check_pods()
            except Exception as exc:  # noqa: BLE001 - one line, never a traceback
                pod_checks = [
                    Check(
                        "image:trainer",
                        "FAIL",
                        f"could not be checked: {_short(exc)}",
                        "check the cluster's API server",
                    )
                ]
            for check in pod_checks:
                add(check)
        else:
            for name in ("access", "s3-secret", "image:trainer", "image:sync", *S3_CHECKS):
                add(Check(name, "SKIP", "needs the API and the namespace (see api)"))
        reachable = cluster_ok or api.detail.startswith("API ")
        add(self.check_gpu_nodes() if reachable else Check("gpu-nodes", "SKIP", "needs the API (see api)"))
        add(self.check_pool())
        add(self.check_registry())
        add(
            self.check_training_apis()
            if reachable
            else Check("training-apis", "SKIP", "needs the API (see api)")
        )
        add(
            self.guarded("queue", self.check_queue)
            if reachable
            else Check("queue", "SKIP", "needs the API (see api)")
        )
        return self.results

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.results if c.status == "FAIL"]

    def guarded(self, name: str, check: Callable[[], Check]) -> Check:
        """``check()``, or its failure as one FAIL line: a preflight never ends in a traceback."""
        from kubernetes.client.exceptions import ApiException

        try:
            return check()
        except ApiException as exc:
            return Check(
                name,
                "FAIL",
                f"the API refused: {exc.status} {_api_message(exc)}",
                "see the access line: kubectl apply -f deploy/rbac.yaml"
                if exc.status == 403
                else "check the cluster's API server",
            )
        except Exception as exc:  # noqa: BLE001 - one line, never a traceback
            return Check(
                name, "FAIL", f"could not be checked: {_short(exc)}", "check the settings and the cluster"
            )

    def check_access(self) -> Check:
        """Access reviews (SelfSubjectAccessReview) of everything the workers do."""
        from kubernetes import client

        d = self.deployment
        wanted = access_attributes(WORKER_ACCESS, self.namespace, d.s3_secret)
        api = client.AuthorizationV1Api(self.hook.api_client)
        refused = []
        for attrs in wanted:
            review = client.V1SelfSubjectAccessReview(
                spec=client.V1SelfSubjectAccessReviewSpec(
                    resource_attributes=client.V1ResourceAttributes(**{k: v for k, v in attrs.items() if v})
                )
            )
            if not api.create_self_subject_access_review(review, _request_timeout=15).status.allowed:
                refused.append(attrs)
        return access_check("access", "the workers' account", refused, len(wanted), self.namespace)

    # -- the checks ------------------------------------------------------------------------

    def check_api(self) -> Check:
        from kubernetes.client.exceptions import ApiException

        try:
            info, version = self._version()
        except Exception as exc:  # noqa: BLE001 - any failure to reach the API is this check's answer
            return Check(
                "api",
                "FAIL",
                f"the Kubernetes API of connection {self.kubernetes_conn_id!r} does not answer: "
                f"{_short(exc)}",
                f"point the {self.kubernetes_conn_id} connection (kube_config_path, in_cluster) "
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
        try:
            self.core.read_namespace(self.namespace)
        except ApiException as exc:
            if exc.status == 404:
                return Check(
                    "api",
                    "FAIL",
                    f"API {info} answers, but namespace {self.namespace!r} does not exist",
                    f"kubectl create namespace {self.namespace}, or set KUBETRAIN_NAMESPACE to an existing one",
                )
            if exc.status == 403:
                # A Role in the namespace may not allow reading the namespace itself: listing pods there is enough.
                try:
                    self.core.list_namespaced_pod(self.namespace, limit=1)
                except ApiException as inner:
                    return Check(
                        "api",
                        "FAIL",
                        f"API {info} answers, but namespace {self.namespace!r} is not "
                        f"usable: {inner.status} {inner.reason}",
                        "apply deploy/rbac.yaml in the namespace for Airflow's service account",
                    )
            else:
                raise
        return Check("api", "PASS", f"API {info} answers and namespace {self.namespace!r} exists")

    def _version(self) -> tuple[str, tuple[int, int]]:
        import re

        from kubernetes import client

        info = client.VersionApi(self.hook.api_client).get_code(_request_timeout=10)
        text = f"{info.git_version or info.major + '.' + info.minor} at {self.hook.api_client.configuration.host}"
        major, minor = (
            int(re.sub(r"\D.*", "", part) or 0) for part in (info.major, info.minor)
        )  # "27+" on EKS
        return text, (major, minor)

    def check_s3_secret(self) -> Check:
        from kubernetes.client.exceptions import ApiException

        d = self.deployment
        if not d.s3_secret:
            try:
                account = self.core.read_namespaced_service_account(d.service_account, self.namespace)
            except ApiException as exc:
                if exc.status != 404:
                    raise
                return Check(
                    "s3-secret",
                    "FAIL",
                    f"no S3 Secret (workload identity) and service account "
                    f"{d.service_account!r} does not exist in {self.namespace!r}",
                    f"kubectl -n {self.namespace} create serviceaccount {d.service_account} and bind it to an "
                    "IAM role (IRSA) or GCP service account, or set KUBETRAIN_S3_SECRET",
                )
            annotations = (account.metadata.annotations or {}) if account.metadata else {}
            found = [a for a in IDENTITY_ANNOTATIONS if a in annotations]
            if not found:
                return Check(
                    "s3-secret",
                    "WARN",
                    f"workload identity: service account {d.service_account!r} has none "
                    f"of the annotations {', '.join(IDENTITY_ANNOTATIONS)}",
                    "annotate it with the IAM role or GCP service account that may read the buckets",
                )
            if "eks.amazonaws.com/role-arn" not in found:
                # GKE's and Azure's workload identities hand out their clouds' tokens: S3's SigV4 needs AWS keys
                return Check(
                    "s3-secret",
                    "FAIL",
                    f"workload identity through service account {d.service_account!r} "
                    f"({found[0]}) gives pods {('GCP' if 'gke' in found[0] else 'Azure')} tokens, which the pods' "
                    "S3 client (SigV4) cannot use",
                    "put S3 credentials in a Secret and name it in KUBETRAIN_S3_SECRET: for Cloud Storage, "
                    "HMAC keys with AWS_ENDPOINT_URL=https://storage.googleapis.com (docs/real-cluster.md, GKE)",
                )
            return Check(
                "s3-secret",
                "PASS",
                f"workload identity through service account {d.service_account!r} ({found[0]})",
            )
        try:
            secret = self.core.read_namespaced_secret(d.s3_secret, self.namespace)
        except ApiException as exc:
            if exc.status == 403:
                return Check(
                    "s3-secret",
                    "FAIL",
                    f"the workers may not read Secret {d.s3_secret!r}: {_api_message(exc)}",
                    f"name {d.s3_secret!r} in the resourceNames of deploy/rbac.yaml's Role kubetrain-airflow "
                    "(it names kubetrain-s3) and apply it",
                )
            if exc.status != 404:
                raise
            return Check(
                "s3-secret",
                "FAIL",
                f"Secret {d.s3_secret!r} does not exist in namespace {self.namespace!r}",
                f"kubectl -n {self.namespace} create secret generic {d.s3_secret} "
                "--from-literal=AWS_ACCESS_KEY_ID=... --from-literal=AWS_SECRET_ACCESS_KEY=... "
                "--from-literal=AWS_ENDPOINT_URL=<endpoint pods reach> --from-literal=AWS_DEFAULT_REGION=...",
            )
        keys = set(secret.data or {}) | set(secret.string_data or {})
        missing = [k for k in REQUIRED_SECRET_KEYS if k not in keys]
        if missing:
            return Check(
                "s3-secret",
                "FAIL",
                f"Secret {d.s3_secret!r} lacks {', '.join(missing)} (has: "
                f"{', '.join(sorted(keys)) or 'nothing'})",
                f"add {', '.join(missing)} to Secret "
                f"{d.s3_secret!r}: kubectl -n {self.namespace} patch secret {d.s3_secret} --type merge "
                f'-p \'{{"stringData": {{"{missing[0]}": "..."}}}}\'',
            )
        absent = [k for k in OPTIONAL_SECRET_KEYS if k not in keys]
        note = f"; no {', '.join(absent)} (pods use AWS defaults)" if absent else ""
        return Check(
            "s3-secret", "PASS", f"Secret {d.s3_secret!r} has {', '.join(REQUIRED_SECRET_KEYS)}{note}"
        )

    def check_pods(self) -> list[Check]:
        """Pull each image in a pod of its own; the sync image's pod also runs the S3 probe."""
        images = self.images()
        d = self.deployment
        # `python`, as the training pods run it (pod_spec.STAGE_IN_COMMAND and the trainers' commands)
        trainer_cmd = ["python", "-c", "import trainer; print('trainer package found')"]
        scratch = f"s3://{d.training_bucket}/preflight/{secrets.token_hex(6)}.bin"
        sync_cmd = [
            "python",
            "-m",
            "trainer.sync",
            "probe",
            "--datasets-bucket",
            d.datasets_bucket,
            "--scratch-uri",
            scratch,
        ]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            trainer = pool.submit(self.run_pod, "trainer", images["trainer"], trainer_cmd, with_s3=False)
            sync = pool.submit(self.run_pod, "sync", images["sync"], sync_cmd, with_s3=True)
            outcomes = {"trainer": trainer.result(), "sync": sync.result()}
        checks = [self._image_check(name, images[name], outcomes[name]) for name in ("trainer", "sync")]
        checks.extend(self._s3_checks(images["sync"], outcomes["sync"]))
        return checks

    def _image_check(self, name: str, image: str, outcome: PodOutcome) -> Check:
        setting = f"KUBETRAIN_{name.upper()}_IMAGE"
        if outcome.pulled:
            return Check(f"image:{name}", "PASS", f"{image} was pulled and started")
        if outcome.reason == "Forbidden":
            return Check(
                f"image:{name}",
                "FAIL",
                f"a pod of {image} was refused: {outcome.message}",
                RESTRICTED_FIX
                if "PodSecurity" in outcome.message
                else "see the access line: kubectl apply -f deploy/rbac.yaml",
            )
        if outcome.reason in PULL_FAILURES:
            pull = (
                "; for a private registry name its docker-registry Secret in KUBETRAIN_IMAGE_PULL_SECRETS"
                if not self.deployment.image_pull_secrets
                else ""
            )
            return Check(
                f"image:{name}",
                "FAIL",
                f"{image} cannot be pulled: {outcome.reason} {outcome.message}".strip(),
                f"push it (make images, or the build_trainer_image DAG) or set {setting} to an image the "
                f"nodes can pull{pull}",
            )
        return Check(
            f"image:{name}",
            "FAIL",
            f"a pod of {image} did not start: {outcome.reason} {outcome.message}".strip(),
            f"see `kubectl -n {self.namespace} get events`; the pod needs to be schedulable with the deployment's node "
            "selector and tolerations",
        )

    def _s3_checks(self, image: str, outcome: PodOutcome) -> list[Check]:
        """The probe's report as three lines: the datasets listing, the buckets' regions, the write/read/delete."""
        import json

        if not outcome.pulled:
            return [Check(name, "SKIP", f"needs the sync image ({image}) to run") for name in S3_CHECKS]
        reports = [line for line in outcome.logs.splitlines() if line.startswith(PROBE_PREFIX)]
        if outcome.exit_code != 0 or not reports:
            error = (
                _last_error(outcome.logs)
                or f"{outcome.reason} {outcome.message}".strip()
                or f"exit code {outcome.exit_code}"
            )
            return [
                Check(
                    "s3-from-pod",
                    "FAIL",
                    f"the S3 probe in {image} did not report: {error}",
                    "rebuild and push the sync image (make images) so that it has `python -m trainer.sync "
                    "probe`, or set KUBETRAIN_SYNC_IMAGE",
                ),
                *(Check(name, "SKIP", "needs the S3 probe (see s3-from-pod)") for name in S3_CHECKS[1:]),
            ]
        report = json.loads(reports[-1].removeprefix(PROBE_PREFIX))
        return [
            self._list_check(report["list"]),
            self._region_check(report["region"]),
            self._write_check(report["write"]),
        ]

    def _list_check(self, step: dict[str, Any]) -> Check:
        bucket = self.deployment.datasets_bucket
        if step["ok"]:
            return Check("s3-from-pod", "PASS", f"a pod {step['detail']}")
        return Check(
            "s3-from-pod",
            "FAIL",
            f"a pod could not list bucket {bucket!r}: {step['detail']}",
            self._s3_fix(step["detail"], bucket, "list (s3:ListBucket) and read (s3:GetObject)"),
        )

    def _region_check(self, step: dict[str, Any]) -> Check:
        if not step["ok"]:
            return Check("s3-region", "WARN", f"the buckets' regions could not be asked: {step['detail']}")
        configured, buckets = step["configured"], step["buckets"]
        elsewhere = {b: r for b, r in buckets.items() if r != configured}
        if not elsewhere:
            return Check("s3-region", "PASS", step["detail"])
        region = next(iter(elsewhere.values()))
        where = ", ".join(f"{b!r} is in {r}" for b, r in elsewhere.items())
        secret = self.deployment.s3_secret
        fix = (
            f"kubectl -n {self.namespace} patch secret {secret} --type merge -p "
            f'\'{{"stringData": {{"AWS_REGION": "{region}", "AWS_DEFAULT_REGION": "{region}"}}}}\''
            if secret
            else f"set AWS_REGION={region} in the environment of service account "
            f"{self.deployment.service_account!r}'s pods (or keep the buckets in {configured})"
        )
        if len(set(elsewhere.values())) > 1:
            fix = "keep the datasets and training buckets in one region, and set AWS_REGION to it"
        return Check(
            "s3-region",
            "FAIL",
            f"bucket {where}, but the pods sign for {configured}: every first request "
            "to it is refused and retried, and tools that do not follow S3's region answer fail",
            fix,
        )

    def _write_check(self, step: dict[str, Any]) -> Check:
        bucket = self.deployment.training_bucket
        if step["ok"]:
            return Check("s3-write", "PASS", f"a pod {step['detail']}")
        return Check(
            "s3-write",
            "FAIL",
            f"a pod could not write, read back and delete in bucket {bucket!r}: {step['detail']}",
            self._s3_fix(step["detail"], bucket, "s3:PutObject, s3:GetObject and s3:DeleteObject"),
        )

    def _s3_fix(self, error: str, bucket: str, rights: str) -> str:
        d = self.deployment
        if "Could not connect" in error or "Connect timeout" in error or "EndpointConnectionError" in error:
            return (
                f"set AWS_ENDPOINT_URL in Secret {d.s3_secret!r} to an address pods reach (the in-cluster "
                "service or a routable host, not the Airflow host's localhost)"
            )
        if "PartialCredentialsError" in error or "NoCredentialsError" in error:
            return (
                f"give Secret {d.s3_secret!r} both AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
                if d.s3_secret
                else f"bind service account {d.service_account!r} to an AWS identity (IRSA)"
            )
        if "NoSuchBucket" in error:
            from kubetrain.settings import SETTINGS

            setting = SETTINGS["datasets_bucket" if bucket == d.datasets_bucket else "training_bucket"].env
            return f"create bucket {bucket!r} or set {setting}"
        if (
            "AccessDenied" in error
            or "InvalidAccessKeyId" in error
            or "SignatureDoesNotMatch" in error
            or "Forbidden" in error
        ):
            who = (
                f"Secret {d.s3_secret!r}" if d.s3_secret else f"service account {d.service_account!r}'s role"
            )
            return f"give the pods' credentials ({who}) {rights} on {bucket!r}"
        return "check the pods' S3 credentials and endpoint"

    def check_gpu_nodes(self) -> Check:
        """Nodes that offer the GPU resource, with their taints; a node that serves GPU requests on CPU
        (the dev stack's, annotated :data:`CPU_FALLBACK_ANNOTATION`) is named as such, not as a GPU node."""
        resource = self.deployment.gpu_resource
        try:
            nodes = self.core.list_node(_request_timeout=15).items
        except Exception as exc:  # noqa: BLE001 - e.g. 403: a namespaced Role cannot list nodes
            return Check("gpu-nodes", "INFO", f"nodes cannot be listed ({_short(exc)}); GPU nodes unknown")
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

    def airflow_api(self) -> AirflowApi | None:
        """Where Airflow's REST API is and how to sign in: the ``airflow_api_conn_id`` connection, its URL
        ``airflow_api_url``, else its host, else ``airflow_api_default_url`` or ``[api] base_url``; when the
        connection is not defined, ``airflow_api_url`` or ``airflow_api_default_url`` with no credentials;
        None when there is no URL either."""
        from airflow.sdk import BaseHook

        try:
            conn = BaseHook.get_connection(self.airflow_api_conn_id)
        except Exception as exc:  # noqa: BLE001 - AirflowNotFoundException: not defined
            if type(exc).__name__ != "AirflowNotFoundException":
                raise
            conn = None
        if conn is None:
            url = self.airflow_api_url or self.airflow_api_default_url
            if not url:
                return None
            return AirflowApi(url, f"no credentials: connection {self.airflow_api_conn_id!r} is not defined")
        extra = conn.extra_dejson
        url = (
            self.airflow_api_url
            or _connection_url(conn)
            or self.airflow_api_default_url
            or _configured_api_url()
        )
        if not url:
            raise ValueError(
                f"connection {self.airflow_api_conn_id!r} has no host and [api] base_url is not set: "
                "expected the API server's URL, e.g. http://airflow-api-server:8080"
            )
        return AirflowApi(
            url,
            f"connection {self.airflow_api_conn_id!r}",
            token=str(extra.get("token") or ""),
            username=conn.login or "",
            password=conn.password or "",
        )

    def check_pool(self) -> Check:
        """The Airflow pool of GPU training tasks, read through Airflow's REST API (never the ORM)."""
        manual = f"check with `airflow pools get {self.pool}`"
        setup = (
            f"define connection {self.airflow_api_conn_id} (type http: the API server's URL with a user's login "
            'and password, or extra {"token": ...})'
        )
        try:
            api = self.airflow_api()
        except Exception as exc:  # noqa: BLE001 - a connection that does not parse
            return Check("gpu-pool", "WARN", f"pool {self.pool!r} not checked: {_short(exc)}; {manual}")
        if api is None:
            return Check(
                "gpu-pool",
                "INFO",
                f"pool {self.pool!r} not checked: no Airflow API configured ({setup}); {manual}",
            )
        try:
            pool = api.pool(self.pool)
        except AirflowApiError as exc:
            return Check(
                "gpu-pool",
                "WARN",
                f"pool {self.pool!r} not checked: the Airflow API at {api.url} ({api.where}) {exc}; "
                + (f"{setup}; " if exc.unauthorized else "")
                + manual,
            )
        if pool is None:
            return Check(
                "gpu-pool",
                "FAIL",
                f"Airflow pool {self.pool!r} does not exist (API {api.url}): GPU training tasks would not be "
                "scheduled",
                f"airflow pools set {self.pool} <number of GPUs> 'GPU training pods'",
            )
        return Check(
            "gpu-pool", "PASS", f"Airflow pool {self.pool!r} has {pool.get('slots')} slot(s) (API {api.url})"
        )

    def check_registry(self) -> Check:
        from kubetrain.hooks.registry import RegistryHook
        from kubetrain.imagebuild.oci import RegistryClient, RegistryError

        hook = RegistryHook(self.registry_conn_id)
        try:
            where = f"connection {self.registry_conn_id!r} ({hook.registry})"
            client = hook.get_conn()
        except Exception as exc:  # noqa: BLE001 - not defined: the registry setting
            if type(exc).__name__ != "AirflowNotFoundException":
                return Check(
                    "registry",
                    "FAIL",
                    f"connection {self.registry_conn_id!r}: {_short(exc)}",
                    "fix the registry connection's host and extras",
                )
            registry = self.deployment.registry
            where = f"KUBETRAIN_REGISTRY {registry}"
            client = RegistryClient(
                registry, insecure=registry.split(":")[0] in ("localhost", "127.0.0.1"), timeout=10
            )
        try:
            with client:
                client.ping()
        except RegistryError as exc:
            return Check(
                "registry",
                "FAIL",
                f"the registry of {where} does not answer the workers: {_short(exc)}",
                f"define connection {self.registry_conn_id} with the registry's host, port and credentials "
                "as the Airflow workers reach it",
            )
        return Check("registry", "PASS", f"the registry of {where} answers the workers")

    def check_training_apis(self) -> Check:
        """Which engines a multi-worker job can go to, and whether Kueue is there, with the versions served."""
        from kubernetes import client

        groups = {
            g.name: [v.version for v in g.versions]
            for g in client.ApisApi(self.hook.api_client).get_api_versions(_request_timeout=10).groups
        }
        api = client.CustomObjectsApi(self.hook.api_client)
        served, missing = [], []
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

        queue = self.deployment.queue
        if not queue:
            return Check(
                "queue", "INFO", "no Kueue queue configured (KUBETRAIN_QUEUE): pods go to the scheduler"
            )
        groups = {
            g.name for g in client.ApisApi(self.hook.api_client).get_api_versions(_request_timeout=10).groups
        }
        if KUEUE_GROUP not in groups:
            return Check(
                "queue",
                "FAIL",
                f"KUBETRAIN_QUEUE is {queue!r} but the cluster does not serve Kueue ({KUEUE_GROUP})",
                "install Kueue with its plain-pod integration enabled, or empty KUBETRAIN_QUEUE",
            )
        try:
            found = client.CustomObjectsApi(self.hook.api_client).get_namespaced_custom_object(
                KUEUE_GROUP, "v1beta1", self.namespace, "localqueues", queue, _request_timeout=10
            )
        except ApiException as exc:
            if exc.status != 404:
                raise
            return Check(
                "queue",
                "FAIL",
                f"LocalQueue {queue!r} does not exist in namespace {self.namespace}",
                f"create it (kind: LocalQueue, namespace {self.namespace}, spec.clusterQueue: <your ClusterQueue>) "
                "or set KUBETRAIN_QUEUE to one that exists",
            )
        cluster_queue = (found.get("spec") or {}).get("clusterQueue", "?")
        return Check("queue", "PASS", f"LocalQueue {queue!r} feeds ClusterQueue {cluster_queue!r}")

    # -- preflight pods --------------------------------------------------------------------

    def pod(self, purpose: str, image: str, command: Sequence[str], *, with_s3: bool):
        """A short-lived pod like a training pod's: same namespace, account, pull Secrets and placement (the GPU
        vendor's taint tolerated, as GPU training pods tolerate it), and Pod Security level restricted."""
        from kubernetes.client import models as k8s

        from kubetrain.pod_spec import gpu_tolerations

        d = self.deployment
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
                namespace=self.namespace,
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
            self.core.create_namespaced_pod(self.namespace, body)
        except ApiException as exc:
            if exc.status == 403:
                return PodOutcome(False, reason="Forbidden", message=_api_message(exc))
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
                self.core.list_namespaced_pod,
                self.namespace,
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
            response = self.core.read_namespaced_pod_log(
                name,
                self.namespace,
                container="check",
                tail_lines=50,
                _request_timeout=15,
                _preload_content=False,
            )
            logs = response.data.decode("utf-8", "replace")
        except Exception as exc:  # noqa: BLE001 - the outcome stands without its log
            logs = f"(log unavailable: {_short(exc)})"
        return PodOutcome(outcome.pulled, outcome.exit_code, outcome.reason, outcome.message, logs or "")

    def _delete(self, name: str) -> None:
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        try:
            self.core.delete_namespaced_pod(name, self.namespace, grace_period_seconds=0)
        except ApiException as exc:
            if exc.status == 404:
                return
            raise
        try:
            pod = self.core.read_namespaced_pod(name, self.namespace)
        except ApiException as exc:
            if exc.status == 404:
                return
            raise
        # from the version just read, so that a deletion between the read and the watch is replayed
        w = watch.Watch()
        for event in w.stream(
            self.core.list_namespaced_pod,
            self.namespace,
            field_selector=f"metadata.name={name}",
            resource_version=pod.metadata.resource_version,
            timeout_seconds=30,
        ):
            if event["type"] == "DELETED":
                w.stop()
                return
        log.warning("preflight pod %s was not gone within 30 s", name)


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def _api_message(exc) -> str:
    """The message of an API error's Status body (its first line otherwise)."""
    import json

    body = exc.body.decode(errors="replace") if isinstance(exc.body, bytes) else str(exc.body or "")
    try:
        return json.loads(body).get("message") or exc.reason or ""
    except ValueError:
        return (body.strip().splitlines() or [str(exc.reason or "")])[0][:300]


def _last_error(logs: str) -> str:
    lines = [line.strip() for line in logs.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def _snake(toleration: dict[str, Any]) -> dict[str, Any]:
    names = {"tolerationSeconds": "toleration_seconds"}
    return {names.get(k, k): v for k, v in toleration.items()}


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


def run_preflight(emit: Callable[[Check], None] | None = None, **kwargs: Any) -> Preflight:
    """Run the preflight against the deployment's settings; ``kwargs`` go to :class:`Preflight`."""
    preflight = Preflight(Deployment.from_environment(), **kwargs)
    preflight.run(emit)
    return preflight


def fail_on_failures(preflight: Preflight) -> list[str]:
    """The lines of a finished preflight; raises ``AirflowFailException`` (no retry) naming each FAIL."""
    from airflow.sdk.exceptions import AirflowFailException

    if preflight.failed:
        raise AirflowFailException(
            f"{len(preflight.failed)} preflight check(s) failed:\n"
            + "\n".join(c.line() for c in preflight.failed)
        )
    return [c.line() for c in preflight.results]


def _configured_api_url() -> str:
    """Airflow's ``[api] base_url`` (AIRFLOW__API__BASE_URL), empty when not set."""
    from airflow.configuration import conf

    return conf.get("api", "base_url", fallback="") or ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kubetrain.preflight", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--kubernetes-conn-id", default="kubernetes_default")
    parser.add_argument("--registry-conn-id", default="kubetrain_registry_default")
    parser.add_argument(
        "--pool", default="gpu", help="the Airflow pool of GPU training tasks (default %(default)s)"
    )
    parser.add_argument(
        "--pod-timeout", type=float, default=45.0, help="seconds per preflight pod (default %(default)s)"
    )
    parser.add_argument(
        "--airflow-api-conn-id",
        default=AIRFLOW_API_CONN_ID,
        help="connection to Airflow's REST API, where the pool is read (default %(default)s)",
    )
    parser.add_argument(
        "--airflow-api-url",
        help="the Airflow API server's URL, over the connection's host (default: the connection's host, "
        "else [api] base_url)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    try:
        preflight = run_preflight(
            lambda check: print(check.line(), flush=True),
            kubernetes_conn_id=args.kubernetes_conn_id,
            registry_conn_id=args.registry_conn_id,
            pool=args.pool,
            pod_timeout=args.pod_timeout,
            airflow_api_conn_id=args.airflow_api_conn_id,
            airflow_api_url=args.airflow_api_url or None,
            airflow_api_default_url=_configured_api_url() or None,
        )
    except ValueError as exc:  # a setting that does not parse
        print(f"FAIL  settings: {exc}", flush=True)
        return 1
    failed = preflight.failed
    print(f"{len(preflight.results) - len(failed)} passed or noted, {len(failed)} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
