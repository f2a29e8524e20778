"""The S3 lines: ``s3-secret`` (the Secret the pods read, or their workload identity), and ``s3-from-pod``,
``s3-region`` and ``s3-write``, which a pod of the sync image reports by running
``python -m trainer.sync probe`` (trainer/sync/probe.py) with the pods' credentials.

EKS Pod Identity leaves no annotation on the service account (the association lives in EKS): the agent
puts ``AWS_CONTAINER_CREDENTIALS_FULL_URI`` and ``AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE`` in the pods'
environment. Where the preflight's own pod has them, the ``s3-secret`` line resolves credentials through
botocore's chain and passes when they come from that endpoint (botocore's ``container-role`` method) and
list the datasets bucket."""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from typing import Any

from kubetrain.preflight.check import Check, api_message
from kubetrain.preflight.cluster import Cluster
from kubetrain.preflight.pods import PodOutcome

REQUIRED_SECRET_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
OPTIONAL_SECRET_KEYS = ("AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION")
IDENTITY_ANNOTATIONS = (
    "eks.amazonaws.com/role-arn",
    "iam.gke.io/gcp-service-account",
    "azure.workload.identity/client-id",
)
# What EKS Pod Identity's agent puts in a pod's environment (botocore's container credential provider reads them)
POD_IDENTITY_ENV = ("AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE")
CONTAINER_ROLE = "container-role"  # botocore's name for credentials from the container endpoint
# The sync image's own probe (trainer/sync/probe.py): the clients, environment and network path of stage-in and the
# sidecar, with the pods' credentials (AWS_* from the Secret, or workload identity). Its last line is this and JSON.
PROBE_PREFIX = "KUBETRAIN_PROBE "
S3_CHECKS = ("s3-from-pod", "s3-region", "s3-write")


