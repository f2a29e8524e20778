"""EKS Pod Identity: the ``s3-secret`` line passes when botocore resolves the pod's credentials from the container
credentials endpoint (its ``container-role`` provider, with the authorization token file) and they list the
datasets bucket of the dev stack's S3 server; it fails, saying why, when the endpoint or S3 refuses."""

from __future__ import annotations

import json
import threading
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from kubernetes.client import models as k8s

from kubetrain.preflight.s3 import S3Checks
from kubetrain.settings import Deployment

POD_TOKEN = "eks-pod-identity-token-for-the-test"


class CredentialsEndpoint(BaseHTTPRequestHandler):
    """EKS Pod Identity's agent: the pod's credentials, for the bearer of the pod's token (the JSON botocore's
    container provider expects)."""

    keys: tuple[str, str] = ("", "")
    seen: list[str] = []

    def do_GET(self):  # noqa: N802 - http.server's name
        type(self).seen.append(self.headers.get("Authorization", ""))
        if self.headers.get("Authorization") != POD_TOKEN:
            return self.answer(401, {"message": "invalid token"})
        key, secret = type(self).keys
        expiration = (datetime.now(UTC) + timedelta(hours=6)).strftime("%Y-%m-%dT%H:%M:%SZ")
        self.answer(
            200,
            {
                "AccessKeyId": key,
                "SecretAccessKey": secret,
                "Token": "session-token-of-the-association",
                "AccountId": "123456789012",
                "Expiration": expiration,
            },
        )

    def answer(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def pod_identity(s3_server, tmp_path, monkeypatch):
    """This process as a pod with EKS Pod Identity: the agent's variables, and no other AWS credentials."""
    CredentialsEndpoint.keys = (s3_server.access_key_id, s3_server.secret_access_key)
    CredentialsEndpoint.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), CredentialsEndpoint)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    token_file = tmp_path / "eks-pod-identity-token"
    token_file.write_text(POD_TOKEN)
    for name in (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_PROFILE",
        "AWS_ROLE_ARN",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv(
        "AWS_CONTAINER_CREDENTIALS_FULL_URI", f"http://127.0.0.1:{server.server_address[1]}/v1/credentials"
    )
    monkeypatch.setenv("AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE", str(token_file))
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    monkeypatch.setenv("AWS_DEFAULT_REGION", s3_server.region)
    try:
        yield token_file
    finally:
        server.shutdown()
        server.server_close()


def check(fake_cluster):
    account = k8s.V1ServiceAccount(metadata=k8s.V1ObjectMeta(name="trainer"))  # Pod Identity: no annotation
    deployment = Deployment(s3_secret=None, service_account="trainer")
    return S3Checks(fake_cluster(deployment, read_namespaced_service_account=account)).check_s3_secret()


def test_pod_identity_credentials_that_list_the_bucket_pass(pod_identity, fake_cluster):
    line = check(fake_cluster)
    assert line.status == "PASS", line
    assert line.detail.startswith(
        "EKS Pod Identity: credentials from the container endpoint (container-role) list bucket 'datasets'"
    )
    assert CredentialsEndpoint.seen and set(CredentialsEndpoint.seen) == {
        POD_TOKEN
    }  # the token file was sent


def test_an_endpoint_that_refuses_the_pod_token_fails(pod_identity, fake_cluster):
    pod_identity.write_text("a-token-of-another-pod")
    line = check(fake_cluster)
    assert line.status == "FAIL", line
    assert "EKS Pod Identity (AWS_CONTAINER_CREDENTIALS_FULL_URI=http://127.0.0.1:" in line.detail
    assert "no credentials from the endpoint" in line.detail
    assert "Pod Identity association of service account 'trainer'" in line.fix


def test_credentials_that_s3_refuses_fail_naming_the_bucket(pod_identity, fake_cluster):
    CredentialsEndpoint.keys = (CredentialsEndpoint.keys[0], "not-the-secret-key")
    line = check(fake_cluster)
    assert line.status == "FAIL", line
    assert "(container-role) could not list bucket 'datasets'" in line.detail
    assert (
        "SignatureDoesNotMatch" in line.detail
        or "AccessDenied" in line.detail
        or "InvalidAccessKeyId" in line.detail
    )
    assert "s3:ListBucket" in line.fix


def test_keys_in_the_environment_come_first_and_leave_a_warning(
    pod_identity, fake_cluster, monkeypatch, s3_server
):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_access_key)
    line = check(fake_cluster)
    assert line.status == "WARN", line
    assert "botocore resolves credentials from env" in line.detail