def last_error(logs: str) -> str:
    """The last non-empty line of a log, where a failed command says why."""
    lines = [line.strip() for line in logs.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


@dataclass
class S3Checks:
    """What the pods' S3 credentials are, and what they can do from a pod.

    :param cluster: the namespace and the clients.
    """

    cluster: Cluster

    def check_s3_secret(self) -> Check:
        """The Secret the pods read has both AWS keys and the workers may read it; without a Secret, the
        service account carries an identity whose tokens S3 accepts (IRSA)."""
        from kubernetes.client.exceptions import ApiException

        d = self.cluster.deployment
        if not d.s3_secret:
            try:
                account = self.cluster.core.read_namespaced_service_account(
                    d.service_account, self.cluster.namespace
                )
            except ApiException as exc:
                if exc.status != 404:
                    raise
                return Check(
                    "s3-secret",
                    "FAIL",
                    f"no S3 Secret (workload identity) and service account "
                    f"{d.service_account!r} does not exist in {self.cluster.namespace!r}",
                    f"kubectl -n {self.cluster.namespace} create serviceaccount {d.service_account} "
                    "and bind it to an "
                    "IAM role (IRSA) or GCP service account, or set KUBETRAIN_S3_SECRET",
                )
            annotations = (account.metadata.annotations or {}) if account.metadata else {}
            found = [a for a in IDENTITY_ANNOTATIONS if a in annotations]
            if not found and os.environ.get(POD_IDENTITY_ENV[0]):
                return self.check_pod_identity()
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
            secret = self.cluster.core.read_namespaced_secret(d.s3_secret, self.cluster.namespace)
        except ApiException as exc:
            if exc.status == 403:
                return Check(
                    "s3-secret",
                    "FAIL",
                    f"the workers may not read Secret {d.s3_secret!r}: {api_message(exc)}",
                    f"name {d.s3_secret!r} in the resourceNames of deploy/rbac.yaml's Role kubetrain-airflow "
                    "(it names kubetrain-s3) and apply it",
                )
            if exc.status != 404:
                raise
            return Check(
                "s3-secret",
                "FAIL",
                f"Secret {d.s3_secret!r} does not exist in namespace {self.cluster.namespace!r}",
                f"kubectl -n {self.cluster.namespace} create secret generic {d.s3_secret} "
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
                f"{d.s3_secret!r}: kubectl -n {self.cluster.namespace} patch secret {d.s3_secret} "
                "--type merge "
                f'-p \'{{"stringData": {{"{missing[0]}": "..."}}}}\'',
            )
        absent = [k for k in OPTIONAL_SECRET_KEYS if k not in keys]
        note = f"; no {', '.join(absent)} (pods use AWS defaults)" if absent else ""
        return Check(
            "s3-secret", "PASS", f"Secret {d.s3_secret!r} has {', '.join(REQUIRED_SECRET_KEYS)}{note}"
        )

    def check_pod_identity(self) -> Check:
        """EKS Pod Identity in this pod's environment: PASS when botocore's chain resolves credentials from the
        container endpoint (``container-role``) and they list the datasets bucket."""
        import botocore.session
        from botocore.exceptions import BotoCoreError, ClientError

        d = self.cluster.deployment
        uri = os.environ.get(POD_IDENTITY_ENV[0], "")
        session = botocore.session.get_session()
        try:
            credentials = session.get_credentials()
        except BotoCoreError as exc:
            return Check(
                "s3-secret",
                "FAIL",
                f"EKS Pod Identity ({POD_IDENTITY_ENV[0]}={uri}): no credentials from the endpoint: {exc}",
                f"check the Pod Identity association of service account {d.service_account!r} (aws eks "
                "list-pod-identity-associations) and that the eks-pod-identity-agent add-on runs on the node",
            )
        method = getattr(credentials, "method", None)
        if credentials is None or method != CONTAINER_ROLE:
            return Check(
                "s3-secret",
                "WARN",
                f"EKS Pod Identity's {POD_IDENTITY_ENV[0]} is set, but botocore resolves credentials from "
                f"{method or 'nowhere'}, which comes before the container endpoint in its chain",
                "remove the AWS_* keys (or profile) that take precedence from the pods' environment",
            )
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        try:
            client = session.create_client("s3", region_name=region)
            client.list_objects_v2(Bucket=d.datasets_bucket, MaxKeys=1)
        except (BotoCoreError, ClientError) as exc:
            return Check(
                "s3-secret",
                "FAIL",
                f"EKS Pod Identity: credentials from the container endpoint ({CONTAINER_ROLE}) could not list "
                f"bucket {d.datasets_bucket!r}: {exc}",
                f"give the IAM role of service account {d.service_account!r}'s Pod Identity association "
                f"s3:ListBucket and s3:GetObject on {d.datasets_bucket!r}",
            )
        return Check(
            "s3-secret",
            "PASS",
            f"EKS Pod Identity: credentials from the container endpoint ({CONTAINER_ROLE}) list bucket "
            f"{d.datasets_bucket!r}; the training pods get theirs if service account {d.service_account!r} has "
            "a Pod Identity association (s3-from-pod tests it from such a pod)",
        )

    def probe_command(self) -> list[str]:
        """The sync image's probe: list the datasets bucket, ask each bucket's region, and write, read back
        and delete a scratch object under ``preflight/`` in the training bucket."""
        d = self.cluster.deployment
        scratch = f"s3://{d.training_bucket}/preflight/{secrets.token_hex(6)}.bin"
        return [
            "python",
            "-m",
            "trainer.sync",
            "probe",
            "--datasets-bucket",
            d.datasets_bucket,
            "--scratch-uri",
            scratch,
        ]

    def probe_checks(self, image: str, outcome: PodOutcome) -> list[Check]:
        """The probe's report (the pod's log) as three lines: the datasets listing, the buckets' regions, the
        write/read/delete; SKIP when the sync image did not run."""
        if not outcome.pulled:
            return [Check(name, "SKIP", f"needs the sync image ({image}) to run") for name in S3_CHECKS]
        reports = [line for line in outcome.logs.splitlines() if line.startswith(PROBE_PREFIX)]
        if outcome.exit_code != 0 or not reports:
            error = (
                last_error(outcome.logs)
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
        bucket = self.cluster.deployment.datasets_bucket
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
        secret = self.cluster.deployment.s3_secret
        fix = (
            f"kubectl -n {self.cluster.namespace} patch secret {secret} --type merge -p "
            f'\'{{"stringData": {{"AWS_REGION": "{region}", "AWS_DEFAULT_REGION": "{region}"}}}}\''
            if secret
            else f"set AWS_REGION={region} in the environment of service account "
            f"{self.cluster.deployment.service_account!r}'s pods (or keep the buckets in {configured})"
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
        bucket = self.cluster.deployment.training_bucket
        if step["ok"]:
            return Check("s3-write", "PASS", f"a pod {step['detail']}")
        return Check(
            "s3-write",
            "FAIL",
            f"a pod could not write, read back and delete in bucket {bucket!r}: {step['detail']}",
            self._s3_fix(step["detail"], bucket, "s3:PutObject, s3:GetObject and s3:DeleteObject"),
        )

    def _s3_fix(self, error: str, bucket: str, rights: str) -> str:
        d = self.cluster.deployment
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
